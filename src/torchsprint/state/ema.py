"""EMA of the weights with timm's ModelEmaV3 semantics: build_ema(cfg.ema, model), update(step), state_dict.

ModelEma keeps a copy of the plain (unwrapped) model and moves it towards the training weights after
optimizer steps: ema = decay * ema + (1 - decay) * model, as `torch._foreach_lerp_(ema, model, 1 - decay)`
exactly like timm.utils.ModelEmaV3.apply_update_ (tests/e2e/train/test_recipes_ema.py compares the two). Written
here rather than imported because timm is an optional dependency; the decay and its warm-up are
ModelEmaV3.get_decay's formula. Where it differs from ModelEmaV3, on purpose:
- the EMA copy is kept in fp32 even when the model runs in fp16/bf16 weights (precision.mode=fp16/bf16),
  which timm offers as dtype=torch.float32 (a plain fp16/bf16 EMA update rounds to nothing);
- `every_steps`: update every N optimizer steps (torchvision's --model-ema-steps); the warm-up counts
  EMA updates, so with every_steps=N the decay of update k is get_decay(k).
BatchNorm buffers (running mean/var) are averaged like the weights (ModelEmaV3's default,
exclude_buffers=False) or copied from the model with ema.buffers=copy (exclude_buffers=True); integer
buffers (num_batches_tracked) are always copied.
Under DDP every rank's parameters are equal, but BatchNorm statistics differ per rank after each local
forward; `sync` broadcasts rank 0's EMA buffers before the EMA is evaluated or saved (DDP's own
convention for model buffers), so the EMA that is used is the same on every rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from torchsprint.errors import UsageError


class NoEma:
    """EMA off: every call is a no-op (engine code has no `if ema` branches)."""

    enabled = False
    evaluates = False
    module = None

    def update(self, step: int) -> None:
        pass

    def attach(self, source: nn.Module) -> None:
        pass

    def sync(self, rt) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict, log=print) -> None:
        if state is not None:
            log("the checkpoint holds EMA weights, but ema.enabled=false: they are not used")


def ema_decay(update: int, decay: float, warmup: bool, gamma: float, power: float) -> float:
    """Decay of the `update`-th EMA update (1-based): timm ModelEmaV3.get_decay(step=update), update_after_step=0.

    The first update copies the model (decay 0). With warm-up, decay = 1 - (1 + k / gamma) ** -power for
    k = update - 1, capped at `decay` (crowsonkb's warm-up, as in timm).
    """
    k = max(0, update - 1)
    if k <= 0:
        return 0.0
    if warmup:
        return max(min(1 - (1 + k / gamma) ** -power, decay), 0.0)
    return decay


class ModelEma:
    """An EMA copy of `source` (the unwrapped training module: never the DDP or torch.compile wrapper).

    Args:
        source: the plain module, before wrap_model (its copy is made then: fp32, plain BatchNorm, no
            hooks); `attach` then points the EMA at parallel.unwrap(wrapped model), whose weights the
            optimizer updates.
        ema_cfg: the `ema` section.
        device: where the copy lives (the model's device, or CPU with ema.device=cpu).
        channels_last: keep the copy in channels_last, as the model's weights are (RunPlan.channels_last: under
            speed.channels_last=auto the weights are NHWC while the batches stay NCHW, RunPlan.channels_last_inputs).
    """

    enabled = True

    def __init__(self, source: nn.Module, ema_cfg, device: torch.device, channels_last: bool = False):
        self.source, self.cfg = source, ema_cfg
        self.evaluates = ema_cfg.eval
        module = copy.deepcopy(source).to(device=device, dtype=torch.float32)
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.module = module.eval().requires_grad_(False)
        self.param_names = {n for n, _ in source.named_parameters()}
        self.updates = 0  # EMA updates done (the warm-up's step); checkpointed

    def attach(self, source: nn.Module) -> None:
        """Follow `source` from now on: the unwrapped module after wrap_model (SyncBatchNorm, half weights)."""
        own, src = list(self.module.state_dict()), list(source.state_dict())
        if own != src:  # update() zips by position, as timm does: the names must line up
            raise UsageError(f"ema: the EMA copy's state differs from the model's ({len(own)} vs {len(src)} entries)")
        self.source = source

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based global step): update when step % every_steps == 0."""
        if step % self.cfg.every_steps:
            return
        self.updates = step // self.cfg.every_steps
        d = ema_decay(self.updates, self.cfg.decay, self.cfg.warmup, self.cfg.warmup_gamma, self.cfg.warmup_power)
        average = self.cfg.buffers == "average"
        lerp_e, lerp_m, mixed_e, mixed_m = [], [], [], []
        for (name, e), m in zip(self.module.state_dict().items(), self.source.state_dict().values()):
            if not e.is_floating_point() or not (average or name in self.param_names):
                e.copy_(m)  # integer buffers always, float buffers with ema.buffers=copy
            elif e.dtype == m.dtype and e.device == m.device:
                lerp_e.append(e)
                lerp_m.append(m)
            else:  # fp16/bf16 model weights into the fp32 EMA, or a CPU EMA of a GPU model
                mixed_e.append(e)
                mixed_m.append(m)
        if lerp_e:
            torch._foreach_lerp_(lerp_e, lerp_m, weight=1.0 - d)
        for e, m in zip(mixed_e, mixed_m):  # timm's mixed-dtype path: add_ promotes in-kernel
            e.mul_(d).add_(m.to(e.device), alpha=1.0 - d)

    def sync(self, rt) -> None:
        """Broadcast rank 0's EMA buffers (BatchNorm statistics) to every rank; no-op in one process."""
        if not rt.distributed:
            return
        for b in self.module.buffers():
            if b.device.type != rt.device.type:  # ema.device=cpu under NCCL: through the device
                t = b.to(rt.device)
                torch.distributed.broadcast(t, 0)
                b.copy_(t)
            else:
                torch.distributed.broadcast(b, 0)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict | None, log=print) -> None:
        """Restore from a checkpoint's `ema` entry; a checkpoint without one starts the EMA from the model."""
        if state is None:
            log(
                "[yellow]the checkpoint has no EMA weights (saved with ema.enabled=false): the EMA starts from the "
                "resumed weights[/]"
            )
            self.module.load_state_dict(self.source.state_dict())
            return
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def check_ema(ema_cfg) -> None:
    """Refuse EMA settings that cannot apply (non-default values only)."""
    if not ema_cfg.enabled:
        from torchsprint.config.fields import default_of

        changed = [
            f for f in type(ema_cfg).model_fields if f != "enabled" and getattr(ema_cfg, f) != default_of(ema_cfg, f)
        ]
        if changed:
            raise UsageError(
                f"ema.{changed[0]}={getattr(ema_cfg, changed[0])} has no effect with ema.enabled=false; set "
                "ema.enabled=true, or remove it."
            )
        return
    if not ema_cfg.warmup:
        from torchsprint.config.fields import default_of

        for f in ("warmup_gamma", "warmup_power"):
            if getattr(ema_cfg, f) != default_of(ema_cfg, f):
                raise UsageError(
                    f"ema.{f}={getattr(ema_cfg, f)} shapes the decay warm-up, which is off; set "
                    "ema.warmup=true, or remove it."
                )
    if ema_cfg.device == "cpu" and ema_cfg.eval:
        raise UsageError(
            "ema.device=cpu keeps the EMA off the accelerator to save its memory, so it is not evaluated "
            "during training: set ema.eval=false (evaluate it afterwards with `torchsprint eval --weights "
            "ema`), or ema.device=model."
        )


def build_ema(ema_cfg, source: nn.Module, device: torch.device, channels_last: bool = False):
    """ModelEma of `source` (the unwrapped model) when ema.enabled, else the no-op NoEma."""
    check_ema(ema_cfg)
    if not ema_cfg.enabled:
        return NoEma()
    where = torch.device("cpu") if ema_cfg.device == "cpu" else device
    return ModelEma(source, ema_cfg, where, channels_last)

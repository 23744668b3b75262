"""Precision: autocast(), prepare(model), backward(loss), step(opt) and a checkpointable state, for every mode.

Modes (apex levels as aliases in config/training.py: O0 = fp32, O1 = amp_fp16, O2 = fp16; `auto`, the default, is
resolved to one of them before a Precision is built: train/speed_probe.py):
  fp32      everything fp32; autocast is a null context, the scaler is disabled (off is a no-op object).
  amp_fp16  fp32 weights, fp16 autocast, dynamic loss scaling (GradScaler). CUDA only.
  amp_bf16  fp32 weights, bf16 autocast, no scaling (bf16 has fp32's exponent range). CUDA and CPU.
  fp16      half weights (apex O2): the model runs in fp16 with BatchNorm kept in fp32, the optimizer
            updates fp32 master copies, the loss is scaled. CUDA only.
  bf16      like fp16 with bf16 weights and no scaling. CUDA and CPU.
  fp64      everything float64 (Lightning's "64-true"): batches cast in, logits and loss stay float64.
            For numerical checks: two computations that agree in exact arithmetic (DDP against one
            process) differ in fp32 by rounding amplified over the steps, by 1e-6 to 1e-3 depending on
            the CPU's kernels (tests/e2e/train/test_progressive.py); in fp64 by ~1e-15.

Non-finite values (precision.on_nonfinite):
  skip  a step whose gradients hold inf/NaN is not applied (parameters and optimizer state untouched)
        and is counted. With a loss scaler (amp_fp16, fp16) GradScaler's on-device inf check decides,
        and backs the scale off; without one (fp32, amp_bf16, bf16) an on-device max |grad| check does.
  stop  non-finite losses are counted on the device and read when the engine checks (log steps, epoch
        ends), which then stops the run; loss-scaled modes still skip overflowing steps.

No mode syncs with the host in the steady-state step. A skip is decided on the device: `masked_step`
runs the update and puts the parameters and optimizer state back where the flag says so (a copy and a
`where` per tensor). GradScaler.step would instead read the flag on the host every step (`.item()`)
unless the optimizer is fused, and torch's fused SGD advances its momentum on steps the scaler skips
(LibreYOLO/libreyolo#771, torch 2.11), so Precision unscales with the scaler and skips by itself. The
host is asked only when a step would create optimizer state (the first step; a skip must then leave
none) or when the optimizer keeps state on the host (e.g. Adam's step counter without fused or
capturable; optim.impl=auto picks fused for sgd/adam/adamw on CUDA).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._pytree import tree_map

from torchsprint.errors import UsageError

_AUTOCAST = {"amp_fp16": torch.float16, "amp_bf16": torch.bfloat16}
_HALF_WEIGHTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_WIDE_WEIGHTS = {"fp64": torch.float64}
_SCALED = ("amp_fp16", "fp16")  # fp16's 5-bit exponent underflows small gradients without loss scaling


class HalfModel(nn.Module):
    """Runs `module` in half precision: floating inputs are cast to `dtype` on the way in and floating
    outputs back to fp32 on the way out, so the loss is computed in fp32 (apex O2's casts). With
    `out_dtype=None` the outputs keep the module's dtype (fp64: the loss in float64 too).
    """

    _torchsprint_wrapper = True  # parallel.unwrap looks through it; its `module.` prefix is stripped on save

    def __init__(self, module: nn.Module, dtype: torch.dtype, out_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        self.module, self.dtype, self.out_dtype = module, dtype, out_dtype

    def forward(self, *args, **kwargs):
        def cast_in(t):
            return t.to(self.dtype) if torch.is_tensor(t) and t.is_floating_point() else t

        def cast_out(t):
            return t.to(self.out_dtype) if torch.is_tensor(t) and t.is_floating_point() and self.out_dtype else t

        return tree_map(cast_out, self.module(*tree_map(cast_in, args), **tree_map(cast_in, kwargs)))


def concrete_mode(mode: str) -> str:
    """precision.mode where nothing measures it: `auto` is fp32 (train/speed_probe.py resolves a training run's auto
    once, and its config.yaml records the result, so evaluation, export and resume read a concrete mode; auto reaches
    here only as an override given to those, or before the probe: the batch-size search, the teacher)."""
    return "fp32" if mode == "auto" else mode


def check_mode(mode: str, device: torch.device) -> None:
    """Refuse a precision this device cannot run, naming what to use instead."""
    if mode in ("amp_fp16", "fp16") and device.type == "cpu":
        raise UsageError(
            f"precision={mode} needs a CUDA device (CPUs have no fast fp16 math); "
            "on CPU use precision=amp_bf16 (CPU autocast), bf16 or fp32."
        )
    if mode in ("amp_bf16", "bf16") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(
            f"precision={mode}: this GPU has no bfloat16 support (needs compute capability 8.0+, "
            "Ampere or newer). Use precision=amp_fp16."
        )


class Precision:
    """Numeric precision of one run.

    Args:
        mode: fp32 | amp_fp16 | amp_bf16 | fp16 | bf16 | fp64 (never auto: see concrete_mode).
        device: the training device.
        on_nonfinite: 'skip' (skip and count a step with non-finite gradients) or 'stop' (raise at the
            next check); see the module docstring for what each costs.
        graph_safe: disable autocast's weight-cast cache, which CUDA graph capture does not support.
    """

    def __init__(self, mode: str, device: torch.device, *, on_nonfinite: str = "skip", graph_safe: bool = False):
        if mode == "auto":  # a bug of ours, not a user's: auto is resolved (speed_probe) or read as concrete_mode
            raise ValueError("Precision('auto'): resolve precision.mode first (train/speed_probe.py, concrete_mode)")
        check_mode(mode, device)
        self.mode, self.device, self.on_nonfinite, self.graph_safe = mode, device, on_nonfinite, graph_safe
        self.dtype = _AUTOCAST.get(mode)
        self.half = _HALF_WEIGHTS.get(mode)
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode in _SCALED)
        self.masters: list[tuple[nn.Parameter, torch.Tensor]] = []  # (half parameter, fp32 master)
        self._attached: set[int] = set()  # ids of optimizers that step the masters
        self._grads_on_masters = False  # this step's gradients were moved to the masters
        self._unscaled = False  # unscale_ ran for this step (GradScaler refuses a second call)
        self._memo: dict[int, dict] = {}  # masked_step's copy buffers and first-step flag, per optimizer
        # On-device counters, read only by pop_nonfinite (no host sync in the step).
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    # ------------------------------------------------------------ forward

    def autocast(self):
        """Context for forward + loss: torch.autocast in AMP modes, a null context otherwise."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False if self.graph_safe else None)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Half-weight modes: fp32 master copies of the trainable weights, then the model in fp16/bf16
        with BatchNorm in fp32, wrapped in HalfModel. fp64: the model in float64, wrapped to cast batches
        in. Other modes: the model unchanged.

        Call before DDP wraps the model (DDP sizes its buckets by parameter dtype) and before the
        optimizer is built (its state is created in fp32 because steps run on the masters).
        """
        if self.mode in _WIDE_WEIGHTS:  # no masters: the weights themselves are float64
            return HalfModel(model.to(_WIDE_WEIGHTS[self.mode]), _WIDE_WEIGHTS[self.mode], out_dtype=None)
        if self.half is None:
            return model
        keep_fp32 = set()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):  # apex O2's keep_batchnorm_fp32
                keep_fp32.update(id(p) for p in m.parameters(recurse=False))
        params = [p for p in model.parameters() if p.is_floating_point() and id(p) not in keep_fp32]
        self.masters = [(p, p.detach().float().clone()) for p in params if p.requires_grad]
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                continue
            for p in m.parameters(recurse=False):
                if p.is_floating_point():
                    p.data = p.data.to(self.half)
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.to(self.half))
        return HalfModel(model, self.half)

    # ------------------------------------------------------------ backward and step

    def backward(self, loss: torch.Tensor) -> None:
        """(Scaled) backward. Non-finite losses are found by the engine's log-step check (check_finite)."""
        self.scaler.scale(loss).backward()

    def unscale_(self, opt: torch.optim.Optimizer) -> None:
        """Make the optimizer's parameters hold true gradients (before clipping them): unscaled, and in
        fp16/bf16 modes moved to the fp32 masters. No-op in fp32/amp_bf16."""
        self._grads_to_masters(opt)
        if self.scaler.is_enabled() and not self._unscaled:
            self.scaler.unscale_(opt)
            self._unscaled = True

    def step(self, opt: torch.optim.Optimizer) -> None:
        """opt.step(), unless the gradients are non-finite (skipped and counted, see on_nonfinite).

        No host sync in the steady state (module docstring)."""
        self._grads_to_masters(opt)
        if self.scaler.is_enabled():
            self.unscale_(opt)  # unscales in place and records the found-inf flags on the device
            # Private but stable (Lightning reads it too): this step's found-inf flags, before update()
            # clears them; summing keeps them on the device.
            found = sum(self.scaler._found_inf_per_device(opt).values(), torch.zeros((), device=self.device))
            self._skipped += (found > 0).to(torch.int64)
            masked_step(opt, found > 0, self._memo.setdefault(id(opt), {}))
            self.scaler.update()  # backs the scale off after an overflow, on the device
            self._unscaled = False
        elif self.on_nonfinite == "skip":
            bad = ~torch.isfinite(grad_max_abs(opt))
            self._skipped += bad.to(torch.int64)
            masked_step(opt, bad, self._memo.setdefault(id(opt), {}))
        else:
            opt.step()
        self._masters_to_model()

    def pop_nonfinite(
        self, step: int, loss_finite: bool = True, *, bad_step: int | None = None, lr: float | None = None
    ) -> int:
        """Steps skipped since the last call (max over ranks); raises errors.Diverged under stop.

        `loss_finite`: the caller's verdict on this rank's losses since the last call; `bad_step`, the
        first step whose loss was not finite, and `lr`, the learning rate, make the message precise.
        Note: a CPU-GPU sync point; the engine calls it at log steps and epoch ends only.
        """
        from torchsprint.errors import Diverged
        from torchsprint.runtime.collectives import all_reduce_max

        bad = torch.tensor(0 if loss_finite else 1, dtype=torch.int64, device=self.device)
        counts = all_reduce_max(torch.stack([bad, self._skipped]))
        bad_loss, skipped = (int(v) for v in counts.tolist())
        self._skipped.zero_()
        # With a loss scaler, skipped steps are the scaler finding its scale (expected early in a run),
        # so only a non-finite loss stops it; without one any non-finite value does.
        if self.on_nonfinite == "stop" and (bad_loss or (skipped and not self.scaler.is_enabled())):
            what = "loss" if bad_loss else "gradients"
            at = f"at step {bad_step}" if bad_step is not None else f"by step {step}"
            tips = [
                f"a lower optim.lr (now {lr:.3g})" if lr is not None else "a lower optim.lr",
                "optim.clip_grad_norm",
                "sched.warmup_epochs",
            ]
            if self.scaler.is_enabled():
                tips.append("precision=amp_bf16 (fp16's range overflows where bf16's does not)")
            raise Diverged(
                f"training diverged: the {what} became non-finite (inf/NaN) {at}, with "
                f"precision={self.mode}; stopped (precision.on_nonfinite=stop). Try {', '.join(tips[:-1])} "
                f"or {tips[-1]}; precision.on_nonfinite=skip skips such steps instead."
            )
        return skipped

    # ------------------------------------------------------------ fp32 master copies (fp16/bf16 modes)

    def attach(self, opt: torch.optim.Optimizer) -> None:
        """Half-weight modes: make `opt` step the fp32 masters in place of the half parameters.

        Call right after building the optimizer (before loading its state). The parameter groups
        keep their order and options (weight decay, no-decay groups), so state dicts keep their
        layout; the optimizer state is created, saved and loaded in fp32. The half parameters'
        dtype never changes: a dtype change would reset their gradient accumulators and with them
        DDP's all-reduce hooks. Called again by unscale_/step, so forgetting it is not silent.
        """
        if self.half is None or id(opt) in self._attached:
            return
        master_of = {id(p): m for p, m in self.masters}
        for group in opt.param_groups:
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for p, master in self.masters:  # state loaded before attaching: re-key it, in fp32
            if p in opt.state:
                opt.state[master] = {
                    k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                    for k, v in opt.state.pop(p).items()
                }
        self._attached.add(id(opt))

    def broadcast_masters(self) -> None:
        """Give every rank rank 0's masters (and half weights), as DDP's construction does for parameters.

        Each rank built its masters from its own random initialisation; DDP's broadcast reaches the
        half parameters only, and the first step would copy each rank's own masters back.
        """
        if not self.masters or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        with torch.no_grad():
            for p, master in self.masters:
                torch.distributed.broadcast(master, src=0)
                p.copy_(master)

    def _grads_to_masters(self, opt: torch.optim.Optimizer) -> None:
        """Move this step's half gradients to the masters as fp32 (once per step)."""
        if not self.masters or self._grads_on_masters:
            return
        self.attach(opt)
        for p, master in self.masters:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # released: the masters hold the step's gradients now
        self._grads_on_masters = True

    def _masters_to_model(self) -> None:
        """Round the (updated or, after a skipped step, unchanged) masters into the half parameters."""
        if not self.masters:
            return
        with torch.no_grad():
            for p, master in self.masters:
                p.copy_(master)
                master.grad = None
        self._grads_on_masters = False

    # ------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """The loss scaler's state and the fp32 master weights (half-weight modes)."""
        return {"scaler": self.scaler.state_dict(), "masters": [m for _, m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict(); also accepts a bare GradScaler state (older checkpoints)."""
        if not state:
            return
        if "scaler" not in state and "masters" not in state:
            state = {"scaler": state}
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        saved = state.get("masters") or []
        if saved:
            if len(saved) != len(self.masters):
                raise UsageError(
                    f"checkpoint has {len(saved)} fp32 master weights, this run {len(self.masters)}: "
                    "resume with the same model and precision.mode."
                )
            with torch.no_grad():
                for (p, master), s in zip(self.masters, saved):
                    master.copy_(s)
                    p.copy_(s)


def masked_step(opt: torch.optim.Optimizer, skip: torch.Tensor, memo: dict) -> None:
    """opt.step(), undone where the 0-dim bool tensor `skip` is true, without asking the host.

    The parameters with gradients and every tensor of their optimizer state are copied into buffers
    (kept in `memo` across steps), the update runs, and `where(skip, saved, updated)` puts back the old
    values: bit-identical to not stepping (NaN-safe), bit-identical to opt.step() otherwise. Two cases
    read `skip` on the host instead (a sync): a step that would create optimizer state (a skip must
    leave none, as if the optimizer never ran: its first step), and state kept on the host while the
    parameter is on a device (a device `where` cannot put it back).
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    tensors, host_state, missing = list(params), False, 0
    for p in params:
        st = opt.state.get(p) or {}
        missing += not st
        for v in st.values():
            if torch.is_tensor(v):
                host_state |= v.device != p.device
                tensors.append(v)
    # Empty state after a real step means a stateless optimizer (SGD without momentum): nothing to create.
    creates_state = missing and (not memo.get("stepped") or missing < len(params))
    if host_state or creates_state:
        if not bool(skip):  # note: a CPU-GPU sync point (first step, or host-side optimizer state)
            opt.step()
            memo["stepped"] = True
        return
    saved = memo.setdefault("saved", [])
    if [(t.shape, t.dtype, t.device) for t in saved] != [(t.shape, t.dtype, t.device) for t in tensors]:
        saved[:] = [torch.empty_like(t) for t in tensors]
    with torch.no_grad():
        torch._foreach_copy_(saved, tensors)
        opt.step()
        for t, old in zip(tensors, saved):
            torch.where(skip, old, t, out=t)


def grad_max_abs(opt: torch.optim.Optimizer) -> torch.Tensor:
    """max |g| over the optimizer's gradients as a device scalar (inf/NaN propagate; no overflow)."""
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())  # nothing to check: finite
    return torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))

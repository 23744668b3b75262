"""Stochastic weight averaging with torch.optim.swa_utils: build_swa(cfg.swa, ...), end_epoch, update_bn, state_dict.

The recipe of torch.optim.swa_utils' documentation (and Lightning's StochasticWeightAveraging), run through the
run's own objects:
- the run's schedule sets the learning rate up to the end of the epoch before `swa.start`; then SWALR takes
  over (built at that moment, so it anneals from the learning rate the schedule reached, as Lightning builds it
  at the start epoch) and steps once per epoch; the run's schedule steps no more (SwaSchedule);
- AveragedModel.update_parameters after every epoch from `swa.start` on (an equal-weight running mean);
- after the last epoch, update_bn over one pass of the run's training loader on the run's device (BatchNorm
  statistics of the averaged weights: the training copies' statistics belong to other weights).
Exact resume: the averaged module, its count and SWALR's state go into every checkpoint (`swa`), and SWALR is
rebuilt from the epoch number, so a resumed run continues as an uninterrupted one does.
Under DDP every rank's parameters are equal, so every rank's average is; the BatchNorm pass reads each rank's
shard of the training data and the statistics are then averaged over ranks (each rank counts the same batches,
so that is the mean over all batches, what update_bn's cumulative average computes in one process).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_swa_avg_fn, update_bn

from torchsprint.errors import UsageError


class NoSwa:
    """SWA off: every call is a no-op (fit has no `if swa` branch)."""

    enabled = False
    module = None

    def schedule(self, sched, opt):
        return sched

    def attach(self, source: nn.Module) -> None:
        pass

    def end_epoch(self, epoch: int, finished: bool) -> None:
        pass

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict | None, epoch: int, log=print) -> None:
        if state is not None:
            log("the checkpoint holds SWA weights, but swa.enabled=false: they are not used")


def start_index(swa_cfg, epochs: int) -> int:
    """The 0-based index of the first averaged epoch from swa.start (an epoch number, or a fraction of `epochs`)."""
    start = swa_cfg.start
    if start < 1:
        return int(epochs * start)  # Lightning: int(max_epochs * swa_epoch_start)
    if float(start) != int(start):
        raise UsageError(
            f"swa.start={start}: give an epoch number (an integer, 1-based) or a fraction of run.epochs "
            "below 1, e.g. swa.start=0.75."
        )
    return int(start) - 1


def check_swa(swa_cfg, epochs: int) -> int:
    """Refuse SWA settings that cannot apply; the first averaged epoch's 0-based index when enabled."""
    from torchsprint.config.fields import default_of

    if not swa_cfg.enabled:
        changed = [
            f for f in type(swa_cfg).model_fields if f != "enabled" and getattr(swa_cfg, f) != default_of(swa_cfg, f)
        ]
        if changed:
            raise UsageError(
                f"swa.{changed[0]}={getattr(swa_cfg, changed[0])} has no effect with swa.enabled=false; set "
                "swa.enabled=true, or remove it."
            )
        return 0
    if swa_cfg.lr is None:
        raise UsageError(
            "swa.enabled=true needs swa.lr, the learning rate SWALR anneals to and keeps while the weights "
            "are averaged (a tenth to a half of optim.lr is usual), e.g. swa.lr=0.01."
        )
    start = start_index(swa_cfg, epochs)
    if start >= epochs:
        raise UsageError(
            f"swa.start={swa_cfg.start} is epoch {start + 1}, after the run's last epoch (run.epochs={epochs}): "
            f"nothing would be averaged. Set swa.start to at most {epochs} (or a fraction below 1), or "
            "raise run.epochs."
        )
    return start


class SwaSchedule:
    """The run's scheduler until SWA starts, then nothing: SWALR sets the learning rate from there (Swa.end_epoch).

    The engine calls step() per step or per epoch as before; its state is the run's scheduler's (SWALR's goes
    into the checkpoint's `swa` entry), so a checkpoint keeps its format with SWA on or off.
    """

    def __init__(self, main, swa: Swa):
        self.main, self.swa = main, swa

    def step(self, *args, **kwargs) -> None:
        if self.swa.swalr is None:
            self.main.step(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.main.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.main.load_state_dict(state)

    def __getattr__(self, name):  # optimizer, get_last_lr, ...: the run's scheduler's
        return getattr(self.main, name)


class Swa:
    """AveragedModel of the training module, SWALR from the first averaged epoch on.

    Args:
        source: the plain module, before wrap_model (copied then: fp32, plain BatchNorm); `attach` points the
            average at parallel.unwrap(wrapped model), whose weights the optimizer updates.
        swa_cfg: the `swa` section.
        start: 0-based index of the first averaged epoch (check_swa).
        device: where the average lives (the model's device).
        channels_last: keep the copy in channels_last (the batches' memory format).
    """

    enabled = True

    def __init__(self, source: nn.Module, swa_cfg, start: int, device: torch.device, channels_last: bool = False):
        self.cfg, self.start, self.source = swa_cfg, start, source
        self.opt: torch.optim.Optimizer | None = None  # the run's optimizer, whose learning rates SWALR sets (schedule)
        self.averaged = AveragedModel(source, device=device)
        module = self.averaged.module.to(dtype=torch.float32)  # the average in fp32 whatever precision.mode keeps
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        self.averaged.module = module.eval().requires_grad_(False)
        self.swalr: SWALR | None = None  # built when the first averaged epoch begins

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    @property
    def count(self) -> int:
        """How many epochs' weights are in the average."""
        return int(self.averaged.n_averaged)

    def schedule(self, sched, opt: torch.optim.Optimizer) -> SwaSchedule:
        """The run's scheduler `sched` of `opt`, stepped only until SWA starts (built after it: SWALR, when it starts
        at once, anneals from the learning rate that scheduler set first)."""
        self.opt = opt
        if self.start == 0:
            self.begin()  # averaging from the first epoch: SWALR from the first step
        return SwaSchedule(sched, self)

    def attach(self, source: nn.Module) -> None:
        """Average `source` from now on: the unwrapped module after wrap_model (SyncBatchNorm, half weights)."""
        own, src = [p.shape for p in self.module.parameters()], [p.shape for p in source.parameters()]
        if own != src:  # update_parameters zips by position: the parameters must line up
            raise UsageError(f"swa: the averaged copy's parameters differ from the model's ({len(own)} vs {len(src)})")
        if any(p.dtype != torch.float32 for p in source.parameters()):
            # fp16/bf16 weights (precision.mode=fp16/bf16): the per-tensor average (torch's get_swa_avg_fn) promotes
            # to the fp32 copy in-kernel; the default foreach lerp needs one dtype on both sides.
            self.averaged.avg_fn = get_swa_avg_fn()
        self.source = source

    def begin(self) -> None:
        """The first averaged epoch begins: SWALR takes the learning rate over from the run's schedule."""
        self.swalr = SWALR(
            self.opt, swa_lr=self.cfg.lr, anneal_epochs=self.cfg.anneal_epochs, anneal_strategy=self.cfg.anneal_strategy
        )

    @torch.no_grad()
    def end_epoch(self, epoch: int, finished: bool) -> None:
        """After training epoch `epoch` (0-based): average its weights and step SWALR from swa.start on; begin SWA
        when the next epoch is the first averaged one. A partial epoch (a pause, run.max_steps) does nothing."""
        if not finished:
            return
        if epoch >= self.start:
            self.averaged.update_parameters(self.source)
            self.swalr.step()
        elif epoch + 1 == self.start:
            self.begin()

    def update_bn(self, loader, epoch: int, rt, prec, seed: int) -> None:
        """Recompute the average's BatchNorm statistics over one pass of the training `loader` (recompute_bn)."""
        recompute_bn(self.module, loader, epoch, rt, prec, seed)

    def state_dict(self) -> dict:
        return {
            "averaged": self.averaged.state_dict(),
            "start": self.start,
            "swalr": None if self.swalr is None else self.swalr.state_dict(),
        }

    def load_state_dict(self, state: dict | None, epoch: int, log=print) -> None:
        """Restore from a checkpoint's `swa` entry at epoch `epoch` (TrainState.epoch: the epoch to train next)."""
        if state is None or state["averaged"]["n_averaged"] == 0:
            if epoch > self.start:
                raise UsageError(
                    f"swa.start={self.cfg.start} (epoch {self.start + 1}) is before the resume point (epoch "
                    f"{epoch + 1}) and the checkpoint has no average of the epochs since: set swa.start to "
                    f"{epoch + 1} or later, or resume from a checkpoint saved before epoch {self.start + 1}."
                )
        elif state["start"] != self.start:
            raise UsageError(
                f"the checkpoint's SWA average starts at epoch {state['start'] + 1}, this run's swa.start="
                f"{self.cfg.start} at epoch {self.start + 1}: resume with the same swa.start."
            )
        if state is not None:
            self.averaged.load_state_dict(state["averaged"])
        if epoch >= self.start:
            if self.swalr is None:
                self.begin()
            for g in self.opt.param_groups:
                g["swa_lr"] = self.cfg.lr  # this run's swa.lr (the resumed optimizer state holds the saved one)
            if state is not None and state.get("swalr") is not None:
                self.swalr.load_state_dict(state["swalr"])


@torch.no_grad()
def recompute_bn(module: nn.Module, loader, epoch: int, rt, prec, seed: int) -> None:
    """BatchNorm statistics of `module` from one pass of a training `loader` (torch.optim.swa_utils.update_bn).

    `epoch`: the loader's epoch to draw (order and augmentation), e.g. run.epochs: a pass no training epoch
    made; `seed`: the global RNG stream of the pass (dropout before a BatchNorm), restored afterwards, so the
    result does not depend on what ran before it. Under DDP each rank reads its shard and the statistics are
    then averaged over ranks. `module` is left in eval mode.
    """
    from torchsprint.runtime.rng import rng_isolated

    loader.set_epoch(epoch)
    devices = [rt.device] if rt.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), prec.autocast():
        torch.manual_seed(seed)
        update_bn(rng_isolated(loader, rt.device), module)
    module.eval()
    if rt.distributed:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                for b in (m.running_mean, m.running_var):
                    torch.distributed.all_reduce(b)
                    b.div_(rt.world_size)


def build_swa(swa_cfg, source: nn.Module, epochs: int, device: torch.device, channels_last: bool = False):
    """Swa of `source` (the unwrapped model, before wrap_model) when swa.enabled, else the no-op NoSwa.

    `epochs`: run.epochs (swa.start as a fraction counts them). Checked before anything is copied. Then
    `attach(unwrap(model))` after wrap_model and `sched = swa.schedule(sched, opt)` after the scheduler.
    """
    start = check_swa(swa_cfg, epochs)
    if not swa_cfg.enabled:
        return NoSwa()
    return Swa(source, swa_cfg, start, device, channels_last)


def describe(swa: Swa, epochs: int) -> str:
    """One line: which epochs are averaged and how the learning rate gets there."""
    anneal = swa.cfg.anneal_epochs
    return (
        f"SWA: epochs {swa.start + 1}-{epochs} averaged; from epoch {swa.start + 1} the learning rate anneals to "
        f"swa.lr={swa.cfg.lr:g} over {anneal} epoch(s) ({swa.cfg.anneal_strategy}, SWALR)"
    )


__all__ = ["NoSwa", "Swa", "SwaSchedule", "build_swa", "check_swa", "recompute_bn"]

"""data.progressive: the training crop's side per epoch (progressive resizing), and the size the backends' crops read.

FFCV's ImageNet recipes train at 160 px for most epochs and ramp to 192 near the end (min_res, max_res,
start_ramp, end_ramp, res_step in ffcv-imagenet's train_imagenet.py get_resolution); timm offers the same as
--train-size-schedule. Early epochs cost fewer pixels, the last ones train at the final size, and the
accuracy at the end stays close to a fixed-size run (BENCHMARKS.md measures it here).

The side of epoch e is a pure function of e (`Schedule.size`), so a run resumed mid-ramp crops exactly as an
uninterrupted one. Every backend applies it where its random_resized_crop sets the output size: the crop
objects read the side from a one-element shared-memory tensor (`LiveSize`) that the train loader's
`set_epoch` writes before the epoch's batches are requested, so persistent DataLoader workers (cpu and gpu
backends) see it as the main process does (the gpu backend's cpu_fraction travels the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchsprint.errors import UsageError


@dataclass(frozen=True)
class Schedule:
    """Crop side per epoch: start_size through start_epoch, end_size from end_epoch, linear between (epochs from 1)."""

    start_size: int
    end_size: int
    start_epoch: int
    end_epoch: int
    step: int

    def size(self, epoch: int) -> int:
        """The side for `epoch` counted from 0, as the loaders' set_epoch counts (the log prints epoch + 1).

        Between the ramp's ends: start + (end - start) * (e - start_epoch) / (end_epoch - start_epoch), rounded to
        the nearest multiple of step with halves up, in integers (no float rounding to differ between machines).
        """
        e, s, last = epoch + 1, self.start_epoch, self.end_epoch
        if e <= s:
            return self.start_size
        if e >= last:
            return self.end_size
        num = self.start_size * (last - s) + (self.end_size - self.start_size) * (e - s)  # size * (last - s)
        den = (last - s) * self.step
        return (2 * num + den) // (2 * den) * self.step  # floor(num / den + 1/2) multiples of step

    def sizes(self, epochs: int) -> list[int]:
        """The side of each of `epochs` epochs."""
        return [self.size(e) for e in range(epochs)]

    def describe(self, epochs: int) -> str:
        """'128 (epochs 1-3), 160 (epoch 4), 192 (epochs 5-10)': each side and the epochs (from 1) that train at it."""
        runs: list[list[int]] = []  # [side, first, last]
        for e, side in enumerate(self.sizes(epochs), start=1):
            if runs and runs[-1][0] == side:
                runs[-1][2] = e
            else:
                runs.append([side, e, e])
        return ", ".join(f"{side} (epoch{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''})" for side, a, b in runs)


def train_schedule(data_cfg) -> Schedule | None:
    """data.progressive checked against data.train.transforms; None when it is off.

    Refused: no random_resized_crop in the training spec (nothing to resize), more than one, a non-square crop,
    an end_size other than the crop's size, a crop size that is not a multiple of step or below start_size.
    """
    from torchsprint.data.preprocess.transforms import parse_step

    p = data_cfg.progressive
    if p.start_size is None:
        return None
    where = "data.train.transforms"
    crops = [
        (i, arg)
        for i, (name, arg) in enumerate(parse_step(s, where) for s in data_cfg.train.transforms)
        if name == "random_resized_crop"
    ]
    if not crops:
        raise UsageError(
            f"data.progressive resizes the output of random_resized_crop, and {where} has none "
            f"({[parse_step(s, where)[0] for s in data_cfg.train.transforms]}): add "
            f"random_resized_crop: {{size: {p.end_size or 'END'}}} to it, or remove data.progressive."
        )
    if len(crops) > 1:
        raise UsageError(
            f"data.progressive: {where} has {len(crops)} random_resized_crop steps (at {[i for i, _ in crops]}); "
            "the schedule sets one crop's size: keep one."
        )
    i, arg = crops[0]
    size = arg.get("size") if isinstance(arg, dict) else arg
    sides = [size] if isinstance(size, int) else list(size) if isinstance(size, list | tuple) else []
    if not sides or len(set(sides)) != 1 or not isinstance(sides[0], int):
        raise UsageError(
            f"data.progressive: {where}[{i}] random_resized_crop size {size!r} is not one square side; "
            f"the schedule scales square crops: use size: {max(sides) if sides else 'N'}."
        )
    side = sides[0]
    if p.end_size is not None and p.end_size != side:
        raise UsageError(
            f"data.progressive.end_size={p.end_size} differs from {where}[{i}] random_resized_crop size "
            f"{side}: the crop's size is the final training size. Make them equal, or leave end_size out."
        )
    if side % p.step:
        raise UsageError(
            f"data.progressive: the final size ({where}[{i}] random_resized_crop size {side}) is not a "
            f"multiple of data.progressive.step={p.step}; change the step or the crop's size."
        )
    if side < p.start_size:
        raise UsageError(
            f"data.progressive.start_size={p.start_size} is above the final size ({where}[{i}] "
            f"random_resized_crop size {side}): progressive resizing grows the crop; lower start_size."
        )
    return Schedule(p.start_size, side, p.start_epoch, p.end_epoch, p.step)


class LiveSize:
    """The current epoch's side in a one-element shared-memory tensor that the crop objects read per batch.

    `set_epoch(e)` writes schedule.size(e); loaders call it in their own set_epoch, before the epoch's
    batches are requested from the workers (a persistent worker reads the new value; a new iterator of the
    gpu backend closes the previous one's producer first).
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.value = torch.tensor([schedule.size(0)], dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.value[0] = self.schedule.size(epoch)

    @property
    def side(self) -> int:
        return int(self.value[0])


class FixedSize:
    """No schedule (data.progressive off): set_epoch changes nothing (off is a no-op object, DESIGN rule 4)."""

    def set_epoch(self, epoch: int) -> None:
        pass


FIXED = FixedSize()


def attach_schedule(data_cfg, ops) -> LiveSize | FixedSize:
    """Make the random_resized_crop among `ops` (the training pipeline's step objects: those with a `live`
    attribute) read its side from a LiveSize of data.progressive; FIXED when it is off."""
    schedule = train_schedule(data_cfg)
    if schedule is None:
        return FIXED
    live = LiveSize(schedule)
    crops = [op for op in ops if hasattr(op, "live")]
    if len(crops) != 1:  # train_schedule found exactly one random_resized_crop in the spec these ops came from
        raise RuntimeError(f"data.progressive: expected one crop op in the compiled pipeline, found {len(crops)}")
    crops[0].live = live.value
    return live


def check_epochs(data_cfg, epochs: int) -> None:
    """The ramp must end within the run: an end_epoch after run.epochs would never train at the final size."""
    p = data_cfg.progressive
    if p.start_size is not None and p.end_epoch > epochs:
        raise UsageError(
            f"data.progressive.end_epoch={p.end_epoch} comes after the run's last epoch (run.epochs={epochs}): "
            "it would never train at the final size, which evaluation uses. Lower end_epoch, or raise "
            "run.epochs."
        )


def check_compile(data_cfg, epochs: int) -> None:
    """speed.compile with data.progressive: one graph per input shape (plan.SpeedPlan.static_shapes, which wrap_model's
    torch.compile reads) must fit torch's limit of graphs per model (torch._dynamo.config.recompile_limit, 8 in
    torch 2.14), beyond which it runs the model uncompiled. Counted: each training size (twice when a last partial batch
    is kept, data.drop_last=false), and evaluation's full and last partial batch."""
    schedule = train_schedule(data_cfg)
    if schedule is None:
        return
    import torch._dynamo

    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)
    sizes = sorted(set(schedule.sizes(epochs)))
    graphs = len(sizes) * (1 if data_cfg.drop_last else 2) + 2
    if graphs > limit:
        raise UsageError(
            f"data.progressive with speed.compile: {len(sizes)} training sizes ({sizes}) make up to {graphs} "
            f"compiled graphs, over torch's {limit} per model (torch._dynamo.config.recompile_limit), past "
            "which it runs uncompiled. Raise data.progressive.step or narrow the size range."
        )

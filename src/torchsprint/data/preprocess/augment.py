"""The preprocessing spec compiled for batches on any device, with per-sample random parameters.

Used by the `memory` and `gpu` backends. Randomness is counter-based: sample i of epoch e gets a
row of K uniforms in [0, 1) computed from its sample seed (core.sample_seed(seed, e, i)) by a
splitmix64 hash, vectorised in torch. A sample's crop, flip and cutout therefore depend only on
(run seed, epoch, sample index): not on the batch it lands in, the rank, whether the CPU or the GPU
share of a batch decodes it, or where a resumed run restarts. Every step maps its slice of the row to
parameters with the image's actual size, so the same draw means the same relative geometry on the
CPU and the GPU.

The steps themselves live in batch_ops.py (the BATCH_OPS registry). Steps run in two stages. The head
(up to the step that makes every image the same size, e.g. random_resized_crop or center_crop) sees
images of different sizes; the tail runs batched on one NCHW uint8 tensor with per-sample parameter
tensors, e.g. a flip is `where(mask, x.flip(-1), x)`, never one coin for the whole batch. The usual
heads (random_resized_crop; resize to a fixed size; center_crop; resize shorter side + center_crop)
have a fused form, `HeadGeometry`: one crop window and output size per sample, applied to a padded
batch in one pass by batch_ops.resample_batch. Other heads run image by image (apply_one).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from torchsprint.data.core import as_int64, lsr64
from torchsprint.data.preprocess.batch_geometry import (
    CenterCrop,
    RandomResizedCrop,
    Resize,
    pair_size,
    resample_batch,
)
from torchsprint.data.preprocess.batch_ops import BATCH_OPS
from torchsprint.errors import UsageError


def uniforms(seeds: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k) float64 uniforms in [0, 1): splitmix64 of (sample seed, counter), 53-bit mantissas."""
    if k == 0:
        return torch.zeros(len(seeds), 0, dtype=torch.float64)
    z = seeds.to(torch.int64)[:, None] + torch.arange(1, k + 1, dtype=torch.int64)[None, :] * as_int64(
        0x9E3779B97F4A7C15
    )
    z = (z ^ lsr64(z, 30)) * as_int64(0xBF58476D1CE4E5B9)
    z = (z ^ lsr64(z, 27)) * as_int64(0x94D049BB133111EB)
    z = z ^ lsr64(z, 31)
    return lsr64(z, 11).to(torch.float64) / float(1 << 53)


def to_device(params: dict, device) -> dict:
    """A step's parameter tensors on `device`; keys starting with "_" stay on the host (a step that
    decides on them in Python, e.g. which samples an auto-augment op gathers, then needs no device sync)."""
    return {k: v if k.startswith("_") else v.to(device, non_blocking=True) for k, v in params.items()}


class HeadGeometry:
    """A head that is one crop-and-resize per sample, in resample_batch's terms.

    Supported heads: [random_resized_crop], [resize to (h, w)], [center_crop] and [resize shorter side,
    center_crop] (torchvision's rules for sizes and crop placement, vectorised). Built by `fused_head`.
    """

    def __init__(self, steps: list):
        self.steps = steps
        self.antialias = getattr(steps[0], "antialias", True)

    @property
    def out_size(self) -> tuple[int, int]:
        """(h, w) of the head's output: read at each use, as data.progressive changes a random_resized_crop's."""
        return pair_size(self.steps[-1].size)

    @property
    def min_resized(self) -> tuple[int, int] | None:
        """Host-side lower bound of the resized length per axis (None: no scaling), for the number of taps."""
        if isinstance(self.steps[0], RandomResizedCrop):
            return self.out_size
        if isinstance(self.steps[0], Resize):
            return self.steps[0].min_resized()
        return None

    def max_scale(self, height: int, width: int) -> tuple[float, float]:
        """Upper bounds of input / resized length for inputs of at most height x width."""
        low = self.min_resized
        if low is None:
            return 1.0, 1.0
        return height / low[0], width / low[1]

    def windows(self, params: list[dict], hs: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(4, B) int64 rows and columns (start, length, resized, offset) for images of sizes hs x ws."""
        first = self.steps[0]
        zero = torch.zeros_like(hs)
        if isinstance(first, RandomResizedCrop):
            rows, cols = first.geometry(params[0], hs, ws)
        elif isinstance(first, Resize):
            rh, rw = first.resized(hs, ws)
            rows, cols = (zero, hs, rh, zero), (zero, ws, rw, zero)
            if len(self.steps) == 2:
                top, left = self.steps[1].offsets(rh, rw)
                rows, cols = (zero, hs, rh, top), (zero, ws, rw, left)
        else:  # center_crop alone: no scaling, an offset window
            top, left = first.offsets(hs, ws)
            rows, cols = (zero, hs, hs, top), (zero, ws, ws, left)
        return torch.stack(rows), torch.stack(cols)

    def apply(
        self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, max_scale: tuple[float, float]
    ) -> torch.Tensor:
        """Run the head on a padded uint8 batch `x` with windows(...) moved to x.device."""
        return resample_batch(x, tuple(rows), tuple(cols), self.out_size, max_scale, self.antialias)


def fused_head(steps: list) -> HeadGeometry | None:
    """The HeadGeometry of these head steps, or None when they have no fused form."""
    kinds = [type(op) for op in steps]
    if kinds in ([RandomResizedCrop], [CenterCrop]) or (kinds == [Resize] and steps[0].fixes_size):
        return HeadGeometry(steps)
    if kinds == [Resize, CenterCrop] and not steps[0].fixes_size:
        return HeadGeometry(steps)
    return None


@dataclass
class BatchPipeline:
    """A spec compiled for batches: per-image head steps, batched tail steps, normalisation constants."""

    steps: list[tuple[str, Any]]
    head: int  # steps [0, head) run per image; the rest batched
    k: int  # uniforms per sample
    mean: tuple[float, ...]
    std: tuple[float, ...]
    out_size: tuple[int, int] | None

    @cached_property
    def geometry(self) -> HeadGeometry | None:
        """The fused form of the head (None: run it image by image)."""
        return fused_head([op for _, op in self.steps[: self.head]]) if self.head else None

    def draw(self, seeds: torch.Tensor) -> torch.Tensor:
        """(B, k) uniforms for these sample seeds (CPU, cheap: ~1 us per sample)."""
        return uniforms(seeds, self.k)

    def params(
        self, u: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, start: int = 0, stop: int | None = None
    ) -> list[dict]:
        """Parameter dicts (tensors over the batch) of steps[start:stop] for inputs of sizes hs x ws.

        `u` holds whole rows (all k columns); a step always reads the same columns.
        """
        out, col = [], sum(op.k for _, op in self.steps[:start])
        for _, op in self.steps[start:stop]:
            p, hs, ws = op.params(u[:, col : col + op.k], hs, ws)
            out.append(p)
            col += op.k
        return out

    def run_head(self, images: list[torch.Tensor], params: list[dict], rows: list[int]) -> list[torch.Tensor]:
        """Per-image head steps; `rows` maps each image to its row in `params`."""
        out = []
        for j, img in enumerate(images):
            for (_, op), p in zip(self.steps[: self.head], params[: self.head]):
                img = op.apply_one(img, p, rows[j])
            out.append(img)
        return out

    def run_tail(self, x: torch.Tensor, params: list[dict]) -> torch.Tensor:
        """Batched tail steps on uint8 NCHW `x` (any device) with `params` = self.params(..., start=self.head);
        the small parameter tensors move to x.device."""
        for (_, op), p in zip(self.steps[self.head :], params):
            x = op.apply_batch(x, to_device(p, x.device))
        return x

    def __call__(self, x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """Augment a uniform-size uint8 batch (memory backend): every step batched."""
        if not self.steps:
            return x  # nothing to draw: keep the per-batch cost of an unaugmented split at zero
        n, _, h, w = x.shape
        params = self.params(self.draw(seeds), torch.full((n,), h), torch.full((n,), w))
        for (_, op), p in zip(self.steps, params):
            x = op.apply_batch(x, to_device(p, x.device))
        return x


def compile_batch_spec(spec: list, where: str, channels: int, backend: str) -> BatchPipeline:
    """Compile a spec for the batched backends; steps they cannot run are refused by name."""
    from torchsprint.data.preprocess.transforms import TRANSFORMS, call_with, normalize, parse_step

    steps, mean, std = [], None, None
    parsed = [parse_step(s, where) for s in spec]
    for i, (name, arg) in enumerate(parsed):
        TRANSFORMS.get(name)  # unknown names get the registry's "did you mean"
        if name == "normalize":
            if i != len(parsed) - 1:
                raise UsageError(f"{where}: normalize must be the last step (it runs on the device after the copy).")
            mean, std = call_with(normalize, arg, f"{where}[{i}] normalize")
            continue
        if name not in BATCH_OPS:
            raise UsageError(
                f"{where}[{i}]: step '{name}' is not supported by data.backend={backend} "
                f"(it supports {', '.join(BATCH_OPS.names())}, normalize). Remove the step or use data.backend=cpu."
            )
        steps.append((name, call_with(BATCH_OPS.get(name), arg, f"{where}[{i}] {name}")))
    if mean is None:
        mean, std = ((0.0,), (1.0,))
    if len(mean) == 1 and channels > 1:
        mean, std = mean * channels, std * channels
    if len(mean) != channels:
        raise UsageError(
            f"{where}: normalize has {len(mean)} channel statistics but the images have {channels} channels."
        )
    fixing = [i for i, (_, op) in enumerate(steps) if op.fixes_size]
    head = fixing[0] + 1 if fixing else 0
    out_size = next((op.size for _, op in reversed(steps) if op.fixes_size), None)
    out_size = pair_size(out_size) if out_size is not None else None
    return BatchPipeline(steps, head, sum(op.k for _, op in steps), tuple(mean), tuple(std), out_size)

"""The preprocessing spec compiled for batches on any device, with per-sample random parameters.

Used by the `memory` and `gpu` backends. Randomness is counter-based: sample i of epoch e gets a
row of K uniforms in [0, 1) computed from its sample seed (core.sample_seed(seed, e, i)) by a
splitmix64 hash, vectorised in torch. A sample's crop, flip and cutout therefore depend only on
(run seed, epoch, sample index): not on the batch it lands in, the rank, whether the CPU or the GPU
share of a batch decodes it, or where a resumed run restarts. Every step maps its slice of the row to
parameters with the image's actual size, so the same draw means the same relative geometry on the
CPU and the GPU.

Steps run in two stages. The head (up to the step that makes every image the same size, e.g.
random_resized_crop or center_crop) runs per image, because decoded images differ in size; the tail
runs batched on one NCHW uint8 tensor with per-sample parameter tensors, e.g. a flip is
`where(mask, x.flip(-1), x)`, never one coin for the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

BATCH_OPS = Registry("batched transform")

_M64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores (arithmetic wraps mod 2**64)."""
    return c - (1 << 64) if c >= (1 << 63) else c


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic for negative values)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def sample_seeds(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """Vectorised core.sample_seed: int64 seeds for int64 `indices`, bit-identical to the scalar one."""
    base = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) & _M64
    x = indices.to(torch.int64) * _s64(0x94D049BB133111EB) + _s64(base)
    x = x ^ _lsr(x, 31)
    x = x * _s64(0xD6E8FEB86659FD93)
    x = x ^ _lsr(x, 32)
    return x & ((1 << 63) - 1)


def uniforms(seeds: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k) float64 uniforms in [0, 1): splitmix64 of (sample seed, counter), 53-bit mantissas."""
    if k == 0:
        return torch.zeros(len(seeds), 0, dtype=torch.float64)
    z = seeds.to(torch.int64)[:, None] + torch.arange(1, k + 1, dtype=torch.int64)[None, :] * _s64(0x9E3779B97F4A7C15)
    z = (z ^ _lsr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _s64(0x94D049BB133111EB)
    z = z ^ _lsr(z, 31)
    return _lsr(z, 11).to(torch.float64) / float(1 << 53)


def _pair(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, list | tuple) and len(size) == 2:
        return int(size[0]), int(size[1])
    if isinstance(size, list | tuple) and len(size) == 1:
        return int(size[0]), int(size[0])
    raise UsageError(f"size must be an int or [height, width], got {size!r}")


def _resized_crop(img, top, left, h, w, size):
    from torchvision.transforms.v2 import functional as F

    # torchvision's own kernel (uint8 AVX path on CPU, float + round on CUDA): the cpu backend's
    # RandomResizedCrop calls this very function, so only the draws and the device differ.
    return F.resized_crop(img, int(top), int(left), int(h), int(w), list(size), antialias=True)


# ---------------------------------------------------------------- steps
# Each step: k (uniforms per sample); params(u (B,k), hs, ws) -> (params, out_hs, out_ws) on CPU
# tensors; fixes_size (output size independent of input); apply_one(img CHW, params, i) for the
# per-image head; apply_batch(x NCHW, params) for the batched tail (params moved to x.device).


class RandomResizedCrop:
    """torchvision's RandomResizedCrop: 10 tries of area in `scale` x aspect in log-uniform `ratio`,
    first fit wins, else a centre crop clamped to `ratio` (torchvision v2 get_params)."""

    k = 10 * 2 + 2
    fixes_size = True

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), antialias: bool = True):
        self.size = _pair(size)
        self.scale, self.ratio = tuple(scale), tuple(ratio)

    def params(self, u, hs, ws):
        hs64, ws64 = hs.double(), ws.double()
        area = (hs64 * ws64)[:, None]
        target = area * (self.scale[0] + u[:, 0:10] * (self.scale[1] - self.scale[0]))
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(lo + u[:, 10:20] * (hi - lo))
        w = torch.round(torch.sqrt(target * aspect))
        h = torch.round(torch.sqrt(target / aspect))
        ok = (w > 0) & (h > 0) & (w <= ws64[:, None]) & (h <= hs64[:, None])
        first = torch.where(ok.any(1), ok.double().argmax(1), torch.full_like(hs, -1))
        pick = first.clamp(min=0)[:, None]
        cw, ch = w.gather(1, pick)[:, 0], h.gather(1, pick)[:, 0]
        # fallback: whole image cropped to the nearest allowed aspect ratio, centred
        in_ratio = ws64 / hs64
        fw = torch.where(in_ratio < self.ratio[0], ws64, torch.where(in_ratio > self.ratio[1], torch.round(hs64 * self.ratio[1]), ws64))
        fh = torch.where(in_ratio < self.ratio[0], torch.round(ws64 / self.ratio[0]), hs64)
        fallback = first < 0
        cw, ch = torch.where(fallback, fw, cw), torch.where(fallback, fh, ch)
        top = torch.where(fallback, torch.div(hs64 - ch, 2, rounding_mode="floor"), torch.floor(u[:, 20] * (hs64 - ch + 1)))
        left = torch.where(fallback, torch.div(ws64 - cw, 2, rounding_mode="floor"), torch.floor(u[:, 21] * (ws64 - cw + 1)))
        p = {"top": top.long(), "left": left.long(), "h": ch.long(), "w": cw.long()}
        n = len(hs)
        return p, torch.full((n,), self.size[0]), torch.full((n,), self.size[1])

    def apply_one(self, img, p, i):
        return _resized_crop(img, p["top"][i], p["left"][i], p["h"][i], p["w"][i], self.size)

    def apply_batch(self, x, p):
        return torch.stack([self.apply_one(x[i], p, i) for i in range(len(x))])


class Resize:
    """Deterministic resize: an int resizes the shorter side (keeping aspect), a pair sets (h, w)."""

    k = 0

    def __init__(self, size, interpolation: str = "bilinear", antialias: bool = True, max_size=None):
        if interpolation != "bilinear" or max_size is not None:
            raise UsageError("the batched resize supports interpolation=bilinear and no max_size; use data.backend=cpu for others.")
        self.size = size
        self.fixes_size = not isinstance(size, int) and not (isinstance(size, list | tuple) and len(size) == 1)

    def _out(self, h: int, w: int) -> tuple[int, int]:
        if self.fixes_size:
            return _pair(self.size)
        s = self.size if isinstance(self.size, int) else self.size[0]
        # torchvision's rule (_compute_resized_output_size): the long side is int(s * long / short).
        return (s, int(s * w / h)) if h <= w else (int(s * h / w), s)

    def params(self, u, hs, ws):
        out = [self._out(int(h), int(w)) for h, w in zip(hs, ws)]
        return {}, torch.tensor([o[0] for o in out]), torch.tensor([o[1] for o in out])

    def apply_one(self, img, p, i):
        from torchvision.transforms.v2 import functional as F

        return F.resize(img, list(self._out(img.shape[-2], img.shape[-1])), antialias=True)

    def apply_batch(self, x, p):
        from torchvision.transforms.v2 import functional as F

        return F.resize(x, list(self._out(x.shape[-2], x.shape[-1])), antialias=True)


class CenterCrop:
    """Deterministic centre crop (torchvision's rounding: top = round((H - h) / 2))."""

    k = 0
    fixes_size = True

    def __init__(self, size):
        self.size = _pair(size)

    def params(self, u, hs, ws):
        n = len(hs)
        return {}, torch.full((n,), self.size[0]), torch.full((n,), self.size[1])

    def apply_one(self, img, p, i):
        from torchvision.transforms.v2 import functional as F

        return F.center_crop(img, list(self.size))

    def apply_batch(self, x, p):
        from torchvision.transforms.v2 import functional as F

        return F.center_crop(x, list(self.size))


class RandomCrop:
    """Pad by `padding` (constant 0), then a uniformly placed crop of `size` (per sample).

    Batched, it pads once and gathers every sample's window with one advanced-indexing op.
    """

    k = 2
    fixes_size = True

    def __init__(self, size, padding=None, padding_mode: str = "constant", pad_if_needed: bool = False):
        if padding_mode != "constant" or pad_if_needed:
            raise UsageError("the batched random_crop supports padding_mode=constant without pad_if_needed; use data.backend=cpu.")
        self.size = _pair(size)
        self.pad = int(padding or 0)
        if isinstance(padding, list | tuple):
            if len(set(padding)) != 1:
                raise UsageError("the batched random_crop takes one padding value for all sides.")
            self.pad = int(padding[0])

    def params(self, u, hs, ws):
        ph, pw = hs + 2 * self.pad, ws + 2 * self.pad
        if bool(((ph < self.size[0]) | (pw < self.size[1])).any()):
            raise UsageError(f"random_crop size {self.size} is larger than the padded image; lower size or raise padding.")
        top = torch.floor(u[:, 0] * (ph - self.size[0] + 1).double()).long()
        left = torch.floor(u[:, 1] * (pw - self.size[1] + 1).double()).long()
        n = len(hs)
        return {"top": top, "left": left}, torch.full((n,), self.size[0]), torch.full((n,), self.size[1])

    def apply_one(self, img, p, i):
        if self.pad:
            img = torch.nn.functional.pad(img, (self.pad,) * 4)
        t, left = int(p["top"][i]), int(p["left"][i])
        return img[:, t : t + self.size[0], left : left + self.size[1]]

    def apply_batch(self, x, p):
        if self.pad:
            x = torch.nn.functional.pad(x, (self.pad,) * 4)
        rows = p["top"][:, None] + torch.arange(self.size[0], device=x.device)[None, :]  # (B, h)
        cols = p["left"][:, None] + torch.arange(self.size[1], device=x.device)[None, :]  # (B, w)
        b = torch.arange(len(x), device=x.device)[:, None, None]
        out = x.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]]  # (B, h, w, C)
        return out.permute(0, 3, 1, 2).contiguous()


class Flip:
    """Per-sample flip with probability p along the last (hflip) or second-last (vflip) axis."""

    k = 1
    fixes_size = False

    def __init__(self, p: float = 0.5, dim: int = -1):
        self.p, self.dim = float(p), dim

    def params(self, u, hs, ws):
        return {"flip": u[:, 0] < self.p}, hs, ws

    def apply_one(self, img, p, i):
        return img.flip(self.dim) if bool(p["flip"][i]) else img

    def apply_batch(self, x, p):
        return torch.where(p["flip"].view(-1, 1, 1, 1), x.flip(self.dim), x)


class Cutout:
    """Zero a size x size square centred uniformly in the image, clipped at the borders
    (DeVries & Taylor 2017, as in the CIFAR speedruns), with probability p per sample."""

    k = 3
    fixes_size = False

    def __init__(self, size: int = 8, p: float = 1.0, value: int = 0):
        self.size, self.p, self.value = int(size), float(p), int(value)

    def params(self, u, hs, ws):
        cy = torch.floor(u[:, 0] * hs.double()).long()
        cx = torch.floor(u[:, 1] * ws.double()).long()
        return {"cy": cy, "cx": cx, "on": u[:, 2] < self.p}, hs, ws

    def _mask(self, h, w, cy, cx, on, device):
        y0 = (cy - self.size // 2)[:, None, None]
        x0 = (cx - self.size // 2)[:, None, None]
        yy = torch.arange(h, device=device)[None, :, None]
        xx = torch.arange(w, device=device)[None, None, :]
        inside = (yy >= y0) & (yy < y0 + self.size) & (xx >= x0) & (xx < x0 + self.size) & on[:, None, None]
        return inside[:, None]  # (B, 1, H, W)

    def apply_one(self, img, p, i):
        m = self._mask(img.shape[-2], img.shape[-1], p["cy"][i : i + 1].to(img.device), p["cx"][i : i + 1].to(img.device),
                       p["on"][i : i + 1].to(img.device), img.device)[0]
        return img.masked_fill(m, self.value)

    def apply_batch(self, x, p):
        return x.masked_fill(self._mask(x.shape[-2], x.shape[-1], p["cy"], p["cx"], p["on"], x.device), self.value)


class ColorJitter:
    """Per-sample brightness, contrast and saturation factors in [1 - v, 1 + v], applied in that fixed
    order in float and rounded back to uint8 (torchvision picks a random order; hue is not supported)."""

    k = 3
    fixes_size = False

    def __init__(self, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0):
        if hue:
            raise UsageError("color_jitter hue is not supported by the batched (memory/gpu) backends; set hue: 0 or use data.backend=cpu.")
        self.b, self.c, self.s = float(brightness), float(contrast), float(saturation)

    def params(self, u, hs, ws):
        f = lambda v, col: (1 - v) + u[:, col] * 2 * v  # noqa: E731
        return {"b": f(self.b, 0), "c": f(self.c, 1), "s": f(self.s, 2)}, hs, ws

    def apply_batch(self, x, p):
        y = x.float()
        dev = x.device
        y = y * p["b"].to(dev, torch.float32).view(-1, 1, 1, 1)
        if y.shape[1] == 3:
            gray = (0.299 * y[:, 0] + 0.587 * y[:, 1] + 0.114 * y[:, 2]).unsqueeze(1)
        else:
            gray = y
        mean = gray.mean(dim=(1, 2, 3), keepdim=True)
        c = p["c"].to(dev, torch.float32).view(-1, 1, 1, 1)
        y = (y * c + mean * (1 - c)).clamp_(0, 255)
        if y.shape[1] == 3:
            gray = (0.299 * y[:, 0] + 0.587 * y[:, 1] + 0.114 * y[:, 2]).unsqueeze(1)
            s = p["s"].to(dev, torch.float32).view(-1, 1, 1, 1)
            y = y * s + gray * (1 - s)
        return y.clamp_(0, 255).round_().to(torch.uint8)

    def apply_one(self, img, p, i):
        return self.apply_batch(img[None], {k: v[i : i + 1] for k, v in p.items()})[0]


BATCH_OPS.register("random_resized_crop")(RandomResizedCrop)
BATCH_OPS.register("resize")(Resize)
BATCH_OPS.register("center_crop")(CenterCrop)
BATCH_OPS.register("random_crop")(RandomCrop)
BATCH_OPS.register("hflip")(lambda p=0.5: Flip(p, -1))
BATCH_OPS.register("vflip")(lambda p=0.5: Flip(p, -2))
BATCH_OPS.register("cutout")(Cutout)
BATCH_OPS.register("color_jitter")(ColorJitter)


@dataclass
class BatchPipeline:
    """A spec compiled for batches: per-image head steps, batched tail steps, normalisation constants."""

    steps: list[tuple[str, Any]]
    head: int  # steps [0, head) run per image; the rest batched
    k: int  # uniforms per sample
    mean: tuple[float, ...]
    std: tuple[float, ...]
    out_size: tuple[int, int] | None

    def draw(self, seeds: torch.Tensor) -> torch.Tensor:
        """(B, k) uniforms for these sample seeds (CPU, cheap: ~1 us per sample)."""
        return uniforms(seeds, self.k)

    def params(self, u: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, start: int = 0, stop: int | None = None) -> list[dict]:
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
            x = op.apply_batch(x, {k: v.to(x.device, non_blocking=True) for k, v in p.items()})
        return x

    def __call__(self, x: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """Augment a uniform-size uint8 batch (memory backend): every step batched."""
        if not self.steps:
            return x  # nothing to draw: keep the per-batch cost of an unaugmented split at zero
        n, _, h, w = x.shape
        params = self.params(self.draw(seeds), torch.full((n,), h), torch.full((n,), w))
        for (_, op), p in zip(self.steps, params):
            x = op.apply_batch(x, {k: v.to(x.device, non_blocking=True) for k, v in p.items()})
        return x


def compile_batch_spec(spec: list, where: str, channels: int, backend: str) -> BatchPipeline:
    """Compile a spec for the batched backends; steps they cannot run are refused by name."""
    from torchsprint.data.transforms import TRANSFORMS, call_with, normalize, parse_step

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
        raise UsageError(f"{where}: normalize has {len(mean)} channel statistics but the images have {channels} channels.")
    fixing = [i for i, (_, op) in enumerate(steps) if op.fixes_size]
    head = fixing[0] + 1 if fixing else 0
    out_size = next((op.size for _, op in reversed(steps) if op.fixes_size), None)
    out_size = _pair(out_size) if out_size is not None else None
    return BatchPipeline(steps, head, sum(op.k for _, op in steps), tuple(mean), tuple(std), out_size)

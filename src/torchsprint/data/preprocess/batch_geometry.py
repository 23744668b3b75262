"""Batched geometric steps for the memory and gpu backends (registered in batch_ops.py's BATCH_OPS): crops,
resize, flips, and `resample_batch`, the fused crop + resize.

`resample_batch` crops and resizes a whole batch in one pass, each sample with its own window: the
batched random_resized_crop (memory backend) and the fused head of the gpu backend (decoded JPEGs of
different sizes, padded into one tensor) both use it instead of a torchvision call per image.
"""

from __future__ import annotations

import math

import torch

from torchsprint.errors import UsageError


def pair_size(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, list | tuple) and len(size) == 2:
        return int(size[0]), int(size[1])
    if isinstance(size, list | tuple) and len(size) == 1:
        return int(size[0]), int(size[0])
    raise UsageError(f"size must be an int or [height, width], got {size!r}")


def _resized_crop(img, top, left, h, w, size, antialias: bool = True):
    from torchvision.transforms.v2 import functional as F

    # torchvision's own kernel (uint8 AVX path on CPU, float + round on CUDA): the cpu backend's
    # RandomResizedCrop calls this very function, so only the draws and the device differ.
    return F.resized_crop(img, int(top), int(left), int(h), int(w), list(size), antialias=antialias)


# ---------------------------------------------------------------- batched crop + resize


def axis_weights(
    start: torch.Tensor,
    length: torch.Tensor,
    resized: torch.Tensor,
    offset: torch.Tensor,
    out_len: int,
    in_len: int,
    taps: int,
    antialias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample bilinear resampling weights along one axis, as torch's (anti-aliased) interpolate computes them.

    Sample b takes the window [start, start + length) of its input row, resizes it to `resized` pixels
    and keeps output pixels [offset, offset + out_len) of that (a centre crop after a resize; positions
    outside [0, resized) are zero, as torchvision pads a crop larger than the image).

    The weights are those of aten's UpSampleKernel (`_compute_indices_min_size_weights_aa`, bilinear =
    triangle filter): scale = length / resized, support = scale (1 when upsampling), the first tap at
    trunc(center - support + 0.5) clamped to the window, each weight normalised by their sum. Without
    antialias the support stays 1, which is exactly align_corners=False bilinear interpolation (edge
    pixels clamp). Only +, -, *, / and trunc: IEEE-exact, so identical on every device.

    Args:
        start, length, resized, offset: (B,) int64 on the device of the result.
        out_len: output pixels per sample; in_len: the (padded) input length, to clamp indices.
        taps: weights per output pixel (>= floor(2 * max scale) + 1; extra taps get weight 0).
    Returns:
        index (B, out_len, taps) int64 into [0, in_len), weight (B, out_len, taps) float32.
    """
    f64 = torch.float64
    scale = length.to(f64) / resized.to(f64)
    one = torch.ones_like(scale)
    support = torch.where(scale >= 1, scale, one) if antialias else one
    invscale = torch.where(scale >= 1, 1 / scale, one) if antialias else one
    i = torch.arange(out_len, dtype=f64, device=start.device)[None, :] + offset[:, None].to(
        f64
    )  # position in the resized row
    center = scale[:, None] * (i + 0.5)
    lo = torch.clamp(torch.trunc(center - support[:, None] + 0.5), min=0)
    hi = torch.minimum(torch.trunc(center + support[:, None] + 0.5), length[:, None].to(f64))
    pos = lo[..., None] + torch.arange(taps, dtype=f64, device=start.device)  # (B, out, taps) in the window
    w = (1 - ((pos - center[..., None] + 0.5) * invscale[:, None, None]).abs()).clamp(min=0)
    inside = (pos < hi[..., None]) & ((i >= 0) & (i < resized[:, None].to(f64)))[..., None]
    w = torch.where(inside, w, 0.0)
    total = w.sum(-1, keepdim=True)
    w = torch.where(total > 0, w / total, 0.0)
    index = (pos + start[:, None, None].to(f64)).clamp(0, in_len - 1).long()
    return index, w.float()


def taps_for(max_scale: float, antialias: bool) -> int:
    """Taps per output pixel that cover the widest filter at `max_scale` (input / output length)."""
    return int(math.floor(2 * max(max_scale, 1.0) if antialias else 2)) + 1


def resample_batch(
    x: torch.Tensor,
    rows: tuple,
    cols: tuple,
    out_size: tuple[int, int],
    max_scale: tuple[float, float],
    antialias: bool = True,
) -> torch.Tensor:
    """Crop and resize every sample of a uint8 NCHW batch with its own window, in one batched pass.

    The hand-written part of torchsprint's GPU input path: torchvision resizes one image per call, and a
    batch of decoded JPEGs has as many sizes as images. Here each axis is resampled separably with
    per-sample weights (axis_weights): rows first (gather `taps` input rows per output row), then
    columns, accumulating in fp32 with separate multiply and add kernels, so a sample's pixels do not
    depend on the batch it is in, the padding around it, or the device (no fused multiply-add
    contraction), then rounded to uint8 like torchvision's float path. Against torchvision's own
    per-image uint8 kernel (which rounds between its two passes) pixels differ by at most 1 level
    (tests/e2e/data/test_data_backends.py measures it).

    Args:
        x: (B, C, H, W) uint8; sample b's image occupies any region the windows point into (padding
            elsewhere is never read with a non-zero weight).
        rows, cols: (start, length, resized, offset) per axis, each (B,) int64 on x.device (axis_weights).
        out_size: (height, width) of the output.
        max_scale: host-side upper bounds of length / resized per axis (for the number of taps).
        antialias: torchvision's antialias (a triangle filter as wide as the downscale factor).
    """
    b, c, h, w = x.shape
    oh, ow = out_size
    if b == 0:
        return x.new_zeros(0, c, oh, ow)
    iy, wy = axis_weights(*rows, oh, h, taps_for(max_scale[0], antialias), antialias)
    ix, wx = axis_weights(*cols, ow, w, taps_for(max_scale[1], antialias), antialias)
    acc = None
    for k in range(iy.shape[-1]):
        sel = x.gather(2, iy[:, None, :, k, None].expand(b, c, oh, w)).float()
        term = torch.mul(sel, wy[:, None, :, k, None])
        acc = term if acc is None else torch.add(acc, term)
    out = None
    for k in range(ix.shape[-1]):
        term = torch.mul(acc.gather(3, ix[:, None, None, :, k].expand(b, c, oh, ow)), wx[:, None, None, :, k])
        out = term if out is None else torch.add(out, term)
    return out.round_().clamp_(0, 255).to(torch.uint8)


class RandomResizedCrop:
    """torchvision's RandomResizedCrop: 10 tries of area in `scale` x aspect in log-uniform `ratio`,
    first fit wins, else a centre crop clamped to `ratio` (torchvision v2 get_params)."""

    k = 10 * 2 + 2
    fixes_size = True

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), antialias: bool = True):
        self._size, self.antialias = pair_size(size), bool(antialias)
        self.scale, self.ratio = tuple(scale), tuple(ratio)
        self.live = (
            None  # data.progressive: a shared one-element tensor holding this epoch's side (progressive.LiveSize)
        )

    @property
    def size(self) -> tuple[int, int]:
        """(h, w) of the output: the spec's, or this epoch's side under data.progressive (read at each use)."""
        return self._size if self.live is None else (int(self.live[0]),) * 2

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
        fw = torch.where(
            in_ratio < self.ratio[0],
            ws64,
            torch.where(in_ratio > self.ratio[1], torch.round(hs64 * self.ratio[1]), ws64),
        )
        fh = torch.where(in_ratio < self.ratio[0], torch.round(ws64 / self.ratio[0]), hs64)
        fallback = first < 0
        cw, ch = torch.where(fallback, fw, cw), torch.where(fallback, fh, ch)
        top = torch.where(
            fallback, torch.div(hs64 - ch, 2, rounding_mode="floor"), torch.floor(u[:, 20] * (hs64 - ch + 1))
        )
        left = torch.where(
            fallback, torch.div(ws64 - cw, 2, rounding_mode="floor"), torch.floor(u[:, 21] * (ws64 - cw + 1))
        )
        p = {"top": top.long(), "left": left.long(), "h": ch.long(), "w": cw.long()}
        n = len(hs)
        return p, torch.full((n,), self.size[0]), torch.full((n,), self.size[1])

    def apply_one(self, img, p, i):
        return _resized_crop(img, p["top"][i], p["left"][i], p["h"][i], p["w"][i], self.size, self.antialias)

    def geometry(self, p, hs, ws):
        """Per-axis (start, length, resized, offset) windows for resample_batch."""
        oh, ow = (torch.full_like(hs, s) for s in self.size)
        zero = torch.zeros_like(hs)
        return (p["top"], p["h"], oh, zero), (p["left"], p["w"], ow, zero)

    def apply_batch(self, x, p):
        # One batched pass, no per-sample host values (a Python int per sample synced with a CUDA device).
        hs = torch.full((len(x),), x.shape[-2], device=x.device)
        ws = torch.full((len(x),), x.shape[-1], device=x.device)
        rows, cols = self.geometry(p, hs, ws)
        size = self.size
        return resample_batch(x, rows, cols, size, (x.shape[-2] / size[0], x.shape[-1] / size[1]), self.antialias)


class Resize:
    """Deterministic resize: an int resizes the shorter side (keeping aspect), a pair sets (h, w)."""

    k = 0

    def __init__(self, size, interpolation: str = "bilinear", antialias: bool = True, max_size=None):
        if interpolation != "bilinear" or max_size is not None:
            raise UsageError(
                "the batched resize supports interpolation=bilinear and no max_size; use data.backend=cpu for others."
            )
        self.size, self.antialias = size, bool(antialias)
        self.fixes_size = not isinstance(size, int) and not (isinstance(size, list | tuple) and len(size) == 1)

    def _out(self, h: int, w: int) -> tuple[int, int]:
        if self.fixes_size:
            return pair_size(self.size)
        s = self.size if isinstance(self.size, int) else self.size[0]
        # torchvision's rule (_compute_resized_output_size): the long side is int(s * long / short).
        return (s, int(s * w / h)) if h <= w else (int(s * h / w), s)

    def params(self, u, hs, ws):
        return {}, *self.resized(hs, ws)

    def apply_one(self, img, p, i):
        from torchvision.transforms.v2 import functional as F

        return F.resize(img, list(self._out(img.shape[-2], img.shape[-1])), antialias=self.antialias)

    def apply_batch(self, x, p):
        from torchvision.transforms.v2 import functional as F

        return F.resize(x, list(self._out(x.shape[-2], x.shape[-1])), antialias=self.antialias)

    def resized(self, hs, ws):
        """Vectorised _out: output (heights, widths) for (B,) input sizes (same int() truncation)."""
        if self.fixes_size:
            h, w = pair_size(self.size)
            return torch.full_like(hs, h), torch.full_like(ws, w)
        s = self.size if isinstance(self.size, int) else self.size[0]
        long_h = torch.trunc(s * hs.double() / ws.double()).long()  # int(s * h / w) for portrait images
        long_w = torch.trunc(s * ws.double() / hs.double()).long()
        return torch.where(hs <= ws, torch.full_like(hs, s), long_h), torch.where(
            hs <= ws, long_w, torch.full_like(ws, s)
        )

    def min_resized(self) -> tuple[int, int]:
        """Host-side lower bounds of the output size (the shorter side is `size`, the longer one more)."""
        if self.fixes_size:
            return pair_size(self.size)
        s = self.size if isinstance(self.size, int) else self.size[0]
        return s, s


class CenterCrop:
    """Deterministic centre crop (torchvision's rounding: top = round((H - h) / 2))."""

    k = 0
    fixes_size = True

    def __init__(self, size):
        self.size = pair_size(size)

    def params(self, u, hs, ws):
        n = len(hs)
        return {}, torch.full((n,), self.size[0]), torch.full((n,), self.size[1])

    def apply_one(self, img, p, i):
        from torchvision.transforms.v2 import functional as F

        return F.center_crop(img, list(self.size))

    def apply_batch(self, x, p):
        from torchvision.transforms.v2 import functional as F

        return F.center_crop(x, list(self.size))

    def offsets(self, hs, ws):
        """Top and left of the crop in (B,) images of these sizes, as torchvision's center_crop places it:
        round((H - h) / 2) (round half to even, like Python's round), or minus the top padding when the
        crop is larger than the image."""

        def one(n, c):
            inside = torch.round((n - c).double() / 2).long()
            return torch.where(n >= c, inside, -torch.div(c - n, 2, rounding_mode="floor"))

        return one(hs, self.size[0]), one(ws, self.size[1])


class RandomCrop:
    """Pad by `padding` (constant 0), then a uniformly placed crop of `size` (per sample).

    Batched, it pads once and gathers every sample's window with one advanced-indexing op.
    """

    k = 2
    fixes_size = True

    def __init__(self, size, padding=None, padding_mode: str = "constant", pad_if_needed: bool = False):
        if padding_mode != "constant" or pad_if_needed:
            raise UsageError(
                "the batched random_crop supports padding_mode=constant without pad_if_needed; use data.backend=cpu."
            )
        self.size = pair_size(size)
        self.pad = int(padding or 0)
        if isinstance(padding, list | tuple):
            if len(set(padding)) != 1:
                raise UsageError("the batched random_crop takes one padding value for all sides.")
            self.pad = int(padding[0])

    def params(self, u, hs, ws):
        ph, pw = hs + 2 * self.pad, ws + 2 * self.pad
        if bool(((ph < self.size[0]) | (pw < self.size[1])).any()):
            raise UsageError(
                f"random_crop size {self.size} is larger than the padded image; lower size or raise padding."
            )
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

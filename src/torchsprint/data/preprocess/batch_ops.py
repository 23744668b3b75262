"""Batched preprocessing steps (the BATCH_OPS registry) for the memory and gpu backends.

Each step has `k` (uniforms it reads per sample); `params(u (B, k), hs, ws)` -> (parameters, output
heights, output widths) as CPU tensors; `fixes_size` (output size independent of the input);
`apply_one(img CHW, params, i)` for the per-image head; `apply_batch(x NCHW, params)` for the batched
tail, with per-sample parameters (never one coin for the whole batch). augment.py compiles a spec
into a pipeline of these steps and draws the uniforms.

`resample_batch` crops and resizes a whole batch in one pass, each sample with its own window: the
batched random_resized_crop (memory backend) and the fused head of the gpu backend (decoded JPEGs of
different sizes, padded into one tensor) both use it instead of a torchvision call per image.
"""

from __future__ import annotations

import math

import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

BATCH_OPS = Registry("batched transform")


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


def axis_weights(start: torch.Tensor, length: torch.Tensor, resized: torch.Tensor, offset: torch.Tensor, out_len: int,
                 in_len: int, taps: int, antialias: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    i = torch.arange(out_len, dtype=f64, device=start.device)[None, :] + offset[:, None].to(f64)  # position in the resized row
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


def resample_batch(x: torch.Tensor, rows: tuple, cols: tuple, out_size: tuple[int, int], max_scale: tuple[float, float],
                   antialias: bool = True) -> torch.Tensor:
    """Crop and resize every sample of a uint8 NCHW batch with its own window, in one batched pass.

    The hand-written part of torchsprint's GPU input path: torchvision resizes one image per call, and a
    batch of decoded JPEGs has as many sizes as images. Here each axis is resampled separably with
    per-sample weights (axis_weights): rows first (gather `taps` input rows per output row), then
    columns, accumulating in fp32 with separate multiply and add kernels, so a sample's pixels do not
    depend on the batch it is in, the padding around it, or the device (no fused multiply-add
    contraction), then rounded to uint8 like torchvision's float path. Against torchvision's own
    per-image uint8 kernel (which rounds between its two passes) pixels differ by at most 1 level
    (tests/test_data_backends.py measures it).

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
        self.live = None  # data.progressive: a shared one-element tensor holding this epoch's side (progressive.LiveSize)

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
            raise UsageError("the batched resize supports interpolation=bilinear and no max_size; use data.backend=cpu for others.")
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
        return torch.where(hs <= ws, torch.full_like(hs, s), long_h), torch.where(hs <= ws, long_w, torch.full_like(ws, s))

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
            raise UsageError("the batched random_crop supports padding_mode=constant without pad_if_needed; use data.backend=cpu.")
        self.size = pair_size(size)
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


# ---------------------------------------------------------------- automatic augmentation, batched
# TrivialAugmentWide and RandAugment with per-sample op and magnitude. The op tables (names, magnitude
# bins, signs) are torchvision's own (v2.TrivialAugmentWide/RandAugment._AUGMENTATION_SPACE), and the
# ops are torchvision's kernels rewritten for a per-sample parameter tensor: per op, the samples that
# drew it are gathered, transformed together, and scattered back (index_copy_). Hand-written because
# torchvision's functionals take one parameter per call (a call per sample would be one kernel launch
# per image on the GPU). tests/test_auto_augment.py compares every op with torchvision on each image.


def _inverse_affine(center, angle, translate, shear) -> list[float]:
    from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

    return _get_inverse_affine_matrix(center, angle, translate, 1.0, shear)


def affine_batch(x: torch.Tensor, matrices: list[list[float]], interpolation: str) -> torch.Tensor:
    """torchvision's affine_image (fill=None) for uint8 NCHW `x` with one inverse matrix per sample.

    The grid is torchvision's _affine_grid with a batch of thetas (the same bmm per sample), sampled
    by one grid_sample call (zeros outside), rounded back to uint8 as torchvision does.
    """
    n, _, h, w = x.shape
    dev = x.device
    theta = torch.tensor(matrices, dtype=torch.float32, device=dev).reshape(n, 2, 3)
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=dev)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=dev))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=dev).unsqueeze_(-1))
    base[..., 2].fill_(1)
    rescaled = theta.transpose(1, 2).div_(torch.tensor([0.5 * w, 0.5 * h], dtype=torch.float32, device=dev))
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(rescaled).view(n, h, w, 2)
    out = torch.nn.functional.grid_sample(x.float(), grid, mode=interpolation, padding_mode="zeros", align_corners=False)
    return out.round_().to(x.dtype)


def _geometric(x, mags, name, interpolation):
    import math as m

    h, w = x.shape[-2:]
    if name == "Rotate":
        out = x.clone()
        angles = [a % 360 for a in mags]
        # torchvision's rotate_image fast paths: 0 is a copy, 180 (and 90/270 on square images) rot90.
        quarter = {180: 2} | ({90: 1, 270: 3} if h == w else {})
        rest = [i for i, a in enumerate(angles) if a != 0 and a not in quarter]
        for a, k in quarter.items():
            sel = [i for i, b in enumerate(angles) if b == a]
            if sel:
                idx = torch.tensor(sel, device=x.device)
                out.index_copy_(0, idx, torch.rot90(x.index_select(0, idx), k=k, dims=(-2, -1)))
        if rest:
            idx = torch.tensor(rest, device=x.device)
            mats = [_inverse_affine([0.0, 0.0], -angles[i], [0.0, 0.0], [0.0, 0.0]) for i in rest]
            out.index_copy_(0, idx, affine_batch(x.index_select(0, idx), mats, interpolation))
        return out
    corner = [-w * 0.5, -h * 0.5]  # center=[0, 0] in pixels, in torchvision's centred coordinates
    if name == "ShearX":
        mats = [_inverse_affine(corner, 0.0, [0.0, 0.0], [m.degrees(m.atan(v)), 0.0]) for v in mags]
    elif name == "ShearY":
        mats = [_inverse_affine(corner, 0.0, [0.0, 0.0], [0.0, m.degrees(m.atan(v))]) for v in mags]
    elif name == "TranslateX":
        mats = [_inverse_affine([0.0, 0.0], 0.0, [float(int(v)), 0.0], [0.0, 0.0]) for v in mags]
    else:  # TranslateY
        mats = [_inverse_affine([0.0, 0.0], 0.0, [0.0, float(int(v))], [0.0, 0.0]) for v in mags]
    return affine_batch(x, mats, interpolation)


def _factor(mags, x) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 1, 1, 1) float32 factors f = 1 + magnitude (torchvision's brightness/colour/contrast/sharpness
    factor) and 1 - f, each computed in float64 from the Python magnitude first, as torchvision does."""
    f = [1.0 + v for v in mags]
    as_t = lambda vals: torch.tensor(vals, dtype=torch.float32, device=x.device).view(-1, 1, 1, 1)  # noqa: E731
    return as_t(f), as_t([1.0 - v for v in f])


def _fma(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """float32(a + b * alpha) rounded once, as torch's `a.add_(b, alpha=...)` computes it (a fused
    multiply-add on CPU and CUDA): for uint8-range a, b the float64 sum is exact, so one rounding."""
    return (a.double() + b.double() * alpha.double()).float()


def _blend(img, other, ratio, alpha):
    # torchvision's _blend, `img.mul(r).add_(other, alpha=1 - r)`, clamped and truncated to uint8, r per sample.
    return _fma(img.mul(ratio), other, alpha).clamp_(0, 255).to(img.dtype)


def _gray(x):
    from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image

    return _rgb_to_grayscale_image(x, num_output_channels=1, preserve_dtype=False).floor_()


def _color(x, mags, name):
    from torchvision.transforms.v2 import functional as F

    f, one_minus_f = _factor(mags, x)
    c = x.shape[-3]
    if name == "Brightness":
        return x.mul(f).clamp_(0, 255).to(x.dtype)
    if name == "Color":
        return x if c == 1 else _blend(x, _gray(x), f, one_minus_f)
    if name == "Contrast":
        gray = _gray(x) if c == 3 else x.to(torch.float32)
        return _blend(x, gray.mean(dim=(-3, -2, -1), keepdim=True), f, one_minus_f)
    if name == "Sharpness":
        h, w = x.shape[-2:]
        if h <= 2 or w <= 2:
            return x
        a, b = 1.0 / 13.0, 5.0 / 13.0
        kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=x.device).expand(c, 1, 3, 3)
        out = x.to(torch.float32, copy=True)
        blurred = torch.nn.functional.conv2d(out, kernel, groups=c).round_()
        view = out[..., 1:-1, 1:-1]
        view.copy_(_fma(view, blurred.sub_(view), one_minus_f))
        return out.clamp_(0, 255).to(x.dtype)
    if name == "Posterize":
        bits = [int(v) for v in mags]
        masks = [255 if b >= 8 else ((1 << b) - 1) << (8 - b) for b in bits]
        return x & torch.tensor(masks, dtype=torch.uint8, device=x.device).view(-1, 1, 1, 1)
    if name == "Solarize":
        thr = torch.tensor([255.0 * v for v in mags], dtype=torch.float32, device=x.device).view(-1, 1, 1, 1)
        return torch.where(x >= thr, 255 - x, x)
    if name == "AutoContrast":
        return F.autocontrast(x)
    if name == "Equalize":
        return F.equalize(x)
    raise ValueError(name)


GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


def apply_aug_op(x: torch.Tensor, name: str, mags: list[float], interpolation: str = "nearest") -> torch.Tensor:
    """One auto-augment op of torchvision's table (e.g. "ShearX") on uint8 NCHW `x`, magnitude mags[i] for sample i."""
    if name == "Identity" or len(x) == 0:
        return x
    if name in GEOMETRIC:
        return _geometric(x, mags, name, interpolation)
    return _color(x, mags, name)


class AutoAugmentOps:
    """Batched TrivialAugmentWide / RandAugment with per-sample op, magnitude bin and sign.

    Per op application the draws are torchvision's: op uniform over the table, bin uniform over
    num_magnitude_bins (TrivialAugmentWide) or fixed (RandAugment), negated when u <= 0.5 (signed ops).
    `fill` other than None (zeros) and interpolations other than nearest/bilinear: data.backend=cpu.
    """

    fixes_size = False

    def __init__(self, kind: str, num_ops: int, magnitude: int | None, num_magnitude_bins: int, interpolation: str, fill):
        from torchvision.transforms import v2

        if fill is not None:
            raise UsageError(f"{kind} fill={fill!r} is supported by data.backend=cpu only (the batched backends fill with 0).")
        if interpolation not in ("nearest", "bilinear"):
            raise UsageError(f"{kind} interpolation={interpolation!r}: the batched backends support nearest and bilinear; "
                             "use data.backend=cpu for others.")
        if magnitude is not None and not 0 <= magnitude < num_magnitude_bins:
            raise UsageError(f"{kind} magnitude={magnitude} must be in [0, num_magnitude_bins={num_magnitude_bins}).")
        table = (v2.RandAugment if kind == "rand_augment" else v2.TrivialAugmentWide)._AUGMENTATION_SPACE
        self.names = list(table)
        self.table = table
        self.num_ops, self.magnitude, self.bins, self.interpolation = int(num_ops), magnitude, int(num_magnitude_bins), interpolation
        self.k = 3 * self.num_ops

    def params(self, u, hs, ws):
        n_ops = len(self.names)
        op = torch.floor(u[:, 0::3] * n_ops).long()  # (B, num_ops)
        bin_ = torch.floor(u[:, 1::3] * self.bins).long() if self.magnitude is None else torch.full_like(op, self.magnitude)
        neg = u[:, 2::3] <= 0.5  # torchvision: `if signed and torch.rand(()) <= 0.5: magnitude *= -1`
        # Host-side ("_" keys stay on the CPU): which samples drew which op decides the gathers.
        return {"_op": op, "_bin": bin_, "_neg": neg}, hs, ws

    def magnitudes(self, name: str, bins: torch.Tensor, neg: torch.Tensor, h: int, w: int) -> list[float]:
        fn, signed = self.table[name]
        values = fn(self.bins, h, w)
        if values is None:
            return [0.0] * len(bins)
        out = [float(values[int(b)]) for b in bins]
        return [-v if signed and bool(s) else v for v, s in zip(out, neg)]

    def apply_batch(self, x, p):
        h, w = x.shape[-2:]
        for j in range(self.num_ops):
            op, bins, neg = p["_op"][:, j], p["_bin"][:, j], p["_neg"][:, j]
            out = None
            for k, name in enumerate(self.names):
                sel = (op == k).nonzero().flatten()  # a host tensor: no device sync
                if name == "Identity" or len(sel) == 0:
                    continue
                mags = self.magnitudes(name, bins[sel], neg[sel], h, w)
                idx = sel.to(x.device)
                out = x.clone() if out is None else out
                out.index_copy_(0, idx, apply_aug_op(x.index_select(0, idx), name, mags, self.interpolation))
            x = x if out is None else out
        return x

    def apply_one(self, img, p, i):
        return self.apply_batch(img[None], {k: v[i : i + 1] for k, v in p.items()})[0]


BATCH_OPS.register("rand_augment")(
    lambda num_ops=2, magnitude=9, num_magnitude_bins=31, interpolation="nearest", fill=None:
    AutoAugmentOps("rand_augment", num_ops, magnitude, num_magnitude_bins, interpolation, fill))
BATCH_OPS.register("trivial_augment_wide")(
    lambda num_magnitude_bins=31, interpolation="nearest", fill=None:
    AutoAugmentOps("trivial_augment_wide", 1, None, num_magnitude_bins, interpolation, fill))

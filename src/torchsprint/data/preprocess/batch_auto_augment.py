"""Batched automatic augmentation for the memory and gpu backends (registered in batch_ops.py's BATCH_OPS):
rand_augment and trivial_augment_wide with a per-sample op and magnitude, and their ops (`apply_aug_op`)."""

from __future__ import annotations

import torch

from torchsprint.errors import UsageError

# ---------------------------------------------------------------- automatic augmentation, batched
# TrivialAugmentWide and RandAugment with per-sample op and magnitude. The op tables (names, magnitude
# bins, signs) are torchvision's own (v2.TrivialAugmentWide/RandAugment._AUGMENTATION_SPACE), and the
# ops are torchvision's kernels rewritten for a per-sample parameter tensor: per op, the samples that
# drew it are gathered, transformed together, and scattered back (index_copy_). Hand-written because
# torchvision's functionals take one parameter per call (a call per sample would be one kernel launch
# per image on the GPU). tests/e2e/data/test_auto_augment.py compares every op with torchvision on each image.


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
    out = torch.nn.functional.grid_sample(
        x.float(), grid, mode=interpolation, padding_mode="zeros", align_corners=False
    )
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
        kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=x.device).expand(
            c, 1, 3, 3
        )
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

    def __init__(
        self, kind: str, num_ops: int, magnitude: int | None, num_magnitude_bins: int, interpolation: str, fill
    ):
        from torchvision.transforms import v2

        if fill is not None:
            raise UsageError(
                f"{kind} fill={fill!r} is supported by data.backend=cpu only (the batched backends fill with 0)."
            )
        if interpolation not in ("nearest", "bilinear"):
            raise UsageError(
                f"{kind} interpolation={interpolation!r}: the batched backends support nearest and bilinear; "
                "use data.backend=cpu for others."
            )
        if magnitude is not None and not 0 <= magnitude < num_magnitude_bins:
            raise UsageError(f"{kind} magnitude={magnitude} must be in [0, num_magnitude_bins={num_magnitude_bins}).")
        table = (v2.RandAugment if kind == "rand_augment" else v2.TrivialAugmentWide)._AUGMENTATION_SPACE
        self.names = list(table)
        self.table = table
        self.num_ops, self.magnitude, self.bins, self.interpolation = (
            int(num_ops),
            magnitude,
            int(num_magnitude_bins),
            interpolation,
        )
        self.k = 3 * self.num_ops

    def params(self, u, hs, ws):
        n_ops = len(self.names)
        op = torch.floor(u[:, 0::3] * n_ops).long()  # (B, num_ops)
        bin_ = (
            torch.floor(u[:, 1::3] * self.bins).long()
            if self.magnitude is None
            else torch.full_like(op, self.magnitude)
        )
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

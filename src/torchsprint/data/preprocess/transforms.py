"""One preprocessing spec -> a CPU pipeline (torchvision transforms v2 on uint8) plus on-device normalisation.

A spec is a list of steps, each a name or a one-key mapping: `[random_crop: {size: 32, padding: 4},
hflip, normalize: cifar10]`. Geometry and colour steps run on uint8 tensors in the loader;
`normalize` (always last) runs on the device after the uint8 copy, so a quarter of the bytes cross
the bus and the float conversion is one fused multiply-add there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

TRANSFORMS = Registry("transform", listed="transforms")

# Channel statistics in [0, 1] units. ImageNet: torchvision's reference scripts; CIFAR: per-channel
# statistics of the CIFAR-10/100 training sets (Krizhevsky 2009), as used by timm and airbench.
NORMALIZE_PRESETS = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "half": ((0.5,), (0.5,)),  # maps [0, 1] to [-1, 1]
    "none": ((0.0,), (1.0,)),  # only scales to [0, 1]
}


def _v2():
    from torchvision.transforms import v2

    return v2


def _size(v):
    return list(v) if isinstance(v, list | tuple) else v


def _is_uint8_image(img) -> bool:
    # Exactly torch.Tensor (not a tv_tensors subclass such as BoundingBoxes) holding one uint8 CHW image.
    return type(img) is torch.Tensor and img.dtype == torch.uint8 and img.ndim == 3


def channels_last_copy(img: torch.Tensor) -> torch.Tensor:
    """A uint8 CHW view whose memory is HWC-contiguous (a copy unless it already is).

    torch's uint8 antialiased bilinear resize (AVX2/AVX-512, the path torchvision takes on CPU) works
    on interleaved pixels; given a planar or a strided (cropped) input it repacks internally, and it
    allocates a planar output for anything that is not channels-last contiguous. Copying the crop into
    HWC memory first costs less than that: 0.21 vs 0.26 ms per RandomResizedCrop(224) of 500x375, one
    thread, measured with F.interpolate on 200 crops. Values are untouched, so the output is identical.
    """
    c, h, w = img.shape
    if img.stride() == (1, w * c, c) or c == 1:
        return img
    return img.permute(1, 2, 0).contiguous().permute(2, 0, 1)


class FastResize:
    """v2.Resize with a channels-last input for uint8 images: same arithmetic (torchvision's own
    `resize` kernel) and pixels, less time. Other inputs go to v2.Resize unchanged."""

    def __init__(self, size, interpolation, antialias: bool, max_size):
        v2 = _v2()
        self.reference = v2.Resize(size, interpolation=interpolation, antialias=antialias, max_size=max_size)
        self.size, self.interpolation, self.antialias, self.max_size = size, interpolation, antialias, max_size

    def __call__(self, img):
        if not _is_uint8_image(img):
            return self.reference(img)
        F = _v2().functional
        size = [self.size] if isinstance(self.size, int) else self.size
        return F.resize(
            channels_last_copy(img),
            size,
            interpolation=self.interpolation,
            max_size=self.max_size,
            antialias=self.antialias,
        )

    def __repr__(self) -> str:
        return f"Fast{self.reference!r}"


class FastRandomResizedCrop:
    """v2.RandomResizedCrop for uint8 CHW tensors: bit-identical, and cheaper (500x375 -> 224, one
    thread: ~0.21 vs ~0.38 ms for the crop and resize alone; BENCHMARKS.md, "Data loading").

    The crop parameters are drawn by the same code as torchvision 0.29's `make_params` (same global-RNG
    calls in the same order, so per-sample seeds give the same crops); the crop is a view, copied to
    channels-last memory (`channels_last_copy`), then resized by torchvision's own resize kernel.
    torchvision's transform costs more in Python dispatch (~0.1 ms) and in resizing a strided crop.
    `tests/e2e/data/test_data_backends.py` checks equality with v2.RandomResizedCrop on many seeds and sizes.
    Other inputs (PIL images, tv_tensors) go to v2.RandomResizedCrop unchanged.
    """

    def __init__(self, size, scale, ratio, antialias: bool):
        import math

        v2 = _v2()
        self.reference = v2.RandomResizedCrop(size, scale=scale, ratio=ratio, antialias=antialias)
        self.size, self.scale, self.ratio = list(self.reference.size), self.reference.scale, self.reference.ratio
        self.interpolation, self.antialias = self.reference.interpolation, antialias
        self._log_ratio = torch.log(torch.tensor(self.ratio))
        self._sqrt = math.sqrt
        self.live = (
            None  # data.progressive: a shared one-element tensor holding this epoch's side (progressive.LiveSize)
        )

    def params(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, h, w), drawn exactly as torchvision's RandomResizedCrop.make_params."""
        area = height * width
        log_ratio = self._log_ratio
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(self._sqrt(target_area * aspect_ratio)))
            h = int(round(self._sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)  # fallback: central crop
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img):
        size = self.size if self.live is None else [int(self.live[0])] * 2  # read per image: the epoch may change it
        if not _is_uint8_image(img):
            if self.live is not None:
                self.reference.size = tuple(size)
            return self.reference(img)
        i, j, h, w = self.params(img.shape[-2], img.shape[-1])
        crop = channels_last_copy(img[:, i : i + h, j : j + w])
        return _v2().functional.resize(crop, size, interpolation=self.interpolation, antialias=self.antialias)

    def __repr__(self) -> str:
        return f"Fast{self.reference!r}"


class FastFlip:
    """v2.RandomHorizontalFlip / RandomVerticalFlip without the dispatch: the same `torch.rand(1) >= p`
    draw, the same `flip`. Other inputs go to the v2 transform unchanged."""

    def __init__(self, p: float, dim: int):
        v2 = _v2()
        self.reference = (v2.RandomHorizontalFlip if dim == -1 else v2.RandomVerticalFlip)(p)
        self.p, self.dim = p, dim

    def __call__(self, img):
        if not _is_uint8_image(img):
            return self.reference(img)
        if torch.rand(1) >= self.p:
            return img
        return img.flip(self.dim)

    def __repr__(self) -> str:
        return f"Fast{self.reference!r}"


@TRANSFORMS.register("resize")
def resize(size, interpolation: str = "bilinear", antialias: bool = True, max_size=None):
    mode = _v2().InterpolationMode[interpolation.upper()]
    return FastResize(_size(size), mode, antialias, max_size)


@TRANSFORMS.register("center_crop")
def center_crop(size):
    return _v2().CenterCrop(_size(size))


@TRANSFORMS.register("random_crop")
def random_crop(size, padding=None, padding_mode: str = "constant", pad_if_needed: bool = False):
    return _v2().RandomCrop(_size(size), padding=padding, padding_mode=padding_mode, pad_if_needed=pad_if_needed)


@TRANSFORMS.register("random_resized_crop")
def random_resized_crop(size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), antialias: bool = True):
    return FastRandomResizedCrop(_size(size), tuple(scale), tuple(ratio), antialias)


@TRANSFORMS.register("hflip")
def hflip(p: float = 0.5):
    return FastFlip(p, -1)


@TRANSFORMS.register("vflip")
def vflip(p: float = 0.5):
    return FastFlip(p, -2)


@TRANSFORMS.register("color_jitter")
def color_jitter(brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0):
    return _v2().ColorJitter(brightness, contrast, saturation, hue)


@TRANSFORMS.register("random_rotation")
def random_rotation(degrees):
    return _v2().RandomRotation(degrees)


@TRANSFORMS.register("random_affine")
def random_affine(degrees=0, translate=None, scale=None, shear=None):
    return _v2().RandomAffine(degrees, translate=translate, scale=scale, shear=shear)


@TRANSFORMS.register("random_grayscale")
def random_grayscale(p: float = 0.1):
    return _v2().RandomGrayscale(p)


@TRANSFORMS.register("random_erasing")
def random_erasing(p: float = 0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value: int = 0):
    return _v2().RandomErasing(p, scale=tuple(scale), ratio=tuple(ratio), value=value)


# Automatic augmentation: torchvision's own transforms (their defaults are torchvision's and the
# papers'). They draw from torch's global RNG, which SeededTransform seeds per sample, so the cpu
# backend gives the same image as torchvision under the same generator state. The memory and gpu
# backends run rand_augment and trivial_augment_wide batched (batch_ops.AutoAugmentOps).


def _interp(interpolation: str):
    return _v2().InterpolationMode[interpolation.upper().replace("-", "_")]


@TRANSFORMS.register("rand_augment")
def rand_augment(
    num_ops: int = 2, magnitude: int = 9, num_magnitude_bins: int = 31, interpolation: str = "nearest", fill=None
):
    """RandAugment (Cubuk et al. 2020): num_ops ops drawn uniformly from 14, each at bin `magnitude` of
    `num_magnitude_bins`, sign flipped with p=0.5 (torchvision v2.RandAugment; timm's rand-m9-n2 is alike)."""
    if not 0 <= magnitude < num_magnitude_bins:
        raise UsageError(f"rand_augment magnitude={magnitude} must be in [0, num_magnitude_bins={num_magnitude_bins}).")
    return _v2().RandAugment(num_ops, magnitude, num_magnitude_bins, _interp(interpolation), fill)


@TRANSFORMS.register("trivial_augment_wide")
def trivial_augment_wide(num_magnitude_bins: int = 31, interpolation: str = "nearest", fill=None):
    """TrivialAugment Wide (Mueller & Hutter 2021): one op of 14 and one magnitude bin, both uniform."""
    return _v2().TrivialAugmentWide(num_magnitude_bins, _interp(interpolation), fill)


AUTO_AUGMENT_POLICIES = ("imagenet", "cifar10", "svhn")


@TRANSFORMS.register("auto_augment")
def auto_augment(policy: str = "imagenet", interpolation: str = "nearest", fill=None):
    """AutoAugment (Cubuk et al. 2019) with a learned policy: imagenet (default), cifar10 or svhn."""
    if policy not in AUTO_AUGMENT_POLICIES:
        raise UsageError(f"auto_augment policy={policy!r}: use one of {', '.join(AUTO_AUGMENT_POLICIES)}.")
    return _v2().AutoAugment(_v2().AutoAugmentPolicy(policy), _interp(interpolation), fill)


@TRANSFORMS.register("augmix")
def augmix(
    severity: int = 3,
    mixture_width: int = 3,
    chain_depth: int = -1,
    alpha: float = 1.0,
    all_ops: bool = True,
    interpolation: str = "bilinear",
    fill=None,
):
    """AugMix (Hendrycks et al. 2020): a Dirichlet mix of `mixture_width` augmentation chains, blended with the
    original by Beta(alpha, alpha). Only the augmentation itself (timm's JSD loss over splits is not offered)."""
    return _v2().AugMix(severity, mixture_width, chain_depth, alpha, all_ops, _interp(interpolation), fill)


class Cutout:
    """Zero a size x size square centred uniformly in the image, clipped at the borders (DeVries &
    Taylor 2017), with probability p. Draws from torch's global RNG, which SeededTransform seeds per
    sample; the batched backends run batch_ops.Cutout with the same geometry."""

    def __init__(self, size: int = 8, p: float = 1.0, value: int = 0):
        self.size, self.p, self.value = int(size), float(p), int(value)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
        if float(torch.rand(())) >= self.p:
            return img
        y0, x0 = max(0, cy - self.size // 2), max(0, cx - self.size // 2)
        y1, x1 = min(h, cy - self.size // 2 + self.size), min(w, cx - self.size // 2 + self.size)
        img = img.clone()
        img[..., y0:y1, x0:x1] = self.value
        return img


@TRANSFORMS.register("cutout")
def cutout(size: int = 8, p: float = 1.0, value: int = 0):
    return Cutout(size, p, value)


@TRANSFORMS.register("normalize")
def normalize(preset="imagenet", mean=None, std=None):
    """Not a CPU transform: recorded and applied on the device. Returns (mean, std)."""
    if mean is not None or std is not None:
        if mean is None or std is None:
            raise UsageError("normalize needs both mean and std, e.g. normalize: {mean: [0.5], std: [0.5]}")
        return tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if preset not in NORMALIZE_PRESETS:
        raise UsageError(
            f"normalize: unknown preset '{preset}'. Use one of {sorted(NORMALIZE_PRESETS)} or {{mean, std}}."
        )
    return NORMALIZE_PRESETS[preset]


@dataclass
class Pipeline:
    """A compiled spec: the uint8 CPU part and the on-device normalisation constants."""

    cpu: Any  # callable uint8 CHW tensor -> uint8 CHW tensor, or None for identity
    mean: tuple[float, ...]
    std: tuple[float, ...]
    out_size: tuple[int, int] | None  # (H, W) when the spec fixes it
    steps: list[tuple[str, Any]]


def parse_step(step, where: str) -> tuple[str, Any]:
    if isinstance(step, str):
        return step, None
    if isinstance(step, dict) and len(step) == 1:
        return next(iter(step.items()))
    raise UsageError(f"{where}: each step is a name or a one-key mapping like {{resize: 256}}, got {step!r}.")


def call_with(fn, arg, where: str):
    try:
        if arg is None:
            return fn()
        if isinstance(arg, dict):
            return fn(**arg)
        return fn(arg)
    except TypeError as e:
        raise UsageError(f"{where}: bad arguments {arg!r}: {e}") from None


def compile_spec(spec: list, where: str = "data.train.transforms", channels: int = 3) -> Pipeline:
    """Compile a spec into a Pipeline; `where` names the config key in error messages."""
    steps = [parse_step(s, where) for s in spec]
    mean, std = NORMALIZE_PRESETS["none"]
    built = []
    out_size = None
    for i, (name, arg) in enumerate(steps):
        fn = TRANSFORMS.get(name)
        if name == "normalize":
            if i != len(steps) - 1:
                raise UsageError(f"{where}: normalize must be the last step (it runs on the device after the copy).")
            mean, std = call_with(fn, arg, f"{where}[{i}] normalize")
            continue
        built.append(call_with(fn, arg, f"{where}[{i}] {name}"))
        if name in ("center_crop", "random_crop", "random_resized_crop") or (name == "resize" and _is_pair(arg)):
            size = arg["size"] if isinstance(arg, dict) else arg
            out_size = (size, size) if isinstance(size, int) else tuple(size)
    if len(mean) == 1 and channels > 1:
        mean, std = mean * channels, std * channels
    if len(mean) != channels:
        raise UsageError(
            f"{where}: normalize has {len(mean)} channel statistics but the images have {channels} channels."
        )
    cpu = _v2().Compose(built) if built else None
    return Pipeline(cpu=cpu, mean=tuple(mean), std=tuple(std), out_size=out_size, steps=steps)


def _is_pair(arg) -> bool:
    size = arg.get("size") if isinstance(arg, dict) else arg
    return isinstance(size, list | tuple) and len(size) == 2


@dataclass(frozen=True)
class DecodeHint:
    """(h, w) of a stored image -> the smallest decoded (min_h, min_w) the spec's first step can use
    without upsampling what it would otherwise downsample, or None when no 2x reduction is possible.

    JPEG decoders can scale by 1/2, 1/4, 1/8 (and N/8) inside the IDCT, which skips most of the
    IDCT and colour-conversion work. It only pays off when the first step shrinks the image at least
    2x in every case: random_resized_crop's smallest crop is sqrt(area * scale_min * ratio_min) wide,
    so with the 2x margin below, 224 outputs with scale_min=0.08 need a ~3,660-pixel geometric-mean side
    (12 MP phone photos qualify; ~500x375 ImageNet-like photos never do, and decode unscaled).
    """

    step: str
    size: tuple[int, int]
    scale_min: float = 1.0
    ratio: tuple[float, float] = (1.0, 1.0)

    def __call__(self, h: int, w: int):
        if self.step == "random_resized_crop":
            area = h * w * self.scale_min
            min_w, min_h = (area * self.ratio[0]) ** 0.5, (area / self.ratio[1]) ** 0.5
            factor = min(min_w / self.size[1], min_h / self.size[0], w / self.size[1], h / self.size[0])
        elif self.step == "resize_short":
            factor = min(h, w) / self.size[0]
        else:
            factor = min(h / self.size[0], w / self.size[1])
        # Keep a 2x margin: the DCT downscale then feeds an antialiased resize that still shrinks >= 2x.
        # `torchsprint data compare` on 500x375 synthetic JPEGs, resize 40 + center_crop 32: mean |diff|
        # 0.3-0.4, max 14 grey levels vs a full decode; without the margin 2.4 and 102 (edges moved).
        factor /= 2
        if factor < 2:
            return None
        return -(-h // int(factor)), -(-w // int(factor))


def decode_hint(spec: list, where: str = "data.train.transforms") -> DecodeHint | None:
    """The DecodeHint of a spec's first step (random_resized_crop or resize), else None."""
    if not spec:
        return None
    name, arg = parse_step(spec[0], where)
    kw = arg if isinstance(arg, dict) else {"size": arg}
    size = kw.get("size")
    if name == "random_resized_crop" and size is not None:
        sz = (size, size) if isinstance(size, int) else tuple(size)
        scale = kw.get("scale", (0.08, 1.0))
        ratio = kw.get("ratio", (3 / 4, 4 / 3))
        return DecodeHint(name, sz, float(scale[0]), (float(ratio[0]), float(ratio[1])))
    if name == "resize" and size is not None:
        if isinstance(size, int) or (isinstance(size, list | tuple) and len(size) == 1):
            s = size if isinstance(size, int) else size[0]
            return DecodeHint("resize_short", (s, s))
        return DecodeHint("resize", tuple(size))
    return None

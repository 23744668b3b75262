"""Paired image-to-image datasets (task=image_to_image): `paired_folder` and the generated `synthetic_blur`.

A pair is stored as one uint8 tensor with the input's channels followed by the target's, (2C, H, W),
so that every geometric step of the train spec (random crop, flip, resize) is drawn once per pair
and applied to both by the unchanged loader backends. `PairedLoaders` splits the device batch back
into (inputs, targets).

Units: inputs and targets are both pixels / 255, in [0, 1] (the spec may not normalise with other
statistics), so a model's output y maps back to pixels as round(clamp(y, 0, 1) * 255) (tasks.to_pixels).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, MODE, Loaders, Splits, check_options, existing_folder, need_root
from torchsprint.errors import UsageError

# Steps that move pixels without changing their values the same way on every channel: safe for a
# stacked pair. Colour steps would treat the target's channels as extra colours.
PAIRED_STEPS = ("resize", "center_crop", "random_crop", "random_resized_crop", "hflip", "vflip", "normalize")


class PairedImages(torch.utils.data.Dataset):
    """(input path, target path) pairs decoded on access into one (2C, H, W) uint8 tensor.

    An unreadable file, or a pair whose two images differ in size, yields (None, 0, "path: reason")
    (counted by the loader, or an error under data.on_bad_sample=error).
    """

    def __init__(self, pairs: list[tuple[str, str]], mode: str, decoder: str, max_pixels: int):
        from torchsprint.data.sources.folders import ImageFiles

        self.pairs = pairs
        self.inputs = ImageFiles([(a, 0) for a, _ in pairs], mode, decoder=decoder, max_pixels=max_pixels)
        self.targets = ImageFiles([(b, 0) for _, b in pairs], mode, decoder=decoder, max_pixels=max_pixels)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        x, _, xs = self.inputs[i]
        if x is None:
            return None, 0, xs
        y, _, ys = self.targets[i]
        if y is None:
            return None, 0, ys
        if x.shape != y.shape:
            return None, 0, f"{xs}: input {tuple(x.shape)} and target {tuple(y.shape)} differ in size"
        return torch.cat([x, y]), 0, xs


class PairedLoader:
    """Splits each on-device (2C, H, W) batch into (inputs, targets) of C channels each."""

    def __init__(self, loader, channels: int):
        self.loader, self.channels = loader, channels

    @property
    def skipped(self):
        return getattr(self.loader, "skipped", [])

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.loader.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):  # the wrapped loader's extras (e.g. `.loader` for export's raw batches)
        return getattr(self.loader, name)

    def __iter__(self):
        c = self.channels
        for pair, _ in self.loader:
            yield pair[:, :c], pair[:, c:]


def paired_wrap(channels: int):
    def wrap(loaders: Loaders) -> Loaders:
        info = replace(
            loaders.info, in_channels=channels, mean=loaders.info.mean[:channels], std=loaders.info.std[:channels]
        )
        return Loaders(
            PairedLoader(loaders.train, channels), PairedLoader(loaders.val, channels), info, loaders.skipped
        )

    return wrap


def check_paired_spec(data_cfg) -> None:
    """Only geometric steps, and no normalisation other than [0, 1] scaling (outputs must map back to pixels)."""
    from torchsprint.data.preprocess.transforms import NORMALIZE_PRESETS, parse_step

    for where, spec in (
        ("data.train.transforms", data_cfg.train.transforms),
        ("data.eval.transforms", data_cfg.eval.transforms),
    ):
        for i, step in enumerate(spec):
            name, arg = parse_step(step, where)
            if name not in PAIRED_STEPS:
                raise UsageError(
                    f"{where}[{i}]: '{name}' is not supported for paired images (task=image_to_image): "
                    f"only geometric steps applied to input and target alike ({', '.join(PAIRED_STEPS[:-1])})."
                )
            if name == "normalize" and arg not in ("none", {"preset": "none"}) and arg is not None:
                raise UsageError(
                    f"{where}[{i}]: task=image_to_image scales inputs and targets to [0, 1] (pixels / 255) so "
                    f"that outputs map back to pixels; use `normalize: none` or leave the step out."
                )
            if name == "normalize" and arg is None:
                raise UsageError(
                    f"{where}[{i}]: a bare `normalize` means ImageNet statistics; task=image_to_image "
                    f"needs `normalize: none` (or no normalize step). Stats: {NORMALIZE_PRESETS['none']}."
                )


def match_pairs(folder: Path) -> list[tuple[str, str]]:
    """(input, target) paths of folder/input/** and folder/target/** matched by relative path.

    Matching ignores the extension (a .jpg input may pair with a .png target); an input without a
    target, or a target without an input, is an error naming the file.
    """
    from torchsprint.data.sources.folders import IMAGE_EXTENSIONS

    def scan(sub: Path) -> dict[str, Path]:
        if not sub.is_dir():
            raise UsageError(
                f"{sub} does not exist. paired_folder expects <root>/[train|val]/input/... and .../target/... trees."
            )
        return {
            str(p.relative_to(sub).with_suffix("")): p
            for p in sorted(sub.rglob("*"))
            if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
        }

    inputs, targets = scan(folder / "input"), scan(folder / "target")
    for a, b, side in ((inputs, targets, "target"), (targets, inputs, "input")):
        missing = sorted(set(a) - set(b))
        if missing:
            raise UsageError(
                f"{a[missing[0]]} has no {side} partner (expected {folder / side / missing[0]}.*)"
                + (f" and {len(missing) - 1} more file(s) lack one" if len(missing) > 1 else "")
                + ". Inputs and targets are matched by relative path."
            )
    if not inputs:
        raise UsageError(f"{folder}: no images under input/ and target/.")
    return [(str(inputs[k]), str(targets[k])) for k in sorted(inputs)]


def paired_splits(root: Path, data_cfg) -> Splits:
    check_paired_spec(data_cfg)
    mode = data_cfg.options.get("mode", "RGB")
    if (root / "train").is_dir():
        train = match_pairs(root / "train")
        val = match_pairs(root / "val") if (root / "val").is_dir() else []
    else:
        train, val = match_pairs(root), []
    if not val:
        rng = np.random.default_rng(data_cfg.split_seed)
        order = rng.permutation(len(train))
        n_val = int(round(len(train) * data_cfg.val_fraction))
        train, val = [train[i] for i in sorted(order[n_val:])], [train[i] for i in sorted(order[:n_val])]
    c = 1 if mode == "GRAY" else 3

    def files(pairs):
        return PairedImages(pairs, mode, data_cfg.decoder, data_cfg.max_image_pixels)

    # The backends see 2C-channel stacked pairs; `wrap` restores C-channel inputs and targets. `classes`
    # names the output channels (the model's output size).
    return Splits(
        files(train),
        files(val),
        ["gray"] if c == 1 else ["red", "green", "blue"],
        in_channels=2 * c,
        task="image_to_image",
        wrap=paired_wrap(c),
    )


@DATASETS.register("paired_folder")
def paired_folder(data_cfg) -> Splits:
    """Input/target image pairs (task=image_to_image): <root>/train/{input,target}/... and <root>/val/{input,target}/...

    (or <root>/{input,target}/... split by val_fraction). Files are matched by relative path; a file
    without its partner is an error naming it. data.options: mode (RGB or GRAY).
    """
    check_options(data_cfg, MODE)
    root = existing_folder(need_root(data_cfg, "folder with train/input, train/target (and val/...)"))
    return paired_splits(root, data_cfg)


# ---------------------------------------------------------------- synthetic_blur

BLUR_DEFAULTS = {"num_images": 64, "val_images": 16, "size": 32, "sigma": 1.0, "seed": 0}


def gaussian_kernel(sigma: float) -> np.ndarray:
    """The known blur: a normalised 2-D Gaussian, radius ceil(3 sigma) (99.7% of the mass)."""
    r = int(np.ceil(3 * sigma))
    x = np.arange(-r, r + 1, dtype=np.float64)
    k = np.exp(-(x**2) / (2 * sigma**2))
    k /= k.sum()
    return np.outer(k, k)


def blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """(H, W, 3) uint8 convolved with gaussian_kernel(sigma), borders reflected, rounded back to uint8."""
    k = gaussian_kernel(sigma)
    r = k.shape[0] // 2
    padded = np.pad(img.astype(np.float64), ((r, r), (r, r), (0, 0)), mode="reflect")
    out = np.zeros(img.shape, dtype=np.float64)
    h, w = img.shape[:2]
    for dy in range(k.shape[0]):
        for dx in range(k.shape[1]):
            out += k[dy, dx] * padded[dy : dy + h, dx : dx + w]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def render_sharp(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) uint8 with hard edges: a flat background and 3-6 random rectangles and discs."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 7))):
        x0, y0 = (int(v) for v in rng.integers(0, size - 4, 2))
        s = int(rng.integers(4, size // 2))
        box = [x0, y0, x0 + s, y0 + s]
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return np.asarray(im)


def generate_blur_pairs(folder: Path, *, num_images: int, val_images: int, size: int, sigma: float, seed: int) -> Path:
    """Write folder/{train,val}/{input,target}/<i>.png (lossless: the blur is the only degradation); reuse when
    complete."""
    from torchsprint.data.sources.synthetic import generate_once

    def write(tmp: Path) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        for split, n in (("train", num_images), ("val", val_images)):
            for side in ("input", "target"):
                (tmp / split / side).mkdir(parents=True)
            for i in range(n):
                sharp = render_sharp(rng, size)
                Image.fromarray(sharp).save(tmp / split / "target" / f"{i:05d}.png")
                Image.fromarray(blur(sharp, sigma)).save(tmp / split / "input" / f"{i:05d}.png")

    return generate_once(
        folder, {"num_images": num_images, "val_images": val_images, "size": size, "sigma": sigma, "seed": seed}, write
    )


@DATASETS.register("synthetic_blur")
def synthetic_blur(data_cfg) -> Splits:
    """Generated deblurring pairs (task=image_to_image): sharp shapes (target) and their Gaussian blur (input), PNG.

    data.options: num_images (64), val_images (16), size (32 px square), sigma (1.0 px, the known
    kernel), seed (0). Made once under data.root, in a paired_folder layout.
    """
    need_root(data_cfg, "folder to generate the image pairs into")
    check_options(data_cfg, {k: f"default {v}" for k, v in BLUR_DEFAULTS.items()})
    p = BLUR_DEFAULTS | data_cfg.options
    folder = Path(data_cfg.root).expanduser() / (
        f"synthetic_blur-n{p['num_images']}-v{p['val_images']}-{p['size']}px-sigma{p['sigma']}-s{p['seed']}"
    )
    generate_blur_pairs(folder, **p)
    return paired_splits(folder, data_cfg.model_copy(update={"options": {}}))

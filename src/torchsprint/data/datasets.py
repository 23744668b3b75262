"""Datasets (DATASETS registry): digits (bundled with scikit-learn) and image_folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from torchsprint.data import DATASETS
from torchsprint.data.core import Splits
from torchsprint.errors import UsageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class TensorImages(torch.utils.data.Dataset):
    """Already-decoded uint8 images (N, C, H, W) with integer labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, ids: list[str] | None = None):
        self.images, self.labels = images, labels
        self.ids = ids

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i]), self.ids[i] if self.ids else str(i)


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a seeded, class-stratified train/val split."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    if val_fraction <= 0:
        return idx, idx[:0]
    tr, va = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=labels)
    return np.sort(tr), np.sort(va)


@DATASETS.register("digits")
def digits(data_cfg) -> Splits:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 grayscale images, 10 classes, no download."""
    from sklearn.datasets import load_digits

    d = load_digits()
    # Pixel values are 0..16 ink counts; scale to the uint8 range every other dataset uses.
    images = torch.from_numpy(np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(d.target.astype(np.int64))
    tr, va = stratified_split(d.target, data_cfg.val_fraction, data_cfg.split_seed)
    classes = [str(c) for c in d.target_names]
    return Splits(
        train=TensorImages(images[tr], labels[tr], [f"digits/{i}" for i in tr]),
        val=TensorImages(images[va], labels[va], [f"digits/{i}" for i in va]),
        classes=classes,
        in_channels=1,
    )


def decode_image_file(path: str, mode: str = "RGB") -> torch.Tensor:
    """Decode a JPEG/PNG/... file into a uint8 CHW tensor with torchvision's decoders (libjpeg-turbo, libpng)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(path), mode=getattr(ImageReadMode, mode), apply_exif_orientation=True)


class ImageFiles(torch.utils.data.Dataset):
    """A list of (path, label) decoded on access; an unreadable file yields None (the loader decides)."""

    def __init__(self, samples: list[tuple[str, int]], mode: str = "RGB"):
        self.samples, self.mode = samples, mode

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            return decode_image_file(path, self.mode), label, path
        except Exception as e:  # torchvision raises RuntimeError for corrupt data, OSError for I/O
            return None, label, f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def scan_class_folders(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted subfolder names) and (path, class index) for every image below them."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UsageError(f"{root}: no class subfolders. image_folder expects <root>/<class>/<image> files.")
    samples = []
    for ci, c in enumerate(classes):
        files = sorted(p for p in (root / c).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        samples += [(str(p), ci) for p in files]
    if not samples:
        raise UsageError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the class subfolders {classes[:5]}.")
    return classes, samples


@DATASETS.register("image_folder")
def image_folder(data_cfg) -> Splits:
    """Class-per-subfolder images: <root>/train/<class>/* and <root>/val/<class>/* (or <root>/<class>/* split by val_fraction)."""
    if data_cfg.root is None:
        raise UsageError("data.dataset=image_folder needs data.root=<folder with train/ and val/ class subfolders>.")
    root = Path(data_cfg.root).expanduser()
    if not root.is_dir():
        raise UsageError(f"data.root={root} does not exist or is not a folder.")
    mode = data_cfg.options.get("mode", "RGB")
    if (root / "train").is_dir():
        classes, train = scan_class_folders(root / "train")
        if (root / "val").is_dir():
            val_classes, val = scan_class_folders(root / "val")
            if val_classes != classes:
                raise UsageError(f"{root}: train/ and val/ have different class folders: {classes} vs {val_classes}.")
        else:
            train, val = _split_samples(train, data_cfg)
    else:
        classes, samples = scan_class_folders(root)
        train, val = _split_samples(samples, data_cfg)
    return Splits(ImageFiles(train, mode), ImageFiles(val, mode), classes, in_channels=1 if mode == "GRAY" else 3)


def _split_samples(samples, data_cfg):
    labels = np.array([s[1] for s in samples])
    tr, va = stratified_split(labels, data_cfg.val_fraction, data_cfg.split_seed)
    return [samples[i] for i in tr], [samples[i] for i in va]

"""CIFAR-10/100 from the official python batches in data.root (never downloaded)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, Splits, TensorImages
from torchsprint.errors import UsageError

# The layouts of the python versions of CIFAR (https://www.cs.toronto.edu/~kriz/cifar.html):
# each batch is a pickled dict with b"data" (N, 3072) uint8, rows = 1024 R, 1024 G, 1024 B of a
# 32x32 image in row-major order, and the labels under `label_key`.
CIFAR_LAYOUTS = {
    "cifar10": {"folder": "cifar-10-batches-py", "train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"],
                "meta": "batches.meta", "names_key": b"label_names", "label_key": b"labels"},
    "cifar100": {"folder": "cifar-100-python", "train": ["train"], "val": ["test"],
                 "meta": "meta", "names_key": b"fine_label_names", "label_key": b"fine_labels"},
}


def _unpickle(path: Path) -> dict:
    # Trusted local files only: these are the dataset's official pickles, which the user placed in data.root.
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def load_cifar(root: Path, name: str) -> Splits:
    """Read CIFAR python batches from `root` (or root/cifar-10-batches-py); never downloads."""
    lay = CIFAR_LAYOUTS[name]
    if (root / lay["folder"]).is_dir():
        root = root / lay["folder"]
    missing = [f for f in lay["train"] + lay["val"] + [lay["meta"]] if not (root / f).is_file()]
    if missing:
        raise UsageError(
            f"{name}: {root} lacks {missing}. Download and unpack the python version "
            f"({lay['folder']}) into data.root yourself; torchsprint never downloads at run time."
        )

    def load(files):
        xs, ys = [], []
        for f in files:
            d = _unpickle(root / f)
            xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[lay["label_key"]], dtype=np.int64))
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    classes = [c.decode() for c in _unpickle(root / lay["meta"])[lay["names_key"]]]
    (xt, yt), (xv, yv) = load(lay["train"]), load(lay["val"])
    return Splits(TensorImages(xt, yt, [f"{name}/train/{i}" for i in range(len(yt))]),
                  TensorImages(xv, yv, [f"{name}/test/{i}" for i in range(len(yv))]), classes, in_channels=3)


def _cifar(name):
    def build(data_cfg) -> Splits:
        if data_cfg.root is None:
            raise UsageError(f"data.dataset={name} needs data.root=<folder with the {CIFAR_LAYOUTS[name]['folder']} batches>.")
        return load_cifar(Path(data_cfg.root).expanduser(), name)

    build.__doc__ = f"{name.upper()} from the official python pickles in data.root (train: 50,000, val: the 10,000 test images)."
    return build


DATASETS.register("cifar10")(_cifar("cifar10"))
DATASETS.register("cifar100")(_cifar("cifar100"))

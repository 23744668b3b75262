"""CIFAR-10/100 from the official python batches in data.root (never downloaded)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, Splits, TensorImages, check_options, need_root
from torchsprint.errors import UsageError

# The layouts of the python versions of CIFAR (https://www.cs.toronto.edu/~kriz/cifar.html):
# each batch is a pickled dict with b"data" (N, 3072) uint8, rows = 1024 R, 1024 G, 1024 B of a
# 32x32 image in row-major order, and the labels under `label_key`.
CIFAR_LAYOUTS = {
    "cifar10": {
        "folder": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "val": ["test_batch"],
        "meta": "batches.meta",
        "names_key": b"label_names",
        "label_key": b"labels",
    },
    "cifar100": {
        "folder": "cifar-100-python",
        "train": ["train"],
        "val": ["test"],
        "meta": "meta",
        "names_key": b"fine_label_names",
        "label_key": b"fine_labels",
    },
}


class CifarUnpickler(pickle.Unpickler):
    """Unpickles the plain types CIFAR batches hold (dicts, lists, bytes, ints, numpy uint8 arrays) and
    nothing else: a pickle naming any other callable (os.system, builtins.eval, a class with a __reduce__)
    is refused before it runs. pickle.load would call whatever the file names."""

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),  # numpy 1 / 2 names
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),  # pickle protocol 5 arrays
        ("_codecs", "encode"),  # bytes pickled by Python 3 with protocol 2
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a CIFAR batch holds only dicts, lists, bytes and numpy arrays"
            )
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    """One CIFAR python batch as a dict, through CifarUnpickler; a malformed or hostile file is a UsageError."""
    try:
        with open(path, "rb") as f:
            d = CifarUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, OSError) as e:
        raise UsageError(
            f"{path} is not a CIFAR python batch ({type(e).__name__}: {e}). Re-download and unpack "
            "the python version of the dataset."
        ) from None
    if not isinstance(d, dict):
        raise UsageError(f"{path} is not a CIFAR python batch (a pickled {type(d).__name__}, not a dict).")
    return d


def _field(d: dict, key: bytes, path: Path):
    if key not in d:
        raise UsageError(
            f"{path} is not a CIFAR python batch: no {key.decode()!r} entry (has "
            f"{sorted(k.decode(errors='replace') if isinstance(k, bytes) else str(k) for k in d)[:6]})."
        )
    return d[key]


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
            data, labels = _field(d, b"data", root / f), _field(d, lay["label_key"], root / f)
            try:
                x = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
                y = np.asarray(labels, dtype=np.int64).reshape(-1)
            except (ValueError, TypeError) as e:
                raise UsageError(
                    f"{root / f}: CIFAR data must be N x 3072 uint8 values with N integer labels ({e})."
                ) from None
            if len(x) != len(y):
                raise UsageError(f"{root / f}: {len(x)} images but {len(y)} labels.")
            bad = np.flatnonzero((y < 0) | (y >= len(classes)))
            if len(bad):  # a wrong label would index past the class list (or silently train on a wrong class)
                raise UsageError(
                    f"{root / f}: label {int(y[bad[0]])} (sample {int(bad[0])}, {len(bad)} such) is outside "
                    f"0..{len(classes) - 1}, the {len(classes)} classes of {root / lay['meta']}. The batch "
                    "is damaged or from another dataset; re-download and unpack it."
                )
            xs.append(x)
            ys.append(y)
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    names = _field(_unpickle(root / lay["meta"]), lay["names_key"], root / lay["meta"])
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in names]
    (xt, yt), (xv, yv) = load(lay["train"]), load(lay["val"])
    return Splits(
        TensorImages(xt, yt, [f"{name}/train/{i}" for i in range(len(yt))]),
        TensorImages(xv, yv, [f"{name}/test/{i}" for i in range(len(yv))]),
        classes,
        in_channels=3,
    )


def _cifar(name):
    def build(data_cfg) -> Splits:
        check_options(data_cfg, {})
        return load_cifar(need_root(data_cfg, f"folder with the {CIFAR_LAYOUTS[name]['folder']} batches"), name)

    build.__doc__ = (
        f"{name.upper()} from the official python pickles in data.root (train: 50,000, val: the 10,000 test images)."
    )
    return build


DATASETS.register("cifar10")(_cifar("cifar10"))
DATASETS.register("cifar100")(_cifar("cifar100"))

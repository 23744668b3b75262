"""Datasets (DATASETS registry): digits, image_folder, file_list, cifar10/cifar100 and synthetic_jpeg."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, Splits
from torchsprint.errors import UsageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class TensorImages(torch.utils.data.Dataset):
    """Already-decoded uint8 images (N, C, H, W) with integer labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, ids: list[str] | None = None):
        self.images, self.labels = images, labels
        self.ids = ids
        self._targets = labels.tolist()  # plain ints: no tensor indexing + int() per sample (~1 us each)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self._targets[i], self.ids[i] if self.ids else str(i)


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
    """Decode a JPEG/PNG/... file into a uint8 CHW tensor (RGB or GRAY); raises BadImage for bad files."""
    from torchsprint.data.decode import decode_bytes, read_bytes

    return decode_bytes(read_bytes(path), channels=1 if mode == "GRAY" else 3)


class ImageFiles(torch.utils.data.Dataset):
    """A list of (path, label) decoded on access; an unreadable file yields (None, label, "path: reason").

    Args:
        samples: (path, class index) pairs.
        mode: "RGB" or "GRAY".
        decoder: a DECODERS name ('auto' picks the fastest installed).
        max_pixels: larger images are bad samples (data.max_image_pixels).
        min_size_for: optional (h, w) -> (min_h, min_w) hint from the preprocessing, which lets JPEG
            decoders scale in the DCT when the pipeline would shrink the image anyway.
    """

    def __init__(self, samples: list[tuple[str, int]], mode: str = "RGB", *, decoder: str = "auto",
                 max_pixels: int = 89_478_485, min_size_for=None):
        from torchsprint.data.decode import resolve_decoder

        self.samples, self.mode = samples, mode
        self.decoder, self.max_pixels, self.min_size_for = resolve_decoder(decoder), max_pixels, min_size_for

    @property
    def channels(self) -> int:
        return 1 if self.mode == "GRAY" else 3

    def with_min_size(self, min_size_for) -> ImageFiles:
        """A copy that passes a decode-size hint to the decoder (see `min_size_for`)."""
        return ImageFiles(self.samples, self.mode, decoder=self.decoder, max_pixels=self.max_pixels, min_size_for=min_size_for)

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int) -> tuple[bytes, int, str]:
        """The raw bytes of sample i (for backends that decode elsewhere, e.g. on the GPU)."""
        from torchsprint.data.decode import read_bytes

        path, label = self.samples[i]
        return read_bytes(path), label, path

    def __getitem__(self, i: int):
        from torchsprint.data.decode import BadImage, decode_bytes, read_bytes

        path, label = self.samples[i]
        try:
            image = decode_bytes(read_bytes(path), channels=self.channels, decoder=self.decoder,
                                 max_pixels=self.max_pixels, min_size_for=self.min_size_for)
            return image, label, path
        except (BadImage, OSError) as e:
            return None, label, f"{path}: {e}"


def image_files(samples, data_cfg, mode: str = "RGB") -> ImageFiles:
    """ImageFiles configured from the data section (decoder, pixel limit)."""
    return ImageFiles(samples, mode, decoder=data_cfg.decoder, max_pixels=data_cfg.max_image_pixels)


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
    return Splits(image_files(train, data_cfg, mode), image_files(val, data_cfg, mode), classes,
                  in_channels=1 if mode == "GRAY" else 3)


def _split_samples(samples, data_cfg):
    labels = np.array([s[1] for s in samples])
    tr, va = stratified_split(labels, data_cfg.val_fraction, data_cfg.split_seed)
    return [samples[i] for i in tr], [samples[i] for i in va]


# ---------------------------------------------------------------- file_list

LIST_SUFFIXES = (".csv", ".txt", ".tsv", ".lst")


def read_file_list(path: Path) -> list[tuple[str, str]]:
    """(absolute path, label text) rows of a list file.

    One sample per line: `path,label` (CSV), `path<TAB>label` or `path label` (the label is the last
    field, so paths may contain spaces). Blank lines and `#` comments are ignored; a first line whose
    label is literally `label` is a header. Relative paths are relative to the list file's folder.
    """
    import csv

    if not path.is_file():
        raise UsageError(f"file list {path} does not exist. data.root must name a .csv/.txt list or a folder with train.csv/val.csv.")
    rows = []
    base = path.parent
    with open(path, newline="", encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for n, line in enumerate(lines):
        if "," in line:
            fields = next(csv.reader([line]))
            p, label = ",".join(fields[:-1]).strip(), fields[-1].strip()
        else:
            parts = line.rsplit("\t" if "\t" in line else None, 1)
            if len(parts) != 2:
                raise UsageError(f"{path}:{n + 1}: expected `path,label`, got {line!r}.")
            p, label = parts[0].strip(), parts[1].strip()
        if not p or not label:
            raise UsageError(f"{path}:{n + 1}: expected `path,label`, got {line!r}.")
        if n == 0 and label.lower() in ("label", "class", "target"):
            continue  # header row
        full = Path(p).expanduser()
        rows.append((str(full if full.is_absolute() else base / full), label))
    if not rows:
        raise UsageError(f"{path}: no samples. Write one `path,label` per line.")
    return rows


def label_classes(labels: list[str], names: list[str] | None) -> tuple[list[str], dict[str, int]]:
    """Class names and label->index. Integer labels are indices (names from `names` or "0".."K-1");
    text labels are class names, sorted."""
    if all(lab.lstrip("-").isdigit() for lab in labels):
        ints = [int(lab) for lab in labels]
        if min(ints) < 0:
            raise UsageError(f"file_list: negative label {min(ints)}; integer labels are class indices 0..K-1.")
        k = max(ints) + 1
        if names is not None and len(names) < k:
            raise UsageError(f"file_list: labels go up to {k - 1} but data.options.classes names only {len(names)} classes.")
        classes = list(names) if names is not None else [str(i) for i in range(k)]
        return classes, {lab: int(lab) for lab in set(labels)}
    classes = list(names) if names is not None else sorted(set(labels))
    unknown = sorted(set(labels) - set(classes))
    if unknown:
        raise UsageError(f"file_list: labels {unknown[:5]} are not in data.options.classes.")
    return classes, {c: i for i, c in enumerate(classes)}


def _find_list(folder: Path, stem: str) -> Path | None:
    for suffix in LIST_SUFFIXES:
        if (folder / f"{stem}{suffix}").is_file():
            return folder / f"{stem}{suffix}"
    return None


@DATASETS.register("file_list")
def file_list(data_cfg) -> Splits:
    """Images named in list files of `path,label` lines.

    data.root is one list file (split by val_fraction) or a folder holding train.csv and val.csv (or
    .txt). data.options: train_list / val_list (explicit files), classes (names for integer labels),
    mode (RGB or GRAY).
    """
    if data_cfg.root is None and "train_list" not in data_cfg.options:
        raise UsageError("data.dataset=file_list needs data.root=<list.csv or folder with train.csv/val.csv>.")
    opts = data_cfg.options
    root = Path(data_cfg.root).expanduser() if data_cfg.root else None
    train_path = Path(opts["train_list"]) if "train_list" in opts else None
    val_path = Path(opts["val_list"]) if "val_list" in opts else None
    if train_path is None:
        if root.is_file():
            train_path = root
        elif root.is_dir():
            train_path, val_path = _find_list(root, "train"), val_path or _find_list(root, "val")
            if train_path is None:
                raise UsageError(f"{root}: no train.csv/train.txt list in this folder.")
        else:
            raise UsageError(f"data.root={root} does not exist.")
    train_rows = read_file_list(train_path)
    val_rows = read_file_list(val_path) if val_path is not None else []
    classes, index = label_classes([r[1] for r in train_rows + val_rows], opts.get("classes"))
    train = [(p, index[lab]) for p, lab in train_rows]
    val = [(p, index[lab]) for p, lab in val_rows]
    if val_path is None:
        train, val = _split_samples(train, data_cfg)
    mode = opts.get("mode", "RGB")
    return Splits(image_files(train, data_cfg, mode), image_files(val, data_cfg, mode), classes,
                  in_channels=1 if mode == "GRAY" else 3)


# ---------------------------------------------------------------- CIFAR

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


# ---------------------------------------------------------------- synthetic_jpeg

SYNTHETIC_DEFAULTS = {"num_images": 1000, "val_images": 200, "size": [500, 375], "classes": 10, "quality": 90, "seed": 0}
_SHAPES = ("disc", "square", "triangle", "stripes", "ring")


def render_synthetic(rng: np.random.Generator, cls: int, n_classes: int, w: int, h: int) -> np.ndarray:
    """One (h, w, 3) uint8 picture of class `cls`: a class-specific shape and hue at a random place and
    scale over a random gradient with Gaussian noise (sigma 12), so it decodes like a photo (~70 KB
    at 500x375, quality 90) and a small CNN can learn it."""
    from PIL import Image, ImageDraw

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    a, b, c = rng.uniform(-0.3, 0.3, 3)
    base = rng.uniform(60, 190, 3)[None, None, :] + (a * xx + b * yy)[..., None] * np.array([1.0, 0.6, -0.4]) + c * 40
    img = base + rng.normal(0, 12, (h, w, 3))
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    hue = cls / n_classes
    import colorsys

    colour = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(hue, 0.85, rng.uniform(0.7, 1.0)))
    s = int(min(w, h) * rng.uniform(0.3, 0.6))
    x0, y0 = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
    shape = _SHAPES[cls % len(_SHAPES)]
    if shape == "disc":
        draw.ellipse([x0, y0, x0 + s, y0 + s], fill=colour)
    elif shape == "square":
        draw.rectangle([x0, y0, x0 + s, y0 + s], fill=colour)
    elif shape == "triangle":
        draw.polygon([(x0, y0 + s), (x0 + s, y0 + s), (x0 + s // 2, y0)], fill=colour)
    elif shape == "stripes":
        for k in range(0, s, max(2, s // 6)):
            draw.rectangle([x0 + k, y0, x0 + k + max(1, s // 12), y0 + s], fill=colour)
    else:
        draw.ellipse([x0, y0, x0 + s, y0 + s], outline=colour, width=max(2, s // 8))
    return np.asarray(im)


def generate_once(folder: Path, params: dict, write) -> Path:
    """Make a generated dataset at `folder` once: `write(tmp)` fills a temporary sibling, which gets a
    done.json of `params` and is renamed into place; a complete folder is reused as it is.

    The rename is atomic, so concurrent processes (test workers, DDP ranks) never see half a dataset;
    when another process finished first, its copy is kept and ours discarded.
    """
    if (folder / "done.json").is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    (tmp / "done.json").write_text(json.dumps(params))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def generate_synthetic_jpeg(folder: Path, *, num_images: int, val_images: int, size, classes: int, quality: int,
                            seed: int) -> Path:
    """Write an image-folder tree folder/{train,val}/<class>/<i>.jpg once; reuse it when complete (generate_once)."""
    w, h = size

    def write(tmp: Path) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        names = [f"class_{c:02d}_{_SHAPES[c % len(_SHAPES)]}" for c in range(classes)]
        for split, n in (("train", num_images), ("val", val_images)):
            for c in names:
                (tmp / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                cls = i % classes
                Image.fromarray(render_synthetic(rng, cls, classes, w, h)).save(tmp / split / names[cls] / f"{i:06d}.jpg",
                                                                                  quality=quality)

    return generate_once(folder, {"num_images": num_images, "val_images": val_images, "size": [w, h], "classes": classes,
                                  "quality": quality, "seed": seed}, write)


@DATASETS.register("synthetic_jpeg")
def synthetic_jpeg(data_cfg) -> Splits:
    """Generated JPEGs in an image-folder layout under data.root, made once and reused.

    data.options: num_images (train, default 1000), val_images (200), size [w, h] ([500, 375], about
    ImageNet's typical photo), classes (10), quality (90), seed (0). Each parameter set gets its own
    subfolder, so changing them never mixes datasets.
    """
    if data_cfg.root is None:
        raise UsageError("data.dataset=synthetic_jpeg needs data.root=<folder to generate the JPEG files into>.")
    unknown = sorted(set(data_cfg.options) - set(SYNTHETIC_DEFAULTS) - {"mode"})
    if unknown:
        raise UsageError(f"synthetic_jpeg: unknown data.options {unknown}; valid: {sorted(SYNTHETIC_DEFAULTS)}.")
    p = SYNTHETIC_DEFAULTS | {k: v for k, v in data_cfg.options.items() if k != "mode"}
    w, h = p["size"]
    folder = Path(data_cfg.root).expanduser() / (
        f"synthetic_jpeg-n{p['num_images']}-v{p['val_images']}-{w}x{h}-c{p['classes']}-q{p['quality']}-s{p['seed']}")
    generate_synthetic_jpeg(folder, num_images=p["num_images"], val_images=p["val_images"], size=(w, h),
                            classes=p["classes"], quality=p["quality"], seed=p["seed"])
    classes, train = scan_class_folders(folder / "train")
    _, val = scan_class_folders(folder / "val")
    mode = data_cfg.options.get("mode", "RGB")
    return Splits(image_files(train, data_cfg, mode), image_files(val, data_cfg, mode), classes,
                  in_channels=1 if mode == "GRAY" else 3)

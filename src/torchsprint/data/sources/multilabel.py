"""Multi-label datasets (task=multilabel): `multilabel_csv` lists and the generated `synthetic_multilabel` shapes.

Targets are multi-hot float vectors (one 0/1 entry per label), which BCE-with-logits and the
multilabel metrics take as they are; they travel through the cpu and memory backends unchanged.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, MODE, Splits, check_options, need_root
from torchsprint.errors import UsageError

LABEL_SEPARATOR = ";"


def read_multilabel_csv(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute path, [labels]) rows of a `path,label1;label2` file.

    The labels are the last comma-separated field, separated by ';' (an empty field: no label). A first
    row whose label field is literally `labels`/`label` is a header; `#` lines and blank lines are
    ignored; relative paths are relative to the CSV's folder.
    """
    if not path.is_file():
        raise UsageError(
            f"multilabel list {path} does not exist. data.root must "
            "name a .csv file or a folder with train.csv/val.csv."
        )
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for n, line in enumerate(lines):
        fields = next(csv.reader([line]))
        if len(fields) < 2 or not fields[0].strip():
            raise UsageError(f"{path}:{n + 1}: expected `path,label1;label2` (labels may be empty), got {line!r}.")
        p, field = ",".join(fields[:-1]).strip(), fields[-1].strip()
        if n == 0 and field.lower() in ("labels", "label", "tags"):
            continue  # header row
        labels = [lab.strip() for lab in field.split(LABEL_SEPARATOR) if lab.strip()]
        full = Path(p).expanduser()
        rows.append((str(full if full.is_absolute() else path.parent / full), labels))
    if not rows:
        raise UsageError(f"{path}: no samples. Write one `path,label1;label2` per line.")
    return rows


def multi_hot(rows: list[tuple[str, list[str]]], classes: list[str], where: Path) -> list[tuple[str, torch.Tensor]]:
    """(path, float32 multi-hot vector over `classes`) per row; unknown labels are errors naming the file."""
    index = {c: i for i, c in enumerate(classes)}
    out = []
    for p, labels in rows:
        unknown = [lab for lab in labels if lab not in index]
        if unknown:
            raise UsageError(f"{where}: {p} has labels {unknown} that are not in data.options.classes {classes[:10]}.")
        v = torch.zeros(len(classes), dtype=torch.float32)
        v[[index[lab] for lab in labels]] = 1.0
        out.append((p, v))
    return out


def _split(samples, data_cfg):
    """A seeded random train/val split (multi-label targets cannot be stratified by one class)."""
    rng = np.random.default_rng(data_cfg.split_seed)
    order = rng.permutation(len(samples))
    n_val = int(round(len(samples) * data_cfg.val_fraction))
    va, tr = np.sort(order[:n_val]), np.sort(order[n_val:])
    return [samples[i] for i in tr], [samples[i] for i in va]


def multilabel_splits(train_csv: Path, val_csv: Path | None, data_cfg) -> Splits:
    from torchsprint.data.sources.folders import image_files

    train_rows = read_multilabel_csv(train_csv)
    val_rows = read_multilabel_csv(val_csv) if val_csv is not None else []
    classes = data_cfg.options.get("classes") or sorted({lab for _, labs in train_rows + val_rows for lab in labs})
    if not classes:
        raise UsageError(f"{train_csv}: no labels at all. Write `path,label1;label2` rows.")
    train = multi_hot(train_rows, list(classes), train_csv)
    val = multi_hot(val_rows, list(classes), val_csv) if val_csv is not None else []
    if val_csv is None:
        train, val = _split(train, data_cfg)
    mode = data_cfg.options.get("mode", "RGB")
    return Splits(
        image_files(train, data_cfg, mode),
        image_files(val, data_cfg, mode),
        list(classes),
        in_channels=1 if mode == "GRAY" else 3,
        task="multilabel",
    )


@DATASETS.register("multilabel_csv")
def multilabel_csv(data_cfg) -> Splits:
    """Images with any number of labels, listed as `path,label1;label2` rows (task=multilabel).

    data.root is one CSV (split by val_fraction) or a folder with train.csv and val.csv. data.options:
    classes (label names and their order; default: every label seen, sorted), mode (RGB or GRAY).
    """
    check_options(data_cfg, {"classes": "label names and their order (default: every label seen, sorted)", **MODE})
    root = need_root(data_cfg, "list.csv or a folder with train.csv/val.csv")
    if root.is_dir():
        if not (root / "train.csv").is_file():
            raise UsageError(f"{root}: no train.csv in this folder (rows `path,label1;label2`).")
        return multilabel_splits(
            root / "train.csv", root / "val.csv" if (root / "val.csv").is_file() else None, data_cfg
        )
    return multilabel_splits(root, None, data_cfg)


# ---------------------------------------------------------------- synthetic_multilabel

MULTILABEL_SHAPES = ("disc", "square", "triangle")
MULTILABEL_DEFAULTS = {"num_images": 200, "val_images": 60, "size": 32, "seed": 0, "quality": 92}


def render_shapes(rng: np.random.Generator, present: list[bool], size: int) -> np.ndarray:
    """(size, size, 3) uint8: a noisy dark background with each present shape drawn once in its own colour
    (disc red, square green, triangle blue, brightness jittered) at a random place; shapes may overlap."""
    from PIL import Image, ImageDraw

    bg = rng.uniform(20, 70) + rng.normal(0, 10, (size, size, 3))
    im = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for k, on in enumerate(present):
        if not on:
            continue
        s = int(size * rng.uniform(0.3, 0.45))
        x0, y0 = int(rng.integers(0, size - s)), int(rng.integers(0, size - s))
        colour = [40, 40, 40]
        colour[k] = int(rng.uniform(190, 255))
        shape, fill = MULTILABEL_SHAPES[k], tuple(colour)
        if shape == "disc":
            draw.ellipse([x0, y0, x0 + s, y0 + s], fill=fill)
        elif shape == "square":
            draw.rectangle([x0, y0, x0 + s, y0 + s], fill=fill)
        else:
            draw.polygon([(x0, y0 + s), (x0 + s, y0 + s), (x0 + s // 2, y0)], fill=fill)
    return np.asarray(im)


def generate_multilabel_shapes(
    folder: Path, *, num_images: int, val_images: int, size: int, seed: int, quality: int
) -> Path:
    """Write folder/images/*.jpg with 0-3 shapes each and folder/{train,val}.csv; reuse a complete folder.

    Each shape is present with probability 1/2, independently, so every label's prevalence (the
    average precision of a random ranking) is about 0.5. Generated in a temporary sibling and renamed
    (concurrent test workers and DDP ranks never see half a dataset).
    """
    from torchsprint.data.sources.synthetic import generate_once

    def write(tmp: Path) -> None:
        from PIL import Image

        (tmp / "images").mkdir(parents=True)
        rng = np.random.default_rng(seed)
        for split, n in (("train", num_images), ("val", val_images)):
            lines = ["path,labels"]
            for i in range(n):
                present = [bool(b) for b in rng.integers(0, 2, len(MULTILABEL_SHAPES))]
                name = f"images/{split}_{i:05d}.jpg"
                Image.fromarray(render_shapes(rng, present, size)).save(tmp / name, quality=quality)
                lines.append(f"{name},{LABEL_SEPARATOR.join(s for s, on in zip(MULTILABEL_SHAPES, present) if on)}")
            (tmp / f"{split}.csv").write_text("\n".join(lines) + "\n")

    return generate_once(
        folder, {"num_images": num_images, "val_images": val_images, "size": size, "seed": seed}, write
    )


@DATASETS.register("synthetic_multilabel")
def synthetic_multilabel(data_cfg) -> Splits:
    """Generated JPEGs with 0-3 of {disc, square, triangle} each (task=multilabel), made once under data.root.

    data.options: num_images (train, 200), val_images (60), size (32 px square), seed (0), quality (92).
    """
    need_root(data_cfg, "folder to generate the images into")
    check_options(data_cfg, {k: f"default {v}" for k, v in MULTILABEL_DEFAULTS.items()})
    p = MULTILABEL_DEFAULTS | data_cfg.options
    folder = Path(data_cfg.root).expanduser() / (
        f"synthetic_multilabel-n{p['num_images']}-v{p['val_images']}-{p['size']}px-s{p['seed']}-q{p['quality']}"
    )
    generate_multilabel_shapes(folder, **p)
    cfg = data_cfg.model_copy(update={"options": {"classes": list(MULTILABEL_SHAPES)}})
    return multilabel_splits(folder / "train.csv", folder / "val.csv", cfg)

"""Image files on disk: image_folder (class-per-subfolder trees) and file_list (CSV/TXT lists of path,label)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint.data.core import (
    DATASETS,
    MODE,
    Splits,
    check_options,
    existing_folder,
    need_root,
    split_samples,
)
from torchsprint.errors import UsageError
from torchsprint.runtime.files import MAX_FILE_MB, MB, unreadable

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class ImageFiles(torch.utils.data.Dataset):
    """A list of (path, label) decoded on access; an unreadable file yields (None, label, "path: reason").

    Args:
        samples: (path, class index) pairs.
        mode: "RGB" or "GRAY".
        decoder: a DECODERS name ('auto' picks the fastest installed).
        max_pixels: larger images are bad samples (data.max_image_pixels).
        max_bytes: larger files, and anything but a regular file, are bad samples, never read (data.max_file_mb).
        min_size_for: optional (h, w) -> (min_h, min_w) hint from the preprocessing, which lets JPEG
            decoders scale in the DCT when the pipeline would shrink the image anyway.
    """

    def __init__(
        self,
        samples: list[tuple[str, int]],
        mode: str = "RGB",
        *,
        decoder: str = "auto",
        max_pixels: int = 89_478_485,
        max_bytes: int = MAX_FILE_MB * MB,
        min_size_for=None,
    ):
        from torchsprint.data.preprocess.decode import resolve_decoder

        self.samples, self.mode, self.max_bytes = samples, mode, max_bytes
        self.decoder, self.max_pixels, self.min_size_for = resolve_decoder(decoder), max_pixels, min_size_for

    @property
    def channels(self) -> int:
        return 1 if self.mode == "GRAY" else 3

    def with_min_size(self, min_size_for) -> ImageFiles:
        """A copy that passes a decode-size hint to the decoder (see `min_size_for`)."""
        return ImageFiles(
            self.samples,
            self.mode,
            decoder=self.decoder,
            max_pixels=self.max_pixels,
            max_bytes=self.max_bytes,
            min_size_for=min_size_for,
        )

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int) -> tuple[bytes, int, str]:
        """The raw bytes of sample i (for backends that decode elsewhere, e.g. on the GPU)."""
        from torchsprint.data.preprocess.decode import read_bytes

        path, label = self.samples[i]
        return read_bytes(path, self.max_bytes), label, path

    def __getitem__(self, i: int):
        from torchsprint.data.preprocess.decode import BadImage, decode_bytes, read_bytes

        path, label = self.samples[i]
        try:
            image = decode_bytes(
                read_bytes(path, self.max_bytes),
                channels=self.channels,
                decoder=self.decoder,
                max_pixels=self.max_pixels,
                min_size_for=self.min_size_for,
            )
            return image, label, path
        except (BadImage, OSError) as e:
            return None, label, f"{path}: {e}"


def image_files(samples, data_cfg, mode: str = "RGB") -> ImageFiles:
    """ImageFiles configured from the data section (decoder, pixel and file size limits)."""
    return ImageFiles(
        samples,
        mode,
        decoder=data_cfg.decoder,
        max_pixels=data_cfg.max_image_pixels,
        max_bytes=data_cfg.max_file_mb * MB,
    )


# Why a file below data.root is not a sample (FolderScan.skipped's keys, the start-up summary's words).
HIDDEN = "hidden (the name starts with '.': .DS_Store, macOS ._ copies, .git)"
NOT_IMAGE = f"not images by their extension (images: {', '.join(IMAGE_EXTENSIONS)})"
BROKEN_LINK = "broken symbolic links (to nothing)"
LINK_LOOP = "links to a folder already listed (a loop, or a second way in: its images are listed once)"
LOOSE = "files beside the class folders (in no class folder)"
# and files.NOT_REGULAR, files.TOO_LARGE: FIFOs and devices, files over data.max_file_mb (never opened)


@dataclass
class FolderScan:
    """What listing a folder of class folders found: the classes, the samples, and every entry left out, by why."""

    classes: list[str]
    samples: list[tuple[str, int]]
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> paths
    linked: int = 0  # samples reached through a symbolic link (to a file, or inside a linked folder): kept


def _note(skipped: dict[str, list[str]], reason: str, path) -> None:
    skipped.setdefault(reason, []).append(str(path))


def list_images(
    folder: Path,
    skipped: dict[str, list[str]],
    seen: set[str],
    max_bytes: int | None = MAX_FILE_MB * MB,
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
    other: str = NOT_IMAGE,
) -> tuple[list[Path], int]:
    """Image files below `folder` (sorted), following links to files and folders, each folder once (the video
    folders list theirs with `extensions` and `other`, their reason for the rest, and no size limit).

    Everything else is recorded in `skipped` by reason (hidden files and folders, other extensions,
    broken links, links back to a folder already listed, FIFOs and devices, files over `max_bytes`). `seen` holds the
    real paths of the folders listed so far (shared across class folders, so a link from one class into another lists
    nothing twice). Returns (images, how many of them were reached through a link).
    """
    import os

    found, linked = [], 0
    real = os.path.realpath(folder)
    if real in seen:
        _note(skipped, LINK_LOOP, folder)
        return [], 0
    seen.add(real)
    via_links = {str(folder)} if folder.is_symlink() else set()  # folders reached through a link
    for top, dirs, files in os.walk(folder, followlinks=True):
        via_link = top in via_links
        for d in sorted(dirs):
            full = Path(top, d)
            if d.startswith("."):
                _note(skipped, HIDDEN, full)
            elif (r := os.path.realpath(full)) in seen:
                _note(skipped, LINK_LOOP, full)
            else:
                seen.add(r)
                if via_link or full.is_symlink():
                    via_links.add(str(full))
                continue
            dirs.remove(d)  # os.walk descends only into what stays in `dirs`
        for name in sorted(files):
            full = Path(top, name)
            if name.startswith("."):
                _note(skipped, HIDDEN, full)
            elif full.is_symlink() and not full.exists():
                _note(skipped, BROKEN_LINK, full)
            elif full.suffix.lower() not in extensions:
                _note(skipped, other, full)
            elif why := unreadable(full, max_bytes):
                _note(skipped, why, full)
            else:
                found.append(full)
                linked += via_link or full.is_symlink()
    # os.walk puts a link to a missing folder among `files` (it is no directory), handled above as a broken link.
    return sorted(found), linked


def scan_folder(root: Path, seen: set[str] | None = None, max_bytes: int = MAX_FILE_MB * MB) -> FolderScan:
    """Class names (sorted subfolder names) and (path, class index) for every image below them.

    A class folder without images is left out with a warning (a class with no samples cannot be
    learnt, and would silently shift every later class index). Files that are not samples (hidden,
    other extensions, broken links, loose files beside the class folders) are counted by reason in
    FolderScan.skipped, never dropped silently.
    """
    import warnings

    skipped: dict[str, list[str]] = {}
    entries = sorted(root.iterdir())
    folders = []
    for p in entries:
        if p.name.startswith("."):
            _note(skipped, HIDDEN, p)
        elif p.is_dir():
            folders.append(p.name)
        elif p.is_symlink() and not p.exists():
            _note(skipped, BROKEN_LINK, p)
        else:
            _note(skipped, LOOSE, p)
    if not folders:
        raise UsageError(f"{root}: no class subfolders. image_folder expects <root>/<class>/<image> files.")
    import os

    seen = set() if seen is None else seen
    seen.add(os.path.realpath(root))  # a link from a class folder back up to root would list every class inside one
    found, linked = {}, 0
    for c in folders:
        found[c], n = list_images(root / c, skipped, seen, max_bytes)
        linked += n
    empty = [c for c in folders if not found[c]]
    classes = [c for c in folders if found[c]]
    if not classes:
        raise UsageError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the class subfolders {folders[:5]}.")
    if empty:
        warnings.warn(
            f"{root}: class folder(s) {empty[:5]} hold no images ({', '.join(IMAGE_EXTENSIONS)}) and are "
            f"left out; training on {len(classes)} classes.",
            stacklevel=2,
        )
    samples = [(str(p), ci) for ci, c in enumerate(classes) for p in found[c]]
    return FolderScan(classes, samples, skipped, linked)


def scan_class_folders(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """scan_folder's (class names, samples), for callers that report nothing of what was left out."""
    scan = scan_folder(root)
    return scan.classes, scan.samples


def merge_skipped(*scans: FolderScan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in scans:
        for reason, paths in s.skipped.items():
            out.setdefault(reason, []).extend(paths)
    return out


# Split folder names image_folder recognises (case-insensitive), as the common dataset layouts spell them:
# ImageNet/torchvision (train, val), Kaggle and Roboflow exports (train, valid, test), TFDS/Keras
# (train, validation, test).
SPLIT_NAMES = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
EXPECTED_LAYOUTS = (
    "<root>/train/<class>/*, optionally <root>/val|valid|validation/<class>/* and <root>/test/<class>/*; "
    "or <root>/<class>/* (split by data.val_fraction)"
)


def _listing(root: Path, limit: int = 8) -> str:
    """A one-line picture of what a folder holds: its subfolders with their image counts, and loose files."""
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = [p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")]
    parts = []
    for d in dirs[:limit]:
        subdirs = sum(1 for q in d.iterdir() if q.is_dir())
        parts.append(f"{d.name}/ ({subdirs} folders)" if subdirs else f"{d.name}/")
    if len(dirs) > limit:
        parts.append(f"... {len(dirs) - limit} more folders")
    if files:
        parts.append(f"{len(files)} loose file(s)")
    return ", ".join(parts) or "nothing"


def find_layout(root: Path) -> dict[str, Path | None]:
    """Which folder of `root` holds each split: {'train': path | None (root is one folder of classes), 'val': ...,
    'test': ...}.

    Refuses (UsageError, showing what was found and what is expected) the layouts that would otherwise be
    misread: split folders beside class folders, two folders for one split, a split folder without
    train/, and one wrapper folder around a split layout (data.root one level too high).
    """
    dirs = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    found: dict[str, list[Path]] = {
        k: [dirs[n] for n in dirs if n.lower() in names] for k, names in SPLIT_NAMES.items()
    }
    split_dirs = {p.name for ps in found.values() for p in ps}
    where = f"data.root={root} holds: {_listing(root)}"
    if not split_dirs:
        if len(dirs) == 1:
            (only,) = dirs.values()
            inner = {p.name.lower() for p in only.iterdir() if p.is_dir()}
            if inner & {n for names in SPLIT_NAMES.values() for n in names}:
                raise UsageError(
                    f"{where}; its one folder {only.name}/ holds split folders ({', '.join(sorted(inner)[:4])}), "
                    f"so set data.root={only}. Expected: {EXPECTED_LAYOUTS}."
                )
        return {"train": None, "val": None, "test": None}
    for k, ps in found.items():
        if len(ps) > 1:
            raise UsageError(
                f"{where}; {' and '.join(p.name + '/' for p in ps)} both look like the {k} split: keep one "
                f"(or rename the other). Expected: {EXPECTED_LAYOUTS}."
            )
    if not found["train"]:
        raise UsageError(
            f"{where}; there is {'/, '.join(sorted(split_dirs))}/ but no train/ folder. Expected: {EXPECTED_LAYOUTS}."
        )
    others = sorted(set(dirs) - split_dirs)
    if others:
        raise UsageError(
            f"{where}; besides the split folders ({', '.join(sorted(split_dirs))}) it has other folders "
            f"({', '.join(others[:5])}) that would be left out: move them into a split folder, or out of "
            f"data.root. Expected: {EXPECTED_LAYOUTS}."
        )
    return {k: (ps[0] if ps else None) for k, ps in found.items()}


def describe_layout(layout: dict[str, Path | None], data_cfg, root: Path) -> str:
    """Where each split comes from, for the start-up summary."""
    if layout["train"] is None:
        return (
            f"{root} is one folder of class folders: split {1 - data_cfg.val_fraction:.0%}/{data_cfg.val_fraction:.0%} "
            f"into train/val (data.val_fraction={data_cfg.val_fraction}, data.split_seed={data_cfg.split_seed})"
        )
    parts = [f"train from {layout['train'].name}/"]
    parts.append(
        f"val from {layout['val'].name}/"
        if layout["val"]
        else f"val: {data_cfg.val_fraction:.0%} of {layout['train'].name}/ (data.val_fraction, no val/ folder)"
    )
    if layout["test"]:
        parts.append(f"test from {layout['test'].name}/")
    return ", ".join(parts)


@DATASETS.register("image_folder")
def image_folder(data_cfg) -> Splits:
    """Class-per-subfolder images in one of the usual layouts (find_layout): train/ with val/ (or valid/,
    validation/) and test/ split folders, train/ alone (val split off by val_fraction), or one folder of
    class folders (split by val_fraction)."""
    check_options(data_cfg, MODE)
    root = existing_folder(need_root(data_cfg, "folder with train/ and val/ class subfolders"))
    mode = data_cfg.options.get("mode", "RGB")
    layout = find_layout(root)
    test, seen, notes, limit = None, set(), [], data_cfg.max_file_mb * MB
    if layout["train"] is not None:
        scans = [scan_folder(layout["train"], seen, limit)]
        classes, train = scans[0].classes, scans[0].samples
        if layout["val"] is not None:
            scans.append(scan_folder(layout["val"], seen, limit))
            val = _same_classes(scans[-1], layout["val"], classes, layout["train"])
        else:
            train, val, notes = split_samples(train, data_cfg, classes, with_notes=True)
        if layout["test"] is not None:
            scans.append(scan_folder(layout["test"], seen, limit))
            test = image_files(_same_classes(scans[-1], layout["test"], classes, layout["train"]), data_cfg, mode)
    else:
        scans = [scan_folder(root, seen, limit)]
        classes = scans[0].classes
        train, val, notes = split_samples(scans[0].samples, data_cfg, classes, with_notes=True)
    linked = sum(s.linked for s in scans)
    if linked:
        notes.append(f"{linked:,} image(s) reached through symbolic links (to files or folders) are used")
    return Splits(
        image_files(train, data_cfg, mode),
        image_files(val, data_cfg, mode),
        classes,
        in_channels=1 if mode == "GRAY" else 3,
        test=test,
        source=describe_layout(layout, data_cfg, root),
        skipped=merge_skipped(*scans),
        notes=notes,
    )


def _same_classes(scan: FolderScan, folder: Path, classes: list[str], train: Path) -> list[tuple[str, int]]:
    """Samples of a val/test split folder, which must have the training classes (a subset is fine: a class
    with no validation images is common; a class training never saw is an error)."""
    import warnings

    names, samples = scan.classes, scan.samples
    unknown = [c for c in names if c not in classes]
    if unknown:
        raise UsageError(
            f"{folder}: class folder(s) {unknown[:5]} are not in {train.name}/ ({len(classes)} classes: "
            f"{classes[:5]}{' ...' if len(classes) > 5 else ''}); the model can only learn classes it trains on. "
            "Add them to train/, or remove them here."
        )
    missing = [c for c in classes if c not in names]
    if missing:
        warnings.warn(
            f"{folder}: no images of class(es) {missing[:5]}; they are trained but not measured on {folder.name}/.",
            stacklevel=3,
        )
    index = {c: i for i, c in enumerate(classes)}
    return [(p, index[names[ci]]) for p, ci in samples]


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
        raise UsageError(
            f"file list {path} does not exist. data.root must name a .csv/.txt list or a folder with train.csv/val.csv."
        )
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
        if names is None and k > len(labels):  # a list of class names up to a label of 10**9 is a MemoryError
            raise UsageError(
                f"file_list: label {k - 1} means {k:,} classes (integer labels are class indices 0..K-1), "
                f"but the lists have {len(labels):,} rows, so most classes would have no image. Renumber "
                "the labels 0..K-1, or write class names as labels."
            )
        if names is not None and len(names) < k:
            raise UsageError(
                f"file_list: labels go up to {k - 1} but data.options.classes names only {len(names)} classes."
            )
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


FILE_LIST_OPTIONS = {
    "train_list": "a list file for training",
    "val_list": "a list file for validation",
    "classes": "class names for integer labels, in index order",
    **MODE,
}


@DATASETS.register("file_list")
def file_list(data_cfg) -> Splits:
    """Images named in list files of `path,label` lines.

    data.root is one list file (split by val_fraction) or a folder holding train.csv and val.csv (or
    .txt). data.options: train_list / val_list (explicit files), classes (names for integer labels),
    mode (RGB or GRAY).
    """
    check_options(data_cfg, FILE_LIST_OPTIONS)
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
    skipped: dict[str, list[str]] = {}  # rows naming a FIFO, a device or a file over data.max_file_mb: never read
    train, val = (
        [(p, index[lab]) for p, lab in rows if not _skip(p, data_cfg, skipped)] for rows in (train_rows, val_rows)
    )
    if val_path is None:
        train, val = split_samples(train, data_cfg)
    mode = opts.get("mode", "RGB")
    return Splits(
        image_files(train, data_cfg, mode),
        image_files(val, data_cfg, mode),
        classes,
        in_channels=1 if mode == "GRAY" else 3,
        skipped=skipped,
    )


def _skip(path: str, data_cfg, skipped: dict[str, list[str]]) -> bool:
    """Whether a listed file is left out (files.unreadable), noted in `skipped` by reason."""
    why = unreadable(path, data_cfg.max_file_mb * MB)
    if why:
        _note(skipped, why, path)
    return bool(why)

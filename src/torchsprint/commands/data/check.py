"""`torchsprint data check`: read every sample of a dataset and say what is wrong with it, before training.

Every file is read and decoded (whatever data.on_bad_sample says), with a progress bar, and the report
lists: every unreadable file with its reason, files with the same bytes (duplicates within a split, and
images shared between train and val/test: a leak that inflates validation scores), class counts per
split with warnings for a single class, tiny classes and strong imbalance, the image size range, and a
few batches through the configured loader backend (shapes, label range, images/s). It writes check.json
and samples.png: one row per class, a few training images after the train preprocessing beside the same
images after the eval preprocessing (tiles of at least 128 px, nearest-neighbour for tiny images).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from torchsprint.observe.logging import replace_file
from torchsprint.train.resolve import resolve

FEW = 5  # a class with fewer training images than this is warned about
IMBALANCE = 10.0  # largest / smallest class ratio above which the report warns


class ScanFiles(torch.utils.data.Dataset):
    """Item i -> what the check needs of one file: its label, a digest of its bytes, its decoded size or the
    reason it cannot be decoded. Runs in DataLoader workers (data.num_workers)."""

    def __init__(self, samples, decoder: str, channels: int, max_pixels: int):
        self.samples, self.decoder, self.channels, self.max_pixels = samples, decoder, channels, max_pixels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        from torchsprint.data.preprocess.decode import BadImage, decode_bytes, read_bytes

        path, label = self.samples[i]
        out = {"i": i, "path": str(path), "label": label, "digest": None, "size": None, "error": None}
        try:
            data = read_bytes(path)
            out["digest"] = hashlib.blake2b(data, digest_size=16).hexdigest()
            img = decode_bytes(data, channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels)
            out["size"] = (int(img.shape[1]), int(img.shape[2]))
        except (BadImage, OSError) as e:
            out["error"] = str(e)
        return out


class ScanItems(torch.utils.data.Dataset):
    """The same for datasets that decode themselves (in-memory tensors, pairs, videos): a digest of the decoded
    pixels instead of the file's bytes."""

    def __init__(self, raw):
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> dict:
        image, target, source = self.raw[i]
        out = {"i": i, "path": str(source), "label": target, "digest": None, "size": None, "error": None}
        if image is None:
            out["error"] = str(source).split(": ", 1)[-1]
        else:
            out["digest"] = hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).hexdigest()
            out["size"] = (int(image.shape[-2]), int(image.shape[-1]))
        return out


def scan_entry(i: int, data, label, source: str, raw) -> dict:
    """ScanFiles' record of one sample read from a webdataset shard."""
    out = {"i": i, "path": source, "label": label, "digest": None, "size": None, "error": None}
    if isinstance(data, Exception):
        out["error"] = str(data)
        return out
    out["digest"] = hashlib.blake2b(data, digest_size=16).hexdigest()
    image, _, reason = raw.decode(data, label, source)
    if image is None:
        out["error"] = reason.split(": ", 1)[-1]
    else:
        out["size"] = (int(image.shape[1]), int(image.shape[2]))
    return out


def scan_split(raw, workers: int, label: str, progress) -> list[dict]:
    """Scan every sample of one split (files: read + decoded with the dataset's decoder)."""
    if getattr(raw, "streaming", False):  # webdataset shards: one pass over the tar streams, in this process
        return [scan_entry(i, data, label, source, raw) for i, data, label, source in raw.read_all()]
    ds = (
        ScanFiles(raw.samples, raw.decoder, raw.channels, raw.max_pixels) if hasattr(raw, "samples") else ScanItems(raw)
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=lambda x: x)
    task = progress.add_task(f"reading {label}", total=len(ds)) if progress else None
    items = []
    for item in loader:
        items.append(item)
        if progress:
            progress.advance(task)
    return items


def class_index(label, task: str) -> list[int]:
    """The classes a target names: its class index, every 1 of a multi-hot vector (multilabel), none for an
    image target (image_to_image)."""
    if task == "multilabel":
        return torch.nonzero(torch.as_tensor(label).flatten() > 0).flatten().tolist()
    if task in ("classification", "video"):
        return [int(label)]
    return []


def analyse(scans: dict[str, list[dict]], classes: list[str], task: str) -> dict:
    """Bad files, duplicates, cross-split overlaps, class counts, sizes, and the problems/warnings they raise."""
    report = {"splits": {}, "bad": [], "duplicates": [], "shared": [], "problems": [], "warnings": []}
    by_digest: dict[str, list[tuple[str, str]]] = defaultdict(list)
    counts = {}
    for split, items in scans.items():
        sizes = [it["size"] for it in items if it["size"]]
        count = Counter(c for it in items if it["error"] is None for c in class_index(it["label"], task))
        counts[split] = count
        report["splits"][split] = {
            "samples": len(items),
            "unreadable": sum(it["error"] is not None for it in items),
            "class_counts": {c: count.get(i, 0) for i, c in enumerate(classes)},
            "min_size": min(sizes, key=lambda s: s[0] * s[1]) if sizes else None,
            "max_size": max(sizes, key=lambda s: s[0] * s[1]) if sizes else None,
        }
        report["bad"] += [{"split": split, "path": it["path"], "reason": it["error"]} for it in items if it["error"]]
        for it in items:
            if it["digest"]:
                by_digest[it["digest"]].append((split, it["path"]))
    for group in by_digest.values():
        splits = {s for s, _ in group}
        if len(group) > 1:
            (report["shared"] if len(splits) > 1 else report["duplicates"]).append([f"{s}: {p}" for s, p in group])
    train = counts.get("train", Counter())
    if task in ("classification", "video"):
        if len(classes) < 2:
            report["problems"].append(
                f"{len(classes)} class ({', '.join(classes)}): nothing to tell apart; add a folder per class"
            )
        present = {i: train.get(i, 0) for i in range(len(classes))}
        few = [f"{classes[i]} ({n})" for i, n in present.items() if n < FEW]
        if few:
            report["warnings"].append(f"class(es) with fewer than {FEW} training images: {', '.join(few[:10])}")
        nonzero = [n for n in present.values() if n]
        if nonzero and max(nonzero) / min(nonzero) > IMBALANCE:
            big = max(present, key=present.get)
            small = min((i for i in present if present[i]), key=present.get)
            report["warnings"].append(
                f"imbalanced classes: {classes[big]} has {present[big]} training images, "
                f"{classes[small]} {present[small]} (x{present[big] / present[small]:.0f}); consider "
                "class weights (loss.args.weight) or more data"
            )
        for split, count in counts.items():
            if split != "train":
                missing = [classes[i] for i in range(len(classes)) if not count.get(i)]
                if missing and len(missing) < len(classes):
                    report["warnings"].append(f"{split} has no images of {', '.join(missing[:10])}")
    if report["bad"]:
        report["problems"].append(
            f"{len(report['bad'])} unreadable file(s) (listed above); fix or remove them, or "
            "train with data.on_bad_sample=skip"
        )
    if report["shared"]:
        report["problems"].append(
            f"{len(report['shared'])} image(s) in more than one split: validation would score "
            "images the model trained on; remove them from one split"
        )
    if report["duplicates"]:
        report["warnings"].append(f"{len(report['duplicates'])} group(s) of identical files within a split")
    for split in scans:
        if not report["splits"][split]["samples"]:
            report["problems"].append(f"the {split} split is empty")
    return report


def sample_grid(splits, cfg, out: Path, per_class: int = 4) -> Path | None:
    """samples.png: per class, `per_class` training images after the train preprocessing, then the same images
    after the eval preprocessing (the cpu backend's reference pipeline, seeded per image)."""
    from torchsprint.data.preprocess.transforms import compile_spec
    from torchsprint.observe.plots import tile_grid

    if splits.task != "classification":
        return None
    train_p = compile_spec(cfg.data.train.transforms, "data.train.transforms", splits.in_channels)
    eval_p = compile_spec(cfg.data.eval.transforms, "data.eval.transforms", splits.in_channels)
    by_class: dict[int, list[int]] = defaultdict(list)
    raw = splits.train
    if getattr(raw, "streaming", False):  # webdataset shards: the first images of each class, read in order
        decoded = {}
        for i, data, lab, source in raw.read_all():
            if len(by_class[lab]) < per_class:
                by_class[lab].append(i)
                decoded[i] = raw.decode(data, lab, source)
            if len(by_class) == len(splits.classes) and all(len(v) >= per_class for v in by_class.values()):
                break
        raw = decoded
    else:
        labels = (
            [lab for _, lab in raw.samples] if hasattr(raw, "samples") else [int(raw[i][1]) for i in range(len(raw))]
        )
        for i, lab in enumerate(labels):
            if len(by_class[lab]) < per_class:
                by_class[lab].append(i)
    rows, names = [], []
    for c in sorted(by_class)[:24]:  # a readable page: at most 24 classes
        tiles_train, tiles_eval = [], []
        for i in by_class[c]:
            image = raw[i][0]
            if image is None:
                continue
            g = torch.Generator().manual_seed(i)
            torch.default_generator.manual_seed(int(torch.randint(2**31, (1,), generator=g)))
            tiles_train.append((train_p.cpu(image) if train_p.cpu else image, "train"))
            tiles_eval.append((eval_p.cpu(image) if eval_p.cpu else image, "eval"))
        pad = [None] * (per_class - len(tiles_train))  # eval columns line up under each other
        rows.append(tiles_train + pad + tiles_eval)
        names.append(splits.classes[c])
    return (
        out / "samples.png"
        if rows
        and tile_grid(
            rows,
            f"{cfg.data.dataset}: train preprocessing (left) and eval preprocessing (right), one row per class",
            row_labels=names,
            path=out / "samples.png",
        )
        else None
    )


def loader_check(cfg, batches: int) -> dict:
    """A few batches of each split through the configured backend: shapes, labels in range, finite, images/s."""
    from torchsprint.data.build import build_loaders
    from torchsprint.runtime.core import Runtime, resolve_device

    data_cfg = cfg.data.model_copy(update={"on_bad_sample": "skip"})  # the scan above already named every bad file
    loaders = build_loaders(
        data_cfg, Runtime(torch.device(resolve_device(cfg.run.device))), seed=cfg.run.seed, epochs=cfg.run.epochs
    )  # auto weighs the memory backend's decode over the run's epochs
    k = loaders.info.num_classes
    # The backend that ran (what `auto` chose, or data.fallback), as build_loaders recorded it.
    out = {"problems": [], "backend": loaders.info.backend, "backend_why": loaders.info.backend_why}
    for name, loader in (("train", loaders.train), ("val", loaders.val)):
        loader.set_epoch(0)
        shapes, n, t0 = set(), 0, time.perf_counter()
        for b, (images, targets) in enumerate(loader):
            shapes.add(tuple(images.shape[1:]))
            if not bool(torch.isfinite(images).all()):  # note: a sync per batch, fine in a checking tool
                out["problems"].append(f"{name}: non-finite pixel values in batch {b}")
            t = targets.cpu()
            if t.ndim == 1 and t.dtype == torch.int64 and bool(((t < 0) | (t >= k)).any()):
                out["problems"].append(f"{name}: labels outside 0..{k - 1} in batch {b}")
            n += images.shape[0]
            if b + 1 >= batches:
                break
        out[name] = {
            "batches": min(batches, len(loader)),
            "of": len(loader),
            "shapes": sorted(shapes),
            "images_per_s": n / max(time.perf_counter() - t0, 1e-9),
        }
    return out


def check(cfg, batches: int = 10, out: Path | None = None, progress: bool = True) -> dict:
    """The whole check (see the module docstring); returns the report (also written to <out>/check.json)."""
    import tempfile

    from torchsprint.data.core import DATASETS
    from torchsprint.state.rundir import writable_file

    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="torchsprint-data-check-"))
    for target in (out, out / "check.json", out / "samples.png"):  # before every file is read, not after
        writable_file(target, "--out", folder=target == out)
    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    named = {"train": splits.train, "val": splits.val}
    if getattr(splits, "test", None) is not None:
        named["test"] = splits.test
    bar = None
    if progress and sys.stdout.isatty():
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
    try:
        scans = {name: scan_split(raw, cfg.data.num_workers, name, bar) for name, raw in named.items()}
    finally:
        if bar:
            bar.stop()
    report = analyse(scans, splits.classes, splits.task)
    report |= {"dataset": cfg.data.dataset, "root": cfg.data.root, "classes": splits.classes}
    # files the source left out (hidden, other extensions, FIFOs and devices, over data.max_file_mb), as train says
    report["skipped"] = {why: {"count": len(paths), "examples": paths[:3]} for why, paths in splits.skipped.items()}
    loading = loader_check(cfg, batches)
    report["loader"] = {k: v for k, v in loading.items() if k not in ("problems", "backend", "backend_why")}
    report |= {"backend": loading["backend"], "backend_why": loading["backend_why"], "backend_config": cfg.data.backend}
    report["problems"] += loading["problems"]
    grid = sample_grid(splits, cfg, out)
    if grid is not None:
        report["grid"] = str(grid)
    replace_file(out / "check.json", json.dumps(report, indent=1, default=str))
    report["out"] = str(out)
    return report


def check_cli(args) -> int:
    """`torchsprint data check -c cfg [--batches N] [--out DIR]`: print the report; exit 1 on problems."""
    from torchsprint import config

    cfg = resolve(config.load(args.config, args.overrides))
    r = check(cfg, args.batches, args.out)
    k = len(r["classes"])
    print(
        f"dataset {r['dataset']} ({r['root'] or 'built in'}), {k} classes: {', '.join(r['classes'][:10])}"
        + (" ..." if k > 10 else "")
    )
    for name, s in r["splits"].items():
        size = (
            f", sizes {s['min_size'][1]}x{s['min_size'][0]} to {s['max_size'][1]}x{s['max_size'][0]} (w x h)"
            if s["min_size"]
            else ""
        )
        print(f"{name:>5}: {s['samples']} samples, unreadable {s['unreadable']}{size}")
        print(f"       class counts: {s['class_counts']}")
    for why, v in r["skipped"].items():
        print(f"left out {v['count']:,} {why}, e.g. {', '.join(v['examples'])}")
    for b in r["bad"]:
        print(f"unreadable: {b['split']}: {b['path']}: {b['reason']}")
    for group in r["shared"]:
        print(f"in more than one split: {' = '.join(group)}")
    for group in r["duplicates"]:
        print(f"identical files: {' = '.join(group)}")
    print(f"loader: data.backend={r['backend']} ({r['backend_why']})")
    for name in ("train", "val"):
        s = r["loader"][name]
        print(
            f"loader ({r['backend']}) {name}: {s['batches']}/{s['of']} batches, shape {s['shapes']}, "
            f"{s['images_per_s']:.0f} images/s"
        )
    if "grid" in r:
        print(f"sample grid: {r['grid']}")
    print(f"report: {Path(r['out']) / 'check.json'}")
    for w in r["warnings"]:
        print(f"warning: {w}")
    for p in r["problems"]:
        print(f"problem: {p}")
    print("ok" if not r["problems"] else f"{len(r['problems'])} problem(s)")
    return 0 if not r["problems"] else 1

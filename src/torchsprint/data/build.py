"""`build_loaders`: dataset + backend from the `data` section, `data.backend: auto`, and what was decided.

The top of the data package: it knows every source and backend (they register themselves in
core's registries), so the choice of backend (`auto`: its measurement in auto.py), the fallback, the record of
what was decided and the description of the data printed at start-up live here, not in core.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch

from torchsprint.data.auto import check_memory_size, choose_backend, file_sizes, plain_image_files
from torchsprint.data.core import (
    DATASETS,
    LOADERS,
    SAMPLER_POWER,
    ClassDraw,
    Loaders,
    Splits,
    as_backend,
    auto_sampler,
    runs_anywhere,
)
from torchsprint.data.image_cache import with_cache
from torchsprint.data.preprocess.progressive import train_schedule
from torchsprint.errors import UsageError

CACHED_BACKENDS = ("cpu", "memory")  # the backends that read decoded pixels (gpu and dali decode the bytes themselves)


def build_loaders(
    data_cfg,
    rt,
    *,
    seed: int,
    channels_last: bool = False,
    dtype: torch.dtype = torch.float32,
    allowed: tuple[str, ...] | None = None,
    split: str = "val",
    splits: Splits | None = None,
    epochs: int = 1,
    keep_backend: str | None = None,
    log=None,
) -> Loaders:
    """Build the dataset named in `data_cfg.dataset` and the backend named in `data_cfg.backend`.

    Args:
        data_cfg: the `data` section.
        rt: the Runtime (device, rank, world size).
        seed: run seed (data order and augmentation).
        channels_last: deliver images in channels_last memory format.
        dtype: floating dtype of the delivered images (fp32, or fp16/bf16 for half models).
        allowed: the backends the task supports (tasks.Task.backends; None: any); `auto` picks among them.
        split: what the evaluation loader (`Loaders.val`) reads: "val", or "test" (the dataset's test split).
        splits: an already built dataset (else built from data_cfg).
        epochs: how many epochs the loaders serve (run.epochs): data.backend=auto weighs the memory backend's
            up-front decode against what it saves per epoch (choose_backend).
        keep_backend: the backend `auto` chose when this run started (a resumed run keeps it: another backend
            augments differently, and the resume would not continue the same run).
        log: where the decoded-image cache says that it builds (data.cache; None: silent).
    The chosen backend and why, and the facts of the data, are in `Loaders.info` (backend, backend_why, facts).
    """
    check_data_fields(data_cfg)
    schedule = train_schedule(data_cfg)  # data.progressive against the training spec, before any data is read
    splits = splits if splits is not None else DATASETS.get(data_cfg.dataset)(data_cfg)
    if (
        data_cfg.decoder != "auto"
        and not hasattr(splits.train, "samples")
        and not getattr(splits.train, "streaming", False)
    ):
        raise UsageError(
            f"data.decoder={data_cfg.decoder}: data.dataset={data_cfg.dataset} is already decoded in memory, "
            "so no decoder runs; remove data.decoder."
        )
    for where, spec in (
        ("data.train.transforms", data_cfg.train.transforms),
        ("data.eval.transforms", data_cfg.eval.transforms),
    ):
        for step in spec:
            name = step if isinstance(step, str) else next(iter(step), None) if isinstance(step, dict) else None
            if name in splits.label_changing:
                raise UsageError(
                    f"{where}: {name} on data.dataset={data_cfg.dataset} {splits.label_changing[name]}; remove it."
                )
    check_train_size(data_cfg, splits)
    splits = with_class_draw(data_cfg, evaluated_split(data_cfg, splits, split))
    # Off CUDA every backend auto may choose reads pixels: the cache first, so that auto measures what will run
    listed, cache = splits, None
    if rt.device.type != "cuda" and data_cfg.backend in ("auto", *CACHED_BACKENDS):
        splits, cache = cached(data_cfg, splits, "cpu", log)
    kw = dict(seed=seed, channels_last=channels_last, dtype=dtype)
    configured = data_cfg.backend
    name, why = configured, "set in the config (data.backend)"
    measured: dict = {}
    if name == "auto" and keep_backend is not None:
        name, why = (
            keep_backend,
            "data.backend=auto: the backend this run chose when it started (decisions.json), kept "
            "so that the resumed run augments as it began",
        )
    elif name == "auto":
        name, why, measured = choose_backend(data_cfg, splits, rt, allowed, epochs=epochs, kw=kw)
    elif name == "memory":
        check_memory_size(data_cfg, splits, rt.device)  # auto checked it already
    backend, fallback = as_backend(LOADERS.get(name)), None
    why_not = backend.cannot_run(rt)
    if why_not is not None:  # the one place a backend falls back (or is refused), whatever the backend
        if data_cfg.fallback is None:
            raise UsageError(
                f"data.backend={name} cannot run here ({why_not}). Set data.backend=cpu, or "
                f"data.fallback=cpu to use the cpu backend wherever {name} cannot run."
            )
        warnings.warn(
            f"data.backend={name} cannot run ({why_not}); using data.fallback={data_cfg.fallback}.", stacklevel=2
        )
        fallback = why_not
        why = f"data.fallback={data_cfg.fallback}: data.backend={name} cannot run here ({why_not})"
        name = data_cfg.fallback
        backend = as_backend(LOADERS.get(name))
        if (also := backend.cannot_run(rt)) is not None:
            raise UsageError(f"data.fallback={name} cannot run here either ({also}). Set data.fallback=cpu.")
    if schedule is not None and not backend.progressive:
        able = [n for n in LOADERS.names() if as_backend(LOADERS.get(n)).progressive]
        raise UsageError(
            f"data.progressive: data.backend={name} does not resize its crop per epoch (backends that do: "
            f"{', '.join(able)}). Set data.backend to one of them, or remove data.progressive."
        )
    if cache is None:  # describe_data reads the files as listed
        splits, cache = cached(data_cfg, splits, name, log)
    loaders = backend(data_cfg.model_copy(update={"backend": name}), splits, rt, **kw)
    info = loaders.info
    # Recorded once, here: every writer (decisions.json, the start-up summary, data check, the engine's hint) reads it.
    info.backend, info.backend_why, info.backend_config, info.fallback = name, why, configured, fallback or ""
    info.backend_measured = measured
    draw = splits.train_draw
    info.sampler, info.sampler_why = (draw.sampler, draw.why) if draw is not None else ("shuffle", splits.sampler_why)
    loaders.info.facts = describe_data(listed) | {"cache": cache}
    return splits.wrap(loaders)


def evaluated_split(data_cfg, splits: Splits, split: str) -> Splits:
    """`splits` whose `val` is what the evaluation loader reads: "val", or "test" (the dataset's test split)."""
    if split == "test":
        if splits.test is None:
            raise UsageError(
                f"data.dataset={data_cfg.dataset} (root={data_cfg.root}) has no test split; image_folder "
                "reads one from a test/ folder beside train/. Evaluate --split val, or add test/."
            )
        return replace(splits, val=splits.test)
    if split != "val":
        raise UsageError(f"--split {split}: choose val or test.")
    return splits


def cached(data_cfg, splits: Splits, backend: str, log) -> tuple[Splits, dict]:
    """The splits as `backend` reads them: from the decoded-image cache (data.cache) where it reads pixels; and
    the cache's record for decisions.json."""
    if backend in CACHED_BACKENDS:
        return with_cache(data_cfg, splits, log or (lambda *_: None))
    if data_cfg.cache == "on":
        raise UsageError(
            f"data.cache=on: data.backend={backend} decodes the files itself (the cache serves "
            f"{' and '.join(CACHED_BACKENDS)}). Set data.backend=cpu or memory, or data.cache=auto."
        )
    return splits, {"state": "off", "why": f"data.backend={backend} decodes the files itself"}


def check_train_size(data_cfg, splits: Splits) -> None:
    """Refuse an empty training split, and an effective batch larger than it."""
    if len(splits.train) == 0:
        raise UsageError(f"dataset '{data_cfg.dataset}' has no training samples (root={data_cfg.root}).")
    if (target := data_cfg.effective_batch_size) is not None and target > len(splits.train):
        # every optimizer step would average all the epoch holds (an epoch of 1,437 at 2048: one step of 1,408)
        raise UsageError(
            f"data.effective_batch_size={target} is more than the {len(splits.train):,} training images: "
            "an optimizer step could never see that many. Set it to at most the training set's size (much "
            "less, for more than one step per epoch), or leave it unset."
        )


def with_class_draw(data_cfg, splits: Splits) -> Splits:
    """`splits` with the training split's per-sample draw weights of data.sampler=balanced|sqrt (and the epoch they
    start, data.sampler_from_epoch); unchanged under shuffle, where data.sampler_from_epoch is refused. auto is
    resolved here, the one place that reads the training labels first (data/core.py's auto_sampler)."""
    sampler, why = data_cfg.sampler, ""
    if sampler == "auto":
        streamed = getattr(splits.train, "streaming", False) or data_cfg.repeated_aug > 1
        sampler, why = (
            ("shuffle", "data.sampler=auto: streamed shards or data.repeated_aug choose the samples")
            if streamed
            else auto_sampler(_labels(splits.train), splits.classes)
        )
    if sampler != "shuffle":
        draw = ClassDraw(SAMPLER_POWER[sampler], data_cfg.sampler_from_epoch - 1, sampler, why)
        return replace(splits, train_weights=balanced_train_weights(data_cfg, splits, draw), train_draw=draw)
    if data_cfg.sampler_from_epoch != 1:
        raise UsageError(
            f"data.sampler_from_epoch={data_cfg.sampler_from_epoch} says when data.sampler=balanced or sqrt "
            f"starts, but data.sampler={data_cfg.sampler}{f' ({why})' if why else ''}; set data.sampler="
            "balanced (or sqrt), or remove data.sampler_from_epoch."
        )
    return replace(splits, sampler_why=why)


def balanced_train_weights(data_cfg, splits: Splits, draw: ClassDraw) -> torch.Tensor:
    """data.sampler=balanced|sqrt: per-sample weights class count ** -power, from the training split's class-index
    labels."""
    labels = None if getattr(splits.train, "streaming", False) else _labels(splits.train)
    if labels is None:
        raise UsageError(
            f"data.sampler={draw.sampler} draws samples by their class, but data.dataset={data_cfg.dataset} has no "
            "per-sample class labels to draw from (streamed shards, or targets that are not one class per "
            "image). Remove data.sampler, or use an indexed dataset (image_folder, file_list)."
        )
    if data_cfg.repeated_aug > 1:
        raise UsageError(
            f"data.sampler={draw.sampler} with data.repeated_aug={data_cfg.repeated_aug}: both choose which samples "
            "an epoch reads; use one of them."
        )
    empty = [
        c for c, n in zip(splits.classes, torch.bincount(labels, minlength=len(splits.classes)).tolist()) if n == 0
    ]
    if empty:  # no draw can pick them: "every class equally often" would not hold (as loss.class_weights=auto refuses)
        raise UsageError(
            f"data.sampler={draw.sampler}: class(es) {empty[:5]} have no training images, so no draw can pick "
            "them; add images, or remove data.sampler."
        )
    return draw.weights(labels, len(splits.classes))


def check_data_fields(data_cfg) -> None:
    """Refuse backend-specific settings the chosen backend would ignore (non-default values only)."""
    if data_cfg.cpu_fraction != 0.0 and data_cfg.backend != "gpu":
        raise UsageError(
            f"data.cpu_fraction={data_cfg.cpu_fraction} splits a batch between CPU and GPU decoding in the "
            f"gpu backend; data.backend={data_cfg.backend} does not use it. Remove it, or set data.backend=gpu."
        )
    if data_cfg.fallback is not None and (
        data_cfg.backend == "auto" or as_backend(LOADERS.get(data_cfg.backend)).cannot_run is runs_anywhere
    ):
        raise UsageError(
            f"data.fallback={data_cfg.fallback} replaces a backend where it cannot run (gpu and dali need "
            f"CUDA); data.backend={data_cfg.backend} always runs. Remove data.fallback."
        )
    if data_cfg.num_workers == 0 and data_cfg.prefetch_factor != 2:
        raise UsageError(
            f"data.prefetch_factor={data_cfg.prefetch_factor} is per worker process, and data.num_workers=0 "
            "loads in the main process. Set data.num_workers too, or remove data.prefetch_factor."
        )


# ---------------------------------------------------------------- what the data is


def describe_data(splits: Splits, sample: int = 32) -> dict:
    """Facts for the start-up summary: where the splits come from, counts, class balance, image sizes, and
    for image files which library decodes each format, the colour modes sampled, and what was left out."""
    facts: dict = {
        "source": splits.source,
        "classes": len(splits.classes),
        "class_names": list(splits.classes[:8]),
        "images": {"train": len(splits.train), "val": len(splits.val)},
        "decoder": getattr(splits.train, "decoder", None),
    }  # None: stored decoded (digits, CIFAR)
    if splits.test is not None:
        facts["images"]["test"] = len(splits.test)
    labels = _labels(splits.train)
    if labels is not None and len(splits.classes) > 1:
        counts = torch.bincount(labels, minlength=len(splits.classes)).tolist()
        lo, hi = min(range(len(counts)), key=counts.__getitem__), max(range(len(counts)), key=counts.__getitem__)
        facts["class_counts"] = {
            "smallest": [splits.classes[lo], counts[lo]],
            "largest": [splits.classes[hi], counts[hi]],
            "per_class": counts,
        }  # in class order: loss.class_weights=auto reads them
    if hasattr(splits.train, "images"):
        facts["image_size"] = {
            "min": list(splits.train.images.shape[-2:]),
            "max": list(splits.train.images.shape[-2:]),
            "sampled": len(splits.train),
        }
    elif plain_image_files(splits.train):
        idx = range(0, len(splits.train), max(1, len(splits.train) // sample))
        paths = [splits.train.samples[i][0] for i in idx][:sample]
        sizes = [s for s in file_sizes(paths) if s is not None]
        if sizes:
            facts["image_size"] = {
                "min": [min(h for h, _ in sizes), min(w for _, w in sizes)],
                "max": [max(h for h, _ in sizes), max(w for _, w in sizes)],
                "sampled": len(sizes),
            }
        facts["decoders"] = decoders_by_format(splits, facts["decoder"])
        facts["modes"] = sampled_modes(paths)
        facts["channels"] = splits.train.channels
    if splits.skipped:
        facts["skipped"] = {
            why: {"count": len(paths), "examples": [os.path.basename(p) for p in paths[:3]]}
            for why, paths in splits.skipped.items()
        }
    if splits.notes:
        facts["notes"] = list(splits.notes)
    return facts


def decoders_by_format(splits: Splits, decoder: str) -> dict[str, dict]:
    """{format: {"decoder": library, "files": count}} over every file of every split (formats by extension)."""
    from collections import Counter

    from torchsprint.data.preprocess.decode import FORMAT_OF_SUFFIX, decoder_for

    counts: Counter = Counter()
    for ds in (splits.train, splits.val, splits.test):
        for path, _ in getattr(ds, "samples", None) or ():
            counts[FORMAT_OF_SUFFIX.get(os.path.splitext(path)[1].lower(), "other")] += 1
    return {fmt: {"decoder": decoder_for(decoder, fmt), "files": n} for fmt, n in counts.most_common()}


def sampled_modes(paths: list[str]) -> dict[str, int]:
    """Pillow's colour mode of each readable file (RGB, L, RGBA, P, I;16 ...), counted; only headers are read."""
    from collections import Counter

    from PIL import Image

    from torchsprint.runtime.files import open_regular

    modes: Counter = Counter()
    for p in paths:
        try:  # open_regular: never a FIFO (it would block) nor a device
            with open_regular(p) as f, Image.open(f) as im:
                modes[im.mode] += 1
        except Exception:  # noqa: BLE001 - an unreadable file is the loader's to report (data.on_bad_sample)
            modes["unreadable"] += 1
    return dict(modes.most_common())


# What decoding does to each Pillow mode (decode.to_uint8_channels and _pil), by the channels the dataset reads.
_MODE_READ = {
    3: {
        "L": "grey repeated to 3 channels",
        "LA": "grey repeated to 3 channels, alpha dropped",
        "RGBA": "alpha dropped",
        "P": "palette expanded to RGB",
        "PA": "palette expanded to RGB, alpha dropped",
        "I;16": "16-bit: the top 8 bits kept, grey repeated to 3 channels",
        "I": "16/32-bit: the top 8 bits kept, grey repeated to 3 channels",
        "CMYK": "converted to RGB",
        "1": "black and white repeated to 3 channels",
    },
    1: {
        "RGB": "converted to grey (ITU-R 601 luma)",
        "RGBA": "alpha dropped, converted to grey",
        "P": "palette expanded, converted to grey",
        "I;16": "16-bit: the top 8 bits kept",
        "I": "16/32-bit: the top 8 bits kept",
        "LA": "alpha dropped",
        "CMYK": "converted to grey",
    },
}


def describe_modes(modes: dict[str, int], channels: int) -> str:
    """'RGB 20, L 5 (grey repeated to 3 channels), ...': each sampled mode and what decoding does to it."""
    keep = "RGB" if channels == 3 else "L"
    read = _MODE_READ.get(channels, {})
    return ", ".join(f"{m} {n}" + (f" ({read[m]})" if m != keep and m in read else "") for m, n in modes.items())


def _labels(ds) -> torch.Tensor | None:
    if hasattr(ds, "labels"):
        t = torch.as_tensor(ds.labels)
        return t.long() if t.ndim == 1 else None
    samples = getattr(ds, "samples", None)
    if samples and isinstance(samples[0][1], int):
        return torch.tensor([s[1] for s in samples], dtype=torch.int64)
    return None

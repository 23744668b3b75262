"""`build_loaders`: dataset + backend from the `data` section, `data.backend: auto`, and what was decided.

The top of the data package: it knows every source and backend (they register themselves in
core's registries), so the choice of backend (`auto`) and the description of the data printed at
start-up live here, not in core.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch

from torchsprint.data.core import (
    DATASETS,
    LOADERS,
    Loaders,
    Splits,
    as_backend,
    balanced_weights,
    memory_budget,
    runs_anywhere,
    size_text,
)
from torchsprint.data.preprocess.progressive import train_schedule
from torchsprint.errors import UsageError

# Files are decoded up front for the memory backend only up to this many (about a minute of decoding
# on 2 CPU cores at ~500 images/s per core, measured in BENCHMARKS.md "Data loading"); more stream.
MEMORY_MAX_FILES = 50_000
HEADER_BYTES = 64 * 1024  # enough of a file for its size (the JPEG frame header follows EXIF/ICC segments)


def build_loaders(data_cfg, rt, *, seed: int, channels_last: bool = False, dtype: torch.dtype = torch.float32,
                  allowed: tuple[str, ...] | None = None, split: str = "val", splits: Splits | None = None,
                  epochs: int = 1, keep_backend: str | None = None) -> Loaders:
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
    The chosen backend and why, and the facts of the data, are in `Loaders.info` (backend, backend_why, facts,
    backend_measured).
    """
    check_data_fields(data_cfg)
    schedule = train_schedule(data_cfg)  # data.progressive against the training spec, before any data is read
    splits = splits if splits is not None else DATASETS.get(data_cfg.dataset)(data_cfg)
    if data_cfg.decoder != "auto" and not hasattr(splits.train, "samples") and not getattr(splits.train, "streaming", False):
        raise UsageError(f"data.decoder={data_cfg.decoder}: data.dataset={data_cfg.dataset} is already decoded in memory, "
                         "so no decoder runs; remove data.decoder.")
    for where, spec in (("data.train.transforms", data_cfg.train.transforms), ("data.eval.transforms", data_cfg.eval.transforms)):
        for step in spec:
            name = step if isinstance(step, str) else next(iter(step), None) if isinstance(step, dict) else None
            if name in splits.label_changing:
                raise UsageError(f"{where}: {name} on data.dataset={data_cfg.dataset} {splits.label_changing[name]}; remove it.")
    if len(splits.train) == 0:
        raise UsageError(f"dataset '{data_cfg.dataset}' has no training samples (root={data_cfg.root}).")
    if split == "test":
        if splits.test is None:
            raise UsageError(f"data.dataset={data_cfg.dataset} (root={data_cfg.root}) has no test split; image_folder "
                             "reads one from a test/ folder beside train/. Evaluate --split val, or add test/.")
        splits = replace(splits, val=splits.test)
    elif split != "val":
        raise UsageError(f"--split {split}: choose val or test.")
    if data_cfg.sampler == "balanced":
        splits = replace(splits, train_weights=balanced_train_weights(data_cfg, splits))
    kw = dict(seed=seed, channels_last=channels_last, dtype=dtype)
    configured = data_cfg.backend
    name, why = configured, "set in the config (data.backend)"
    measured: dict = {}
    if name == "auto" and keep_backend is not None:
        name, why = keep_backend, "data.backend=auto: the backend this run chose when it started (decisions.json), kept " \
                                  "so that the resumed run augments as it began"
    elif name == "auto":
        name, why, measured = choose_backend(data_cfg, splits, rt, allowed, epochs=epochs, kw=kw)
    elif name == "memory":
        check_memory_size(data_cfg, splits, rt.device)  # auto checked it already
    backend, fallback = as_backend(LOADERS.get(name)), None
    why_not = backend.cannot_run(rt)
    if why_not is not None:  # the one place a backend falls back (or is refused), whatever the backend
        if data_cfg.fallback is None:
            raise UsageError(f"data.backend={name} cannot run here ({why_not}). Set data.backend=cpu, or "
                             f"data.fallback=cpu to use the cpu backend wherever {name} cannot run.")
        warnings.warn(f"data.backend={name} cannot run ({why_not}); using data.fallback={data_cfg.fallback}.", stacklevel=2)
        fallback = why_not
        why = f"data.fallback={data_cfg.fallback}: data.backend={name} cannot run here ({why_not})"
        name = data_cfg.fallback
        backend = as_backend(LOADERS.get(name))
        if (also := backend.cannot_run(rt)) is not None:
            raise UsageError(f"data.fallback={name} cannot run here either ({also}). Set data.fallback=cpu.")
    if schedule is not None and not backend.progressive:
        able = [n for n in LOADERS.names() if as_backend(LOADERS.get(n)).progressive]
        raise UsageError(f"data.progressive: data.backend={name} does not resize its crop per epoch (backends that do: "
                         f"{', '.join(able)}). Set data.backend to one of them, or remove data.progressive.")
    loaders = backend(data_cfg.model_copy(update={"backend": name}), splits, rt, **kw)
    info = loaders.info
    # Recorded once, here: every writer (decisions.json, the start-up summary, data check, the engine's hint) reads it.
    info.backend, info.backend_why, info.backend_config, info.fallback = name, why, configured, fallback or ""
    info.backend_measured = measured
    loaders.info.facts = describe_data(splits)
    return splits.wrap(loaders)


def balanced_train_weights(data_cfg, splits: Splits) -> torch.Tensor:
    """data.sampler=balanced: per-sample weights 1 / class count, from the training split's class-index labels."""
    labels = None if getattr(splits.train, "streaming", False) else _labels(splits.train)
    if labels is None:
        raise UsageError(f"data.sampler=balanced draws samples by their class, but data.dataset={data_cfg.dataset} has no "
                         "per-sample class labels to draw from (streamed shards, or targets that are not one class per "
                         "image). Remove data.sampler, or use an indexed dataset (image_folder, file_list).")
    if data_cfg.repeated_aug > 1:
        raise UsageError(f"data.sampler=balanced with data.repeated_aug={data_cfg.repeated_aug}: both choose which samples "
                         "an epoch reads; use one of them.")
    return balanced_weights(labels, len(splits.classes))


def check_data_fields(data_cfg) -> None:
    """Refuse backend-specific settings the chosen backend would ignore (non-default values only)."""
    if data_cfg.cpu_fraction != 0.0 and data_cfg.backend != "gpu":
        raise UsageError(f"data.cpu_fraction={data_cfg.cpu_fraction} splits a batch between CPU and GPU decoding in the "
                         f"gpu backend; data.backend={data_cfg.backend} does not use it. Remove it, or set data.backend=gpu.")
    if data_cfg.fallback is not None and (data_cfg.backend == "auto"
                                          or as_backend(LOADERS.get(data_cfg.backend)).cannot_run is runs_anywhere):
        raise UsageError(f"data.fallback={data_cfg.fallback} replaces a backend where it cannot run (gpu and dali need "
                         f"CUDA); data.backend={data_cfg.backend} always runs. Remove data.fallback.")
    if data_cfg.num_workers == 0 and data_cfg.prefetch_factor != 2:
        raise UsageError(f"data.prefetch_factor={data_cfg.prefetch_factor} is per worker process, and data.num_workers=0 "
                         "loads in the main process. Set data.num_workers too, or remove data.prefetch_factor.")


# ---------------------------------------------------------------- data.backend: auto


def _batched_spec_problem(data_cfg, channels: int, backend: str) -> str | None:
    from torchsprint.data.preprocess.augment import compile_batch_spec

    try:
        for where, split in (("data.train.transforms", data_cfg.train), ("data.eval.transforms", data_cfg.eval)):
            compile_batch_spec(split.transforms, where, channels, backend)
    except UsageError as e:
        return str(e)
    return None


def file_size(path: str) -> tuple[int, int] | None:
    """(height, width) of an image file as decoded upright, from its header; None when unknown. Reads the
    first 4 KiB, and up to HEADER_BYTES only when a JPEG's frame header comes later (after a large EXIF
    thumbnail or ICC profile)."""
    from torchsprint.data.preprocess.decode import BadImage, read_header

    try:
        with open(path, "rb") as f:
            head = f.read(4096)
            try:
                h = read_header(head)
            except BadImage:
                h = read_header(head + f.read(HEADER_BYTES - len(head)))
    except (OSError, BadImage):
        return None
    if h.height is None:
        return None
    return (h.width, h.height) if h.orientation in (5, 6, 7, 8) else (h.height, h.width)


def file_sizes(paths: list[str], stop_at_distinct: int | None = None) -> list[tuple[int, int] | None]:
    """file_size of each path; with `stop_at_distinct`, stops once that many distinct sizes (or one unknown)
    were seen (enough to know a folder is not of one size)."""
    out, seen = [], set()
    for p in paths:
        size = file_size(p)
        out.append(size)
        seen.add(size)
        if stop_at_distinct is not None and (None in seen or len(seen) >= stop_at_distinct):
            break
    return out


def decoded_size(splits: Splits) -> tuple[int | None, str]:
    """(bytes of the train and val splits decoded, in words what they are), or (None, why it is not known
    up front). A dataset held decoded (digits, CIFAR) is measured; a folder of at most MEMORY_MAX_FILES
    images of one size is estimated from the file headers; other datasets are not known before decoding."""
    train, val = splits.train, splits.val
    if hasattr(train, "images"):
        nbytes = sum(int(d.images.numel()) * d.images.element_size() for d in (train, val) if hasattr(d, "images"))
        return nbytes, f"the dataset is decoded in memory already ({len(train) + len(val):,} images,"
    if not (_plain_image_files(train) and _plain_image_files(val)):
        return None, "this dataset type is not decoded up front"
    n = len(train) + len(val)
    if n > MEMORY_MAX_FILES:
        return None, f"{n:,} files > {MEMORY_MAX_FILES:,} would take long to decode up front"
    sizes = file_sizes([s[0] for s in train.samples] + [s[0] for s in val.samples], stop_at_distinct=2)
    distinct = set(sizes)
    if None in distinct:
        return None, "some file sizes are unknown (not JPEG/PNG, or unreadable)"
    if len(distinct) != 1:
        return None, "the images have different sizes"
    (h, w), = distinct
    return n * h * w * splits.in_channels, f"{n:,} files of one size ({w}x{h}) decode to"


def check_memory_size(data_cfg, splits: Splits, device: torch.device) -> None:
    """data.backend=memory: refuse, before decoding anything, a dataset whose decoded size is known to exceed
    the memory budget (auto's limit). Sizes not known up front are guarded while decoding (backends/memory.py)."""
    train = splits.train
    if hasattr(train, "images"):
        nbytes, _ = decoded_size(splits)
    elif _plain_image_files(train) and _plain_image_files(splits.val):
        # The first file's size: the memory backend keeps images of one size only, so this is the size it needs.
        first = next((s for s in file_sizes([train.samples[0][0]]) if s is not None), None)
        nbytes = None if first is None else (len(train) + len(splits.val)) * first[0] * first[1] * splits.in_channels
    else:
        nbytes = None
    budget, budget_text = memory_budget(device, data_cfg.memory_budget_gib)
    if nbytes is not None and nbytes > budget:
        raise UsageError(f"data.backend=memory: the decoded dataset would take about {size_text(nbytes)}, over the "
                         f"{size_text(budget)} it may use ({budget_text}). Use data.backend=cpu (it loads batch by "
                         "batch), or raise data.memory_budget_gib.")


# data.backend=auto's order of preference among the backends registered with auto=True where nothing is measured
# (a dataset already decoded in memory); a backend registered later with auto=True is considered after these.
AUTO_ORDER = ("memory", "gpu", "cpu")

# data.backend=auto on image files measures its candidates on the user's own files, in this process, within a bound:
MEASURE_SECONDS = 1.0  # each candidate's timed batches stop once this has passed (plus the batch under way)
MEASURE_FILES = 64  # files sampled (evenly through the training split), fewer for slow files: see measure_backends
MEASURE_BATCH = 32  # the measuring batch size at most (data.batch_size when smaller)
MEMORY_MARGIN = 0.10  # the memory backend must save this share of the cpu backend's estimated loading time: it also
# holds the decoded images (its peak memory was 1.7x the cpu backend's on issue 31's photos), so a near tie streams


def choose_backend(data_cfg, splits: Splits, rt, allowed: tuple[str, ...] | None, *, epochs: int = 1,
                   kw: dict | None = None) -> tuple[str, str, dict]:
    """data.backend=auto: (backend, why, measured figures). Among the backends registered with auto=True that the task
    supports (`allowed`) and that can run here:

    1. memory is a candidate when the decoded dataset fits core.memory_budget (data.memory_budget_gib, else
       MEMORY_SHARE_RAM of RAM or MEMORY_SHARE_GPU of the GPU) and the preprocessing runs in batched ops: a
       dataset already decoded in memory (digits, CIFAR), or a folder of at most MEMORY_MAX_FILES images of one size;
    2. gpu is a candidate for JPEG files on CUDA (nvJPEG decoding, augmentation on the GPU);
    3. cpu always (it decodes and augments every epoch).
    Only one candidate: it runs. A dataset already decoded in memory: memory (a cost model, nothing to measure: no
    decode either way, and a batch is one gather plus batched ops instead of a Python call per sample; 1.54x the
    cpu backend on the default run, BENCHMARKS.md). Image files: the candidates are measured on the user's files
    and machine (measure_backends, within MEASURE_SECONDS each) and the one with the least estimated loading time
    over `epochs` epochs wins:

        cpu, gpu:  epochs x (train + val images) / images_per_s
        memory:    (train + val images) / decode_images_per_s   (the up-front decode, data.num_workers in parallel)
                   + epochs x (train + val images) / images_per_s
    memory must beat the best other candidate by MEMORY_MARGIN (it also holds every decoded image in memory).
    With data.num_workers > 0 on CUDA the cpu backend's rate is multiplied by the workers (they run beside the
    GPU); on a CPU device it is not (the workers take the cores the model trains on).
    """
    device = rt.device
    candidates = [n for n in AUTO_ORDER if n in LOADERS and as_backend(LOADERS.get(n)).auto]
    candidates += [n for n in LOADERS.names() if n not in candidates and as_backend(LOADERS.get(n)).auto]
    ok = [n for n in candidates if allowed is None or n in allowed]
    if not ok:
        raise UsageError(f"data.backend=auto: none of {', '.join(candidates)} serves this task (it supports {allowed}); "
                         "set data.backend.")
    fallback = "cpu" if "cpu" in ok else ok[-1]
    budget, budget_text = memory_budget(device, data_cfg.memory_budget_gib)
    reasons, runnable, memory_why = [], [fallback], None
    train = splits.train
    if "memory" in ok:
        problem = _batched_spec_problem(data_cfg, splits.in_channels, "memory")
        nbytes, what = (None, None) if problem is not None else decoded_size(splits)
        if problem is not None:
            reasons.append(f"memory: the preprocessing has a step batched ops lack ({problem.split(':')[0]})")
        elif nbytes is None:
            reasons.append(f"memory: {what}")
        elif nbytes <= budget:
            how = ("batches are gathered and augmented in batches" if hasattr(train, "images") else
                   "decoded once at start, then batches come from memory with batched augmentation")
            close = ")" if hasattr(train, "images") else ""  # closes decoded_size's "(N images," of a held dataset
            memory_why = f"{what} {size_text(nbytes)} <= {budget_text}{close}: {how} on {device.type}"
            if hasattr(train, "images"):
                return "memory", memory_why, {}
            runnable.append("memory")
        else:
            reasons.append(f"memory: {'decoded ' if not hasattr(train, 'images') else ''}{size_text(nbytes)} > {budget_text}")
    if "gpu" in ok:
        if (why_not := as_backend(LOADERS.get("gpu")).cannot_run(rt)) is not None:
            reasons.append(f"gpu: {why_not}")
        elif not _plain_image_files(train):
            reasons.append("gpu: not a dataset of image files")
        elif (problem := _batched_spec_problem(data_cfg, splits.in_channels, "gpu")) is not None:
            reasons.append(f"gpu: {problem.split(':')[0]}")
        else:
            paths = [s[0] for s in train.samples[:: max(1, len(train) // 64)]][:64]
            jpeg = sum(p.lower().endswith((".jpg", ".jpeg")) for p in paths)
            if jpeg * 2 >= len(paths):
                runnable.append("gpu")
            else:
                reasons.append(f"gpu: only {jpeg} of {len(paths)} sampled files are JPEGs")
    runnable = list(dict.fromkeys(runnable))
    if len(runnable) == 1:
        return fallback, "; ".join(reasons) or "the only backend for this task", {}
    from torchsprint.collectives import broadcast_object

    # Rank 0 measures, every rank takes its figures: all ranks must run the same backend.
    measured = broadcast_object(measure_backends(runnable, data_cfg, splits, rt, kw or {}) if rt.is_main else None, rt)
    n = len(splits.train) + len(splits.val)
    workers = max(1, data_cfg.num_workers)
    for name, m in measured["backends"].items():
        rate = m["images_per_s"] * (workers if name == "cpu" and device.type == "cuda" and data_cfg.num_workers else 1)
        m["estimate_s"] = epochs * n / rate + (n / (m["decode_images_per_s"] * workers) if name == "memory" else 0.0)
    est = {name: m["estimate_s"] for name, m in measured["backends"].items()}
    best_other = min((v, k) for k, v in est.items() if k != "memory")
    pick = "memory" if "memory" in est and est["memory"] < (1 - MEMORY_MARGIN) * best_other[0] else best_other[1]
    figures = "; ".join(
        f"{k} {m['images_per_s']:.0f} img/s" + (f" after decoding at {m['decode_images_per_s']:.0f} img/s up front"
                                               if k == "memory" else "") + f": ~{_duration(m['estimate_s'])}"
        for k, m in measured["backends"].items())
    why = (f"measured on {measured['files']} of the training files, {measured['clock']} ({figures} for {epochs} "
           f"epoch(s) of {n:,} images)")
    if pick != "memory" and "memory" in est:
        why += f"; memory would need to save {MEMORY_MARGIN:.0%} over {best_other[1]} for its up-front decode and memory"
    elif pick == "memory":
        why += f"; {memory_why}"
    measured |= {"epochs": epochs, "images": n, "chosen": pick}
    return pick, "; ".join([why] + reasons), measured


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def measure_backends(names: list[str], data_cfg, splits: Splits, rt, kw: dict) -> dict:
    """Each backend of `names` on a sample of the training files, in this process: {"files", "batch_size", "seconds",
    "clock", "backends": {name: {"images_per_s", "images", and for memory "decode_images_per_s"}}}.

    The sample: MEASURE_FILES files evenly through the training split, fewer when a file takes long to decode (as
    many as two decodes' timing says fit in MEASURE_SECONDS, at least 8). Each backend is built on that sample with
    data.num_workers=0 (building the memory backend decodes the sample: its decode rate);
    after one untimed batch each, the backends' training batches are timed in turn (one batch of each, again,
    so that a change in the machine's load falls on all of them; passes over the sample in new epochs' orders,
    at most 4) until each has MEASURE_SECONDS (or, on a busy machine, 3x that in wall-clock time in all). The clock: on a CPU device the CPU time of this process (all its threads: the
    work each backend does per image, whatever else runs on a shared machine); on CUDA the wall clock, with a
    sync per batch. Bound: the probe, each build (the memory backend's decode of the sample, about MEASURE_SECONDS),
    one untimed batch each and MEASURE_SECONDS each: about 3 x MEASURE_SECONDS per backend on any files.
    """
    import time

    from torchsprint.data.sources.folders import ImageFiles

    cuda = rt.device.type == "cuda"
    now = time.perf_counter if cuda else time.process_time
    t_all = time.perf_counter()
    train = splits.train
    train[0]  # untimed: the decoder's first call sets itself up (imports, tables)
    t0 = now()
    for i in (len(train) // 3, 2 * len(train) // 3):
        train[i]
    per_file = (now() - t0) / 2
    count = int(min(MEASURE_FILES, len(train), max(8, MEASURE_SECONDS / max(per_file, 1e-9))))
    sample = [train.samples[i * len(train) // count] for i in range(count)]
    files = ImageFiles(sample, train.mode, decoder=train.decoder, max_pixels=train.max_pixels)
    # The sample trains; one file stands for the validation split (the memory backend decodes both when built).
    sub = replace(splits, train=files, val=ImageFiles(sample[:1], train.mode, decoder=train.decoder,
                                                      max_pixels=train.max_pixels), test=None, train_weights=None)
    batch = max(1, min(data_cfg.batch_size, MEASURE_BATCH, count // 3))
    cfg = data_cfg.model_copy(update={"num_workers": 0, "batch_size": batch, "sampler": "shuffle", "repeated_aug": 1,
                                      "drop_last": True, "prefetch_factor": 2})
    one = replace(rt, rank=0, world_size=1)  # the sample is not sharded: every rank takes rank 0's figures
    out, its, train_loaders = {}, {}, {}
    for name in names:
        t0 = now()
        loaders = LOADERS.get(name)(cfg.model_copy(update={"backend": name}), sub, one, **kw)
        built = now() - t0
        loaders.train.set_epoch(0)
        train_loaders[name] = loaders.train
        its[name] = iter(loaders.train)
        t0 = now()
        first = next(its[name])  # untimed: the first batch pays one-time costs (allocations, set-ups) ...
        out[name] = {"images_per_s": 0.0, "images": 0, "seconds": 0.0, "first": (first[0].shape[0], now() - t0)}
        if name == "memory":  # the build decoded the sample and the one validation file
            out[name]["decode_images_per_s"] = (count + 1) / max(built, 1e-9)
    active, t_timed = list(names), time.perf_counter()
    while active and time.perf_counter() - t_timed < 3 * MEASURE_SECONDS * len(names):  # a wall-clock bound too
        for name in list(active):
            m = out[name]
            t0 = now()
            x = next(its[name], None)
            if x is None and m["images"] < 4 * count:  # the sample is spent: another pass (a new epoch's order)
                train_loaders[name].set_epoch(m["images"] // count + 1)
                its[name] = iter(train_loaders[name])
                x = next(its[name], None)
            if x is not None and cuda:
                torch.cuda.synchronize(rt.device)
            if x is None:
                active.remove(name)
                continue
            m["seconds"] += now() - t0
            m["images"] += x[0].shape[0]
            if m["seconds"] >= MEASURE_SECONDS:
                active.remove(name)
    for m in out.values():
        first = m.pop("first")
        if not m["images"]:  # ... unless the sample held one batch only (a tiny training split)
            m["images"], m["seconds"] = first
        m["images_per_s"] = m["images"] / max(m.pop("seconds"), 1e-9)
    its.clear()
    train_loaders.clear()
    return {"files": count, "batch_size": batch, "seconds": time.perf_counter() - t_all,
            "clock": "wall clock" if cuda else "CPU time of this process", "backends": out}


def _plain_image_files(ds) -> bool:
    from torchsprint.data.sources.folders import ImageFiles

    return isinstance(ds, ImageFiles) and len(ds) > 0


# ---------------------------------------------------------------- what the data is


def describe_data(splits: Splits, sample: int = 32) -> dict:
    """Facts for the start-up summary: where the splits come from, counts, class balance, image sizes, and
    for image files which library decodes each format, the colour modes sampled, and what was left out."""
    facts: dict = {"source": splits.source, "classes": len(splits.classes), "class_names": list(splits.classes[:8]),
                   "images": {"train": len(splits.train), "val": len(splits.val)},
                   "decoder": getattr(splits.train, "decoder", None)}  # None: stored decoded (digits, CIFAR)
    if splits.test is not None:
        facts["images"]["test"] = len(splits.test)
    labels = _labels(splits.train)
    if labels is not None and len(splits.classes) > 1:
        counts = torch.bincount(labels, minlength=len(splits.classes)).tolist()
        lo, hi = min(range(len(counts)), key=counts.__getitem__), max(range(len(counts)), key=counts.__getitem__)
        facts["class_counts"] = {"smallest": [splits.classes[lo], counts[lo]], "largest": [splits.classes[hi], counts[hi]],
                                 "per_class": counts}  # in class order: loss.class_weights=auto reads them
    if hasattr(splits.train, "images"):
        facts["image_size"] = {"min": list(splits.train.images.shape[-2:]), "max": list(splits.train.images.shape[-2:]),
                               "sampled": len(splits.train)}
    elif _plain_image_files(splits.train):
        idx = range(0, len(splits.train), max(1, len(splits.train) // sample))
        paths = [splits.train.samples[i][0] for i in idx][:sample]
        sizes = [s for s in file_sizes(paths) if s is not None]
        if sizes:
            facts["image_size"] = {"min": [min(h for h, _ in sizes), min(w for _, w in sizes)],
                                   "max": [max(h for h, _ in sizes), max(w for _, w in sizes)], "sampled": len(sizes)}
        facts["decoders"] = decoders_by_format(splits, facts["decoder"])
        facts["modes"] = sampled_modes(paths)
        facts["channels"] = splits.train.channels
    if splits.skipped:
        facts["skipped"] = {why: {"count": len(paths), "examples": [os.path.basename(p) for p in paths[:3]]}
                            for why, paths in splits.skipped.items()}
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

    modes: Counter = Counter()
    for p in paths:
        try:
            with Image.open(p) as im:
                modes[im.mode] += 1
        except Exception:  # noqa: BLE001 - an unreadable file is the loader's to report (data.on_bad_sample)
            modes["unreadable"] += 1
    return dict(modes.most_common())


# What decoding does to each Pillow mode (decode.to_uint8_channels and _pil), by the channels the dataset reads.
_MODE_READ = {
    3: {"L": "grey repeated to 3 channels", "LA": "grey repeated to 3 channels, alpha dropped", "RGBA": "alpha dropped",
        "P": "palette expanded to RGB", "PA": "palette expanded to RGB, alpha dropped",
        "I;16": "16-bit: the top 8 bits kept, grey repeated to 3 channels", "I": "16/32-bit: the top 8 bits kept, grey "
        "repeated to 3 channels", "CMYK": "converted to RGB", "1": "black and white repeated to 3 channels"},
    1: {"RGB": "converted to grey (ITU-R 601 luma)", "RGBA": "alpha dropped, converted to grey", "P": "palette "
        "expanded, converted to grey", "I;16": "16-bit: the top 8 bits kept", "I": "16/32-bit: the top 8 bits kept",
        "LA": "alpha dropped", "CMYK": "converted to grey"},
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

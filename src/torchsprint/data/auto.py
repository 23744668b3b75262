"""data.backend=auto: the candidates that can run, their measurement on the user's files, the rule and its figures;
and the decoded size of a dataset (the memory backend's budget check).

data/build.py's `build_loaders` calls `choose_backend` and records what it returns.
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import replace

import torch

from torchsprint.data.core import LOADERS, Splits, as_backend, memory_budget, size_text
from torchsprint.errors import UsageError
from torchsprint.runtime.measurements import recall, remember

# Files are decoded up front for the memory backend only up to this many (about a minute of decoding
# on 2 CPU cores at ~500 images/s per core, measured in BENCHMARKS.md "Data loading"); more stream.
MEMORY_MAX_FILES = 50_000
HEADER_BYTES = 64 * 1024  # enough of a file for its size (the JPEG frame header follows EXIF/ICC segments)


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
    from torchsprint.runtime.files import open_regular

    try:
        with open_regular(path) as f:  # a FIFO would block open(), a device never end
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
    if hasattr(train, "shapes") and hasattr(val, "shapes"):  # read from the decoded-image cache: its index knows
        # one size per split (the memory backend holds a tensor per split; the eval resize makes val's own size)
        if len(train.shapes()) != 1 or len(val.shapes()) > 1:
            return None, "the cached images of a split have different sizes"
        ((c, h, w),) = train.shapes()
        n = len(train) + len(val)
        return train.nbytes() + val.nbytes(), f"{n:,} cached images of one size a split ({w}x{h} for training) take"
    if not (plain_image_files(train) and plain_image_files(val)):
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
    ((h, w),) = distinct
    return n * h * w * splits.in_channels, f"{n:,} files of one size ({w}x{h}) decode to"


def check_memory_size(data_cfg, splits: Splits, device: torch.device) -> None:
    """data.backend=memory: refuse, before decoding anything, a dataset whose decoded size is known to exceed
    the memory budget (auto's limit). Sizes not known up front are guarded while decoding (backends/memory.py)."""
    train = splits.train
    if hasattr(train, "images"):
        nbytes, _ = decoded_size(splits)
    elif hasattr(train, "nbytes") and hasattr(splits.val, "nbytes"):  # the decoded-image cache's index knows them
        nbytes = train.nbytes() + splits.val.nbytes()
    elif plain_image_files(train) and plain_image_files(splits.val):
        # The first file's size: the memory backend keeps images of one size only, so this is the size it needs.
        first = next((s for s in file_sizes([train.samples[0][0]]) if s is not None), None)
        nbytes = None if first is None else (len(train) + len(splits.val)) * first[0] * first[1] * splits.in_channels
    else:
        nbytes = None
    budget, budget_text = memory_budget(device, data_cfg.memory_budget_gib)
    if nbytes is not None and nbytes > budget:
        raise UsageError(
            f"data.backend=memory: the decoded dataset would take about {size_text(nbytes)}, over the "
            f"{size_text(budget)} it may use ({budget_text}). Use data.backend=cpu (it loads batch by "
            "batch), or raise data.memory_budget_gib."
        )


# data.backend=auto's order of preference among the backends registered with auto=True where nothing is measured
# (a dataset already decoded in memory); a backend registered later with auto=True is considered after these.
AUTO_ORDER = ("memory", "gpu", "cpu")

# data.backend=auto on image files measures its candidates on the user's own files, in this process, within a bound:
MEASURE_SECONDS = 1.0  # each candidate's timed batches stop once this has passed (plus the batch under way)
MEASURE_FILES = 256  # files sampled (evenly through the training split) at most, fewer for slow files, but at least
# MEASURE_BATCHES of the run's batch size: see measure_backends
MEASURE_BATCHES = 2  # the sample holds at least this many batches of data.batch_size (when the split has them): a
# backend's cost per image depends on the batch size (the memory backend's batched ops have a cost per batch; with the
# wall clock, a user's folder of grey PNGs read memory 176 -> 486 img/s: BENCHMARKS.md, "data.backend auto ...
# re-measured")
MEMORY_MARGIN = 0.10  # the memory backend must save this share of the cpu backend's estimated loading time: it also
# holds the decoded images (its peak memory was 1.7x the cpu backend's on a user's photos), so a near tie streams


def choose_backend(
    data_cfg, splits: Splits, rt, allowed: tuple[str, ...] | None, *, epochs: int = 1, kw: dict | None = None
) -> tuple[str, str, dict]:
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
    ok = auto_candidates(allowed)
    fallback = "cpu" if "cpu" in ok else ok[-1]
    reasons, runnable, memory_why = [], [fallback], None
    if "memory" in ok and (memory_why := memory_fits(data_cfg, splits, rt.device, reasons)) is not None:
        if hasattr(splits.train, "images"):
            return "memory", memory_why, {}
        runnable.append("memory")
    if "gpu" in ok and gpu_suits(data_cfg, splits, rt, reasons):
        runnable.append("gpu")
    runnable = list(dict.fromkeys(runnable))
    if len(runnable) == 1:
        return fallback, "; ".join(reasons) or "the only backend for this task", {}
    from torchsprint.runtime.collectives import broadcast_object

    # Rank 0 measures (or reads what this machine measured before), every rank takes its figures: all ranks must
    # run the same backend.
    measured = broadcast_object(measured_once(runnable, data_cfg, splits, rt, kw or {}) if rt.is_main else None, rt)
    pick, why = pick_measured(measured, data_cfg, splits, rt.device, epochs, memory_why)
    return pick, "; ".join([why] + reasons), measured


def measured_once(names: list[str], data_cfg, splits: Splits, rt, kw: dict) -> dict:
    """measure_backends' figures, measured once per machine (runtime/measurements.py: the CPU, its flags, the threads
    and torch) and per data set (its files' paths, count and total size), transforms, batch, workers and candidates:
    a later run with the same keys reads them ("measured before") instead of measuring again."""
    files = hashlib.sha256()
    total = 0
    for split in (splits.train, splits.val):
        for path, label in getattr(split, "samples", []):
            files.update(f"{path}\0{label}\n".encode())
            try:
                total += os.stat(path).st_size
            except OSError:
                pass
    keys = {
        "candidates": names,
        "files": files.hexdigest()[:24],
        "bytes": total,
        "device": str(rt.device),
        "spec": [data_cfg.train.transforms, data_cfg.eval.transforms],
        "batch": data_cfg.batch_size,
        "workers": data_cfg.num_workers,
        "decoder": data_cfg.decoder,
        "options": data_cfg.options,
        "kw": {k: str(v) for k, v in kw.items()},
    }
    stored = recall("backend_auto", keys)
    if stored is not None:
        return copy.deepcopy(stored["value"]) | {"measured_before": stored["date"]}
    measured = measure_backends(names, data_cfg, splits, rt, kw)
    remember("backend_auto", keys, copy.deepcopy(measured))
    return measured


def auto_candidates(allowed: tuple[str, ...] | None) -> list[str]:
    """The backends registered with auto=True that the task supports, in AUTO_ORDER then registration order."""
    candidates = [n for n in AUTO_ORDER if n in LOADERS and as_backend(LOADERS.get(n)).auto]
    candidates += [n for n in LOADERS.names() if n not in candidates and as_backend(LOADERS.get(n)).auto]
    ok = [n for n in candidates if allowed is None or n in allowed]
    if not ok:
        raise UsageError(
            f"data.backend=auto: none of {', '.join(candidates)} serves this task (it supports {allowed}); "
            "set data.backend."
        )
    return ok


def memory_fits(data_cfg, splits: Splits, device: torch.device, reasons: list[str]) -> str | None:
    """Why the memory backend is a candidate (the decoded size within the budget, batched preprocessing), or None
    with the reason it is not appended to `reasons`."""
    train = splits.train
    budget, budget_text = memory_budget(device, data_cfg.memory_budget_gib)
    problem = _batched_spec_problem(data_cfg, splits.in_channels, "memory")
    nbytes, what = (None, None) if problem is not None else decoded_size(splits)
    if problem is not None:
        reasons.append(f"memory: the preprocessing has a step batched ops lack ({problem.split(':')[0]})")
    elif nbytes is None:
        reasons.append(f"memory: {what}")
    elif nbytes <= budget:
        how = (
            "batches are gathered and augmented in batches"
            if hasattr(train, "images")
            else "decoded once at start, then batches come from memory with batched augmentation"
        )
        close = ")" if hasattr(train, "images") else ""  # closes decoded_size's "(N images," of a held dataset
        return f"{what} {size_text(nbytes)} <= {budget_text}{close}: {how} on {device.type}"
    else:
        reasons.append(
            f"memory: {'decoded ' if not hasattr(train, 'images') else ''}{size_text(nbytes)} > {budget_text}"
        )
    return None


def gpu_suits(data_cfg, splits: Splits, rt, reasons: list[str]) -> bool:
    """Whether the gpu backend is a candidate: it can run here, on image files mostly JPEG (sampled), with batched
    preprocessing; when not, the reason is appended to `reasons`."""
    train = splits.train
    if (why_not := as_backend(LOADERS.get("gpu")).cannot_run(rt)) is not None:
        reasons.append(f"gpu: {why_not}")
    elif not plain_image_files(train):
        reasons.append("gpu: not a dataset of image files")
    elif (problem := _batched_spec_problem(data_cfg, splits.in_channels, "gpu")) is not None:
        reasons.append(f"gpu: {problem.split(':')[0]}")
    else:
        paths = [s[0] for s in train.samples[:: max(1, len(train) // 64)]][:64]
        jpeg = sum(p.lower().endswith((".jpg", ".jpeg")) for p in paths)
        if jpeg * 2 >= len(paths):
            return True
        reasons.append(f"gpu: only {jpeg} of {len(paths)} sampled files are JPEGs")
    return False


def pick_measured(
    measured: dict, data_cfg, splits: Splits, device: torch.device, epochs: int, memory_why: str | None
) -> tuple[str, str]:
    """(backend, why) from measure_backends' figures: each candidate's estimated loading time over `epochs` epochs
    (the rule in choose_backend), added to `measured` with the epochs, images and the choice."""
    n = len(splits.train) + len(splits.val)
    workers = max(1, data_cfg.num_workers)
    for name, m in measured["backends"].items():
        rate = m["images_per_s"] * (workers if name == "cpu" and device.type == "cuda" and data_cfg.num_workers else 1)
        m["estimate_s"] = epochs * n / rate + (n / (m["decode_images_per_s"] * workers) if name == "memory" else 0.0)
    est = {name: m["estimate_s"] for name, m in measured["backends"].items()}
    best_other = min((v, k) for k, v in est.items() if k != "memory")
    pick = "memory" if "memory" in est and est["memory"] < (1 - MEMORY_MARGIN) * best_other[0] else best_other[1]
    figures = "; ".join(
        f"{k} {m['images_per_s']:.0f} img/s"
        + (f" after decoding at {m['decode_images_per_s']:.0f} img/s up front" if k == "memory" else "")
        + f": ~{_duration(m['estimate_s'])}"
        for k, m in measured["backends"].items()
    )
    before = (
        f"measured before, {measured['measured_before']} (on this machine, data and settings), "
        if measured.get("measured_before")
        else "measured "
    )
    why = (
        f"{before}on {measured['files']} of the training files, {measured['clock']} ({figures} for {epochs} "
        f"epoch(s) of {n:,} images)"
    )
    if pick != "memory" and "memory" in est:
        why += (
            f"; memory would need to save {MEMORY_MARGIN:.0%} over {best_other[1]} for its up-front decode and memory"
        )
    elif pick == "memory":
        why += f"; {memory_why}"
    measured |= {"epochs": epochs, "images": n, "chosen": pick}
    return pick, why


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def sample_size(train, batch_size: int, now) -> int:
    """How many training files measure_backends samples: as many as two decodes' timing (on the clock `now`) says fit
    in MEASURE_SECONDS, 8 to MEASURE_FILES, and at least MEASURE_BATCHES batches of `batch_size`; at most the split."""
    train[0]  # untimed: the decoder's first call sets itself up (imports, tables)
    t0 = now()
    for i in (len(train) // 3, 2 * len(train) // 3):
        train[i]
    per_file = (now() - t0) / 2
    by_time = min(MEASURE_FILES, max(8, int(MEASURE_SECONDS / max(per_file, 1e-9))))
    return min(len(train), max(by_time, MEASURE_BATCHES * batch_size))


def measure_backends(names: list[str], data_cfg, splits: Splits, rt, kw: dict) -> dict:
    """Each backend of `names` on a sample of the training files, in this process: {"files", "batch_size", "seconds",
    "clock", "backends": {name: {"images_per_s", "images", and for memory "decode_images_per_s"}}}.

    The sample: sample_size's count of files evenly through the training split; data.batch_size is the measuring
    batch size where the sample holds MEASURE_BATCHES of it (a cost per batch, as of batched ops, weighs as it will
    in the run). Each backend is built on that sample with data.num_workers=0 (building the memory backend decodes
    the sample: its decode rate); after one untimed batch each, the backends' training batches are timed in turn
    (one batch of each, again, so that a change in the machine's load falls on all of them; passes over the sample
    in new epochs' orders, at most 4) until each has MEASURE_SECONDS (or, on a busy machine, 3x that in wall-clock
    time in all).

    The clock is what the run will pay. With data.num_workers=0 (and on CUDA) the batches are made on the training
    thread between steps: the wall clock (a sync per batch on CUDA), which counts a batched op's threads once and a
    slow disk's waits (the CPU time of the process counted the memory backend's two threads twice on a user's
    photos, and a read's wait not at all). With workers on a CPU device the batches are made beside the training
    step on the same cores: the CPU time of this process (the work each backend takes from the model's cores).
    Bound: the probe, each build (the memory backend's decode of the sample), one untimed batch each and
    MEASURE_SECONDS each: about 3 x MEASURE_SECONDS per backend, or two batches of the run's size where those take
    longer.
    """
    import time

    cuda = rt.device.type == "cuda"
    wall = cuda or data_cfg.num_workers == 0
    now = time.perf_counter if wall else time.process_time
    t_all = time.perf_counter()
    train = splits.train
    count = sample_size(train, data_cfg.batch_size, now)
    sub = measuring_sample(splits, count)
    batch = max(1, min(data_cfg.batch_size, count // MEASURE_BATCHES))  # the run's batch size where the split allows
    cfg = data_cfg.model_copy(
        update={
            "num_workers": 0,
            "batch_size": batch,
            "sampler": "shuffle",
            "repeated_aug": 1,
            "drop_last": True,
            "prefetch_factor": 2,
        }
    )
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
    return {
        "files": count,
        "batch_size": batch,
        "seconds": time.perf_counter() - t_all,
        "clock": "wall clock" if wall else "CPU time of this process",
        "backends": out,
    }


def measuring_sample(splits: Splits, count: int) -> Splits:
    """`count` training files evenly through the split, as the run reads them (from the decoded-image cache where
    the run does); one file stands for the validation split (the memory backend decodes both when built)."""
    from torchsprint.data.sources.folders import ImageFiles

    train = splits.train
    picked = [i * len(train) // count for i in range(count)]
    if hasattr(train, "subset"):  # read from the decoded-image cache: measured as the run will read it
        files, one_file = train.subset(picked), train.subset(picked[:1])
    else:
        sample = [train.samples[i] for i in picked]
        files = ImageFiles(sample, train.mode, decoder=train.decoder, max_pixels=train.max_pixels)
        one_file = ImageFiles(sample[:1], train.mode, decoder=train.decoder, max_pixels=train.max_pixels)
    return replace(splits, train=files, val=one_file, test=None, train_weights=None)


def plain_image_files(ds) -> bool:
    """Whether `ds` is a non-empty data set of image files (sources.folders.ImageFiles)."""
    from torchsprint.data.sources.folders import ImageFiles

    return isinstance(ds, ImageFiles) and len(ds) > 0

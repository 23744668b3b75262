"""Input-pipeline throughput: decode + RandomResizedCrop(224) + flip + normalize on ~500x375 JPEGs.

Compares torchsprint's loader backends against the naive baseline of the seeds (PIL `Image.open` +
torchvision transforms + ToTensor + Normalize in a DataLoader with the same number of workers), and
times the candidate JPEG decoders one image at a time on one thread.

    .venv/bin/python -m benchmarks.data.data_throughput --images 512 --workers 2 --repeats 3

On a GPU (`--device cuda`) it measures the loader backends that feed the GPU instead (the GPU job's M2):
the cpu backend with --workers workers (and per core, by CPU time), the gpu backend with
cpu_fraction 0 and auto, and DALI when it is installed; `--json` writes the figures.

    python -m benchmarks.data.data_throughput --device cuda --images 20000 --workers 16 --batch-size 256 --json m2.json

`--transfer` times what crosses the DataLoader's worker queue per batch of 256 JPEGs: one tensor per
file (the gpu backend before) against one flat buffer with offsets (now).

Variants alternate within each repeat (A B C A B C ...) so that load from other processes on a
shared machine hits them alike; the median over repeats is reported with the min-max range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks.common.loader_timing import cpu_backend_parts, cpu_seconds_per_image, time_epoch


def naive_loader(samples, batch_size: int, workers: int):
    """The seeds' loader: PIL decode, PIL-space augmentation, float tensors built in the workers."""
    import torch
    import torchvision.transforms as T
    from PIL import Image

    tf = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )

    class Naive(torch.utils.data.Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            path, label = samples[i]
            return tf(Image.open(path).convert("RGB")), label

    return torch.utils.data.DataLoader(
        Naive(),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        drop_last=True,
    )


def torchsprint_loader(
    root: str, backend: str, decoder: str, batch_size: int, workers: int, n: int, device: str = "cpu", extra: tuple = ()
):
    import torch

    from torchsprint import config
    from torchsprint.data import build_loaders
    from torchsprint.runtime.core import Runtime

    cfg = config.load(
        None,
        [
            "data.dataset=synthetic_jpeg",
            f"data.root={root}",
            f"data.options={{num_images: {n}, val_images: 8}}",
            f"data.backend={backend}",
            f"data.decoder={decoder}",
            f"data.batch_size={batch_size}",
            f"data.num_workers={workers}",
            "data.train.transforms=[{random_resized_crop: {size: 224}}, hflip, {normalize: imagenet}]",
            "data.eval.transforms=[{resize: 256}, {center_crop: 224}, {normalize: imagenet}]",
            *extra,
        ],
    )
    loaders = build_loaders(cfg.data, Runtime(torch.device(device)), seed=0)
    return loaders.train


def transfer_micro(paths: list[Path], batch: int = 256, batches: int = 8, workers: int = 2) -> dict:
    """ms per batch through a DataLoader worker queue: `batch` JPEGs as one tensor each (the gpu backend
    before) against one flat uint8 buffer with offsets (now). The bytes are read before the workers
    start (forked copies), so only what crosses the queue differs."""
    import torch

    from torchsprint.data.backends.gpu import pack

    files = (paths * (batch * batches // max(1, len(paths)) + 1))[: batch * batches]
    blobs = [p.read_bytes() for p in files]

    class PerFile(torch.utils.data.Dataset):
        def __len__(self):
            return batches

        def __getitem__(self, b):
            return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in blobs[b * batch : (b + 1) * batch]]

    class Flat(PerFile):
        def __getitem__(self, b):
            return pack(blobs[b * batch : (b + 1) * batch])

    out = {}
    for name, ds in (("one tensor per JPEG", PerFile()), ("one flat buffer + offsets", Flat())):
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        out[name] = (time.perf_counter() - t0) / batches * 1e3
    return out


def gpu_main(args) -> None:
    """The GPU job's M2: the backends that feed a GPU, same JPEGs, same spec, images/s."""
    import torch

    from torchsprint.data.backends.dali import dali_available

    dev = args.device
    variants = {
        f"cpu backend, {args.workers} workers": ("cpu", ()),
        "gpu backend, cpu_fraction 0": ("gpu", ("data.cpu_fraction=0.0",)),
        "gpu backend, cpu_fraction auto": ("gpu", ("data.cpu_fraction=auto",)),
    }
    if dali_available():
        variants["dali backend"] = ("dali", ())
    loaders = {
        name: torchsprint_loader(args.root, backend, "auto", args.batch_size, args.workers, args.images, dev, extra)
        for name, (backend, extra) in variants.items()
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    thread_cpu: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name in variants:
            stats: dict = {}
            results[name].append(time_epoch(loaders[name], r, stats=stats))
            if stats["thread_cpu_ms_per_batch"] is not None:
                thread_cpu[name].append(stats["thread_cpu_ms_per_batch"])
    thread_ms = {name: statistics.median(xs) if xs else None for name, xs in thread_cpu.items()}
    # per core: the same cpu backend's per-image work in this process, normalising on the CPU
    cpu_loader = torchsprint_loader(args.root, "cpu", "auto", args.batch_size, 0, args.images)
    per_core = 1 / statistics.median(cpu_seconds_per_image(cpu_loader, False) for _ in range(args.repeats))
    gpu_name = torch.cuda.get_device_name() if torch.cuda.is_available() else dev
    print(
        f"{args.images} JPEGs 500x375 q90, batch {args.batch_size}, {args.workers} workers, {os.cpu_count()} cores, "
        f"{gpu_name}, torch {torch.__version__} ({time.strftime('%Y-%m-%d %H:%M')})"
    )
    print("| loader | images/s (median) | min-max | training thread's CPU ms per batch (median) |")
    print("|---|---|---|---|")
    rows = {}
    for name, xs in results.items():
        rows[name] = statistics.median(xs)
        ms = "" if thread_ms[name] is None else f"{thread_ms[name]:.2f}"
        print(f"| {name} | {rows[name]:.0f} | {min(xs):.0f}-{max(xs):.0f} | {ms} |")
    print(f"| cpu backend per core (CPU time, one thread) | {per_core:.0f} | | |")
    fallbacks = {name: getattr(loaders[name], "cpu_fallbacks", None) for name in variants}
    final_fraction = {name: getattr(loaders[name], "cpu_fraction", None) for name in variants}
    if not dali_available():
        print("dali backend: not measured, NVIDIA DALI is not installed here")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": gpu_name,
                    "torch": torch.__version__,
                    "images": args.images,
                    "batch_size": args.batch_size,
                    "workers": args.workers,
                    "images_per_s": rows,
                    "cpu_backend_per_core": per_core,
                    "runs": results,
                    "gpu_cpu_fallbacks": fallbacks,
                    "final_cpu_fraction": final_fraction,
                    "thread_cpu_ms_per_batch": thread_ms,
                    "dali": "measured" if dali_available() else "not installed",
                },
                indent=1,
            )
        )


def decoder_micro(paths: list[Path], repeats: int) -> dict:
    """ms per image, one thread, for each decoder (file read included), best of `repeats`."""
    import io

    import numpy as np
    import torch
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    torch.set_num_threads(1)
    blobs = [p.read_bytes() for p in paths[:64]]

    def pil(b):
        return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))

    def pil_draft(b):
        im = Image.open(io.BytesIO(b))
        im.draft("RGB", (224, 224))  # scale chosen so that the result stays >= 224 on both sides
        return np.asarray(im.convert("RGB"))

    variants = {
        "torchvision.io.decode_jpeg": lambda b: decode_jpeg(
            torch.frombuffer(bytearray(b), dtype=torch.uint8), mode=ImageReadMode.RGB
        ),
        "PIL Image.open + convert": pil,
        "PIL + draft(224) (DCT scaling)": pil_draft,
    }
    try:
        import simplejpeg

        variants["simplejpeg"] = lambda b: simplejpeg.decode_jpeg(b)
        variants["simplejpeg min 224 (DCT scaling)"] = lambda b: simplejpeg.decode_jpeg(
            b, min_height=224, min_width=224
        )
    except ImportError:
        pass
    out = {}
    for name, fn in variants.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for b in blobs:
                fn(b)
            best = min(best, (time.perf_counter() - t0) / len(blobs))
        out[name] = best * 1e3
    return out


def stage_breakdown(paths: list[Path], repeats: int, n: int = 192, batch: int = 64) -> dict:
    """CPU ms per image of each step of the per-image path, one thread, this process, best of `repeats`:
    where the time goes in the naive path, in torchvision v2 on uint8 tensors, and in the cpu backend."""
    import torch
    import torchvision.transforms as T
    from PIL import Image
    from torchvision.transforms import v2

    from torchsprint.data.preprocess.decode import decode_bytes
    from torchsprint.data.preprocess.normalize import DeviceNormalize
    from torchsprint.data.preprocess.transforms import compile_spec

    torch.set_num_threads(1)
    paths = paths[:n]
    blobs = [p.read_bytes() for p in paths]
    decoded = [decode_bytes(b, decoder="simplejpeg") for b in blobs]
    pils = [Image.open(p).convert("RGB") for p in paths]
    v2_tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
    fast_tf = compile_spec([{"random_resized_crop": {"size": 224}}, "hflip"], "bench").cpu
    naive_tf = T.Compose(
        [
            T.RandomResizedCrop(224),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    crops = [fast_tf(x) for x in decoded]
    norm = DeviceNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), torch.device("cpu"))
    recycled = DeviceNormalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), torch.device("cpu"), recycle=True)
    batches = [torch.stack(crops[i : i + batch]) for i in range(0, len(crops) - batch + 1, batch)]

    def old_normalize(x):  # before: x.float() and addcmul each allocate a batch of fp32
        return torch.addcmul(norm.shift, x.float(), norm.scale)

    per_image = {
        "naive: PIL Image.open + convert (from file)": lambda i: Image.open(paths[i]).convert("RGB"),
        "naive: RandomResizedCrop + flip + ToTensor + Normalize (PIL)": lambda i: naive_tf(pils[i]),
        "decode: simplejpeg + header sniff (bytes in memory)": lambda i: decode_bytes(blobs[i], decoder="simplejpeg"),
        "seed: torch.manual_seed (before)": lambda i: torch.manual_seed(i),
        "seed: torch.default_generator.manual_seed (now)": lambda i: torch.default_generator.manual_seed(i),
        "RandomResizedCrop(224) + flip: torchvision v2 on uint8 (before)": lambda i: v2_tf(decoded[i]),
        "RandomResizedCrop(224) + flip: torchsprint, same pixels (now)": lambda i: fast_tf(decoded[i]),
    }
    per_batch = {
        f"collate: torch.stack of {batch}": lambda b: torch.stack(crops[b * batch : (b + 1) * batch]),
        "normalize on the CPU: float + addcmul (before)": lambda b: old_normalize(batches[b]),
        "normalize on the CPU: float + in-place addcmul, fresh buffer": lambda b: norm(batches[b]),
        "normalize on the CPU: in-place addcmul, recycled buffer (now)": lambda b: recycled(batches[b]),
    }
    out = {}
    for name, fn in per_image.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            for i in range(len(paths)):
                fn(i)
            best = min(best, (time.process_time() - t0) / len(paths))
        out[name] = best * 1e3
    for name, fn in per_batch.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            for b in range(len(batches)):
                fn(b)
            best = min(best, (time.process_time() - t0) / (len(batches) * batch))
        out[name] = best * 1e3
    return out


class LoadSampler:
    """1-minute load average every `every` seconds in a background thread (this benchmark's own 3
    processes count too: on 2 cores a load near 3 means nobody else was running)."""

    def __init__(self, every: float = 2.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512, help="training JPEGs (500x375, generated once)")
    ap.add_argument("--root", default="/tmp/torchsprint-bench-data", help="where the synthetic JPEGs live")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for every variant")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu: the CPU table below; cuda: the backends that feed a GPU (M2)")
    ap.add_argument("--json", help="write the figures to this JSON file (--device cuda)")
    ap.add_argument("--transfer", action="store_true", help="only the worker-queue transfer comparison")
    args = ap.parse_args()

    import torch

    if args.transfer:
        torchsprint_loader(args.root, "cpu", "auto", args.batch_size, 0, args.images)  # generates the JPEGs once
        paths = sorted(Path(args.root).glob(f"*n{args.images}-*/train/*/*.jpg"))
        print("| per batch of 256 JPEGs through the worker queue | ms |")
        print("|---|---|")
        for name, ms in transfer_micro(paths, workers=args.workers).items():
            print(f"| {name} | {ms:.1f} |")
        return
    if args.device != "cpu":
        gpu_main(args)
        return
    torch.set_num_threads(1)
    variants = {
        "naive: PIL + torchvision transforms (float in workers)": None,
        "cpu backend, decoder=auto": ("cpu", "auto"),
        "cpu backend, decoder=torchvision": ("cpu", "torchvision"),
        "cpu backend, decoder=pil": ("cpu", "pil"),
    }
    loaders = {}
    for name, v in variants.items():
        if v is None:
            continue
        loaders[name] = torchsprint_loader(args.root, v[0], v[1], args.batch_size, args.workers, args.images)
    ds, _, split = cpu_backend_parts(loaders["cpu backend, decoder=auto"])
    samples = ds.raws[split].samples
    loaders["naive: PIL + torchvision transforms (float in workers)"] = naive_loader(
        samples, args.batch_size, args.workers
    )
    results: dict[str, list[float]] = {name: [] for name in variants}
    load_before = os.getloadavg()
    with LoadSampler() as load:
        for r in range(args.repeats):
            for name in variants:
                results[name].append(time_epoch(loaders[name], r))
    cpu_s: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            cpu_s[name].append(cpu_seconds_per_image(loaders[name], name.startswith("naive")))
    base = statistics.median(results["naive: PIL + torchvision transforms (float in workers)"])
    cores = os.cpu_count()
    ls = load.samples or [os.getloadavg()[0]]
    print(
        f"{len(samples)} JPEGs 500x375, batch {args.batch_size}, {args.workers} workers, {cores} cores, "
        f"1-min load average before {load_before[0]:.2f}, during min/median/max "
        f"{min(ls):.2f}/{statistics.median(ls):.2f}/{max(ls):.2f} ({time.strftime('%Y-%m-%d %H:%M')})"
    )
    base_cpu = statistics.median(cpu_s["naive: PIL + torchvision transforms (float in workers)"])
    print(
        "| variant | images/s, 2 workers (median) | min-max | vs naive "
        "| CPU ms per image, 1 thread | images/s per core | vs naive |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, xs in results.items():
        med, c = statistics.median(xs), statistics.median(cpu_s[name])
        print(
            f"| {name} | {med:.0f} | {min(xs):.0f}-{max(xs):.0f} | "
            f"{med / base:.2f}x | {c * 1e3:.2f} | {1 / c:.0f} | {base_cpu / c:.2f}x |"
        )
    print()
    paths = sorted(Path(args.root).glob("*/train/*/*.jpg"))
    print("| step (one thread, 500x375 JPEG, 224 output) | CPU ms per image |")
    print("|---|---|")
    for name, ms in stage_breakdown(paths, args.repeats).items():
        print(f"| {name} | {ms:.3f} |")
    print()
    print("| decoder (one thread, 500x375, file bytes in memory) | ms per image | images/s |")
    print("|---|---|---|")
    for name, ms in decoder_micro(paths, args.repeats).items():
        print(f"| {name} | {ms:.3f} | {1e3 / ms:.0f} |")
    if not torch.cuda.is_available():
        print("\ngpu / dali backends: not measured, this machine has no CUDA device")


if __name__ == "__main__":
    main()

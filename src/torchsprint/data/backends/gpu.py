"""The `gpu` backend: workers read file bytes; nvJPEG decodes batches on the GPU; augmentation runs there.

A share of every batch (`data.cpu_fraction`, the seed's `cpu_percentage`) is decoded and cropped by
the CPU workers instead, so CPU and GPU both work on the input pipeline. Which samples go to the CPU
is decided per batch position (the first round(f * B) samples of the seeded, shuffled batch), and
every sample's random parameters come from its own seed (augment.py), so the split changes who
computes a crop, never which crop. Files nvJPEG cannot take (PNG, CMYK or gray JPEGs) always go to
the CPU share. Bad samples shrink a batch but never remove it: every rank keeps the same step count.
"""

from __future__ import annotations

import time
import warnings

import torch

from torchsprint.data.augment import BatchPipeline, compile_batch_spec
from torchsprint.data.core import LOADERS, DataInfo, EpochSampler, Loaders, prefetch_to_device
from torchsprint.data.decode import BadImage, decode_bytes, read_bytes, read_header
from torchsprint.data.normalize import DeviceNormalize
from torchsprint.errors import UsageError


def cpu_rows(batch: int, fraction: float) -> int:
    """How many leading positions of a batch of `batch` samples the CPU workers take (round half up)."""
    return min(batch, int(fraction * batch + 0.5))


class FractionTuner:
    """`cpu_fraction: auto`: moves the CPU share by `step` every `window` batches from the data wait.

    The loader measures how long it waited for the workers' next batch. Waiting means the CPU
    workers are the bottleneck: give the GPU more (lower the share). No waiting means the workers
    are ahead: give them more, which frees GPU time for the model. Thresholds: a wait above 2 ms
    (about a 2% stall at a 100 ms step) or below 0.2 ms (a ready queue answers in ~0.05 ms).
    """

    def __init__(self, start: float = 0.2, step: float = 0.05, window: int = 8, low: float = 0.0, high: float = 0.9):
        self.fraction, self.step, self.window, self.low, self.high = start, step, window, low, high
        self.waits: list[float] = []

    def update(self, wait_s: float) -> float:
        """Record one batch's wait (seconds); returns the (possibly new) fraction."""
        self.waits.append(wait_s)
        if len(self.waits) >= self.window:
            mean = sum(self.waits) / len(self.waits)
            self.waits.clear()
            if mean > 2e-3:
                self.fraction = max(self.low, self.fraction - self.step)
            elif mean < 2e-4:
                self.fraction = min(self.high, self.fraction + self.step)
        return self.fraction


def nvjpeg_ok(header) -> bool:
    """nvJPEG through torchvision takes 3-component (YCbCr) JPEGs; the rest decode on the CPU."""
    return header.format == "jpeg" and header.components == 3


class BytesBatches(torch.utils.data.Dataset):
    """Worker side: one batch of (index, seed) keys -> bytes for the GPU share, decoded+cropped CPU share.

    `fraction` is a one-element shared-memory tensor, so `cpu_fraction: auto` can move it while
    persistent workers run.
    """

    def __init__(self, raw, pipeline: BatchPipeline, fraction: torch.Tensor, channels: int, on_bad_sample: str,
                 max_pixels: int, decoder: str):
        self.raw, self.pipeline, self.fraction, self.channels = raw, pipeline, fraction, channels
        self.on_bad_sample, self.max_pixels, self.decoder = on_bad_sample, max_pixels, decoder

    def __len__(self) -> int:
        return len(self.raw)

    def _bad(self, source: str, reason) -> str:
        if self.on_bad_sample == "error":
            raise UsageError(f"unreadable sample {source}: {reason}. Fix or remove it, or set data.on_bad_sample=skip.")
        return f"{source}: {reason}"

    def __getitem__(self, keys: list[tuple[int, int]]) -> dict:
        seeds = torch.tensor([s for _, s in keys], dtype=torch.int64)
        u = self.pipeline.draw(seeds)
        n_cpu = cpu_rows(len(keys), float(self.fraction[0]))
        gpu_bytes, gpu_rows, cpu_images, cpu_rows_, skipped = [], [], [], [], []
        targets = []
        for pos, (index, _) in enumerate(keys):
            path, target = self.raw.samples[index]
            targets.append(target)
            try:
                data = read_bytes(path)
                header = read_header(data)
                if pos >= n_cpu and nvjpeg_ok(header):
                    if header.height * header.width > self.max_pixels:
                        raise BadImage(f"{header.width}x{header.height} pixels > data.max_image_pixels={self.max_pixels:,}")
                    gpu_bytes.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    gpu_rows.append(pos)
                    continue
                img = decode_bytes(data, channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels)
            except (BadImage, OSError) as e:
                skipped.append(self._bad(path, e))
                continue
            params = self.pipeline.params(u[pos : pos + 1], torch.tensor([img.shape[1]]), torch.tensor([img.shape[2]]),
                                          0, self.pipeline.head)
            cpu_images.append(self.pipeline.run_head([img], params, [0])[0].contiguous())
            cpu_rows_.append(pos)
        return {"u": u, "targets": torch.tensor(targets, dtype=torch.int64), "gpu_bytes": gpu_bytes,
                "gpu_rows": gpu_rows, "gpu_paths": [self.raw.samples[keys[p][0]][0] for p in gpu_rows],
                "cpu_images": torch.stack(cpu_images) if cpu_images else None, "cpu_rows": cpu_rows_, "skipped": skipped}


def decode_on_device(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Batch-decode JPEG bytes on `device` (nvJPEG on CUDA); a batch with a corrupt file is decoded one
    by one so that only the corrupt ones come back as None."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not data:
        return []
    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        out = []
        for d in data:
            try:
                out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out


class GpuLoader:
    """Main-process side: decode the GPU share, crop it per image, merge with the CPU share in batch
    order, run the batched tail with per-sample parameters, normalise. On CUDA, batch i+1 is prepared
    on a side stream while batch i trains."""

    def __init__(self, loader, batches: torch.utils.data.BatchSampler, pipeline: BatchPipeline, device: torch.device,
                 normalize: DeviceNormalize, fraction: torch.Tensor, tuner: FractionTuner | None, on_bad_sample: str):
        self.loader, self.batches, self.sampler = loader, batches, batches.sampler
        self.pipeline, self.device = pipeline, device
        self.normalize, self.fraction_t, self.tuner, self.on_bad_sample = normalize, fraction, tuner, on_bad_sample
        self.skipped: list[str] = []

    @property
    def cpu_fraction(self) -> float:
        return float(self.fraction_t[0])

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batches.batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def _assemble(self, item: dict):
        p = self.pipeline
        self.skipped += item["skipped"]
        rows = sorted(item["gpu_rows"] + item["cpu_rows"])
        decoded = decode_on_device(item["gpu_bytes"], self.device)
        good_rows, good_imgs = [], []
        for pos, img, path in zip(item["gpu_rows"], decoded, item["gpu_paths"]):
            if img is None:
                if self.on_bad_sample == "error":
                    raise UsageError(f"unreadable sample {path}: corrupt JPEG. Fix or remove it, or set data.on_bad_sample=skip.")
                self.skipped.append(f"{path}: corrupt JPEG (nvJPEG)")
                rows.remove(pos)
                continue
            good_rows.append(pos)
            good_imgs.append(img)
        if not rows:
            raise UsageError(f"every sample of a batch was unreadable, e.g. {self.skipped[-1:]}")
        u = item["u"]
        parts = {}
        if good_imgs:
            hs = torch.tensor([x.shape[1] for x in good_imgs])
            ws = torch.tensor([x.shape[2] for x in good_imgs])
            params = p.params(u[good_rows], hs, ws, 0, p.head)
            for pos, img in zip(good_rows, p.run_head(good_imgs, params, list(range(len(good_imgs))))):
                parts[pos] = img
        if item["cpu_images"] is not None:
            cpu = item["cpu_images"].to(self.device, non_blocking=True)
            for j, pos in enumerate(item["cpu_rows"]):
                parts[pos] = cpu[j]
        shapes = {tuple(x.shape) for x in parts.values()}
        if len(shapes) > 1:
            raise UsageError(f"images in one batch have different shapes {sorted(shapes)[:3]}: add a resize/center_crop or "
                             "random_resized_crop step to the transforms.")
        x = torch.stack([parts[r] for r in rows])
        n, _, h, w = x.shape
        x = p.run_tail(x, p.params(u[rows], torch.full((n,), h), torch.full((n,), w), p.head, None))
        targets = item["targets"][rows].to(self.device, non_blocking=True)
        return self.normalize(x), targets

    def _items(self):
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            if item is None:
                return
            if self.tuner is not None:
                self.fraction_t[0] = self.tuner.update(time.perf_counter() - t0)
            yield item

    def __iter__(self):
        return prefetch_to_device(self._items(), self._assemble, self.device)


def parse_cpu_fraction(value) -> tuple[float, FractionTuner | None]:
    """data.cpu_fraction -> (start fraction, tuner or None); 'auto' starts at 0.2 and tunes."""
    if value == "auto":
        tuner = FractionTuner()
        return tuner.fraction, tuner
    f = float(value)
    if not 0.0 <= f <= 1.0:
        raise UsageError(f"data.cpu_fraction={value}: use a share between 0 and 1 (0.3 = 30% of each batch on the CPU) or 'auto'.")
    return f, None


def needs_cuda(backend: str, rt, data_cfg, splits, build_kw, reason: str | None = None):
    """A backend that cannot run here: fall back to data.fallback (logged) or fail, saying what to do."""
    why = reason or ("this machine has no CUDA device" if not torch.cuda.is_available() else f"run.device is {rt.device}")
    if data_cfg.fallback is None:
        raise UsageError(f"data.backend={backend} needs a CUDA GPU, but {why}. Set data.backend=cpu, "
                         f"or data.fallback=cpu to use the cpu backend wherever {backend} cannot run.")
    warnings.warn(f"data.backend={backend} cannot run ({why}); using data.fallback={data_cfg.fallback}.", stacklevel=2)
    return LOADERS.get(data_cfg.fallback)(data_cfg, splits, rt, **build_kw)


def build_gpu_loaders(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """The gpu backend on rt.device. On a CPU device the same code runs with CPU decoding (tests)."""
    for split in (splits.train, splits.val):
        if not hasattr(split, "read"):
            raise UsageError(f"data.backend=gpu decodes image files, but dataset '{data_cfg.dataset}' is already decoded "
                             "in memory. Use data.backend=memory (or cpu) for it.")
    channels = splits.in_channels
    train_p = compile_batch_spec(data_cfg.train.transforms, "data.train.transforms", channels, "gpu")
    eval_p = compile_batch_spec(data_cfg.eval.transforms, "data.eval.transforms", channels, "gpu")
    if (train_p.mean, train_p.std) != (eval_p.mean, eval_p.std):
        raise UsageError("data.train.transforms and data.eval.transforms must normalize with the same mean and std.")
    if channels != 3:
        raise UsageError("data.backend=gpu decodes RGB JPEGs; for gray images use data.backend=cpu.")
    start, tuner = parse_cpu_fraction(data_cfg.cpu_fraction)
    norm = DeviceNormalize(train_p.mean, train_p.std, rt.device, dtype=dtype, channels_last=channels_last)
    out = []
    for raw, pipe, train in ((splits.train, train_p, True), (splits.val, eval_p, False)):
        fraction = torch.tensor([start], dtype=torch.float64).share_memory_()
        sampler = EpochSampler(len(raw), seed=seed, shuffle=train, rank=rt.rank, world_size=rt.world_size, pad=train)
        bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop = train and data_cfg.drop_last and len(sampler) >= bs
        workers = data_cfg.num_workers
        ds = BytesBatches(raw, pipe, fraction, channels, data_cfg.on_bad_sample, data_cfg.max_image_pixels, raw.decoder)
        batches = torch.utils.data.BatchSampler(sampler, bs, drop)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, sampler=batches, num_workers=workers,
            pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
            persistent_workers=data_cfg.persistent_workers and workers > 0,
            prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
            generator=torch.Generator().manual_seed(seed),  # not the global RNG (see cpu.make_loader)
        )
        out.append(GpuLoader(loader, batches, pipe, rt.device, norm, fraction, tuner if train else None, data_cfg.on_bad_sample))
    info = DataInfo(splits.classes, channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=out[0], val=out[1], info=info)


@LOADERS.register("gpu")
def gpu_loader(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """File bytes from workers, nvJPEG batch decode and per-sample augmentation on the GPU, CPU/GPU split."""
    kw = dict(seed=seed, channels_last=channels_last, dtype=dtype)
    if rt.device.type != "cuda":
        return needs_cuda("gpu", rt, data_cfg, splits, kw)
    return build_gpu_loaders(data_cfg, splits, rt, **kw)

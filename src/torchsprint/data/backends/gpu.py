"""The `gpu` backend: workers read file bytes; nvJPEG decodes batches on the GPU; augmentation runs there.

Per batch, the workers send one flat uint8 buffer of JPEG bytes with offsets (not one tensor per
file: measured on CPU, 57-65 ms per batch of 256 through the DataLoader against 3-4 ms for one
buffer), the crop windows and random parameters of every sample (drawn vectorised in the worker from
the sample seeds, in float64 on the CPU, so every device and every CPU/GPU split draws the same
crops), and the CPU share (below). A producer thread (below) decodes the buffer with one batched
nvJPEG call, pads the images into one tensor and crops and resizes them all in one pass
(batch_ops.resample_batch), then runs the batched tail (flips, cutout...) and normalises.

The host work runs off the training thread (BENCHMARKS.md, "GPU, first run": on an H200 it was 29 ms of CPU per batch of
256 on the training thread, a ceiling near 8,800 images/s whatever the GPU). One producer thread per
iterator assembles batches ahead into a bounded queue of `data.prefetch_factor` batches (the same
setting the DataLoader and DALI queues use: ready batches sit on the device, ~150 MB each at
256x3x224x224 fp32, so the default 2 keeps ~0.5 GB ahead). One thread, not a pool: torchvision's
CUDA decoder holds one process-wide mutex for the whole batched call and waits for its own stream
twice inside it, so a second producer would queue on that lock; what remains is a few ms of kernel
launches per batch that one thread keeps ahead of the GPU, and more threads would take the GIL from
the training thread's Python. On CUDA the producer works on its own stream and records an event after
each batch; the training thread only takes the next item from the queue, makes its current stream
wait on the event (no host sync) and calls record_stream on the tensors it takes. Small host tensors
the batch needs on the device (crop windows, the tail's per-sample parameters, targets, the batch
order) cross the bus as one pinned buffer and one copy (`stage`); the CPU share is one more copy,
pinned by the DataLoader. What is still per file is torchvision's: nvJPEG takes one host pointer per
file and copies each bitstream itself (decode_jpegs_cuda takes a list of CPU tensors), and one copy
launch per image pads the decoded images into one tensor (the producer's work, not the training
thread's). Producer exceptions are raised again on the training thread with their own type and
message; an iterator closed, abandoned (break) or garbage-collected stops its thread, and a new
iterator or set_epoch closes the previous one first. Nothing in the assembly draws from the global
torch RNG (every random number comes from the sample seeds), so exact resume does not depend on
which thread runs it.

A share of every batch (`data.cpu_fraction`, the seed's `cpu_percentage`) is decoded and cropped by
the CPU workers instead, so CPU and GPU both work on the input pipeline. Which samples go to the CPU
is decided per batch position (the first round(f * B) samples of the seeded, shuffled batch), and
every sample's random parameters come from its own seed (augment.py), so the split changes who
computes a crop, never which crop. (The pixels can differ by the decoders, nvJPEG against
libjpeg-turbo, and by one level where torchvision's uint8 CPU resize rounds between its passes.)
`cpu_fraction: auto` (FractionTuner) starts at 0, the GPU decoding everything, so its floor is
cpu_fraction 0's speed, and every `window` batches: raises the share by `step` while the workers keep
up (the producer's mean wait for their next batch under 0.2 ms) and the batch rate has not fallen;
lowers it by `step`, and caps it there until the next epoch, when the workers made the producer wait
(over 2 ms) or the rate fell more than 3% (a window's noise) below the best measured at a lower share.
So it only keeps a share that adds the CPU's throughput to the GPU's; each epoch probes upward again.
Files nvJPEG cannot take go to the CPU share by their header (PNG, gray or CMYK JPEGs, 12-bit,
lossless and arithmetic-coded JPEGs); a file that passes the header check and that nvJPEG still
rejects is decoded on the CPU by the producer (counted in `cpu_fallbacks`, reported once), and
only a file no decoder reads is a bad sample. Bad samples shrink a batch but never remove it: every
rank keeps the same step count.
"""

from __future__ import annotations

import time
import warnings
import weakref

import torch

from torchsprint.data.core import (
    LOADERS,
    Backend,
    DataInfo,
    EpochSampler,
    Loaders,
    cuda_missing,
    draw_start,
)
from torchsprint.data.prefetch import AheadIterator, prefetch_to_device, stage_params
from torchsprint.data.preprocess.augment import BatchPipeline, compile_batch_spec
from torchsprint.data.preprocess.decode import BadImage, decode_bytes, read_header
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.data.preprocess.on_device import (
    decode_on_device,
    nvjpeg_ok,
    run_head_on_device,
)
from torchsprint.data.preprocess.progressive import FIXED, attach_schedule
from torchsprint.errors import UsageError


def cpu_rows(batch: int, fraction: float) -> int:
    """How many leading positions of a batch of `batch` samples the CPU workers take (round half up)."""
    return min(batch, int(fraction * batch + 0.5))


class FractionTuner:
    """`cpu_fraction: auto`: the CPU share of each batch, moved by `step` every `window` batches (the rule is
    in the module docstring).

    The producer reports how long it waited for the workers' next batch (`update`); the window's batch
    rate comes from the clock between windows. Waiting means the CPU workers are the bottleneck: lower
    the share. No waiting means they keep up: raise it, unless the rate fell against a lower share (the
    workers' CPU work slowed the rest, e.g. the producer or the training thread sharing the cores).
    Thresholds: a wait above 2 ms (about a 2% stall at a 100 ms step) or below 0.2 ms (a ready queue
    answers in ~0.05 ms); a rate more than `slower` (3%) below the best at a lower share.
    """

    def __init__(
        self,
        start: float = 0.0,
        step: float = 0.05,
        window: int = 8,
        low: float = 0.0,
        high: float = 1.0,
        slower: float = 0.03,
    ):
        self.fraction, self.step, self.window, self.low, self.high, self.slower = start, step, window, low, high, slower
        self.ceiling = high  # the highest share allowed until restart(): lowered where a share did not pay
        self.rates: dict[int, float] = {}  # batches/s last measured at each share, keyed by share / step
        self.waits: list[float] = []
        self._t0: float | None = None  # when the current window started (None: at the next update)

    def restart(self) -> None:
        """A new pass over the data: the window restarts (the first batch's wait, workers starting and queues
        filling, says nothing about the split) and the ceiling lifts, so each epoch probes upward again."""
        self.waits.clear()
        self._t0 = None
        self.ceiling = self.high

    def update(self, wait_s: float, now: float | None = None) -> float:
        """Record one batch's wait (seconds; `now`: the clock, perf_counter by default); returns the share."""
        now = time.perf_counter() if now is None else now
        if self._t0 is None:
            self._t0 = now
            return self.fraction
        self.waits.append(wait_s)
        if len(self.waits) < self.window:
            return self.fraction
        rate = len(self.waits) / max(now - self._t0, 1e-9)
        mean = sum(self.waits) / len(self.waits)
        self.waits.clear()
        self._t0 = now
        key = round(self.fraction / self.step)
        self.rates[key] = rate
        below = max((r for k, r in self.rates.items() if k < key), default=None)
        if mean > 2e-3 or (below is not None and rate < (1 - self.slower) * below):
            self.ceiling = round(max(self.low, self.fraction - self.step), 6)  # round: no drift from adding steps
            self.fraction = self.ceiling
        elif mean < 2e-4:
            self.fraction = max(self.fraction, round(min(self.ceiling, self.fraction + self.step), 6))
        return self.fraction


def shared_bytes(total: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `total` bytes; in a DataLoader worker it lives in shared memory
    already, so sending it to the main process copies nothing more (as cpu.collate does for images)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(total, dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(max(total, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (total,), (1,))


def pack(blobs: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes objects -> (one flat uint8 tensor, int64 offsets of len(blobs) + 1)."""
    sizes = [len(b) for b in blobs]
    offsets = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
    flat = shared_bytes(int(offsets[-1]))
    view = memoryview(flat.numpy())
    for b, start, size in zip(blobs, offsets.tolist(), sizes):
        view[start : start + size] = b  # one memcpy per file, no tensor per file
    return flat, offsets


class BytesBatches(torch.utils.data.Dataset):
    """Worker side: one batch of (index, seed) keys -> the GPU share's bytes and crop windows, the CPU
    share decoded and cropped, and every sample's uniforms.

    `fraction` is a one-element shared-memory tensor, so `cpu_fraction: auto` can move it while
    persistent workers run.
    """

    def __init__(
        self,
        raw,
        pipeline: BatchPipeline,
        fraction: torch.Tensor,
        channels: int,
        on_bad_sample: str,
        max_pixels: int,
        decoder: str,
    ):
        self.raw, self.pipeline, self.fraction, self.channels = raw, pipeline, fraction, channels
        self.on_bad_sample, self.max_pixels, self.decoder = on_bad_sample, max_pixels, decoder

    def __len__(self) -> int:
        return len(self.raw)

    def _bad(self, source: str, reason) -> str:
        if self.on_bad_sample == "error":
            raise UsageError(f"unreadable sample {source}: {reason}. Fix or remove it, or set data.on_bad_sample=skip.")
        return f"{source}: {reason}"

    def __getitem__(self, keys: list[tuple[int, int]]) -> dict:
        return self(([index, seed, None, *self.raw.samples[index][::-1]]) for index, seed in keys)

    def __call__(self, entries) -> dict:
        """(index, seed, bytes | OSError | None to read them, target, path) entries -> one batch (see the class).
        Webdataset shards (sources/shard_stream.ShardStream) hand their JPEG bytes straight from the tar."""
        entries = list(entries)
        p = self.pipeline
        seeds = torch.tensor([e[1] for e in entries], dtype=torch.int64)
        u = p.draw(seeds)
        n_cpu = cpu_rows(len(entries), float(self.fraction[0]))
        blobs, gpu_rows, gpu_hw, gpu_paths, cpu_images, cpu_rows_, skipped, targets = [], [], [], [], [], [], [], []
        for pos, (index, _, data, target, path) in enumerate(entries):
            targets.append(target)
            try:
                if data is None:
                    data = self.raw.read(index)[0]
                elif isinstance(data, Exception):
                    raise data
                header = read_header(data)
                if pos >= n_cpu and nvjpeg_ok(header):
                    if header.height * header.width > self.max_pixels:
                        raise BadImage(
                            f"{header.width}x{header.height} pixels > data.max_image_pixels={self.max_pixels:,}"
                        )
                    blobs.append(data)
                    gpu_rows.append(pos)
                    gpu_hw.append((header.height, header.width))
                    gpu_paths.append(path)
                    continue
                img = decode_bytes(data, channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels)
            except (BadImage, OSError) as e:
                skipped.append(self._bad(path, e))
                continue
            params = p.params(u[pos : pos + 1], torch.tensor([img.shape[1]]), torch.tensor([img.shape[2]]), 0, p.head)
            cpu_images.append(p.run_head([img], params, [0])[0].contiguous())
            cpu_rows_.append(pos)
        flat, offsets = pack(blobs)
        hw = torch.tensor(gpu_hw, dtype=torch.int64).view(-1, 2)
        rows = torch.tensor(gpu_rows, dtype=torch.int64)
        windows = None
        if p.geometry is not None and len(rows):
            head = p.params(u[rows], hw[:, 0], hw[:, 1], 0, p.head)
            windows = torch.stack(p.geometry.windows(head, hw[:, 0], hw[:, 1]))  # (2, 4, n): rows, cols
        return {
            "u": u,
            "targets": torch.tensor(targets, dtype=torch.int64),
            "gpu_data": flat,
            "gpu_offsets": offsets,
            "gpu_rows": rows,
            "gpu_paths": gpu_paths,
            "windows": windows,
            "cpu_images": torch.stack(cpu_images) if cpu_images else None,
            "cpu_rows": torch.tensor(cpu_rows_, dtype=torch.int64),
            "skipped": skipped,
        }


class GpuLoader:
    """Main-process side: decode the GPU share in one batch, crop/resize it in one pass, merge it with the
    CPU share in batch order, run the batched tail with per-sample parameters, normalise. With `ahead` > 0
    a producer thread does all of it `ahead` batches ahead (AheadIterator); `ahead=0` runs it on the
    iterating thread (on CUDA, batch i+1 prepared on a side stream while batch i trains), the reference
    the threaded path is tested against."""

    def __init__(
        self,
        loader,
        batches: torch.utils.data.BatchSampler,
        pipeline: BatchPipeline,
        device: torch.device,
        normalize: DeviceNormalize,
        fraction: torch.Tensor,
        tuner: FractionTuner | None,
        on_bad_sample: str,
        channels: int = 3,
        decoder: str = "torchvision",
        max_pixels: int = 89_478_485,
        ahead: int = 2,
    ):
        self.loader, self.batches, self.sampler = loader, batches, batches.sampler
        self.pipeline, self.device = pipeline, device
        self.normalize, self.fraction_t, self.tuner, self.on_bad_sample = normalize, fraction, tuner, on_bad_sample
        self.channels, self.decoder, self.max_pixels = channels, decoder, max_pixels
        self.ahead = ahead
        self.skipped: list[str] = []
        self.cpu_fallbacks = 0  # files nvJPEG rejected that the CPU decoded
        self._active = None  # weakref to the running AheadIterator, closed before another starts
        self.resolution = FIXED  # data.progressive (training loader): the crop side of each epoch

    @property
    def cpu_fraction(self) -> float:
        return float(self.fraction_t[0])

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self._close_active()  # a producer still running would read the sampler (and the crop side) while it changes
        self.resolution.set_epoch(epoch)
        self.sampler.set_epoch(epoch, start_batch * self.batches.batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def _fallback(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        """Decode on the CPU a file nvJPEG rejected; None (skipped) or UsageError when no decoder reads it."""
        try:
            img = decode_bytes(
                bytes(data.numpy()), channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels
            )
        except BadImage as e:
            if self.on_bad_sample == "error":
                raise UsageError(
                    f"unreadable sample {path}: {e}. Fix or remove it, or set data.on_bad_sample=skip."
                ) from None
            self.skipped.append(f"{path}: {e}")
            return None
        if self.cpu_fallbacks == 0:
            warnings.warn(
                f"nvJPEG could not decode {path}; decoding such files on the CPU (counted in the loader's "
                "cpu_fallbacks; reported once).",
                stacklevel=2,
            )
        self.cpu_fallbacks += 1
        return img.to(self.device, non_blocking=True)

    def _decode(self, item: dict) -> tuple[list[torch.Tensor], list[int] | None]:
        """The GPU share decoded on the device -> (images, kept indices into the share, None when all were)."""
        sizes = item["gpu_offsets"].diff().tolist()
        if not sizes:
            return [], None
        views = list(torch.split(item["gpu_data"], sizes))  # one call for every file's view of the flat buffer
        decoded = decode_on_device(views, self.device)
        if all(img is not None for img in decoded):
            return decoded, None
        images, kept = [], []
        for j, img in enumerate(decoded):
            if img is None:
                img = self._fallback(views[j], item["gpu_paths"][j])
                if img is None:
                    continue
            images.append(img)
            kept.append(j)
        return images, kept

    def _assemble(self, item: dict):
        """One worker item -> (normalised images, targets) on the device, in the sampler's batch order.

        Draws nothing from the global torch RNG (every random number comes from item["u"]). Host tensors
        reach the device through one `stage` (plus the CPU share's images): windows, the tail's parameters,
        targets, and the batch order when the shares do not concatenate into it."""
        p, dev = self.pipeline, self.device
        self.skipped += item["skipped"]
        images, kept = self._decode(item)
        gpu_rows, windows = item["gpu_rows"], item["windows"]
        if kept is not None:
            gpu_rows = gpu_rows[kept]
            windows = windows[:, :, kept] if windows is not None else None
        cpu_images = item["cpu_images"]
        # The CPU share holds the leading positions (cpu_rows), so [CPU share, GPU share] is usually the batch
        # order already; only files sent to the CPU by their header, later in the batch, need a gather.
        rows = [
            r for r, share in ((item["cpu_rows"], cpu_images), (gpu_rows, images)) if share is not None and len(share)
        ]
        if not rows:
            raise UsageError(f"every sample of a batch was unreadable, e.g. {self.skipped[-1:]}")
        rows = torch.cat(rows) if len(rows) > 1 else rows[0]
        order, positions = torch.sort(rows)
        in_order = torch.equal(order, rows)
        u, targets = item["u"], item["targets"]
        if len(order) < len(u):  # skipped samples: the rows kept (else order is every row, 0..B-1)
            u, targets = u[order], targets[order]
        gpu_x = None
        if images and p.geometry is None:  # per-image head: needs nothing staged (it runs before the tail's staging)
            gpu_x = run_head_on_device(p, images, None, item["u"][gpu_rows], dev)
        shapes = {tuple(cpu_images.shape[1:])} if cpu_images is not None else set()
        if images:
            shapes.add((images[0].shape[0], *p.geometry.out_size) if gpu_x is None else tuple(gpu_x.shape[1:]))
        if len(shapes) > 1:
            raise UsageError(
                f"images in one batch have different shapes {sorted(shapes)[:3]}: add a resize/center_crop or "
                "random_resized_crop step to the transforms."
            )
        (_, h, w), n = shapes.pop(), len(order)
        # tail parameters: vectorised on the CPU (tens of microseconds per batch), then one copy with the rest
        tail = p.params(u, torch.full((n,), h), torch.full((n,), w), p.head, None)
        extra = [targets] + ([] if in_order else [positions]) + ([windows] if images and gpu_x is None else [])
        tail, extra = stage_params(tail, extra, dev)
        parts = [] if cpu_images is None else [cpu_images.to(dev, non_blocking=True)]
        if images:
            parts.append(gpu_x if gpu_x is not None else run_head_on_device(p, images, extra[-1], u, dev))
        x = torch.cat(parts) if len(parts) > 1 else parts[0]
        if not in_order:
            x = x.index_select(0, extra[1])  # batch order: every sample where the sampler put it
        x = p.run_tail(x, tail)
        return self.normalize(x), extra[0]

    def _items(self, it=None):
        """The DataLoader's items (`it`: its iterator, made here when None); feeds the tuner the wait for each."""
        it = iter(self.loader) if it is None else it
        if self.tuner is not None:
            self.tuner.restart()
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            if item is None:
                return
            if self.tuner is not None:
                self.fraction_t[0] = self.tuner.update(time.perf_counter() - t0)
            yield item

    def __iter__(self):
        self._close_active()
        if self.ahead == 0:
            return prefetch_to_device(self._items(), self._assemble, self.device)
        it = AheadIterator(lambda: self._items(iter(self.loader)), self._assemble, self.device, self.ahead)
        self._active = weakref.ref(it)
        return it


def parse_cpu_fraction(value) -> tuple[float, FractionTuner | None]:
    """data.cpu_fraction -> (start fraction, tuner or None); 'auto' starts at 0 and tunes (FractionTuner)."""
    if value == "auto":
        tuner = FractionTuner()
        return tuner.fraction, tuner
    f = float(value)
    if not 0.0 <= f <= 1.0:
        raise UsageError(
            f"data.cpu_fraction={value}: use a share between 0 and 1 (0.3 = 30% of each batch on the CPU) or 'auto'."
        )
    return f, None


def build_gpu_loaders(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """The gpu backend on rt.device. On a CPU device the same code runs with CPU decoding (tests)."""
    for split in (splits.train, splits.val):
        if not hasattr(split, "read") and not getattr(split, "streaming", False):
            raise UsageError(
                f"data.backend=gpu decodes image files, but dataset '{data_cfg.dataset}' is already decoded "
                "in memory. Use data.backend=memory (or cpu) for it."
            )
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
        sampler = EpochSampler(
            len(raw),
            seed=seed,
            shuffle=train,
            rank=rt.rank,
            world_size=rt.world_size,
            pad=train,
            repeats=data_cfg.repeated_aug if train else 1,
            weights=splits.train_weights if train else None,
            weights_from=draw_start(splits),
        )
        bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop = train and data_cfg.drop_last and len(sampler) >= bs
        workers = data_cfg.num_workers
        ds = BytesBatches(raw, pipe, fraction, channels, data_cfg.on_bad_sample, data_cfg.max_image_pixels, raw.decoder)
        if getattr(raw, "streaming", False):  # webdataset shards: workers batch their own shards' JPEG bytes
            from torchsprint.data.sources.shard_stream import ShardStream

            if train and data_cfg.repeated_aug > 1:
                raise UsageError(
                    f"data.repeated_aug={data_cfg.repeated_aug} repeats sample indices of a map-style "
                    "dataset; webdataset shards stream in shard order. Remove data.repeated_aug."
                )

            batches = ds = ShardStream(
                raw,
                ds,
                seed=seed,
                train=train,
                batch_size=bs,
                drop_last=train and data_cfg.drop_last,
                rank=rt.rank,
                world_size=rt.world_size,
                workers=workers,
            )
        else:
            batches = torch.utils.data.BatchSampler(sampler, bs, drop)
        loader = torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            sampler=None if ds is batches else batches,
            num_workers=workers,
            pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
            persistent_workers=data_cfg.persistent_workers and workers > 0,
            prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
            generator=torch.Generator().manual_seed(seed),  # not the global RNG (see cpu.make_loaders)
        )
        out.append(
            GpuLoader(
                loader,
                batches,
                pipe,
                rt.device,
                norm,
                fraction,
                tuner if train else None,
                data_cfg.on_bad_sample,
                channels,
                raw.decoder,
                data_cfg.max_image_pixels,
                ahead=data_cfg.prefetch_factor,
            )
        )
    out[0].resolution = attach_schedule(data_cfg, [op for _, op in train_p.steps])
    info = DataInfo(splits.classes, channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=out[0], val=out[1], info=info)


# Building it on a CPU device runs the same code with CPU decoding (the tests do); a run asks cannot_run first.
LOADERS.register("gpu")(Backend(build_gpu_loaders, cannot_run=cuda_missing, auto=True, progressive=True))

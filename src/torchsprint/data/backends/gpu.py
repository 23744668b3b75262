"""The `gpu` backend: workers read file bytes; nvJPEG decodes batches on the GPU; augmentation runs there.

Per batch, the workers send one flat uint8 buffer of JPEG bytes with offsets (not one tensor per
file: measured on CPU, 57-65 ms per batch of 256 through the DataLoader against 3-4 ms for one
buffer), the crop windows and random parameters of every sample (drawn vectorised in the worker from
the sample seeds, in float64 on the CPU, so every device and every CPU/GPU split draws the same
crops), and the CPU share (below). A producer thread (below) decodes the buffer with one batched
nvJPEG call, pads the images into one tensor and crops and resizes them all in one pass
(batch_ops.resample_batch), then runs the batched tail (flips, cutout...) and normalises.

The host work runs off the training thread (issue 27: on an H200 it was 29 ms of CPU per batch of 256
on the training thread, a ceiling near 8,800 images/s whatever the GPU). One producer thread per
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

import atexit
import contextlib
import queue
import threading
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
    prefetch_to_device,
)
from torchsprint.data.preprocess.augment import BatchPipeline, compile_batch_spec
from torchsprint.data.preprocess.decode import BadImage, decode_bytes, read_header
from torchsprint.data.preprocess.normalize import DeviceNormalize
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

    def __init__(self, start: float = 0.0, step: float = 0.05, window: int = 8, low: float = 0.0, high: float = 1.0,
                 slower: float = 0.03):
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


# Huffman-coded 8-bit frames: baseline (SOF0), extended (SOF1), progressive (SOF2). nvJPEG has no
# lossless (SOF3) or arithmetic-coded (SOF9-11) decoding and no 12-bit output to uint8.
NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)


def nvjpeg_ok(header) -> bool:
    """Whether nvJPEG (torchvision's decode_jpeg on CUDA) takes the file: a 3-component (YCbCr) 8-bit
    Huffman-coded JPEG stored upright. Gray and CMYK files decode on the CPU too, with torchvision's colour
    conversion; so do files with an EXIF orientation (decode.apply_orientation turns them upright there,
    the one orientation policy of every decoder)."""
    return (header.format == "jpeg" and header.components == 3 and header.sof in NVJPEG_FRAMES and header.bits == 8
            and header.orientation == 1)


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
        return self(([index, seed, None, *self.raw.samples[index][::-1]]) for index, seed in keys)

    def __call__(self, entries) -> dict:
        """(index, seed, bytes | OSError | None to read them, target, path) entries -> one batch (see the class).
        Webdataset shards (sources/webdataset.ShardStream) hand their JPEG bytes straight from the tar."""
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
                        raise BadImage(f"{header.width}x{header.height} pixels > data.max_image_pixels={self.max_pixels:,}")
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
        return {"u": u, "targets": torch.tensor(targets, dtype=torch.int64), "gpu_data": flat, "gpu_offsets": offsets,
                "gpu_rows": rows, "gpu_paths": gpu_paths, "windows": windows,
                "cpu_images": torch.stack(cpu_images) if cpu_images else None,
                "cpu_rows": torch.tensor(cpu_rows_, dtype=torch.int64), "skipped": skipped}


# ---------------------------------------------------------------- decoding on the device

_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# torch.utils.deterministic.fill_uninitialized_memory is process-wide and _decode_jpegs saves and restores it:
# two producers (a train and a val iterator alive at once) must not interleave that. torchvision's CUDA decoder
# takes one process-wide mutex for the whole call anyway, so this lock costs no parallelism there.
_DECODE_LOCK = threading.Lock()


def decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that JPEG decodes on `device` run on, and nothing else (see decode_on_device).

    High priority, for a pool of its own: torch.cuda.Stream() hands out the next of 32 pooled streams per
    priority, round robin, so a default-priority decode stream would be the very stream of one prefetch pass
    in 32 (prefetch_to_device takes one per pass), and the ordering below would silently be a no-op."""
    if device not in _DECODE_STREAMS:
        _DECODE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _DECODE_STREAMS[device]


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    import torch.utils.deterministic
    from torchvision.io import ImageReadMode, decode_jpeg

    # Under torch.use_deterministic_algorithms, empty() outputs are filled on the current stream, while
    # nvJPEG writes them from its own: the fill could land after the pixels. The decoder writes every
    # output byte, so there is nothing to fill.
    with _DECODE_LOCK:
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:  # one file the decoder rejects fails the whole batch call: find it
            out = []
            for d in data:
                try:
                    out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    out.append(None)
            return out
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = fill


def decode_on_device(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Batch-decode JPEG bytes (CPU uint8 tensors) into uint8 CHW RGB images on `device`; files the
    decoder rejects come back as None (the caller decodes them on the CPU or counts them bad).

    On CUDA the decode is ordered explicitly. torchvision's nvJPEG wrapper allocates its outputs on the
    caller's current stream and decodes on a private one; nvJPEG's hardware engine writes its outputs
    when the call is made, whatever is still queued (pytorch/vision#9606, meta-pytorch/torchcodec#1634:
    reproduced on H100s, CUDA 12.3-13.2). The caching allocator hands a block freed on a stream to the
    next allocation on that stream at once, so a decode on the stream that crops the previous batch
    could overwrite images that crop has not read yet. Here decodes run with a stream of their own as
    the current one: only earlier decode outputs can be recycled for their outputs, and each output is
    `record_stream`-ed on the consuming stream, so its block is reused only once the work queued there
    before it was freed has finished (an event the allocator polls; no host wait). The consumer waits
    for the decode stream before it reads.
    """
    if not data:
        return []
    if device.type != "cuda":
        return _decode_jpegs(data, device)
    consumer = torch.cuda.current_stream(device)
    stream = decode_stream(device)
    if stream == consumer:  # the caller made the decode stream current: the ordering below would do nothing
        raise RuntimeError("decode_on_device: called with the decode stream as the current stream")
    with torch.cuda.stream(stream):
        out = _decode_jpegs(data, device)
    consumer.wait_stream(stream)
    for img in out:
        if img is not None:
            img.record_stream(consumer)
    return out


def pad_batch(images: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Images of different sizes -> one (N, C, Hmax, Wmax) uint8 tensor, each in its top-left corner.

    The rest is left uninitialised: resample_batch never gives it a non-zero weight. One fused call for
    the N copies (the same copy kernels, without a Python dispatch per image).
    """
    h = max(x.shape[1] for x in images)
    w = max(x.shape[2] for x in images)
    out = torch.empty(len(images), images[0].shape[0], h, w, dtype=torch.uint8, device=device)
    torch._foreach_copy_([o[:, : x.shape[1], : x.shape[2]] for o, x in zip(out.unbind(0), images)], images,
                         non_blocking=True)
    return out


def run_head_on_device(p: BatchPipeline, images: list[torch.Tensor], windows: torch.Tensor | None, u: torch.Tensor,
                       device: torch.device) -> torch.Tensor:
    """The head on decoded images of different sizes: one fused pass (padded batch + resample_batch) when
    the head has a fused form, else image by image. `windows`: the fused head's (2, 4, N) windows, on the
    host or already on `device` (None: computed here from `u`). Returns (N, C, h, w) uint8."""
    if p.geometry is not None:
        if windows is None:
            hs = torch.tensor([x.shape[1] for x in images])
            ws = torch.tensor([x.shape[2] for x in images])
            windows = torch.stack(p.geometry.windows(p.params(u, hs, ws, 0, p.head), hs, ws))
        w = windows.to(device, non_blocking=True)
        scale = p.geometry.max_scale(max(x.shape[1] for x in images), max(x.shape[2] for x in images))
        return p.geometry.apply(pad_batch(images, device), w[0], w[1], scale)
    if not p.head:
        return torch.stack(images)
    hs = torch.tensor([x.shape[1] for x in images])
    ws = torch.tensor([x.shape[2] for x in images])
    heads = p.run_head(images, p.params(u, hs, ws, 0, p.head), list(range(len(images))))
    shapes = {tuple(x.shape) for x in heads}
    if len(shapes) > 1:
        raise UsageError(f"images in one batch have different shapes {sorted(shapes)[:3]}: add a resize/center_crop or "
                         "random_resized_crop step to the transforms.")
    return torch.stack(heads)


def preprocess_on_device(p: BatchPipeline, images: list[torch.Tensor], u: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Decoded images of any sizes -> the spec's uint8 output batch on `device` (predict, data compare)."""
    if not images:
        return torch.empty(0, dtype=torch.uint8, device=device)
    x = run_head_on_device(p, images, None, u, device)
    n = len(x)
    return p.run_tail(x, p.params(u, torch.full((n,), x.shape[2]), torch.full((n,), x.shape[3]), p.head, None))


STAGE_ALIGN = 16  # bytes: every tensor starts where a view as any dtype (up to complex128) is allowed


def stage(tensors: list[torch.Tensor], device: torch.device, pack: bool | None = None) -> list[torch.Tensor]:
    """Small host tensors -> the same tensors on `device`, through one pinned buffer and one copy.

    Each tensor's bytes go to a 16-byte aligned place in one uint8 buffer (pinned on CUDA), the buffer
    crosses in one non_blocking copy, and views of it as each dtype and shape come back: one transfer
    per batch instead of one per tensor. On a CPU device they come back as they are; `pack=True` packs
    anyway (tests check the byte arithmetic on the CPU)."""
    if not (device.type != "cpu" if pack is None else pack):
        return list(tensors)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    starts, pieces, total = [], [], 0
    for b in flat:
        starts.append(total)
        pad = -len(b) % STAGE_ALIGN
        pieces += [b, torch.zeros(pad, dtype=torch.uint8)] if pad else [b]
        total += len(b) + pad
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if pieces:
        torch.cat(pieces, out=buf)
    moved = buf.to(device, non_blocking=True)  # pinned: the host allocator keeps buf until the copy is done
    return [moved[s : s + len(b)].view(t.dtype).view(t.shape) for t, s, b in zip(tensors, starts, flat)]


def stage_params(params: list[dict], extra: list[torch.Tensor], device: torch.device) -> tuple[list[dict], list[torch.Tensor]]:
    """The tail's parameter dicts and `extra` tensors on `device` in one `stage` (keys starting with "_" stay on
    the host, as augment.to_device leaves them; run_tail's .to(device) is then a no-op)."""
    keys = [(i, k) for i, d in enumerate(params) for k, v in d.items() if not k.startswith("_") and torch.is_tensor(v)]
    moved = stage([*extra, *(params[i][k] for i, k in keys)], device)
    out = [dict(d) for d in params]
    for (i, k), v in zip(keys, moved[len(extra) :]):
        out[i][k] = v
    return out, moved[: len(extra)]


class GpuLoader:
    """Main-process side: decode the GPU share in one batch, crop/resize it in one pass, merge it with the
    CPU share in batch order, run the batched tail with per-sample parameters, normalise. With `ahead` > 0
    a producer thread does all of it `ahead` batches ahead (AheadIterator); `ahead=0` runs it on the
    iterating thread (on CUDA, batch i+1 prepared on a side stream while batch i trains), the reference
    the threaded path is tested against."""

    def __init__(self, loader, batches: torch.utils.data.BatchSampler, pipeline: BatchPipeline, device: torch.device,
                 normalize: DeviceNormalize, fraction: torch.Tensor, tuner: FractionTuner | None, on_bad_sample: str,
                 channels: int = 3, decoder: str = "torchvision", max_pixels: int = 89_478_485, ahead: int = 2):
        self.loader, self.batches, self.sampler = loader, batches, batches.sampler
        self.pipeline, self.device = pipeline, device
        self.normalize, self.fraction_t, self.tuner, self.on_bad_sample = normalize, fraction, tuner, on_bad_sample
        self.channels, self.decoder, self.max_pixels = channels, decoder, max_pixels
        self.ahead = ahead
        self.skipped: list[str] = []
        self.cpu_fallbacks = 0  # files nvJPEG rejected that the CPU decoded
        self._active = None  # weakref to the running AheadIterator, closed before another starts

    @property
    def cpu_fraction(self) -> float:
        return float(self.fraction_t[0])

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self._close_active()  # a producer still running would read the sampler while it changes
        self.sampler.set_epoch(epoch, start_batch * self.batches.batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def _fallback(self, data: torch.Tensor, path: str) -> torch.Tensor | None:
        """Decode on the CPU a file nvJPEG rejected; None (skipped) or UsageError when no decoder reads it."""
        try:
            img = decode_bytes(bytes(data.numpy()), channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels)
        except BadImage as e:
            if self.on_bad_sample == "error":
                raise UsageError(f"unreadable sample {path}: {e}. Fix or remove it, or set data.on_bad_sample=skip.") from None
            self.skipped.append(f"{path}: {e}")
            return None
        if self.cpu_fallbacks == 0:
            warnings.warn(f"nvJPEG could not decode {path}; decoding such files on the CPU (counted in the loader's "
                          "cpu_fallbacks; reported once).", stacklevel=2)
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
        rows = [r for r, share in ((item["cpu_rows"], cpu_images), (gpu_rows, images)) if share is not None and len(share)]
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
            raise UsageError(f"images in one batch have different shapes {sorted(shapes)[:3]}: add a resize/center_crop or "
                             "random_resized_crop step to the transforms.")
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
        it = AheadIterator(self, self.ahead)
        self._active = weakref.ref(it)
        return it


class _Failed:
    """A producer's exception, handed to the training thread to raise there."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()  # the producer's last item: the epoch is complete


def _put(q: queue.Queue, obj, stop: threading.Event) -> bool:
    """Put `obj` unless the consumer stopped (checked every 50 ms while the queue is full); False: stopped."""
    while not stop.is_set():
        try:
            q.put(obj, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(items, assemble, q: queue.Queue, stop: threading.Event, device: torch.device) -> None:
    """The producer thread: assemble each item, on CUDA on a stream of its own with an event recorded after
    each batch. Holds no reference to the AheadIterator, so dropping that closes it (its __del__)."""
    end = _END
    try:
        try:
            with contextlib.ExitStack() as ctx:
                ctx.enter_context(torch.no_grad())  # grad mode is per thread: tensors built here never need a graph
                stream = None
                if device.type == "cuda":
                    ctx.enter_context(torch.cuda.device(device))
                    # Default priority: decode_stream's pool is the high-priority one, so never that stream.
                    stream = torch.cuda.Stream(device)
                    ctx.enter_context(torch.cuda.stream(stream))
                for item in items:
                    if stop.is_set():
                        return
                    batch = assemble(item)
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not _put(q, (batch, event), stop):
                        return
        finally:
            items.close()  # the DataLoader iterator goes with it (non-persistent workers shut down)
    except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
        end = _Failed(e)
    _put(q, end, stop)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # iterators whose producer may still run


@atexit.register
def _close_live() -> None:
    """Stop every producer before the interpreter finalises: a daemon thread it kills inside a torch call
    would abort the process ("terminate called without an active exception")."""
    for it in list(_LIVE):
        it.close()


class AheadIterator:
    """The training thread's side of the gpu backend: batches assembled ahead by one producer thread.

    The first `next` makes the DataLoader's iterator here (its worker processes fork from the training
    thread, never from the producer while this thread runs) and starts the producer; each `next` then only
    takes an item from a queue of `depth` batches and, on CUDA, makes the current stream wait on the
    item's event and record_streams its tensors: no host sync, no tensor work, no per-sample Python.
    """

    def __init__(self, owner: GpuLoader, depth: int):
        self._owner, self._device = owner, owner.device
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            items = self._owner._items(iter(self._owner.loader))
            self._thread = threading.Thread(target=_produce, name="torchsprint-gpu-loader", daemon=True,
                                            args=(items, self._owner._assemble, self._queue, self._stop, self._device))
            self._thread.start()
            _LIVE.add(self)
        while True:
            try:
                got = self._queue.get(timeout=1.0)
                break
            except queue.Empty:  # the producer always ends with an item; a thread gone without one is a bug
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("the gpu loader's producer thread ended without a batch or an error") from None
        if got is _END or isinstance(got, _Failed):
            self.close()
            if got is _END:
                raise StopIteration
            raise got.error  # the producer's exception, same type and message (a UsageError stays one line)
        batch, event = got
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)  # the device waits for the batch; the host does not
            for t in batch:
                t.record_stream(current)  # allocated on the producer's stream, used on this one
        return batch

    def close(self) -> None:
        """Stop the producer and wait for it (it finishes at most the batch in hand); idempotent."""
        self._done = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()  # unblock a put; batches nobody takes are dropped
            thread.join(0.05)
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def parse_cpu_fraction(value) -> tuple[float, FractionTuner | None]:
    """data.cpu_fraction -> (start fraction, tuner or None); 'auto' starts at 0 and tunes (FractionTuner)."""
    if value == "auto":
        tuner = FractionTuner()
        return tuner.fraction, tuner
    f = float(value)
    if not 0.0 <= f <= 1.0:
        raise UsageError(f"data.cpu_fraction={value}: use a share between 0 and 1 (0.3 = 30% of each batch on the CPU) or 'auto'.")
    return f, None


def build_gpu_loaders(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """The gpu backend on rt.device. On a CPU device the same code runs with CPU decoding (tests)."""
    for split in (splits.train, splits.val):
        if not hasattr(split, "read") and not getattr(split, "streaming", False):
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
        sampler = EpochSampler(len(raw), seed=seed, shuffle=train, rank=rt.rank, world_size=rt.world_size, pad=train,
                           repeats=data_cfg.repeated_aug if train else 1,
                           weights=splits.train_weights if train else None)
        bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop = train and data_cfg.drop_last and len(sampler) >= bs
        workers = data_cfg.num_workers
        ds = BytesBatches(raw, pipe, fraction, channels, data_cfg.on_bad_sample, data_cfg.max_image_pixels, raw.decoder)
        if getattr(raw, "streaming", False):  # webdataset shards: workers batch their own shards' JPEG bytes
            from torchsprint.data.sources.webdataset import ShardStream

            if train and data_cfg.repeated_aug > 1:
                raise UsageError(f"data.repeated_aug={data_cfg.repeated_aug} repeats sample indices of a map-style "
                                 "dataset; webdataset shards stream in shard order. Remove data.repeated_aug.")

            batches = ds = ShardStream(raw, ds, seed=seed, train=train, batch_size=bs, drop_last=train and data_cfg.drop_last,
                                       rank=rt.rank, world_size=rt.world_size, workers=workers)
        else:
            batches = torch.utils.data.BatchSampler(sampler, bs, drop)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, sampler=None if ds is batches else batches, num_workers=workers,
            pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
            persistent_workers=data_cfg.persistent_workers and workers > 0,
            prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
            generator=torch.Generator().manual_seed(seed),  # not the global RNG (see cpu.make_loaders)
        )
        out.append(GpuLoader(loader, batches, pipe, rt.device, norm, fraction, tuner if train else None, data_cfg.on_bad_sample,
                             channels, raw.decoder, data_cfg.max_image_pixels, ahead=data_cfg.prefetch_factor))
    info = DataInfo(splits.classes, channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=out[0], val=out[1], info=info)


# Building it on a CPU device runs the same code with CPU decoding (the tests do); a run asks cannot_run first.
LOADERS.register("gpu")(Backend(build_gpu_loaders, cannot_run=cuda_missing, auto=True))

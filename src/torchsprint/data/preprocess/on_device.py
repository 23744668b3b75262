"""Decoding and preprocessing on the device: nvJPEG batch decode with its stream ordering, the fused crop and
resize of images of different sizes, the spec's tail; shared by the gpu backend, predict and `data compare`."""

from __future__ import annotations

import threading

import torch

from torchsprint.data.preprocess.augment import BatchPipeline
from torchsprint.errors import UsageError

# Huffman-coded 8-bit frames: baseline (SOF0), extended (SOF1), progressive (SOF2). nvJPEG has no
# lossless (SOF3) or arithmetic-coded (SOF9-11) decoding and no 12-bit output to uint8.
NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)


def nvjpeg_ok(header) -> bool:
    """Whether nvJPEG (torchvision's decode_jpeg on CUDA) takes the file: a 3-component (YCbCr) 8-bit
    Huffman-coded JPEG stored upright. Gray and CMYK files decode on the CPU too, with torchvision's colour
    conversion; so do files with an EXIF orientation (decode.apply_orientation turns them upright there,
    the one orientation policy of every decoder)."""
    return (
        header.format == "jpeg"
        and header.components == 3
        and header.sof in NVJPEG_FRAMES
        and header.bits == 8
        and header.orientation == 1
    )


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
    torch._foreach_copy_(
        [o[:, : x.shape[1], : x.shape[2]] for o, x in zip(out.unbind(0), images)], images, non_blocking=True
    )
    return out


def run_head_on_device(
    p: BatchPipeline, images: list[torch.Tensor], windows: torch.Tensor | None, u: torch.Tensor, device: torch.device
) -> torch.Tensor:
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
        raise UsageError(
            f"images in one batch have different shapes {sorted(shapes)[:3]}: add a resize/center_crop or "
            "random_resized_crop step to the transforms."
        )
    return torch.stack(heads)


def preprocess_on_device(
    p: BatchPipeline, images: list[torch.Tensor], u: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Decoded images of any sizes -> the spec's uint8 output batch on `device` (predict, data compare)."""
    if not images:
        return torch.empty(0, dtype=torch.uint8, device=device)
    x = run_head_on_device(p, images, None, u, device)
    n = len(x)
    return p.run_tail(x, p.params(u, torch.full((n,), x.shape[2]), torch.full((n,), x.shape[3]), p.head, None))

"""The `dali` backend: an NVIDIA DALI pipeline decodes (nvJPEG, "mixed") and resamples on the GPU; it runs
only when DALI imports (`pip install 'torchsprint[dali]'`, the CUDA 13 build nvidia-dali-cuda130 that
matches PyTorch's CUDA 13 wheels).

File bytes and labels come from our EpochSampler, so sharding, epoch seeding, mid-epoch resume, equal step
counts per rank and bad-sample accounting are those of every other backend. DALI draws nothing itself:
each sample's crop window and flips come from its own seed (augment.py), the same uniforms and windows
the gpu backend draws, computed per batch in Python and handed to DALI per sample (external_source:
ROI, flip flags). So the randomness is per sample, differs by rank (ranks see different samples),
matches the other backends' crops, and the pipeline holds no state a checkpoint would miss: resume is
exact. Supported spec: a head with a fused form (random_resized_crop; resize to (h, w); center_crop;
resize shorter side + center_crop), then hflip/vflip, then normalize. DALI resizes with its own filter
(measured on its CPU backend: within 2 levels of torchvision's, mean 0.1-0.2).

Errors: files whose header is unreadable or too large go through data.on_bad_sample before DALI sees
them. A file DALI's decoder rejects fails the whole batch; that batch's files are then decoded with the
CPU decoder, the unreadable ones are skipped (counted) or stop the run (data.on_bad_sample=error), and
the pipeline is rebuilt from that batch. Queue: data.prefetch_factor batches ahead (default 2),
max(2, data.num_workers) CPU threads. Output is uint8 NCHW; normalisation is the shared DeviceNormalize.
"""

from __future__ import annotations

import numpy as np
import torch

from torchsprint.data.core import LOADERS, Backend, DataInfo, EpochSampler, Loaders, cuda_missing, draw_start
from torchsprint.data.preprocess.augment import BatchPipeline, compile_batch_spec
from torchsprint.data.preprocess.batch_geometry import Flip
from torchsprint.data.preprocess.decode import BadImage, check_size, decode_bytes, read_header
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.errors import UsageError


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def check_dali_spec(p: BatchPipeline, where: str) -> None:
    """DALI runs the fused head (one ROI resize per sample) and flips; anything else is refused by name."""
    if p.head and p.geometry is None:
        names = [name for name, _ in p.steps[: p.head]]
        raise UsageError(
            f"{where}: data.backend=dali runs one crop+resize per sample (random_resized_crop, resize, "
            f"center_crop, or resize then center_crop) before the flips; {names} has no such form. "
            "Use data.backend=gpu or cpu."
        )
    if not p.head:
        raise UsageError(
            f"{where}: data.backend=dali needs a step that gives every image one size (random_resized_crop, "
            "resize to [h, w] or center_crop)."
        )
    for name, op in p.steps[p.head :]:
        if not isinstance(op, Flip):
            raise UsageError(
                f"{where}: step '{name}' is not supported by data.backend=dali after the crop (it supports "
                "hflip, vflip, normalize there). Use data.backend=gpu or cpu."
            )


def image_size(data: bytes, header) -> tuple[int, int]:
    """(height, width) from the header; Pillow reads it for formats the sniffer does not size (BMP, WebP...)."""
    if header.height is not None:
        return header.height, header.width
    import io

    from PIL import Image

    try:
        w, h = Image.open(io.BytesIO(data)).size
    except Exception as e:  # noqa: BLE001 - whatever Pillow says, the file is not an image it can size
        raise BadImage(f"not a readable image ({type(e).__name__})") from None
    return h, w


class DaliLoader:
    """Feeds per-sample bytes, crop windows (ROI) and flip flags from EpochSampler into a DALI pipeline;
    yields normalised device tensors.

    Args:
        device: the DALI device: "gpu" (nvJPEG "mixed" decode, GPU resize) or "cpu" (tests of the
            graph on machines without a GPU; the same ops on DALI's CPU backend).
    """

    def __init__(
        self,
        raw,
        pipeline: BatchPipeline,
        sampler: EpochSampler,
        batch_size: int,
        drop_last: bool,
        rt,
        normalize: DeviceNormalize,
        threads: int,
        queue: int,
        on_bad_sample: str,
        max_pixels: int,
        decoder: str,
        device: str = "gpu",
    ):
        self.raw, self.pipeline, self.sampler, self.batch_size, self.drop_last = (
            raw,
            pipeline,
            sampler,
            batch_size,
            drop_last,
        )
        self.normalize, self.on_bad_sample, self.max_pixels, self.decoder = (
            normalize,
            on_bad_sample,
            max_pixels,
            decoder,
        )
        self.rt, self.threads, self.queue, self.dali_device = rt, threads, queue, device
        self.skipped: list[str] = []
        self.bad: set[int] = set()  # sample indices found unreadable by the CPU check after a DALI error

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _bad_sample(self, path: str, reason) -> None:
        if self.on_bad_sample == "error":
            raise UsageError(f"unreadable sample {path}: {reason}. Fix or remove it, or set data.on_bad_sample=skip.")
        self.skipped.append(f"{path}: {reason}")

    def _prepare(self, keys: list[tuple[int, int]]) -> tuple[list, ...]:
        """One batch's DALI inputs: bytes, ROI start/end (y, x), flip flags, labels; unreadable headers skipped."""
        p, geo = self.pipeline, self.pipeline.geometry
        blobs, sizes, seeds, labels = [], [], [], []
        for index, seed in keys:
            if index in self.bad:
                continue
            path, target = self.raw.samples[index]
            try:
                data = self.raw.read(index)[0]
                header = read_header(data)
                check_size(header, self.max_pixels)
                sizes.append(image_size(data, header))
            except (BadImage, OSError) as e:
                self._bad_sample(path, e)
                continue
            blobs.append(np.frombuffer(data, dtype=np.uint8))
            seeds.append(seed)
            labels.append(np.array(target, dtype=np.int64))
        if not blobs:
            raise UsageError(f"every sample of a batch was unreadable, e.g. {self.skipped[-1:]}")
        n = len(blobs)
        u = p.draw(torch.tensor(seeds, dtype=torch.int64))
        hs, ws = torch.tensor([s[0] for s in sizes]), torch.tensor([s[1] for s in sizes])
        rows, cols = geo.windows(p.params(u, hs, ws, 0, p.head), hs, ws)
        out_h, out_w = geo.out_size

        def roi(w, out):  # (start, length, resized, offset) -> the source interval resampled to `out` pixels
            start, length, resized, offset = (v.double() for v in w)
            scale = length / resized
            return start + offset * scale, start + (offset + out) * scale

        y0, y1 = roi(rows, out_h)
        x0, x1 = roi(cols, out_w)
        starts = torch.stack([y0, x0], 1).float().numpy()
        ends = torch.stack([y1, x1], 1).float().numpy()
        hflip = torch.zeros(n, dtype=torch.bool)
        vflip = torch.zeros(n, dtype=torch.bool)
        tail = p.params(u, torch.full((n,), out_h), torch.full((n,), out_w), p.head, None)
        for (_, op), prm in zip(p.steps[p.head :], tail):  # flips compose by parity
            if op.dim == -1:
                hflip ^= prm["flip"]
            else:
                vflip ^= prm["flip"]
        as_list = lambda t, dtype: [np.array(v, dtype=dtype) for v in t.tolist()]  # noqa: E731
        return (blobs, list(starts), list(ends), as_list(hflip.int(), np.int32), as_list(vflip.int(), np.int32), labels)

    def _build(self, batches: list, start: int):
        """A pipeline whose external source yields batches[start:] (rebuilt per epoch, resume and after errors)."""
        from nvidia.dali import fn, pipeline_def, types

        source = (self._prepare(keys) for keys in batches[start:])
        geo = self.pipeline.geometry
        gpu = self.dali_device == "gpu"

        @pipeline_def(
            batch_size=self.batch_size,
            num_threads=self.threads,
            device_id=(self.rt.device.index or 0) if gpu else None,
            seed=self.sampler.seed + self.rt.rank,
            prefetch_queue_depth=self.queue,
            exec_dynamic=True,
        )
        def pipe():
            data, roi_start, roi_end, hflip, vflip, labels = fn.external_source(
                source=source,
                num_outputs=6,
                batch=True,
                dtype=[types.UINT8, types.FLOAT, types.FLOAT, types.INT32, types.INT32, types.INT64],
            )
            images = fn.decoders.image(data, device="mixed" if gpu else "cpu", output_type=types.RGB)
            images = fn.resize(
                images,
                resize_y=geo.out_size[0],
                resize_x=geo.out_size[1],
                roi_start=roi_start,
                roi_end=roi_end,
                antialias=geo.antialias,
            )
            images = fn.flip(images, horizontal=hflip, vertical=vflip)
            return fn.transpose(images, perm=[2, 0, 1]), labels  # HWC -> CHW, uint8

        p = pipe()
        p.build()
        return p

    def _to_torch(self, images, labels) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.rt.device
        y = torch.from_numpy(np.array(labels.as_tensor())).to(dev, non_blocking=True)
        t = images.as_tensor()
        if self.dali_device != "gpu":
            return torch.from_numpy(np.array(t)).to(dev), y
        from nvidia.dali.plugin.pytorch import feed_ndarray

        x = torch.empty(t.shape(), dtype=torch.uint8, device=dev)
        feed_ndarray(t, x, cuda_stream=torch.cuda.current_stream(dev))  # ordered on the stream that will read x
        return x, y

    def _check_batch(self, keys: list[tuple[int, int]]) -> bool:
        """After DALI failed on a batch: decode its files on the CPU; unreadable ones become bad samples.
        Returns whether any was found (else the error was not the data's)."""
        found = False
        for index, _ in keys:
            if index in self.bad:
                continue
            path, _ = self.raw.samples[index]
            try:
                decode_bytes(self.raw.read(index)[0], decoder=self.decoder, max_pixels=self.max_pixels)
            except (BadImage, OSError) as e:
                self.bad.add(index)
                self._bad_sample(path, e)
                found = True
        return found

    def __iter__(self):
        keys = list(iter(self.sampler))
        batches = [keys[b * self.batch_size : (b + 1) * self.batch_size] for b in range(len(self))]
        b = 0
        while b < len(batches):
            pipe = self._build(batches, b)
            try:
                while b < len(batches):
                    images, labels = pipe.run()
                    x, y = self._to_torch(images, labels)
                    b += 1
                    yield self.normalize(x), y
            except RuntimeError:
                if not self._check_batch(batches[b]):
                    raise
                del pipe  # rebuilt from batch b without the unreadable files


def dali_loader(
    data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32, dali_device: str = "gpu"
) -> Loaders:
    """NVIDIA DALI decode (nvJPEG) and resampling, fed by our sampler with our per-sample draws."""
    for split in (splits.train, splits.val):
        if getattr(split, "streaming", False):
            raise UsageError(
                f"data.backend=dali reads image files by index; dataset '{data_cfg.dataset}' streams tar "
                "shards. Use data.backend=gpu (nvJPEG on the JPEG bytes from the tar) or cpu."
            )
        if not hasattr(split, "samples") or not hasattr(split, "read"):
            raise UsageError(
                "data.backend=dali reads image files; dataset "
                f"'{data_cfg.dataset}' is in memory. Use data.backend=memory."
            )
    if splits.in_channels != 3:
        raise UsageError("data.backend=dali decodes RGB images; for gray images use data.backend=cpu.")
    train_p = compile_batch_spec(data_cfg.train.transforms, "data.train.transforms", 3, "dali")
    eval_p = compile_batch_spec(data_cfg.eval.transforms, "data.eval.transforms", 3, "dali")
    check_dali_spec(train_p, "data.train.transforms")
    check_dali_spec(eval_p, "data.eval.transforms")
    if (train_p.mean, train_p.std) != (eval_p.mean, eval_p.std):
        raise UsageError("data.train.transforms and data.eval.transforms must normalize with the same mean and std.")
    norm = DeviceNormalize(train_p.mean, train_p.std, rt.device, dtype=dtype, channels_last=channels_last)
    out = []
    for raw, pipe, train in ((splits.train, train_p, True), (splits.val, eval_p, False)):
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
        out.append(
            DaliLoader(
                raw,
                pipe,
                sampler,
                bs,
                drop,
                rt,
                norm,
                max(2, data_cfg.num_workers),
                data_cfg.prefetch_factor,
                data_cfg.on_bad_sample,
                data_cfg.max_image_pixels,
                raw.decoder,
                dali_device,
            )
        )
    info = DataInfo(splits.classes, 3, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=out[0], val=out[1], info=info)


NOT_INSTALLED = "NVIDIA DALI is not installed: `pip install 'torchsprint[dali]'` on a machine with a CUDA GPU"


def dali_cannot_run(rt) -> str | None:
    """Backend.cannot_run: DALI must import, and its GPU pipeline needs a CUDA device."""
    return NOT_INSTALLED if not dali_available() else cuda_missing(rt)


# Registered whether or not DALI imports, so that `data.backend: dali` on a machine without it says why and
# honours data.fallback like any backend that cannot run here. Not considered by `auto` until measured on a GPU.
LOADERS.register("dali")(Backend(dali_loader, cannot_run=dali_cannot_run))

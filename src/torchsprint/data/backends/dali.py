"""The `dali` backend: an NVIDIA DALI pipeline equivalent to the spec; registered only when DALI imports.

File bytes and labels come from our EpochSampler through an external source, so sharding, epoch
seeding, mid-epoch resume, equal step counts per rank and bad-sample accounting are those of every
other backend. DALI decodes ("mixed" = nvJPEG) and augments; its random draws come from DALI's own
seeded generators (deterministic per run seed, but not the same draws as the cpu/gpu backends).
Output is uint8 NCHW; normalisation is the shared DeviceNormalize, so all backends agree on it.
"""

from __future__ import annotations

import torch

from torchsprint.data.core import LOADERS, DataInfo, EpochSampler, Loaders
from torchsprint.data.decode import BadImage, read_bytes, read_header
from torchsprint.data.normalize import DeviceNormalize
from torchsprint.data.transforms import compile_spec, parse_step
from torchsprint.errors import UsageError


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _size(arg):
    size = arg["size"] if isinstance(arg, dict) else arg
    return [size, size] if isinstance(size, int) else list(size)


def build_graph(fn, types, images, steps, seed: int, where: str):
    """Spec steps -> DALI ops on decoded HWC uint8 GPU images. Unsupported steps are refused by name."""
    for name, arg in steps:
        kw = arg if isinstance(arg, dict) else {}
        if name == "random_resized_crop":
            images = fn.random_resized_crop(images, size=_size(arg), random_area=list(kw.get("scale", (0.08, 1.0))),
                                            random_aspect_ratio=list(kw.get("ratio", (3 / 4, 4 / 3))),
                                            antialias=True, seed=seed)
        elif name == "resize":
            size = kw.get("size", arg)
            if isinstance(size, int) or len(size) == 1:
                images = fn.resize(images, resize_shorter=size if isinstance(size, int) else size[0], antialias=True)
            else:
                images = fn.resize(images, resize_y=size[0], resize_x=size[1], antialias=True)
        elif name == "center_crop":
            images = fn.crop(images, crop=_size(arg))
        elif name in ("hflip", "vflip"):
            p = kw.get("p", arg if isinstance(arg, float) else 0.5)
            coin = fn.random.coin_flip(probability=p, seed=seed + len(name))
            images = fn.flip(images, horizontal=coin) if name == "hflip" else fn.flip(images, vertical=coin)
        elif name == "normalize":
            continue
        else:
            raise UsageError(f"{where}: step '{name}' is not supported by data.backend=dali (it supports "
                             "random_resized_crop, resize, center_crop, hflip, vflip, normalize). Use data.backend=gpu or cpu.")
    return fn.transpose(images, perm=[2, 0, 1])  # HWC -> CHW, still uint8


class DaliLoader:
    """Feeds (bytes, label) batches from EpochSampler into a DALI pipeline; yields normalised device tensors."""

    def __init__(self, raw, spec, sampler: EpochSampler, batch_size: int, drop_last: bool, rt, normalize, seed: int,
                 workers: int, on_bad_sample: str, where: str):
        self.raw, self.sampler, self.batch_size, self.drop_last = raw, sampler, batch_size, drop_last
        self.normalize, self.on_bad_sample, self.device = normalize, on_bad_sample, rt.device
        self.steps = [parse_step(s, where) for s in spec]
        self.skipped: list[str] = []
        self.pipe = self._build(rt, seed, max(1, workers), where)

    def _build(self, rt, seed, threads, where):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=self.batch_size, num_threads=threads, device_id=rt.device.index or 0, seed=seed,
                      prefetch_queue_depth=1, exec_dynamic=True)
        def pipe():
            data = fn.external_source(name="bytes", dtype=types.UINT8, no_copy=False)
            images = fn.decoders.image(data, device="mixed", output_type=types.RGB)
            return build_graph(fn, types, images, self.steps, seed, where)

        p = pipe()
        p.build()
        return p

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _read(self, keys):
        import numpy as np

        data, targets = [], []
        for index, _ in keys:
            path, target = self.raw.samples[index]
            try:
                b = read_bytes(path)
                read_header(b)
            except (BadImage, OSError) as e:
                if self.on_bad_sample == "error":
                    raise UsageError(f"unreadable sample {path}: {e}. Fix or remove it, or set data.on_bad_sample=skip.") from None
                self.skipped.append(f"{path}: {e}")
                continue
            data.append(np.frombuffer(b, dtype=np.uint8))
            targets.append(target)
        return data, targets

    def __iter__(self):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        keys = list(iter(self.sampler))
        for b in range(len(self)):
            data, targets = self._read(keys[b * self.batch_size : (b + 1) * self.batch_size])
            if not data:
                raise UsageError(f"every sample of a batch was unreadable, e.g. {self.skipped[-1:]}")
            self.pipe.feed_input("bytes", data)
            (out,) = self.pipe.run()
            out = out.as_tensor()
            x = torch.empty(out.shape(), dtype=torch.uint8, device=self.device)
            feed_ndarray(out, x, cuda_stream=torch.cuda.current_stream(self.device))
            yield self.normalize(x), torch.tensor(targets, device=self.device)


def dali_loader(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """NVIDIA DALI decode (nvJPEG) and augmentation, fed by our sampler."""
    from torchsprint.data.backends.gpu import needs_cuda

    kw = dict(seed=seed, channels_last=channels_last, dtype=dtype)
    if rt.device.type != "cuda":
        return needs_cuda("dali", rt, data_cfg, splits, kw)
    for split in (splits.train, splits.val):
        if not hasattr(split, "samples"):
            raise UsageError(f"data.backend=dali reads image files; dataset '{data_cfg.dataset}' is in memory. Use data.backend=memory.")
    train_p = compile_spec(data_cfg.train.transforms, "data.train.transforms", splits.in_channels)
    eval_p = compile_spec(data_cfg.eval.transforms, "data.eval.transforms", splits.in_channels)
    norm = DeviceNormalize(train_p.mean, train_p.std, rt.device, dtype=dtype, channels_last=channels_last)
    out = []
    for raw, split, train, where in ((splits.train, data_cfg.train, True, "data.train.transforms"),
                                     (splits.val, data_cfg.eval, False, "data.eval.transforms")):
        sampler = EpochSampler(len(raw), seed=seed, shuffle=train, rank=rt.rank, world_size=rt.world_size, pad=train)
        bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop = train and data_cfg.drop_last and len(sampler) >= bs
        out.append(DaliLoader(raw, split.transforms, sampler, bs, drop, rt, norm, seed, data_cfg.num_workers,
                              data_cfg.on_bad_sample, where))
    info = DataInfo(splits.classes, splits.in_channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=out[0], val=out[1], info=info)


def register_dali() -> None:
    """Register the `dali` loader when nvidia.dali imports (pip install torchsprint[dali])."""
    if dali_available() and "dali" not in LOADERS:
        LOADERS.register("dali")(dali_loader)


register_dali()

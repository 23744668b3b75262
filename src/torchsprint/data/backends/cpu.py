"""The `cpu` backend: DataLoader workers decode and augment uint8 on the CPU; normalisation on the device."""

from __future__ import annotations

import torch

from torchsprint.data.core import LOADERS, DataInfo, EpochSampler, Loaders, prefetch_to_device
from torchsprint.data.normalize import DeviceNormalize
from torchsprint.data.transforms import compile_spec, decode_hint
from torchsprint.errors import UsageError


class SeededTransform(torch.utils.data.Dataset):
    """Applies a uint8 CPU pipeline to each raw sample under a per-sample seed from the sampler.

    Items are requested as (index, seed) by EpochSampler. Bad samples come back as
    (None, target, reason) and are filtered and counted by `collate`.
    """

    def __init__(self, raw, transform, on_bad_sample: str):
        self.raw, self.transform, self.on_bad_sample = raw, transform, on_bad_sample

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, key):
        index, seed = key
        return self.apply(*self.raw[index], seed)

    def apply(self, image, target, source, seed: int):
        """One decoded sample (image None: unreadable) -> (augmented image | None, target, None | reason)."""
        if image is None:
            if self.on_bad_sample == "error":
                raise UsageError(f"unreadable sample {source}. Fix or remove it, or set data.on_bad_sample=skip.")
            return None, target, source
        if self.transform is not None:
            in_worker = torch.utils.data.get_worker_info() is not None
            state = None if in_worker else torch.get_rng_state()  # keep the main process's RNG stream intact
            # Only the CPU generator: the CPU transforms draw from nothing else. torch.manual_seed would
            # also queue a lazy CUDA seeding in a worker without CUDA, formatting a Python stack trace
            # each time: 0.13 ms per image, 5% of the whole per-image cost (BENCHMARKS.md, "Data loading").
            torch.default_generator.manual_seed(seed)
            image = self.transform(image)
            if state is not None:
                torch.set_rng_state(state)
        return image, target, None


def collate(items):
    """Stack good samples into (uint8 NCHW, targets); return the reasons of bad ones alongside."""
    good = [(x, t) for x, t, _ in items if x is not None]
    skipped = [r for x, _, r in items if x is None]
    if not good:
        raise UsageError(f"every sample of a batch was unreadable, e.g. {skipped[0]}")
    xs = [x for x, _ in good]
    out = None
    if torch.utils.data.get_worker_info() is not None:
        # In a worker the batch goes to the main process through shared memory: stack straight into it
        # (as default_collate does) instead of stacking and then copying into it when it is sent.
        storage = xs[0]._typed_storage()._new_shared(len(xs) * xs[0].numel(), device=xs[0].device)
        out = xs[0].new(storage).resize_(len(xs), *xs[0].shape)
    try:
        images = torch.stack(xs, out=out)  # checks the shapes itself: no per-sample Python check on the fast path
    except RuntimeError:
        shapes = sorted({tuple(x.shape) for x in xs})
        if len(shapes) == 1:
            raise
        raise UsageError(
            f"images in one batch have different shapes {shapes[:3]}: add a resize/center_crop or "
            "random_resized_crop step to data.train.transforms and data.eval.transforms."
        ) from None
    targets = torch.as_tensor([t for _, t in good]) if not torch.is_tensor(good[0][1]) else torch.stack([t for _, t in good])
    return images, targets, skipped


class ShardBatch:
    """Worker side of the cpu backend on webdataset shards: (id, seed, bytes, target, source) entries ->
    decoded, augmented and collated like a batch of files (the same decode, transform and bad-sample policy)."""

    def __init__(self, raw, transform: SeededTransform):
        self.raw, self.transform = raw, transform

    def __call__(self, entries) -> tuple:
        return collate([self.transform.apply(*self.raw.decode(data, target, source), seed)
                        for _, seed, data, target, source in entries])


class DeviceLoader:
    """Wraps a DataLoader of uint8 batches: copies to the device and normalises there.

    On CUDA the copy and normalisation of batch i+1 run on a side stream while batch i
    computes (timm's PrefetchLoader idea); pinned memory makes the copy asynchronous.
    `batches` is the epoch handle: a BatchSampler over the loader's EpochSampler (files), or the
    ShardStream itself (webdataset shards): `batch_size`, `sampler.set_epoch(epoch, start_sample)`, `len`.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, batches, device, normalize: DeviceNormalize):
        self.loader, self.batches, self.sampler, self.device = loader, batches, batches.sampler, device
        self.normalize = normalize
        self.skipped: list[str] = []

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batches.batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def _to_device(self, batch):
        images, targets, skipped = batch
        self.skipped += skipped
        images = self.normalize(images.to(self.device, non_blocking=True))
        return images, targets.to(self.device, non_blocking=True)

    def __iter__(self):
        return prefetch_to_device(self.loader, self._to_device, self.device)


def make_loader(raw, pipeline, data_cfg, rt, *, seed, train: bool, channels_last, dtype) -> DeviceLoader:
    workers = data_cfg.num_workers
    bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
    transform = SeededTransform(raw, pipeline.cpu, data_cfg.on_bad_sample)
    common = dict(
        num_workers=workers,
        pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
        persistent_workers=data_cfg.persistent_workers and workers > 0,
        prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
        # Its own generator: a DataLoader without one draws worker base seeds from the global RNG, which
        # would shift the model's dropout stream between a resumed and an uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
    )
    if getattr(raw, "streaming", False):  # webdataset shards: workers make whole batches from their own shards
        from torchsprint.data.sources.webdataset import ShardStream

        if train and data_cfg.repeated_aug > 1:
            raise UsageError(f"data.repeated_aug={data_cfg.repeated_aug} repeats sample indices of a map-style dataset; "
                             "webdataset shards stream in shard order. Remove data.repeated_aug, or use image_folder.")

        stream = ShardStream(raw, ShardBatch(raw, transform), seed=seed, train=train, batch_size=bs,
                             drop_last=train and data_cfg.drop_last, rank=rt.rank, world_size=rt.world_size, workers=workers)
        loader = torch.utils.data.DataLoader(stream, batch_size=None, **common)
        batches = stream
    else:
        sampler = EpochSampler(len(raw), seed=seed, shuffle=train, rank=rt.rank, world_size=rt.world_size, pad=train,
                               repeats=data_cfg.repeated_aug if train else 1)
        batches = torch.utils.data.BatchSampler(sampler, bs, train and data_cfg.drop_last and len(sampler) >= bs)
        loader = torch.utils.data.DataLoader(transform, batch_size=bs, sampler=sampler, collate_fn=collate,
                                             drop_last=batches.drop_last, **common)
    norm = DeviceNormalize(pipeline.mean, pipeline.std, rt.device, dtype=dtype, channels_last=channels_last, recycle=True)
    return DeviceLoader(loader, batches, rt.device, norm)


@LOADERS.register("cpu")
def cpu_loader(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """DataLoader workers decode + augment uint8 on the CPU; the device normalises."""
    train_p = compile_spec(data_cfg.train.transforms, "data.train.transforms", splits.in_channels)
    eval_p = compile_spec(data_cfg.eval.transforms, "data.eval.transforms", splits.in_channels)
    if (train_p.mean, train_p.std) != (eval_p.mean, eval_p.std):
        raise UsageError("data.train.transforms and data.eval.transforms must normalize with the same mean and std.")
    kw = dict(seed=seed, channels_last=channels_last, dtype=dtype)
    train_raw, val_raw = splits.train, splits.val
    if hasattr(train_raw, "with_min_size"):  # image files: let JPEG decoders scale in the DCT when the spec shrinks 2x+
        train_raw = train_raw.with_min_size(decode_hint(data_cfg.train.transforms, "data.train.transforms"))
        val_raw = val_raw.with_min_size(decode_hint(data_cfg.eval.transforms, "data.eval.transforms"))
    train = make_loader(train_raw, train_p, data_cfg, rt, train=True, **kw)
    val = make_loader(val_raw, eval_p, data_cfg, rt, train=False, **kw)
    info = DataInfo(splits.classes, splits.in_channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=train, val=val, info=info)

"""The `cpu` backend: DataLoader workers decode and augment uint8 on the CPU; normalisation on the device."""

from __future__ import annotations

import torch

from torchsprint.data.core import (
    LOADERS,
    Backend,
    DataInfo,
    EpochSampler,
    Loaders,
    TensorImages,
    draw_start,
)
from torchsprint.data.prefetch import prefetch_to_device
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.data.preprocess.progressive import FIXED, attach_schedule
from torchsprint.data.preprocess.transforms import compile_spec, decode_hint
from torchsprint.errors import UsageError


class SeededTransform(torch.utils.data.Dataset):
    """Applies each split's uint8 CPU pipeline to its raw samples under a per-sample seed from the sampler.

    Batches are requested as KeyBatch(split, indices, seeds) by SharedBatches (split: a position in
    `raws`); one item as (split, index, seed). Bad samples come back as (None, target, reason) and are
    filtered and counted by `collate`.
    """

    def __init__(self, raws: list, transforms: list, on_bad_sample: str):
        self.raws, self.transforms, self.on_bad_sample = raws, transforms, on_bad_sample

    def __len__(self) -> int:
        return sum(len(r) for r in self.raws)

    def __getitem__(self, key):
        split, index, seed = key
        return self.apply(split, *self.raws[split][index], seed)

    def apply(self, split: int, image, target, source, seed: int):
        """One decoded sample of `split` (image None: unreadable) -> (augmented image | None, target, None | reason)."""
        if image is None:
            if self.on_bad_sample == "error":
                raise UsageError(f"unreadable sample {source}. Fix or remove it, or set data.on_bad_sample=skip.")
            return None, target, source
        transform = self.transforms[split]
        if transform is not None:
            in_worker = torch.utils.data.get_worker_info() is not None
            state = None if in_worker else torch.get_rng_state()  # keep the main process's RNG stream intact
            # Only the CPU generator: the CPU transforms draw from nothing else. torch.manual_seed would
            # also queue a lazy CUDA seeding in a worker without CUDA, formatting a Python stack trace
            # each time: 0.13 ms per image, 5% of the whole per-image cost (BENCHMARKS.md, "Data loading").
            torch.default_generator.manual_seed(seed)
            image = transform(image)
            if state is not None:
                torch.set_rng_state(state)
        return image, target, None

    def __getitems__(self, keys: KeyBatch):
        """A whole batch (DataLoader's batched fetch). Already-decoded images with no per-sample transform
        and class-index labels are gathered with one index instead of a tensor index and a Python call
        per sample: that per-sample path cost more than a linear model's whole step at batch 32
        (BENCHMARKS.md, "Memory footprint and per-step overhead"). Same values either way."""
        split, indices, seeds = keys
        raw = self.raws[split]
        labels = getattr(raw, "labels", None)
        if (
            self.transforms[split] is None
            and isinstance(raw, TensorImages)
            and torch.is_tensor(labels)
            and labels.ndim == 1
            and not labels.is_floating_point()
        ):
            idx = torch.tensor(indices, dtype=torch.int64)
            return [Gathered((raw.images[idx].contiguous(), labels[idx].to(torch.int64)))]
        return [self[(split, i, s)] for i, s in zip(indices, seeds)]


class KeyBatch(tuple):
    """One batch's keys: (split, sample indices, per-sample seeds); a tuple of two lists, not a tuple per
    sample (building those cost ~1 us per sample in the main process)."""


class Gathered(tuple):
    """A whole batch fetched by SeededTransform.__getitems__: (uint8 images, int64 targets)."""


class SharedBatches(torch.utils.data.Sampler):
    """The batch sampler of the one DataLoader that the train and the eval loader share: batches of
    (split, index, seed) keys of whichever split `start` was last called for.

    One DataLoader, so one set of worker processes: with separate train and eval DataLoaders and
    persistent workers, the train workers sat idle beside the eval ones during every evaluation, and
    each worker holds its own copy-on-write pages of the trainer: 5 processes at the peak instead of 3
    (+0.9 GB of tree RSS for ResNet-18 at 112 px with 2 workers; BENCHMARKS.md, "Memory footprint").
    """

    def __init__(self):
        self.active = None
        self.generation = 0  # which iteration owns the workers; an older one must not resume

    def start(self, split: int, sampler: EpochSampler, batch_size: int, drop_last: bool) -> int:
        self.active = (split, sampler, batch_size, drop_last)
        self.generation += 1
        return self.generation

    def __iter__(self):
        split, sampler, batch_size, drop_last = self.active  # bound now: the DataLoader asks for batches ahead
        return _batches(split, *sampler.keys(), batch_size, drop_last)

    def __len__(self) -> int:
        split, sampler, batch_size, drop_last = self.active
        n = len(sampler)
        return n // batch_size if drop_last else -(-n // batch_size)


def _batches(split: int, order: list[int], seeds: list[int], batch_size: int, drop_last: bool):
    for i in range(0, len(order), batch_size):
        if drop_last and i + batch_size > len(order):
            return
        yield KeyBatch((split, order[i : i + batch_size], seeds[i : i + batch_size]))


class SplitBatches:
    """One split's uint8 batches (images, targets, skipped) from the shared DataLoader."""

    def __init__(
        self, shared: torch.utils.data.DataLoader, split: int, sampler: EpochSampler, batch_size: int, drop_last: bool
    ):
        self.shared, self.split, self.sampler = shared, split, sampler
        self.batch_size, self.drop_last = batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        pool: SharedBatches = self.shared.batch_sampler
        mine = pool.start(self.split, self.sampler, self.batch_size, self.drop_last)
        for batch in self.shared:  # persistent workers: the same processes, reset to this split's keys
            if pool.generation != mine:
                raise RuntimeError(
                    "the train and eval loaders of the cpu backend share their worker processes: iterate one at a time"
                )
            yield batch


def collate(items):
    """Stack good samples into (uint8 NCHW, targets); return the reasons of bad ones alongside."""
    if len(items) == 1 and isinstance(items[0], Gathered):
        images, targets = items[0]
        return images, targets, []
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
    targets = (
        torch.as_tensor([t for _, t in good]) if not torch.is_tensor(good[0][1]) else torch.stack([t for _, t in good])
    )
    return images, targets, skipped


class ShardBatch:
    """Worker side of the cpu backend on webdataset shards: (id, seed, bytes, target, source) entries ->
    decoded, augmented and collated like a batch of files (the same decode, transform and bad-sample policy)."""

    def __init__(self, raw, transform: SeededTransform):
        self.raw, self.transform = raw, transform

    def __call__(self, entries) -> tuple:
        return collate(
            [
                self.transform.apply(0, *self.raw.decode(data, target, source), seed)
                for _, seed, data, target, source in entries
            ]
        )


class DeviceLoader:
    """Wraps one split's uint8 batches: copies to the device and normalises there.

    On CUDA the copy and normalisation of batch i+1 run on a side stream while batch i
    computes (timm's PrefetchLoader idea); pinned memory makes the copy asynchronous.
    `loader` yields the uint8 (images, targets, skipped) batches themselves; `batches` is the epoch handle
    (`batch_size`, `sampler.set_epoch(epoch, start_sample)`, `len`): the SplitBatches of the shared
    DataLoader (files, tensors), or the ShardStream itself (webdataset shards).
    """

    def __init__(self, loader, batches, device, normalize: DeviceNormalize):
        self.loader, self.batches, self.sampler, self.device = loader, batches, batches.sampler, device
        self.normalize = normalize
        self.skipped: list[str] = []
        self.resolution = FIXED  # data.progressive (training loader): the crop side of each epoch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.resolution.set_epoch(epoch)  # before any batch of the epoch is requested from the workers
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


def make_loaders(
    raws: list,
    pipelines: list,
    data_cfg,
    rt,
    *,
    seed,
    channels_last,
    dtype,
    train_weights: torch.Tensor | None = None,
    weights_from: int = 0,
) -> list[DeviceLoader]:
    """A DeviceLoader per split (the first one trains), all drawing from one DataLoader and its workers."""
    workers = data_cfg.num_workers
    shared = torch.utils.data.DataLoader(
        SeededTransform(raws, [p.cpu for p in pipelines], data_cfg.on_bad_sample),
        batch_sampler=SharedBatches(),
        num_workers=workers,
        collate_fn=collate,
        pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
        persistent_workers=data_cfg.persistent_workers and workers > 0,
        prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
        # Its own generator: a DataLoader without one draws worker base seeds from the global RNG, which
        # would shift the model's dropout stream between a resumed and an uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
    )
    out = []
    for split, (raw, pipeline) in enumerate(zip(raws, pipelines)):
        train = split == 0
        sampler = EpochSampler(
            len(raw),
            seed=seed,
            shuffle=train,
            rank=rt.rank,
            world_size=rt.world_size,
            pad=train,
            repeats=data_cfg.repeated_aug if train else 1,
            weights=train_weights if train else None,
            weights_from=weights_from,
        )
        batch_size = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop_last = train and data_cfg.drop_last and len(sampler) >= data_cfg.batch_size
        norm = DeviceNormalize(
            pipeline.mean, pipeline.std, rt.device, dtype=dtype, channels_last=channels_last, recycle=True
        )
        split_batches = SplitBatches(shared, split, sampler, batch_size, drop_last)
        out.append(DeviceLoader(split_batches, split_batches, rt.device, norm))
    return out


def make_stream_loader(raw, pipeline, data_cfg, rt, *, seed, train: bool, channels_last, dtype) -> DeviceLoader:
    """One split of webdataset shards: its own DataLoader whose workers make whole batches from their own shards
    (a stream has no sample indices to share a batch sampler with)."""
    from torchsprint.data.sources.shard_stream import ShardStream

    if train and data_cfg.repeated_aug > 1:
        raise UsageError(
            f"data.repeated_aug={data_cfg.repeated_aug} repeats sample indices of a map-style dataset; "
            "webdataset shards stream in shard order. Remove data.repeated_aug, or use image_folder."
        )
    workers = data_cfg.num_workers
    bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
    transform = SeededTransform([raw], [pipeline.cpu], data_cfg.on_bad_sample)
    stream = ShardStream(
        raw,
        ShardBatch(raw, transform),
        seed=seed,
        train=train,
        batch_size=bs,
        drop_last=train and data_cfg.drop_last,
        rank=rt.rank,
        world_size=rt.world_size,
        workers=workers,
    )
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        pin_memory=data_cfg.pin_memory and rt.device.type == "cuda",
        persistent_workers=data_cfg.persistent_workers and workers > 0,
        prefetch_factor=data_cfg.prefetch_factor if workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )
    norm = DeviceNormalize(
        pipeline.mean, pipeline.std, rt.device, dtype=dtype, channels_last=channels_last, recycle=True
    )
    return DeviceLoader(loader, stream, rt.device, norm)


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
    if getattr(train_raw, "streaming", False):  # webdataset shards
        train = make_stream_loader(train_raw, train_p, data_cfg, rt, train=True, **kw)
        val = make_stream_loader(val_raw, eval_p, data_cfg, rt, train=False, **kw)
    else:
        train, val = make_loaders(
            [train_raw, val_raw],
            [train_p, eval_p],
            data_cfg,
            rt,
            **kw,
            train_weights=splits.train_weights,
            weights_from=draw_start(splits),
        )
    train.resolution = attach_schedule(data_cfg, train_p.cpu.transforms if train_p.cpu is not None else [])
    info = DataInfo(splits.classes, splits.in_channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=train, val=val, info=info)


LOADERS.register("cpu")(Backend(cpu_loader, auto=True, progressive=True))  # runs on any device

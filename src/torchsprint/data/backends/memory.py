"""The `memory` backend: the whole decoded dataset as one uint8 tensor on the device, augmented in batches.

For small datasets (digits, CIFAR: 50,000 x 3 x 32 x 32 uint8 = 154 MB) this removes the input
pipeline: a batch is one gather from device memory plus a few batched ops with per-sample parameters
(random crop with padding, flip, cutout), the way the fastest CIFAR-10 speedruns feed their GPU.
"""

from __future__ import annotations

import torch

from torchsprint.data.core import (
    LOADERS,
    Backend,
    DataInfo,
    EpochSampler,
    Loaders,
    draw_start,
    memory_budget,
    sample_seeds,
    size_text,
)
from torchsprint.data.preprocess.augment import BatchPipeline, compile_batch_spec
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.data.preprocess.progressive import FIXED, attach_schedule
from torchsprint.errors import UsageError


def decode_all(
    raw, on_bad_sample: str, num_workers: int = 0, budget: tuple[int, str] | None = None, held: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Decode every sample of `raw` into (uint8 N x C x H x W, int64 or stacked tensor targets, skipped reasons).

    Already-decoded datasets (TensorImages) are taken as they are. Unreadable samples are skipped
    (counted, with their paths) or raise, per `on_bad_sample`; all ranks decode the same dataset, so
    they all drop the same samples and keep equal step counts. `budget` (bytes, in words): decoding stops
    with a UsageError as soon as the images exceed it, before the process runs out of memory (a dataset
    whose size build_loaders could not know up front: streamed shards, files of unknown size); `held`
    bytes (an earlier split) count against it.
    """
    limit, limit_text = budget if budget is not None else (None, "")

    def refuse(nbytes: int, done: str):
        raise UsageError(
            f"data.backend=memory: the decoded dataset takes {size_text(nbytes)}{done}, over the "
            f"{size_text(limit)} it may use ({limit_text}). Use data.backend=cpu (it loads batch by "
            "batch), or raise data.memory_budget_gib."
        )

    if hasattr(raw, "images") and hasattr(raw, "labels"):
        if limit is not None and held + raw.images.numel() > limit:
            refuse(held + raw.images.numel(), "")
        return raw.images, torch.as_tensor(raw.labels, dtype=torch.int64), []
    images, targets, skipped = [], [], []
    if getattr(raw, "streaming", False):  # webdataset shards: read once, in order, in this process
        loader = [[raw.decode(data, target, source) for _, data, target, source in raw.read_all()]]
    else:
        # Its own generator: without one, iterating a DataLoader draws its workers' base seed from the global RNG
        # (even with num_workers=0), so building this backend shifted the model's initial weights against the
        # cpu and gpu backends for the same run.seed (tests/e2e/data/test_backend_agreement.py).
        loader = torch.utils.data.DataLoader(
            raw, batch_size=64, num_workers=num_workers, collate_fn=list, generator=torch.Generator().manual_seed(0)
        )
    for chunk in loader:
        for image, target, source in chunk:
            if image is None:
                if on_bad_sample == "error":
                    raise UsageError(f"unreadable sample {source}. Fix or remove it, or set data.on_bad_sample=skip.")
                skipped.append(source)
                continue
            images.append(image)
            targets.append(target)
            held += image.numel()  # uint8: one byte per element
            if limit is not None and held > limit:
                refuse(held, f" after {len(images):,} of {len(raw):,} images")
    if not images:
        raise UsageError(f"no readable images (e.g. {skipped[:1]}).")
    shapes = sorted({tuple(x.shape) for x in images})
    if len(shapes) > 1:
        raise UsageError(
            f"data.backend=memory keeps one tensor of same-size images, but the images have {len(shapes)} sizes "
            f"(e.g. {shapes[:3]}). Resize the files to one size, or use data.backend=cpu/gpu."
        )
    # Class indices become int64; tensor targets (multi-hot label vectors) are stacked as they are.
    stacked = (
        torch.stack(targets)
        if torch.is_tensor(targets[0])
        else torch.tensor([int(t) for t in targets], dtype=torch.int64)
    )
    return torch.stack([x.contiguous() for x in images]), stacked, skipped


class MemoryLoader:
    """Batches gathered from a device-resident uint8 tensor; augmentation batched on the device.

    Per-sample parameters come from each sample's seed (core.sample_seed(seed, epoch, index)), so
    `set_epoch(epoch, start_batch)` resumes mid-epoch exactly: the skipped batches are never computed.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        pipeline: BatchPipeline,
        sampler: EpochSampler,
        batch_size: int,
        drop_last: bool,
        normalize: DeviceNormalize,
    ):
        self.images, self.targets, self.pipeline, self.sampler = images, targets, pipeline, sampler
        self.batch_size, self.drop_last, self.normalize = batch_size, drop_last, normalize
        self.skipped: list[str] = []
        self.resolution = FIXED  # data.progressive (training loader): the crop side of each epoch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.resolution.set_epoch(epoch)
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        order, keys = (torch.tensor(x[self.sampler.start :], dtype=torch.int64) for x in self.sampler.keyed_indices())
        seeds = sample_seeds(self.sampler.seed, self.sampler.epoch, keys)  # keys: each repeated copy its own seed
        dev = self.images.device
        order_dev = order.to(dev, non_blocking=True)
        for b in range(len(self)):
            sl = slice(b * self.batch_size, (b + 1) * self.batch_size)
            idx = order_dev[sl]
            x = self.pipeline(self.images[idx], seeds[sl])
            yield self.normalize(x), self.targets[idx]


def fits_on_device(nbytes: int, device: torch.device) -> None:
    """Refuse datasets that would take more than half of the free device memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free // 2:
            raise UsageError(
                f"data.backend=memory: the decoded dataset needs {nbytes / 2**30:.1f} GiB, more than half "
                f"of the {free / 2**30:.1f} GiB free on {device}. Use data.backend=gpu or cpu."
            )


def memory_loader(data_cfg, splits, rt, *, seed, channels_last=False, dtype=torch.float32) -> Loaders:
    """Whole dataset decoded once into device memory; batched per-sample augmentation there."""
    train_p = compile_batch_spec(data_cfg.train.transforms, "data.train.transforms", splits.in_channels, "memory")
    eval_p = compile_batch_spec(data_cfg.eval.transforms, "data.eval.transforms", splits.in_channels, "memory")
    if (train_p.mean, train_p.std) != (eval_p.mean, eval_p.std):
        raise UsageError("data.train.transforms and data.eval.transforms must normalize with the same mean and std.")
    norm = DeviceNormalize(train_p.mean, train_p.std, rt.device, dtype=dtype, channels_last=channels_last)
    loaders = []
    budget, held = memory_budget(rt.device, data_cfg.memory_budget_gib), 0
    for raw, pipe, train in ((splits.train, train_p, True), (splits.val, eval_p, False)):
        if len(raw) == 0:
            images, targets, skipped = (
                torch.zeros(0, splits.in_channels, 1, 1, dtype=torch.uint8),
                torch.zeros(0, dtype=torch.int64),
                [],
            )
        else:
            # The budget covers both splits: the training images count while validation decodes.
            images, targets, skipped = decode_all(raw, data_cfg.on_bad_sample, data_cfg.num_workers, budget, held)
            held += images.numel()
        fits_on_device(images.numel(), rt.device)
        sampler = EpochSampler(
            len(targets),
            seed=seed,
            shuffle=train,
            rank=rt.rank,
            world_size=rt.world_size,
            pad=train,
            repeats=data_cfg.repeated_aug if train else 1,
            weights=splits.train_draw.weights(targets, len(splits.classes))
            if train and splits.train_draw is not None
            else None,  # skipped samples are not in targets
            weights_from=draw_start(splits),
        )
        bs = data_cfg.batch_size if train else (data_cfg.eval_batch_size or 2 * data_cfg.batch_size)
        drop = train and data_cfg.drop_last and len(sampler) >= bs
        loader = MemoryLoader(images.to(rt.device), targets.to(rt.device), pipe, sampler, bs, drop, norm)
        loader.skipped += skipped  # found while decoding; reported with the first epoch
        loaders.append(loader)
    loaders[0].resolution = attach_schedule(data_cfg, [op for _, op in train_p.steps])
    info = DataInfo(splits.classes, splits.in_channels, eval_p.mean, eval_p.std, eval_p.out_size, splits.task)
    return Loaders(train=loaders[0], val=loaders[1], info=info)


LOADERS.register("memory")(
    Backend(memory_loader, auto=True, progressive=True)
)  # any device (it checks the size itself)

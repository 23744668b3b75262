"""The loader seam: the DATASETS and LOADERS registries, DataInfo, Loaders, the seeded epoch sampler,
`build_loaders`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

DATASETS = Registry("dataset", listed="datasets")  # name -> builder(data_cfg) -> Splits; filled by data/sources/*
LOADERS = Registry(
    "loader", listed="loaders"
)  # name -> builder(data_cfg, splits, rt, ...) -> Loaders; filled by data/backends/*


@dataclass
class Splits:
    """What a dataset builder returns: raw (undecoded or uint8) train/val datasets and their metadata.

    Each dataset item is (uint8 CHW tensor | None for an unreadable sample, target, source path or id).
    `test` is an optional held-out split (`torchsprint eval RUN --split test`, `eval.test_at_end`), and
    `source` says in words where the splits come from. `task` names the kind of targets (tasks.TASKS). `wrap` turns the
    backend's Loaders into what the model sees, for datasets whose stored items differ from model inputs (paired images
    stacked along channels, clips collated frames-first); the identity for everything else. `label_changing`
    names preprocessing steps that would silently change what a label means for this data (a flip of a
    clip whose class is its motion direction), which build_loaders refuses.
    """

    train: Any
    val: Any
    classes: list[str]
    in_channels: int
    task: str = "classification"
    wrap: Callable[[Loaders], Loaders] = field(default=lambda loaders: loaders)
    label_changing: dict[str, str] = field(default_factory=dict)  # spec step -> why it would change a label's meaning
    test: Any = None  # a held-out test split (image_folder's test/), evaluated on request only
    source: str = ""  # where the splits come from, in words (the start-up summary prints it)
    train_weights: torch.Tensor | None = (
        None  # per-sample draw weights of the training split (data.sampler=balanced|sqrt)
    )
    train_draw: ClassDraw | None = (
        None  # what train_weights were made from: the class power and the first weighted epoch
    )
    sampler_why: str = ""  # data.sampler=auto resolved to shuffle: why (a ClassDraw says it otherwise)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # why -> files below data.root that are not samples
    notes: list[str] = field(default_factory=list)  # other facts of the listing for the start-up summary


class TensorImages(torch.utils.data.Dataset):
    """Already-decoded uint8 images (N, C, H, W) with integer labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, ids: list[str] | None = None):
        self.images, self.labels = images, labels
        self.ids = ids
        self._targets = labels.tolist()  # plain ints: no tensor indexing + int() per sample (~1 us each)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self._targets[i], self.ids[i] if self.ids else str(i)


# The memory the memory backend may hold, unless data.memory_budget_gib sets it: this share of host RAM
# (CPU runs) or of the device's memory (CUDA; the memory backend also refuses more than half of what is
# free). data.backend=auto picks memory only under it; data.backend=memory refuses a dataset over it.
MEMORY_SHARE_RAM = 0.25
MEMORY_SHARE_GPU = 0.5


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def memory_budget(device: torch.device, budget_gib: float | None = None) -> tuple[int, str]:
    """(bytes the memory backend may hold on `device`, the same in words): data.memory_budget_gib when set,
    else MEMORY_SHARE_GPU of a CUDA device's total memory or MEMORY_SHARE_RAM of what this process can hold
    (runtime.memory_cap: the RAM, or less under a cgroup limit or `ulimit -v`)."""
    if budget_gib is not None:
        return int(budget_gib * 2**30), f"data.memory_budget_gib={budget_gib:g}"
    if device.type == "cuda":
        # Total, not free memory: every rank must make the same choice (the memory backend still checks free memory).
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * MEMORY_SHARE_GPU), f"{MEMORY_SHARE_GPU:.0%} of {device}'s {total / 2**30:.0f} GiB"
    from torchsprint.runtime.core import memory_cap

    cap, where = memory_cap()
    return int(cap * MEMORY_SHARE_RAM), f"{MEMORY_SHARE_RAM:.0%} of {where}"


MODE = {"mode": "RGB (3 channels, default) or GRAY (1 channel)"}


def need_root(data_cfg, what: str) -> Path:
    """data.root as a Path (user-expanded), or a UsageError saying what the dataset wants there: `what` describes
    the folder or file, e.g. "folder with train/ and val/ class subfolders"."""
    if data_cfg.root is None:
        raise UsageError(f"data.dataset={data_cfg.dataset} needs data.root=<{what}>.")
    return Path(data_cfg.root).expanduser()


def existing_folder(root: Path) -> Path:
    """`root` when it is a folder; a UsageError naming it otherwise."""
    if not root.is_dir():
        raise UsageError(f"data.root={root} does not exist or is not a folder.")
    return root


def check_options(data_cfg, allowed: dict[str, str]) -> None:
    """Refuse data.options a dataset does not read (an ignored option is a silent mistake), and a bad mode."""
    unknown = sorted(set(data_cfg.options) - set(allowed))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in allowed.items()) or "none"
        raise UsageError(f"data.dataset={data_cfg.dataset} does not take data.options {unknown}. It takes: {valid}.")
    if "mode" in data_cfg.options and data_cfg.options["mode"] not in ("RGB", "GRAY"):
        raise UsageError(f"data.options.mode={data_cfg.options['mode']!r}: use RGB or GRAY.")


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a seeded, class-stratified train/val split."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    if val_fraction <= 0:
        return idx, idx[:0]
    tr, va = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=labels)
    return np.sort(tr), np.sort(va)


def split_samples(samples: list, data_cfg, classes: list[str] | None = None, with_notes: bool = False):
    """(train, val) lists of (item, class index) samples, split by data.val_fraction, stratified, seeded by
    data.split_seed.

    A class with one sample cannot be in both splits: it is trained on and not validated, and with
    `with_notes` the returned third item, a list of lines for the start-up summary, says so (the split of
    the other classes is the one they would get without it). Too few validation samples for a stratified
    split (fewer than the classes) is a UsageError naming the numbers.
    """
    labels = np.array([s[1] for s in samples])
    notes: list[str] = []
    counts = np.bincount(labels) if len(labels) else np.zeros(0, dtype=np.int64)
    single = np.flatnonzero(counts == 1)
    if data_cfg.val_fraction > 0 and len(single):
        rest = [i for i, lab in enumerate(labels) if counts[lab] > 1]
        name = (lambda c: classes[c]) if classes is not None else str
        notes.append(
            f"{len(single)} class(es) with one image ({', '.join(name(int(c)) for c in single[:5])}"
            f"{' ...' if len(single) > 5 else ''}): trained on, not validated (a split needs 2 images of a class)"
        )
        tr, va = _stratified(labels[rest], data_cfg, len(samples)) if rest else (np.zeros(0, int), np.zeros(0, int))
        tr = np.sort(np.concatenate([np.asarray(rest, dtype=np.int64)[tr], np.flatnonzero(np.isin(labels, single))]))
        va = np.asarray(rest, dtype=np.int64)[va]
    else:
        tr, va = _stratified(labels, data_cfg, len(samples))
    # A class of 2 among 2,000 images can get no validation image from the stratified split: said, like a single one.
    validated = set(labels[va].tolist())
    unseen = [int(c) for c in np.flatnonzero(counts > 1) if data_cfg.val_fraction > 0 and int(c) not in validated]
    if unseen:
        name = (lambda c: classes[c]) if classes is not None else str
        notes.append(
            f"{len(unseen)} class(es) too small for a validation image at data.val_fraction="
            f"{data_cfg.val_fraction} ({', '.join(f'{name(c)}: {counts[c]} images' for c in unseen[:5])}"
            f"{' ...' if len(unseen) > 5 else ''}): trained on, not validated (raise data.val_fraction or add images)"
        )
    out = [samples[i] for i in tr], [samples[i] for i in va]
    return (*out, notes) if with_notes else out


def _stratified(labels: np.ndarray, data_cfg, n_all: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        return stratified_split(labels, data_cfg.val_fraction, data_cfg.split_seed)
    except ValueError as e:  # sklearn: fewer validation samples than classes
        k = len(np.unique(labels))
        raise UsageError(
            f"data.val_fraction={data_cfg.val_fraction} of {n_all} images is too few to give each of the {k} "
            f"classes a validation image ({e}). Raise data.val_fraction, add images, or give a val/ "
            "folder beside train/."
        ) from None


@dataclass
class DataInfo:
    """What the model and the exporter need to know about the data."""

    classes: list[str]
    in_channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_size: tuple[int, int] | None = None
    task: str = "classification"
    # Which backend ran, decided once in build_loaders; decisions.json, the start-up summary, the engine's
    # input-bound hint and `data check` all read it from here, never from the config.
    backend: str = ""  # the loader backend that runs (data.backend, what `auto` chose, or data.fallback)
    backend_why: str = ""  # why that backend (the start-up summary prints it)
    backend_config: str = ""  # data.backend as configured (auto, gpu, ...)
    fallback: str = ""  # why the configured backend could not run here ("" when it runs); then data.fallback ran
    facts: dict = field(default_factory=dict)  # what build.describe_data found (counts, sizes, source)
    # The training order that runs (data.sampler, or what `auto` resolved to) and, for auto, why; set in build_loaders.
    sampler: str = "shuffle"
    sampler_why: str = ""
    backend_measured: dict = field(default_factory=dict)  # data.backend=auto's measurement (auto.measure_backends)

    @property
    def num_classes(self) -> int:
        return len(self.classes)


class Loader(Protocol):
    """An epoch-aware iterable of on-device (images, targets) batches."""

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None: ...
    def __iter__(self): ...
    def __len__(self) -> int: ...


@dataclass
class Loaders:
    train: Loader
    val: Loader
    info: DataInfo
    skipped: list[str] = field(default_factory=list)


def runs_anywhere(rt) -> str | None:
    """Backend.cannot_run of a backend that runs on any device."""
    return None


def cuda_missing(rt) -> str | None:
    """Backend.cannot_run of a backend that needs a CUDA device: why it cannot run on `rt`, or None."""
    if rt.device.type == "cuda":
        return None
    return "needs a CUDA GPU: " + (
        "this machine has no CUDA device" if not torch.cuda.is_available() else f"run.device is {rt.device}"
    )


@dataclass(frozen=True)
class Backend:
    """A loader backend as LOADERS holds it: how to build it, whether it can run here, whether `auto` may pick it.

    Args:
        build: (data_cfg, splits, rt, *, seed, channels_last, dtype) -> Loaders.
        cannot_run: rt -> why the backend cannot run on this machine and device (None: it can). data/build.py
            asks before building and falls back to data.fallback, or refuses, in one place; a backend never
            falls back by itself.
        auto: whether data.backend=auto considers it (auto.choose_backend says when each one suits).
        progressive: whether its training loader applies data.progressive (its set_epoch sets the crop side);
            build_loaders refuses data.progressive with a backend that does not.
    A user's backend may be registered as a plain build function: it runs anywhere and auto never picks it.
    """

    build: Callable[..., Loaders]
    cannot_run: Callable[[Any], str | None] = runs_anywhere
    auto: bool = False
    progressive: bool = False

    def __call__(self, data_cfg, splits, rt, **kw) -> Loaders:
        return self.build(data_cfg, splits, rt, **kw)


def as_backend(entry) -> Backend:
    """A LOADERS entry as a Backend (a plain function registered by a user: runs anywhere, never auto)."""
    return entry if isinstance(entry, Backend) else Backend(entry)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A per-sample augmentation seed that depends only on (run seed, epoch, sample index).

    Because it does not depend on worker count, worker scheduling or how far the loader
    got before a restart, augmentation is bit-identical across resumes and worker settings.
    """
    # splitmix64-style mixing; 63 bits so that torch.manual_seed accepts it.
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & (2**64 - 1)
    x ^= x >> 32
    return x & (2**63 - 1)


_M64 = (1 << 64) - 1


def as_int64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores (arithmetic wraps mod 2**64)."""
    return c - (1 << 64) if c >= (1 << 63) else c


def lsr64(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic for negative values)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def sample_seeds(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """Vectorised core.sample_seed: int64 seeds for int64 `indices`, bit-identical to the scalar one."""
    base = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) & _M64
    x = indices.to(torch.int64) * as_int64(0x94D049BB133111EB) + as_int64(base)
    x = x ^ lsr64(x, 31)
    x = x * as_int64(0xD6E8FEB86659FD93)
    x = x ^ lsr64(x, 32)
    return x & ((1 << 63) - 1)


class EpochSampler(torch.utils.data.Sampler):
    """Seeded, epoch-aware, rank-sharded sampler that yields (index, sample_seed) pairs.

    Train mode (shuffle=True): a permutation seeded by (seed, epoch), padded by wrapping so
    every rank gets the same number of samples (DistributedSampler semantics). Eval mode
    (shuffle=False, pad=False): disjoint contiguous-stride shards with no sample counted twice.
    `start_batch` skips batches already consumed (exact mid-epoch resume) without loading them.
    `repeats` > 1 (train mode): repeated-augmentation sampling (data.repeated_aug), see repeat_aug_positions.
    `weights` (train mode, data.sampler=balanced|sqrt): the epoch's order is n draws with replacement, sample i drawn
    with probability weights[i] / sum(weights) (torch's WeightedRandomSampler with num_samples=n), from the same
    (seed, epoch) generator as the shuffle; ranks take disjoint shards of that one global draw as above. A sample
    drawn twice is augmented differently: the augmentation key is the draw's position, not the sample index.
    `weights_from` (0-based epoch, data.sampler_from_epoch - 1): the epochs before it shuffle, as without weights;
    which kind an epoch gets is a function of its number alone, so a resumed run draws what the uninterrupted one did.
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
        pad: bool = True,
        repeats: int = 1,
        weights: torch.Tensor | None = None,
        weights_from: int = 0,
    ):
        self.n, self.seed, self.shuffle, self.pad = n, seed, shuffle, pad
        self.rank, self.world_size, self.repeats = rank, world_size, repeats
        if weights is not None and (len(weights) != n or repeats > 1 or not shuffle):
            raise ValueError("weights: one per sample, train mode (shuffle) only, without repeats")
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.float64)
        self.weights_from = weights_from
        self.epoch = 0
        self.start = 0  # samples to skip at the start of this epoch (per rank)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start = epoch, start_sample

    def permutation(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            if self.weighted():
                return torch.multinomial(self.weights, self.n, replacement=True, generator=g).tolist()
            return torch.randperm(self.n, generator=g).tolist()
        return list(range(self.n))

    def keyed_indices(self) -> tuple[list[int], list[int]]:
        """(this rank's sample indices of the epoch, each one's augmentation key). The key is the index itself,
        or with repeated augmentation index x repeats + copy, so that every copy of a sample is augmented
        differently (its own seed)."""
        order = self.permutation()
        if self.repeats > 1:
            pos = repeat_aug_positions(self.n, self.repeats, self.rank, self.world_size)
            return [order[i // self.repeats] for i in pos], [
                order[i // self.repeats] * self.repeats + i % self.repeats for i in pos
            ]
        keys = list(range(len(order))) if self.weighted() else order  # a draw's position (see the class doc)
        if self.pad and self.world_size > 1:
            total = math.ceil(self.n / self.world_size) * self.world_size
            order = (order * math.ceil(total / max(1, self.n)))[:total]
            keys = (keys * math.ceil(total / max(1, self.n)))[:total]
        return order[self.rank :: self.world_size], keys[self.rank :: self.world_size]

    def indices(self) -> list[int]:
        return self.keyed_indices()[0]

    def weighted(self) -> bool:
        """Whether this epoch's order is the weighted draw (train mode, weights given, epoch >= weights_from)."""
        return self.shuffle and self.weights is not None and self.epoch >= self.weights_from

    def keys(self) -> tuple[list[int], list[int]]:
        """This epoch's sample indices from `start` on, and their augmentation seeds (two lists)."""
        order, keys = self.keyed_indices()
        order, keys = order[self.start :], keys[self.start :]
        # Vectorised (sample_seeds is bit-identical to sample_seed): a Python sample_seed call per sample cost ~1 us, a
        # tenth of a tiny model's step at batch 32.
        return order, sample_seeds(self.seed, self.epoch, torch.tensor(keys, dtype=torch.int64)).tolist()

    def __iter__(self):
        return iter(zip(*self.keys()))

    def __len__(self) -> int:
        return len(self.indices()) - self.start


def balanced_weights(labels: torch.Tensor, num_classes: int, power: float = 1.0) -> torch.Tensor:
    """Per-sample weights n_c ** -power, n_c the training count of the sample's class. power=1 (data.sampler=balanced):
    every class has total weight 1, so a weighted draw picks each class equally often in expectation; power=0.5
    (data.sampler=sqrt): class c's total weight is n_c ** 0.5, its share of the draws sqrt(n_c) / sum_k sqrt(n_k)."""
    counts = torch.bincount(labels, minlength=num_classes).double()
    return counts[labels] ** -power


@dataclass(frozen=True)
class ClassDraw:
    """data.sampler=balanced|sqrt resolved: the power of balanced_weights and the first weighted epoch (0-based)."""

    power: float  # 1.0 balanced, 0.5 sqrt
    start_epoch: int = 0  # data.sampler_from_epoch - 1
    sampler: str = ""  # the sampler's name (balanced, sqrt)
    why: str = ""  # data.sampler=auto: why it drew this way

    def weights(self, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        return balanced_weights(labels, num_classes, self.power)


SAMPLER_POWER = {"balanced": 1.0, "sqrt": 0.5}  # data.sampler -> balanced_weights' power

# data.sampler=auto draws by square-root frequency from this ratio of the largest to the smallest training class
# (BENCHMARKS.md, "Imbalanced classes: what the default counters with, 2026-11-29": the threshold and the winner).
AUTO_SAMPLER = "sqrt"
AUTO_SAMPLER_RATIO = 4.0


def auto_sampler(labels: torch.Tensor | None, classes: list[str]) -> tuple[str, str]:
    """data.sampler=auto resolved from the training labels: (AUTO_SAMPLER or "shuffle", why in words)."""
    if labels is None:
        return "shuffle", "data.sampler=auto: no per-sample class labels to balance"
    counts = torch.bincount(labels, minlength=len(classes)).tolist()
    present = [(n, c) for n, c in zip(counts, classes) if n > 0]
    (big, big_name), (small, small_name) = max(present), min(present)
    ratio = big / small
    found = (
        f"the training classes are {ratio:.1f}x imbalanced ({big_name} {big:,} images, {small_name} {small:,}), "
        f"{'at least' if ratio >= AUTO_SAMPLER_RATIO else 'under'} the {AUTO_SAMPLER_RATIO:g}x from which "
        "data.sampler=auto counters it"
    )
    return (AUTO_SAMPLER, found) if ratio >= AUTO_SAMPLER_RATIO else ("shuffle", found)


def draw_start(splits: Splits) -> int:
    """The first epoch (0-based) of the training split's weighted draw (EpochSampler's weights_from); 0 without one."""
    return splits.train_draw.start_epoch if splits.train_draw is not None else 0


def repeat_aug_positions(n: int, repeats: int, rank: int, world_size: int, selected_round: int = 256) -> list[int]:
    """Positions (into the permutation repeated `repeats` times, copies side by side) that `rank` takes in an epoch.

    DeiT's RASampler as timm's RepeatAugSampler (data/distributed_sampler.py) does it: each sample of the
    permutation appears `repeats` times in a row, rank r takes every world_size-th position from r
    (wrapping to pad), so the copies of a sample land on different ranks; and an epoch keeps the length
    of one without repeats: floor(n // 256 * 256 / world_size) samples per rank (ceil(n / world_size) for
    n < 256), so it sees about 1/repeats of the distinct samples, each `repeats` times. Position p is copy
    p % repeats of permutation[p // repeats].
    """
    num_samples = math.ceil(n * repeats / world_size)
    total = num_samples * world_size
    if selected_round and n >= selected_round:
        selected = n // selected_round * selected_round // world_size
    else:
        selected = math.ceil(n / world_size)
    selected = min(selected, num_samples)
    return [i % (n * repeats) for i in range(rank, total, world_size)[:selected]]

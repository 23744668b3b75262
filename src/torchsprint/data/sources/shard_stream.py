"""Reading WebDataset tar shards as a stream (sources/webdataset.py lists the shards and their counts): the epoch
plan of every rank and loader worker (pure functions of the shard counts and seeds), `ShardSet` (the samples of a
list of shards: bytes in planned order, decoding) and `ShardStream` (a rank's batches, made in DataLoader workers,
for the cpu and gpu backends).

What the webdataset library does here: brace expansion of shard lists, opening URLs (local, `pipe:`,
http through curl), reading tar streams and grouping members into samples. What is planned here, and
why it is not webdataset's `split_by_node`/`split_by_worker` + `shuffle`: those hand whole shards to
ranks, so with 7 shards on 2 ranks one rank gets 4 and one 3, and DDP needs equal step counts (the
usual fix, resampling with `with_epoch`, repeats and drops samples). Here, per epoch:

1. Shard order: a permutation of the shards seeded by (seed, epoch) (train; eval keeps the listed order).
2. Ranks: the epoch's sample sequence (the shards in that order, each in tar order) is cut into
   `world_size` contiguous ranges of N*r//R .. N*(r+1)//R samples (sizes differ by at most one).
   Every rank runs the same number of steps S = ceil(ceil(N/R) / B): its batches are B samples each but
   the last (when one rank holds one sample fewer and its last batch would be empty, its last two
   batches are B-1 and 1). No sample is repeated or dropped. With data.drop_last, every rank runs
   S = floor(floor(N/R) / B) full batches and the rest of its range (fewer than B + 1 samples per rank)
   is dropped, as the folder datasets drop their last partial batch. Evaluation keeps the listed
   shard order, no sample shuffle, and plain batches per rank (ranks may differ by a batch; the
   evaluation counts uneven ranks, as for folders).
3. Workers: batch j of a rank is made by worker j % W (the DataLoader's round-robin order), and each
   worker's batches take a contiguous stretch of the rank's range. So each worker reads whole shards,
   except where a stretch boundary falls inside a shard: that shard is read by the streams on both
   sides, each keeping only its own samples (a later one reads the earlier part and discards it). There
   are R*W - 1 boundaries, so at most R*W - 1 extra shard reads per epoch (with many shards per
   worker, as in any real run, that is a small share; with fewer shards than streams it is the price
   of equal step counts without repeated samples).
4. Sample shuffle: within each worker's stretch, a seeded shuffle buffer of `shuffle_buffer` samples
   (webdataset's algorithm: fill the buffer, then each incoming sample replaces a random one, which is
   emitted). The order depends on (seed, epoch, world size, num_workers): a run is reproducible for a
   seed and a process/worker layout. Augmentation seeds depend only on (seed, epoch, sample), as for
   folders.
5. Resume: the emitted order is a function of the shard counts and seeds alone, so `set_epoch(e, k)`
   finds exactly which samples the first k batches took; the workers skip them without decoding, skip
   shards holding none of the remaining samples without opening them, and continue with batch k:
   the resumed epoch yields exactly the batches the uninterrupted one would have (the extra reading is
   at most the shards the shuffle buffer spans at the resume point, about shuffle_buffer samples
   plus one shard per worker).

`pipe:` URLs run the shell command they name (webdataset's gopen): see sources/webdataset.py.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass

import numpy as np
import torch

from torchsprint.data.core import sample_seeds
from torchsprint.errors import UsageError

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")  # folders.IMAGE_EXTENSIONS


# ---------------------------------------------------------------- the epoch plan (pure functions of counts and seeds)


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The shards' read order for one epoch: a permutation seeded by (seed, epoch), or the listed order."""
    if not shuffle:
        return list(range(n_shards))
    return np.random.default_rng([seed, epoch, 0x5A4D]).permutation(n_shards).tolist()


def rank_batches(
    total: int, rank: int, world_size: int, batch_size: int, drop_last: bool, equal_steps: bool = True
) -> tuple[int, list[int]]:
    """(first position of this rank's range in the epoch sequence, its batch sizes); see the module docstring, 2.

    equal_steps=False (evaluation, which counts uneven ranks itself, as for folders): batches of
    batch_size and one shorter last batch; an empty range gives no batches.
    """
    start, end = total * rank // world_size, total * (rank + 1) // world_size
    n = end - start
    if not equal_steps:
        return start, [min(batch_size, n - b) for b in range(0, n, batch_size)]
    smallest = total // world_size
    if smallest == 0:
        raise UsageError(
            f"webdataset: {total} samples cannot give each of {world_size} processes one; use fewer processes."
        )
    if drop_last and smallest >= batch_size:
        return start, [batch_size] * (smallest // batch_size)
    largest = -(-total // world_size)
    steps = -(-largest // batch_size)
    sizes = [batch_size] * (steps - 1) + [n - (steps - 1) * batch_size]
    if sizes[-1] == 0:  # this rank holds one sample fewer than the largest: keep its step count
        if len(sizes) < 2 or sizes[-2] < 2:
            raise UsageError(
                f"webdataset: {total} samples on {world_size} processes with data.batch_size={batch_size} "
                "leave one process an empty batch; use data.batch_size >= 2 or data.drop_last=true."
            )
        sizes[-2] -= 1
        sizes[-1] = 1
    return start, sizes


def worker_stretch(sizes: list[int], workers: int, stream: int) -> tuple[int, list[int]]:
    """(offset of worker `stream`'s stretch inside its rank's range, its batch sizes): batches j % W == stream."""
    before = sum(sum(sizes[w::workers]) for w in range(stream))
    return before, sizes[stream::workers]


def pieces(counts: list[int], order: list[int], first: int, n: int) -> list[tuple[int, int, int]]:
    """Positions [first, first + n) of the sequence "shards in `order`, each in tar order" as (shard, start, end)."""
    out, pos = [], 0
    for shard in order:
        lo, hi = max(first, pos), min(first + n, pos + counts[shard])
        if lo < hi:
            out.append((shard, lo - pos, hi - pos))
        pos += counts[shard]
        if pos >= first + n:
            break
    return out


def buffer_shuffle(ids: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """webdataset's shuffle buffer, replayed on sample ids: fill `size`, then every incoming id replaces a
    random buffered one, which is emitted; the rest leaves in a random order. Hand-written (not
    webdataset.shuffle) because resuming needs the order without the samples: it depends only on the ids
    and the generator, never on the bytes."""
    if size <= 1 or len(ids) <= 1:
        return ids
    size = min(size, len(ids))
    buf = ids[:size].copy()
    out = np.empty_like(ids)
    picks = rng.integers(0, size, len(ids) - size)
    for t, x in enumerate(ids[size:].tolist()):  # ~0.2 us per sample
        k = picks[t]
        out[t] = buf[k]
        buf[k] = x
    out[len(ids) - size :] = rng.permutation(buf)
    return out


@dataclass
class StreamPlan:
    """What one worker of one rank reads and yields in one epoch."""

    pieces: list[tuple[int, int, int]]  # (shard, start, end) in read order
    order: np.ndarray  # global sample ids, in the order they are yielded
    sizes: list[int]  # batch sizes, in the order they are yielded


def stream_plan(
    counts: list[int],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    buffer: int,
    rank: int,
    world_size: int,
    workers: int,
    stream: int,
    batch_size: int,
    drop_last: bool,
) -> StreamPlan:
    """The plan of worker `stream` (of `workers`) of `rank` for `epoch`; see the module docstring."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    order = shard_order(len(counts), seed, epoch, shuffle)
    start, sizes = rank_batches(int(offsets[-1]), rank, world_size, batch_size, drop_last, equal_steps=shuffle)
    before, mine = worker_stretch(sizes, workers, stream)
    parts = pieces(counts, order, start + before, sum(mine))
    ids = (
        np.concatenate([np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in parts])
        if parts
        else np.zeros(0, np.int64)
    )
    if shuffle:
        ids = buffer_shuffle(ids, buffer, np.random.default_rng([seed, epoch, rank, workers, stream, 0x5B]))
    return StreamPlan(parts, ids, mine)


# ---------------------------------------------------------------- the raw dataset


class ShardSet:
    """The samples of a list of shards: sizes, labels, bytes in planned order, decoding.

    Not indexable (a tar stream has no random access); the backends build loaders on `ShardStream`.

    Args:
        urls: shard paths or URLs (local, `pipe:...`, http...).
        counts: samples per shard.
        mode: "RGB" or "GRAY".
        decoder, max_pixels, min_size_for: as folders.ImageFiles.
        shuffle_buffer: samples in each worker's shuffle buffer.
        image_key, label_key: member extensions (image_key None: the first of IMAGE_KEYS present).
    """

    streaming = True

    def __init__(
        self,
        urls: list[str],
        counts: list[int],
        mode: str = "RGB",
        *,
        decoder: str = "auto",
        max_pixels: int = 89_478_485,
        min_size_for=None,
        shuffle_buffer: int = 1000,
        image_key: str | None = None,
        label_key: str = "cls",
    ):
        from torchsprint.data.preprocess.decode import resolve_decoder

        self.urls, self.counts, self.mode = list(urls), list(counts), mode
        self.decoder, self.max_pixels, self.min_size_for = resolve_decoder(decoder), max_pixels, min_size_for
        self.shuffle_buffer, self.image_key, self.label_key = shuffle_buffer, image_key, label_key
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64).tolist()

    @property
    def channels(self) -> int:
        return 1 if self.mode == "GRAY" else 3

    def with_min_size(self, min_size_for) -> ShardSet:
        """A copy that passes a decode-size hint to the decoder (folders.ImageFiles.with_min_size)."""
        return ShardSet(
            self.urls,
            self.counts,
            self.mode,
            decoder=self.decoder,
            max_pixels=self.max_pixels,
            min_size_for=min_size_for,
            shuffle_buffer=self.shuffle_buffer,
            image_key=self.image_key,
            label_key=self.label_key,
        )

    def __len__(self) -> int:
        return self.offsets[-1]

    def _samples(self, shard: int):
        """(position, key, members dict) of every sample of one shard, through webdataset's tar reader."""
        from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

        url = self.urls[shard]
        try:
            yield from enumerate(group_by_keys(tar_file_expander(url_opener([{"url": url}]))))
        except (OSError, tarfile.TarError, ValueError) as e:
            raise UsageError(
                f"webdataset: cannot read shard {url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None

    def _entry(self, gid: int, shard: int, sample: dict):
        """One sample as (global id, image bytes or the reason there are none, label, source)."""
        source = f"{self.urls[shard]}#{sample['__key__']}"
        key = self.image_key or next((k for k in IMAGE_KEYS if k in sample), None)
        label = sample.get(self.label_key)
        if label is None:
            raise UsageError(
                f"webdataset: sample {source} has no .{self.label_key} member (its members: "
                f"{sorted(k for k in sample if not k.startswith('__'))}); set data.options.label_key."
            )
        try:
            target = int(label.decode().strip())
        except ValueError:
            raise UsageError(
                f"webdataset: {source}.{self.label_key} holds {label[:20]!r}, not a class index."
            ) from None
        if key is None or key not in sample:
            return gid, OSError(f"no .{key or '/.'.join(IMAGE_KEYS)} member"), target, source
        return gid, sample[key], target, source

    def read_plan(self, plan: StreamPlan, skip: int):
        """Yield (global id, bytes | OSError, label, source) of plan.order[skip:], reading only what is needed."""
        order = plan.order[skip:].tolist()
        needed = set(order)
        pending: dict[int, tuple] = {}

        def reader():
            for shard, start, end in plan.pieces:
                base = self.offsets[shard]
                if not any(base + p in needed for p in range(start, end)):
                    continue  # nothing left to take from this shard: never opened
                pos = -1
                for pos, sample in self._samples(shard):
                    if pos >= end:
                        break
                    if pos >= start and base + pos in needed:
                        yield self._entry(base + pos, shard, sample)
                if pos < end - 1:
                    raise UsageError(
                        f"webdataset: shard {self.urls[shard]} holds {pos + 1} samples but the index says "
                        f"{self.counts[shard]}. Re-write it (torchsprint data shard) or fix the index."
                    )

        it = reader()
        for gid in order:
            while gid not in pending:
                entry = next(it)
                pending[entry[0]] = entry
            yield pending.pop(gid)

    def read_all(self):
        """Every sample, shards in listed order (data check, the memory backend): (id, bytes | OSError, label,
        source)."""
        parts = [(s, 0, c) for s, c in enumerate(self.counts)]
        return self.read_plan(StreamPlan(parts, np.arange(len(self), dtype=np.int64), [len(self)]), 0)

    def decode(self, data, target, source):
        """(uint8 CHW | None, target, source or "source: reason"), as folders.ImageFiles.__getitem__."""
        from torchsprint.data.preprocess.decode import BadImage, decode_bytes

        if isinstance(data, Exception):
            return None, target, f"{source}: {data}"
        try:
            return (
                decode_bytes(
                    data,
                    channels=self.channels,
                    decoder=self.decoder,
                    max_pixels=self.max_pixels,
                    min_size_for=self.min_size_for,
                ),
                target,
                source,
            )
        except (BadImage, OSError) as e:
            return None, target, f"{source}: {e}"


class ShardStream(torch.utils.data.IterableDataset):
    """A rank's batches of a ShardSet, made in DataLoader workers (or the main process with num_workers=0).

    Each yielded item is `make_batch(entries)`, entries being (global id, sample seed, bytes | OSError,
    label, source) tuples; the backends pass their own batch maker (cpu: decode + augment + collate;
    gpu: BytesBatches). Epoch and resume position live in a shared-memory tensor, so persistent workers
    see `set_epoch`. Also the loaders' epoch handle, shaped like a torch BatchSampler over an
    EpochSampler (`batch_size`, `sampler.set_epoch(epoch, start_sample)`, `len`), so the cpu and gpu
    loaders drive shards as they drive folders.
    """

    def __init__(
        self,
        raw: ShardSet,
        make_batch,
        *,
        seed: int,
        train: bool,
        batch_size: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        workers: int,
    ):
        self.raw, self.make_batch, self.seed, self.train = raw, make_batch, seed, train
        self.batch_size, self.drop_last, self.rank, self.world_size = batch_size, drop_last, rank, world_size
        self.workers = max(1, workers)
        self.state = torch.zeros(2, dtype=torch.int64).share_memory_()  # (epoch, start batch)
        self.sampler = self  # the BatchSampler shape (see the class docstring)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.state[0], self.state[1] = epoch, start_sample // self.batch_size

    @property
    def epoch(self) -> int:
        return int(self.state[0])

    def steps(self) -> int:
        """Batches per epoch of this rank (the same on every rank in training)."""
        return len(
            rank_batches(len(self.raw), self.rank, self.world_size, self.batch_size, self.drop_last, self.train)[1]
        )

    def __len__(self) -> int:
        return self.steps() - int(self.state[1])

    def plan(self, stream: int, epoch: int | None = None) -> StreamPlan:
        return stream_plan(
            self.raw.counts,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
            shuffle=self.train,
            buffer=self.raw.shuffle_buffer,
            rank=self.rank,
            world_size=self.world_size,
            workers=self.workers,
            stream=stream,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
        )

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        epoch, start = self.state.tolist()
        # After resuming at batch k the DataLoader asks worker 0 first, and batch k belongs to stream k % W:
        # rotate so that worker i runs stream (i + k) % W and the round-robin goes on as before.
        stream = (worker + start) % self.workers
        plan = self.plan(stream, epoch)
        done = len(range(stream, start, self.workers))  # this stream's batches among the first `start`
        skip = sum(plan.sizes[:done])
        entries = self.raw.read_plan(plan, skip)
        ids = plan.order[skip:]
        seeds = sample_seeds(self.seed, epoch, torch.from_numpy(ids.astype(np.int64))).tolist()
        at = 0
        for size in plan.sizes[done:]:
            batch = [
                (gid, seeds[at + j], data, target, source)
                for j, (gid, data, target, source) in zip(range(size), entries)
            ]
            at += size
            yield self.make_batch(batch)

"""webdataset: WebDataset tar shards (local files, brace-expanded lists, `pipe:` streams) read with the
`webdataset` library, planned so that every rank and loader worker reads its own samples exactly once.

Format: each sample is a group of tar members sharing a key, `<key>.jpg` (or .jpeg/.png/.webp) and
`<key>.cls` (the class index as text), WebDataset's convention. Beside the shards, an index JSON
(`index.json`, written by `torchsprint data shard`) holds the class names and, per shard, its sample
count and checksum; a bare JSON list of class names works too (local shards are then counted by reading
their tar headers; `pipe:` shards need counts in the index, since a stream cannot be counted for free).

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

`pipe:` URLs run the shell command they name (webdataset's gopen), exactly as the user wrote it in the
config: use them only in configs you trust.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, MODE, Splits, check_options, sample_seeds
from torchsprint.errors import UsageError

INDEX_NAME = "index.json"
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")  # folders.IMAGE_EXTENSIONS
WEBDATASET_OPTIONS = {
    "train": "training shards: a path/URL with brace expansion, e.g. 'train-{000000..000127}.tar' or "
             "'pipe:aws s3 cp s3://bucket/train-{000000..000127}.tar -' (default: <root>/train-*.tar)",
    "val": "validation shards, the same way (default: <root>/val-*.tar; none: no validation)",
    "index": f"the index/class JSON (default: <root>/{INDEX_NAME})",
    "shuffle_buffer": "samples in the seeded shuffle buffer of each worker (default 1000; 0 or 1: shard order only)",
    "image_key": "the member extension of the image (default: the first of jpg, jpeg, png, webp, bmp, gif, tif, tiff present)",
    "label_key": "the member extension of the class index (default: cls)",
    **MODE,
}


# ---------------------------------------------------------------- the epoch plan (pure functions of counts and seeds)


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The shards' read order for one epoch: a permutation seeded by (seed, epoch), or the listed order."""
    if not shuffle:
        return list(range(n_shards))
    return np.random.default_rng([seed, epoch, 0x5A4D]).permutation(n_shards).tolist()


def rank_batches(total: int, rank: int, world_size: int, batch_size: int, drop_last: bool,
                 equal_steps: bool = True) -> tuple[int, list[int]]:
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
        raise UsageError(f"webdataset: {total} samples cannot give each of {world_size} processes one; use fewer processes.")
    if drop_last and smallest >= batch_size:
        return start, [batch_size] * (smallest // batch_size)
    largest = -(-total // world_size)
    steps = -(-largest // batch_size)
    sizes = [batch_size] * (steps - 1) + [n - (steps - 1) * batch_size]
    if sizes[-1] == 0:  # this rank holds one sample fewer than the largest: keep its step count
        if len(sizes) < 2 or sizes[-2] < 2:
            raise UsageError(f"webdataset: {total} samples on {world_size} processes with data.batch_size={batch_size} "
                             "leave one process an empty batch; use data.batch_size >= 2 or data.drop_last=true.")
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


def stream_plan(counts: list[int], *, seed: int, epoch: int, shuffle: bool, buffer: int, rank: int, world_size: int,
                workers: int, stream: int, batch_size: int, drop_last: bool) -> StreamPlan:
    """The plan of worker `stream` (of `workers`) of `rank` for `epoch`; see the module docstring."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    order = shard_order(len(counts), seed, epoch, shuffle)
    start, sizes = rank_batches(int(offsets[-1]), rank, world_size, batch_size, drop_last, equal_steps=shuffle)
    before, mine = worker_stretch(sizes, workers, stream)
    parts = pieces(counts, order, start + before, sum(mine))
    ids = np.concatenate([np.arange(offsets[s] + a, offsets[s] + b) for s, a, b in parts]) if parts else np.zeros(0, np.int64)
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

    def __init__(self, urls: list[str], counts: list[int], mode: str = "RGB", *, decoder: str = "auto",
                 max_pixels: int = 89_478_485, min_size_for=None, shuffle_buffer: int = 1000,
                 image_key: str | None = None, label_key: str = "cls"):
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
        return ShardSet(self.urls, self.counts, self.mode, decoder=self.decoder, max_pixels=self.max_pixels,
                        min_size_for=min_size_for, shuffle_buffer=self.shuffle_buffer, image_key=self.image_key,
                        label_key=self.label_key)

    def __len__(self) -> int:
        return self.offsets[-1]

    def _samples(self, shard: int):
        """(position, key, members dict) of every sample of one shard, through webdataset's tar reader."""
        from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

        url = self.urls[shard]
        try:
            yield from enumerate(group_by_keys(tar_file_expander(url_opener([{"url": url}]))))
        except (OSError, tarfile.TarError, ValueError) as e:
            raise UsageError(f"webdataset: cannot read shard {url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def _entry(self, gid: int, shard: int, sample: dict):
        """One sample as (global id, image bytes or the reason there are none, label, source)."""
        source = f"{self.urls[shard]}#{sample['__key__']}"
        key = self.image_key or next((k for k in IMAGE_KEYS if k in sample), None)
        label = sample.get(self.label_key)
        if label is None:
            raise UsageError(f"webdataset: sample {source} has no .{self.label_key} member (its members: "
                             f"{sorted(k for k in sample if not k.startswith('__'))}); set data.options.label_key.")
        try:
            target = int(label.decode().strip())
        except ValueError:
            raise UsageError(f"webdataset: {source}.{self.label_key} holds {label[:20]!r}, not a class index.") from None
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
                    raise UsageError(f"webdataset: shard {self.urls[shard]} holds {pos + 1} samples but the index says "
                                     f"{self.counts[shard]}. Re-write it (torchsprint data shard) or fix the index.")

        it = reader()
        for gid in order:
            while gid not in pending:
                entry = next(it)
                pending[entry[0]] = entry
            yield pending.pop(gid)

    def read_all(self):
        """Every sample, shards in listed order (data check, the memory backend): (id, bytes | OSError, label, source)."""
        parts = [(s, 0, c) for s, c in enumerate(self.counts)]
        return self.read_plan(StreamPlan(parts, np.arange(len(self), dtype=np.int64), [len(self)]), 0)

    def decode(self, data, target, source):
        """(uint8 CHW | None, target, source or "source: reason"), as folders.ImageFiles.__getitem__."""
        from torchsprint.data.preprocess.decode import BadImage, decode_bytes

        if isinstance(data, Exception):
            return None, target, f"{source}: {data}"
        try:
            return decode_bytes(data, channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels,
                                min_size_for=self.min_size_for), target, source
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

    def __init__(self, raw: ShardSet, make_batch, *, seed: int, train: bool, batch_size: int, drop_last: bool,
                 rank: int, world_size: int, workers: int):
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
        return len(rank_batches(len(self.raw), self.rank, self.world_size, self.batch_size, self.drop_last, self.train)[1])

    def __len__(self) -> int:
        return self.steps() - int(self.state[1])

    def plan(self, stream: int, epoch: int | None = None) -> StreamPlan:
        return stream_plan(self.raw.counts, seed=self.seed, epoch=self.epoch if epoch is None else epoch,
                           shuffle=self.train, buffer=self.raw.shuffle_buffer, rank=self.rank,
                           world_size=self.world_size, workers=self.workers, stream=stream,
                           batch_size=self.batch_size, drop_last=self.drop_last)

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
            batch = [(gid, seeds[at + j], data, target, source)
                     for j, (gid, data, target, source) in zip(range(size), entries)]
            at += size
            yield self.make_batch(batch)


# ---------------------------------------------------------------- building the dataset


def expand_shards(spec: str, root: Path | None) -> list[str]:
    """A shard spec -> URLs: '::'-separated lists, brace expansion (webdataset.shardlists.expand_urls);
    relative local paths are taken relative to data.root."""
    from webdataset.shardlists import expand_urls

    out = []
    for url in expand_urls(spec):
        local = "://" not in url and not url.startswith("pipe:")
        if local and root is not None and not Path(url).expanduser().is_absolute():
            url = str(root / url)
        out.append(str(Path(url).expanduser()) if local else url)
    return out


def read_index(path: Path) -> tuple[list[str], dict[str, dict]]:
    """(class names, {shard file name: {"count": n, ...}}) from an index JSON.

    Accepted: {"classes": [...], "shards": {name: {"count": n, "sha256": ...}}} (what `data shard` writes),
    a bare list of class names, or {"0": [wnid, name], ...} (torchvision's imagenet_class_index.json).
    """
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"webdataset: no class index at {path}. Write one (a JSON list of class names, in index "
                         "order) or point data.options.index at it; `torchsprint data shard` writes it.") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"webdataset: cannot read the class index {path}: {e}") from None
    if isinstance(obj, list):
        return [str(c) for c in obj], {}
    if isinstance(obj, dict) and "classes" in obj:
        return [str(c) for c in obj["classes"]], dict(obj.get("shards", {}))
    if isinstance(obj, dict) and all(k.isdigit() for k in obj):
        return [str(obj[k][-1] if isinstance(obj[k], list) else obj[k]) for k in sorted(obj, key=int)], {}
    raise UsageError(f"webdataset: {path} is not a class index: expected a JSON list of class names or "
                     '{"classes": [...], "shards": {...}}.')


def count_local(path: str) -> int:
    """Samples in a local tar shard, from its headers only (tarfile seeks past the data)."""
    from webdataset.tariterators import base_plus_ext

    keys, last = 0, None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isreg():
                    continue
                key, _ = base_plus_ext(member.name)
                if key is not None and key != last:
                    keys, last = keys + 1, key
    except (OSError, tarfile.TarError) as e:
        raise UsageError(f"webdataset: cannot read shard {path}: {e}") from None
    return keys


def shard_counts(urls: list[str], known: dict[str, dict], where: str) -> list[int]:
    """Samples per shard: from the index, else counted from local tar headers; a `pipe:`/remote shard
    missing from the index is an error."""
    out = []
    for url in urls:
        name = _pipe_name(url) if url.startswith("pipe:") else url.rsplit("/", 1)[-1]
        entry = known.get(name)
        if entry is not None:
            out.append(int(entry["count"] if isinstance(entry, dict) else entry))
        elif url.startswith("pipe:") or "://" in url:
            raise UsageError(f"{where}: the index has no sample count for {url!r} (a stream cannot be counted without "
                             f"reading it). Add \"shards\": {{\"{name}\": {{\"count\": N}}}} to the index, or write the "
                             "shards with `torchsprint data shard`.")
        elif not Path(url).is_file():
            raise UsageError(f"{where}: shard {url} does not exist.")
        else:
            out.append(count_local(url))
    return out


def _pipe_name(url: str) -> str:
    """The shard file name a `pipe:` command streams, e.g. 'train-000001.tar' of 'pipe:aws s3 cp s3://b/train-000001.tar -'."""
    for token in reversed(url[5:].split()):
        if token.endswith(".tar") or ".tar" in token:
            return token.rsplit("/", 1)[-1]
    return url


def require_webdataset() -> None:
    """The webdataset library, or a one-line error saying how to install it."""
    try:
        import webdataset  # noqa: F401
    except ImportError:
        raise UsageError("data.dataset=webdataset needs the webdataset library: pip install 'torchsprint[shards]'.") from None


@DATASETS.register("webdataset")
def webdataset(data_cfg) -> Splits:
    """WebDataset tar shards: data.root holds train-*.tar, val-*.tar and index.json (what `torchsprint data
    shard` writes), or data.options names the shards (brace expansion, `pipe:` URLs) and the index."""
    check_options(data_cfg, WEBDATASET_OPTIONS)
    require_webdataset()
    opts = data_cfg.options
    root = Path(data_cfg.root).expanduser() if data_cfg.root else None
    if root is None and "train" not in opts:
        raise UsageError("data.dataset=webdataset needs data.root=<folder with train-*.tar and index.json> "
                         "or data.options.train=<shard list, e.g. 'train-{000000..000127}.tar'>.")
    if root is not None and not root.is_dir() and "train" not in opts:
        raise UsageError(f"data.root={root} does not exist or is not a folder.")
    if "index" in opts:
        index = Path(opts["index"]).expanduser()
        index = index if index.is_absolute() or root is None else root / index
    elif root is not None:
        index = root / INDEX_NAME
    else:
        raise UsageError("data.dataset=webdataset: set data.root (the folder of index.json) or data.options.index.")
    classes, known = read_index(index)
    splits = {}
    for split in ("train", "val"):
        if split in opts:
            urls = expand_shards(str(opts[split]), root)
        else:
            urls = sorted(str(p) for p in root.glob(f"{split}-*.tar")) if root is not None else []
        if split == "train" and not urls:
            raise UsageError(f"webdataset: no training shards ({root}/train-*.tar, or set data.options.train).")
        splits[split] = (urls, shard_counts(urls, known, f"data.options.{split}"))
    if data_cfg.val_fraction != 0.2 or data_cfg.split_seed != 0:
        raise UsageError("data.val_fraction/data.split_seed: webdataset cannot hold out a share of a stream; it validates "
                         "on its val shards (`torchsprint data shard` writes them). Remove these settings.")
    buffer = int(opts.get("shuffle_buffer", 1000))
    if buffer < 0:
        raise UsageError(f"data.options.shuffle_buffer={buffer}: use 0 (no sample shuffle) or more samples.")
    mode = opts.get("mode", "RGB")
    made = [ShardSet(urls, counts, mode, decoder=data_cfg.decoder, max_pixels=data_cfg.max_image_pixels,
                     shuffle_buffer=buffer, image_key=opts.get("image_key"), label_key=opts.get("label_key", "cls"))
            for urls, counts in (splits["train"], splits["val"])]
    return Splits(made[0], made[1], classes, in_channels=1 if mode == "GRAY" else 3)


"""The decoded-image cache (`data.cache`): each split's image files decoded once with the run's decoder, pre-sized
to what the split's transforms can use, stored as raw uint8 in one memory-mapped file that later runs and every
epoch read instead of decoding the files again.

Format: a folder per (split's files, decode settings, size cap) holding `images.u8` (every image HWC, back to
back), `index.npy` (per sample: offset, channels, height, width, crc32 of its bytes, file size, file mtime in ns;
channels 0 marks a file that did not decode, its reason in `bad.json`) and `meta.json` (what the key was made of).

Why a numpy memmap with an index of our own rather than LitData's or MosaicML Streaming's chunks: training draws
sample i in any order (the seeded, resumable EpochSampler; DDP ranks take disjoint index shards of it), and one
sample here is a slice of the page cache copied out, no deserialisation; the chunk formats are built to stream
chunks in sequence and shuffle them with their own sampler, which would replace the order that exact resume and
the per-sample augmentation seeds are built on (and add a dependency). What they do beyond this (object storage,
many machines) is what `data.dataset=webdataset` shards are for.

Written atomically: a build writes `<key>.tmp-<pid>` and renames it to `<key>` when complete, under an exclusive
lock on `<key>.lock`, so a killed build leaves nothing that is read, and a second run building the same cache
waits for the first and reads its result whole. Each read checks the image's crc32: a damaged file is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import size_text
from torchsprint.data.preprocess.transforms import channels_last_copy, compile_spec, decode_hint, parse_step
from torchsprint.errors import UsageError

CACHE_VERSION = 1
DEFAULT_GIB = 20.0  # data.cache_gib=null: at most this, and at most half of the free disk
COLUMNS = 7  # offset, channels, height, width, crc32, file size, file mtime_ns


def cache_root(data_cfg) -> Path:
    """data.cache_dir, else $TORCHSPRINT_CACHE_DIR, else $XDG_CACHE_HOME/torchsprint/images (~/.cache/...)."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    if os.environ.get("TORCHSPRINT_CACHE_DIR"):
        return Path(os.environ["TORCHSPRINT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torchsprint" / "images"


def budget_bytes(data_cfg, root: Path) -> tuple[int, str]:
    """The most bytes the cache folder may hold, and in words where that comes from."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if data_cfg.cache_gib is not None:
        return int(data_cfg.cache_gib * 2**30), f"data.cache_gib={data_cfg.cache_gib:g}"
    limit = min(int(DEFAULT_GIB * 2**30), free // 2)
    return limit, f"data.cache_gib=null: {DEFAULT_GIB:g} GiB, at most half of the {size_text(free)} free"


@dataclass(frozen=True)
class SizeCap:
    """How a split's images are sized before they are cached, from its transforms' first step.

    `resize`: the step itself, applied exactly: the run's own resize then finds the size it makes and returns the
    pixels unchanged (eval from the cache equals eval from the files, bit for bit). `crop` (random_resized_crop of
    `size`, scale from `scale_min`, ratio from `ratio_min`): shrunk until its smallest crop still has `size`
    pixels across (what the transform can use); images already that small are kept as decoded, bit for bit.
    `none`: kept as decoded.
    """

    kind: str
    step: object = None
    text: str = ""
    size: tuple[int, int] = (0, 0)
    scale_min: float = 1.0
    ratio_min: float = 1.0
    ratio_max: float = 1.0

    def describe(self) -> str:
        if self.kind == "resize":
            return f"resized as the transforms' first step {self.text}"
        if self.kind == "crop":
            return (
                f"short side capped for random_resized_crop {self.size[0]}x{self.size[1]}, scale from "
                f"{self.scale_min:g}, ratio {self.ratio_min:.4g}-{self.ratio_max:.4g}"
            )
        return "as decoded"

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.kind == "resize":
            return self.step(image)
        if self.kind != "crop":
            return image
        h, w = image.shape[-2:]
        area = h * w * self.scale_min
        narrowest = math.sqrt(area * self.ratio_min)  # the smallest crop's width and height
        shortest = math.sqrt(area / self.ratio_max)
        factor = min(narrowest / self.size[1], shortest / self.size[0])
        if factor <= 1:
            return image
        from torchvision.transforms.v2 import functional as F

        out = [max(1, math.ceil(h / factor)), max(1, math.ceil(w / factor))]
        return F.resize(channels_last_copy(image), out, antialias=True)


def size_cap(spec: list, where: str, channels: int) -> SizeCap:
    """The SizeCap of a transforms spec (its first step)."""
    if not spec:
        return SizeCap("none")
    name, arg = parse_step(spec[0], where)
    kw = arg if isinstance(arg, dict) else {"size": arg}
    if name == "resize":
        return SizeCap("resize", step=compile_spec([spec[0]], where, channels).cpu, text=json.dumps(spec[0]))
    if name == "random_resized_crop" and kw.get("size") is not None:
        size = kw["size"]
        sz = (size, size) if isinstance(size, int) else tuple(size) * (2 if len(size) == 1 else 1)
        scale = kw.get("scale", (0.08, 1.0))
        ratio = kw.get("ratio", (3 / 4, 4 / 3))
        return SizeCap(
            "crop",
            size=(int(sz[0]), int(sz[1])),
            scale_min=float(scale[0]),
            ratio_min=float(ratio[0]),
            ratio_max=float(ratio[1]),
        )
    return SizeCap("none")


def decoder_version(decoder: str) -> str:
    """The decoding library's version: another libjpeg-turbo can decode other pixels."""
    import importlib.metadata as md

    dist = {"torchvision": "torchvision", "simplejpeg": "simplejpeg", "pil": "pillow"}.get(decoder, decoder)
    try:
        return f"{dist} {md.version(dist)}"
    except md.PackageNotFoundError:
        return dist


def keys_of(files, cap: SizeCap, hint) -> tuple[str, str, np.ndarray]:
    """(key, data set id, per-file (size, mtime_ns)): the key changes with any file's size or mtime, the decode
    settings or the cap; the data set id only with the list of files and the settings (to find a stale cache)."""
    stats = np.zeros((len(files.samples), 2), dtype=np.int64)
    for i, (path, _) in enumerate(files.samples):
        try:
            st = os.stat(path)
            stats[i] = (st.st_size, st.st_mtime_ns)
        except OSError:
            stats[i] = (-1, -1)
    settings = json.dumps(
        [
            CACHE_VERSION,
            files.mode,
            files.decoder,
            decoder_version(files.decoder),
            files.max_pixels,
            files.max_bytes,
            repr(hint),
            cap.describe(),
        ]
    )
    ident = hashlib.sha256(settings.encode())
    for path, label in files.samples:
        ident.update(f"{path}\0{label}\n".encode())
    key = ident.copy()
    key.update(stats.tobytes())
    return key.hexdigest()[:20], ident.hexdigest()[:20], stats


class CachedImages(torch.utils.data.Dataset):
    """An ImageFiles split read from its cache: the same (uint8 CHW | None, label, path or "path: reason") items.

    `read` (raw bytes, for backends that decode elsewhere) and `samples` are the files' own.
    """

    def __init__(self, files, folder: Path, index: np.ndarray, bad: dict[str, str]):
        self.files, self.samples, self.mode = files, files.samples, files.mode
        self.decoder, self.max_pixels, self.max_bytes = files.decoder, files.max_pixels, files.max_bytes
        self.folder, self.index, self.bad = folder, index, bad
        self._data = None

    @property
    def channels(self) -> int:
        return self.files.channels

    def with_min_size(self, min_size_for) -> CachedImages:
        return self  # decoded with the run's hint when the cache was built

    def __getstate__(self):
        return {**self.__dict__, "_data": None}  # each worker maps the file itself

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int):
        return self.files.read(i)

    def subset(self, indices: list[int]) -> CachedImages:
        """The samples at `indices`, read from the same cache (data.backend=auto measures on such a sample)."""
        files = self.files.__class__(
            [self.samples[i] for i in indices],
            self.mode,
            decoder=self.decoder,
            max_pixels=self.max_pixels,
            max_bytes=self.max_bytes,
        )
        bad = {str(j): self.bad[str(i)] for j, i in enumerate(indices) if str(i) in self.bad}
        return CachedImages(files, self.folder, self.index[indices], bad)

    def nbytes(self) -> int:
        """The bytes of every stored image (what the memory backend would hold)."""
        return int(self.index[:, 1:4].prod(axis=1).sum())

    def shapes(self) -> set[tuple[int, int, int]]:
        """The (channels, height, width) of the stored images (unreadable files left out)."""
        rows = self.index[self.index[:, 1] > 0]
        return {tuple(int(v) for v in r) for r in np.unique(rows[:, 1:4], axis=0)}

    def __getitem__(self, i: int):
        offset, c, h, w, crc = (int(v) for v in self.index[i, :5])
        path, label = self.samples[i]
        if c == 0:
            return None, label, f"{path}: {self.bad.get(str(i), 'unreadable')}"
        if self._data is None:
            self._data = np.memmap(self.folder / "images.u8", dtype=np.uint8, mode="r")
        pixels = np.array(self._data[offset : offset + c * h * w])  # a copy: the transforms get writable memory
        if pixels.size != c * h * w or zlib.crc32(pixels) != crc:
            raise UsageError(damaged(self.folder, f"the pixels of {path} do not match their checksum"))
        return torch.from_numpy(pixels).view(h, w, c).permute(2, 0, 1), label, path


def damaged(folder: Path, what: str) -> str:
    return (
        f"the decoded-image cache {folder} is damaged ({what}): delete that folder (or run `torchsprint data cache "
        f"--clear`) and run again, or set data.cache=off."
    )


class _Sized(torch.utils.data.Dataset):
    """Build side: one file decoded as the run decodes it, then sized by the cap, as HWC bytes (or its reason)."""

    def __init__(self, files, cap: SizeCap):
        self.files, self.cap = files, cap

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        image, _, source = self.files[i]
        if image is None:
            return None, source.split(": ", 1)[-1]
        return self.cap(image).permute(1, 2, 0).contiguous().numpy(), None


def build(
    files, cap: SizeCap, folder: Path, key_stats: np.ndarray, meta: dict, limit: int, limit_why: str, workers: int
) -> None:
    """Decode every file into `folder` (a temporary name, renamed by the caller), refusing past `limit` bytes."""
    folder.mkdir(parents=True)
    index = np.zeros((len(files), COLUMNS), dtype=np.int64)
    index[:, 5:] = key_stats
    bad: dict[str, str] = {}
    offset = 0
    loader = torch.utils.data.DataLoader(
        _Sized(files, cap),
        batch_size=32,
        num_workers=workers,
        collate_fn=list,
        generator=torch.Generator().manual_seed(0),
    )
    with open(folder / "images.u8", "wb") as out:
        i = 0
        for chunk in loader:
            for pixels, reason in chunk:
                if pixels is None:
                    bad[str(i)] = reason
                else:
                    h, w, c = pixels.shape
                    out.write(pixels.tobytes())
                    index[i, :5] = (offset, c, h, w, zlib.crc32(pixels))
                    offset += pixels.size
                    if offset > limit:
                        raise CacheTooLarge(
                            f"over {size_text(limit)} ({limit_why}) after {i + 1:,} of {len(files):,} images"
                        )
                i += 1
        out.flush()
        os.fsync(out.fileno())
    np.save(folder / "index.npy", index)
    (folder / "bad.json").write_text(json.dumps(bad))
    meta = {
        **meta,
        "bytes": offset,
        "images": len(files),
        "unreadable": len(bad),
        "built": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


class CacheTooLarge(Exception):
    """The decoded images would not fit the cache's disk budget."""


def open_cache(files, folder: Path) -> CachedImages:
    """A complete cache folder checked against its files (count, sizes): a damaged one is refused."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        index = np.load(folder / "index.npy")
        bad = json.loads((folder / "bad.json").read_text())
        size = (folder / "images.u8").stat().st_size
    except (OSError, ValueError) as e:
        raise UsageError(damaged(folder, f"{type(e).__name__}: {e}")) from None
    if index.shape != (len(files), COLUMNS) or meta.get("images") != len(files):
        raise UsageError(damaged(folder, f"its index holds {index.shape[0]:,} images, the split {len(files):,}"))
    if size != meta.get("bytes"):
        raise UsageError(damaged(folder, f"images.u8 holds {size:,} bytes, its index says {meta.get('bytes'):,}"))
    os.utime(folder / "meta.json")  # the least recently used caches are removed first
    return CachedImages(files, folder, index, bad)


def stale_caches(root: Path, ident: str, key: str) -> list[tuple[Path, dict]]:
    """Complete caches of the same files and settings under another key (files changed since they were built)."""
    out = []
    for meta_file in root.glob("*/meta.json"):
        if meta_file.parent.name == key:
            continue
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        if meta.get("dataset_id") == ident:
            out.append((meta_file.parent, meta))
    return out


def evict(root: Path, limit: int, keep: str) -> list[str]:
    """Remove the least recently used complete caches (never `keep`, never one being built) until the folder fits."""
    entries = []
    for meta_file in root.glob("*/meta.json"):
        folder = meta_file.parent
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        entries.append((meta_file.stat().st_mtime, folder, size))
    total = sum(size for _, _, size in entries)
    removed = []
    for _, folder, size in sorted(entries):
        if total <= limit:
            break
        if folder.name == keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder.name)
    return removed


def cached_split(files, spec: list, where: str, split: str, data_cfg, log) -> tuple[CachedImages | None, dict]:
    """The split `files` (ImageFiles) read from its cache, built now if there is none: (dataset, what happened).
    (None, why) where it does not fit the budget under data.cache=auto; data.cache=on refuses that instead."""
    channels = files.channels
    hint = decode_hint(spec, where)
    cap = size_cap(spec, where, channels)
    files = files.with_min_size(hint)  # decoded as the cpu backend decodes for this spec
    root = cache_root(data_cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"data.cache: cannot create the cache folder {root} ({e.strerror}); set data.cache_dir to a "
            "writable folder, or data.cache=off."
        ) from None
    key, ident, stats = keys_of(files, cap, hint)
    folder = root / key
    record = {"dir": str(folder), "key": key, "sizing": cap.describe()}
    limit, limit_why = budget_bytes(data_cfg, root)

    def too_large(what: str):
        if data_cfg.cache == "on":
            raise UsageError(
                f"data.cache=on: the decoded {split} images take {what} in {root}. Raise "
                "data.cache_gib, set data.cache_dir to a larger disk, or data.cache=off."
            )
        return None, {**record, "state": "off", "why": f"data.cache=auto: the decoded {split} images take {what}"}

    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second run building the same cache waits here, then reads it
        if (folder / "meta.json").exists():
            ds = open_cache(files, folder)
            nbytes = ds.nbytes()
            if nbytes > limit:  # built under a larger budget: the budget holds for every run
                return too_large(f"{size_text(nbytes)}, over {size_text(limit)} ({limit_why})")
            return ds, {
                **record,
                "state": "reused",
                "built": json.loads((folder / "meta.json").read_text())["built"],
                "bytes": nbytes,
                "seconds": 0.0,
            }
        for tmp in root.glob(f"{key}.tmp-*"):  # a killed build's leftovers (only the lock holder writes them)
            shutil.rmtree(tmp, ignore_errors=True)
        stale = stale_caches(root, ident, key)
        changed = ""
        if stale:
            old_index = np.load(stale[0][0] / "index.npy")
            n = int((old_index[:, 5:] != stats).any(axis=1).sum()) if old_index.shape[0] == len(stats) else len(stats)
            changed = f"{n:,} of {len(stats):,} files changed since the cache of {stale[0][1].get('built', '?')}: "
            for old, _ in stale:
                shutil.rmtree(old, ignore_errors=True)
        tmp = root / f"{key}.tmp-{os.getpid()}"
        meta = {
            "version": CACHE_VERSION,
            "dataset_id": ident,
            "split": split,
            "mode": files.mode,
            "decoder": files.decoder,
            "decoder_version": decoder_version(files.decoder),
            "sizing": cap.describe(),
            "first_file": files.samples[0][0] if files.samples else None,
        }
        log(f"data.cache: {changed}decoding {len(files):,} {split} images once into {folder} ({cap.describe()})")
        start = time.perf_counter()
        workers = min(8, len(os.sched_getaffinity(0))) if len(files) >= 256 else 0
        try:
            build(files, cap, tmp, stats, meta, limit, limit_why, workers)
        except CacheTooLarge as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return too_large(str(e))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.rename(tmp, folder)  # complete: from here on it is read
        seconds = time.perf_counter() - start
        removed = evict(root, limit, keep=key)
        ds = open_cache(files, folder)
        return ds, {
            **record,
            "state": "built",
            "built": json.loads((folder / "meta.json").read_text())["built"],
            "bytes": ds.nbytes(),
            "seconds": round(seconds, 2),
            "evicted": removed,
            "changed": changed.rstrip(": "),
        }


def with_cache(data_cfg, splits, log=print):
    """`splits` with each image-file split (train, val, test) read from its cache: (splits, the record for
    decisions.json). Untouched (and said why) where data.cache=off or the data are not image files."""
    from torchsprint.data.sources.folders import ImageFiles

    if data_cfg.cache == "off":
        return splits, {"state": "off", "why": "data.cache=off"}
    if not isinstance(splits.train, ImageFiles):
        if data_cfg.cache == "on":
            raise UsageError(
                f"data.cache=on: data.dataset={data_cfg.dataset} is not read as image files (the cache "
                "covers image_folder and file_list); set data.cache=auto or off."
            )
        return splits, {
            "state": "off",
            "why": f"data.cache=auto: data.dataset={data_cfg.dataset} is not read as image "
            "files (the cache covers image_folder and file_list)",
        }
    record: dict = {"state": "on", "splits": {}}
    changes = {}
    for name, spec, where in (
        ("train", data_cfg.train.transforms, "data.train.transforms"),
        ("val", data_cfg.eval.transforms, "data.eval.transforms"),
        ("test", data_cfg.eval.transforms, "data.eval.transforms"),
    ):
        files = getattr(splits, name)
        if not isinstance(files, ImageFiles) or len(files) == 0:
            continue
        ds, rec = cached_split(files, spec, where, name, data_cfg, log)
        if ds is None:
            return splits, rec
        record["splits"][name] = rec
        changes[name] = ds
    record["dir"] = str(cache_root(data_cfg))
    return replace(splits, **changes), record

"""webdataset: WebDataset tar shards (local files, brace-expanded lists, `pipe:` streams) read with the
`webdataset` library, planned so that every rank and loader worker reads its own samples exactly once. This file:
the options, the index and the shard listing (counts); the epoch plan and the streaming readers the backends use
are in sources/shard_stream.py.

Format: each sample is a group of tar members sharing a key, `<key>.jpg` (or .jpeg/.png/.webp) and
`<key>.cls` (the class index as text), WebDataset's convention. Beside the shards, an index JSON
(`index.json`, written by `torchsprint data shard`) holds the class names and, per shard, its sample
count and checksum; a bare JSON list of class names works too (local shards are then counted by reading
their tar headers; `pipe:` shards need counts in the index, since a stream cannot be counted for free).

`pipe:` URLs run the shell command they name (webdataset's gopen), exactly as the user wrote it in the
config: use them only in configs you trust.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from torchsprint.data.core import DATASETS, MODE, Splits, check_options
from torchsprint.data.sources.shard_stream import ShardSet
from torchsprint.errors import UsageError

INDEX_NAME = "index.json"
WEBDATASET_OPTIONS = {
    "train": "training shards: a path/URL with brace expansion, e.g. 'train-{000000..000127}.tar' or "
    "'pipe:aws s3 cp s3://bucket/train-{000000..000127}.tar -' (default: <root>/train-*.tar)",
    "val": "validation shards, the same way (default: <root>/val-*.tar; none: no validation)",
    "index": f"the index/class JSON (default: <root>/{INDEX_NAME})",
    "shuffle_buffer": "samples in the seeded shuffle buffer of each worker (default 1000; 0 or 1: shard order only)",
    "image_key": (
        "the member extension of the image (default: the first of jpg, jpeg, png, webp, bmp, gif, tif, tiff present)"
    ),
    "label_key": "the member extension of the class index (default: cls)",
    **MODE,
}


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
        raise UsageError(
            f"webdataset: no class index at {path}. Write one (a JSON list of class names, in index "
            "order) or point data.options.index at it; `torchsprint data shard` writes it."
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"webdataset: cannot read the class index {path}: {e}") from None
    if isinstance(obj, list):
        return [str(c) for c in obj], {}
    if isinstance(obj, dict) and "classes" in obj:
        return [str(c) for c in obj["classes"]], dict(obj.get("shards", {}))
    if isinstance(obj, dict) and all(k.isdigit() for k in obj):
        return [str(obj[k][-1] if isinstance(obj[k], list) else obj[k]) for k in sorted(obj, key=int)], {}
    raise UsageError(
        f"webdataset: {path} is not a class index: expected a JSON list of class names or "
        '{"classes": [...], "shards": {...}}.'
    )


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
            raise UsageError(
                f"{where}: the index has no sample count for {url!r} (a stream cannot be counted without "
                f'reading it). Add "shards": {{"{name}": {{"count": N}}}} to the index, or write the '
                "shards with `torchsprint data shard`."
            )
        elif not Path(url).is_file():
            raise UsageError(f"{where}: shard {url} does not exist.")
        else:
            out.append(count_local(url))
    return out


def _pipe_name(url: str) -> str:
    """The shard file name a `pipe:` command streams, e.g. 'train-000001.tar' of
    'pipe:aws s3 cp s3://b/train-000001.tar -'."""
    for token in reversed(url[5:].split()):
        if token.endswith(".tar") or ".tar" in token:
            return token.rsplit("/", 1)[-1]
    return url


def require_webdataset() -> None:
    """The webdataset library, or a one-line error saying how to install it."""
    try:
        import webdataset  # noqa: F401
    except ImportError:
        raise UsageError(
            "data.dataset=webdataset needs the webdataset library: pip install 'torchsprint[shards]'."
        ) from None


@DATASETS.register("webdataset")
def webdataset(data_cfg) -> Splits:
    """WebDataset tar shards: data.root holds train-*.tar, val-*.tar and index.json (what `torchsprint data
    shard` writes), or data.options names the shards (brace expansion, `pipe:` URLs) and the index."""
    check_options(data_cfg, WEBDATASET_OPTIONS)
    require_webdataset()
    opts = data_cfg.options
    root = Path(data_cfg.root).expanduser() if data_cfg.root else None
    if root is None and "train" not in opts:
        raise UsageError(
            "data.dataset=webdataset needs data.root=<folder with train-*.tar and index.json> "
            "or data.options.train=<shard list, e.g. 'train-{000000..000127}.tar'>."
        )
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
        raise UsageError(
            "data.val_fraction/data.split_seed: webdataset cannot hold out a share of a stream; it validates "
            "on its val shards (`torchsprint data shard` writes them). Remove these settings."
        )
    buffer = int(opts.get("shuffle_buffer", 1000))
    if buffer < 0:
        raise UsageError(f"data.options.shuffle_buffer={buffer}: use 0 (no sample shuffle) or more samples.")
    mode = opts.get("mode", "RGB")
    made = [
        ShardSet(
            urls,
            counts,
            mode,
            decoder=data_cfg.decoder,
            max_pixels=data_cfg.max_image_pixels,
            shuffle_buffer=buffer,
            image_key=opts.get("image_key"),
            label_key=opts.get("label_key", "cls"),
        )
        for urls, counts in (splits["train"], splits["val"])
    ]
    return Splits(made[0], made[1], classes, in_channels=1 if mode == "GRAY" else 3)

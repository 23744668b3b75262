"""`torchsprint data cache [DIR]`: build the decoded-image cache of a data set now, list what the cache folder
holds, or clear it (data.cache, data/image_cache.py)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from torchsprint.data.core import DATASETS, size_text
from torchsprint.data.image_cache import cache_root, with_cache
from torchsprint.errors import UsageError
from torchsprint.train.resolve import resolve


def entries(root: Path) -> list[dict]:
    """Every complete cache under `root`: its key, split, images, bytes, built, last used, first file."""
    out = []
    for meta_file in sorted(root.glob("*/meta.json")):
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            meta = {}
        folder = meta_file.parent
        out.append(
            {
                "key": folder.name,
                "dir": str(folder),
                "split": meta.get("split"),
                "images": meta.get("images"),
                "bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                "built": meta.get("built"),
                "dataset_id": meta.get("dataset_id"),
                "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(meta_file.stat().st_mtime)),
                "first_file": meta.get("first_file"),
                "sizing": meta.get("sizing"),
            }
        )
    return out


def cache_cli(args) -> int:
    """Build (default), --list or --clear; DIR is data.root."""
    from torchsprint import config

    overrides = list(args.overrides)
    if args.dir is not None:
        overrides.insert(0, f"data.root={args.dir}")
    cfg = config.load(args.config, overrides)
    root = cache_root(cfg.data)
    if args.list:
        found = entries(root) if root.exists() else []
        if args.json:
            print(json.dumps({"dir": str(root), "caches": found}))
            return 0
        print(f"{root}: {len(found)} cache(s), {size_text(sum(e['bytes'] for e in found))}")
        for e in found:
            print(
                f"  {e['key']}  {e['split']:>5}  {e['images'] or 0:>7,} images  {size_text(e['bytes']):>10}  built "
                f"{e['built']}  used {e['last_used']}  {Path(e['first_file'] or '?').parent}"
            )
        return 0
    if args.clear_all:
        removed = [e["key"] for e in entries(root)] if root.exists() else []
        for key in removed:
            shutil.rmtree(root / key, ignore_errors=True)
        print(f"removed {len(removed)} cache(s) from {root}")
        return 0
    cfg = resolve(cfg, weights=False)  # the transforms decide the sizing; how a model starts does not
    if cfg.data.cache == "off" and not args.clear:
        raise UsageError("data.cache=off: nothing to build; remove data.cache=off (or set it to on).")
    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    if args.clear:
        from torchsprint.data.image_cache import decode_hint, keys_of, size_cap
        from torchsprint.data.sources.folders import ImageFiles

        removed = []
        for name, spec, where in (
            ("train", cfg.data.train.transforms, "data.train.transforms"),
            ("val", cfg.data.eval.transforms, "data.eval.transforms"),
            ("test", cfg.data.eval.transforms, "data.eval.transforms"),
        ):
            files = getattr(splits, name)
            if not isinstance(files, ImageFiles) or not len(files):
                continue
            hint = decode_hint(spec, where)
            _, ident, _ = keys_of(files.with_min_size(hint), size_cap(spec, where, files.channels), hint)
            for e in entries(root) if root.exists() else []:
                if e["dataset_id"] == ident:
                    shutil.rmtree(e["dir"], ignore_errors=True)
                    removed.append(e["key"])
        print(f"removed {len(removed)} cache(s) of {cfg.data.root or cfg.data.dataset} from {root}")
        return 0
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print  # --json: stdout holds the JSON alone
    _, record = with_cache(cfg.data.model_copy(update={"cache": "on"}), splits, say)
    if args.json:
        print(json.dumps(record))
        return 0
    for name, rec in record["splits"].items():
        print(
            f"{name}: {rec['state']} {rec['dir']} ({size_text(rec['bytes'])}, built {rec['built']} UTC"
            + (f", in {rec['seconds']:.1f} s" if rec["state"] == "built" else "")
            + f"; {rec['sizing']})"
        )
    return 0

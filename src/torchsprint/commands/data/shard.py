"""`torchsprint data shard SRC OUT --shard-size 1GB`: an image folder or file list -> shuffled WebDataset tar
shards plus index.json (class names; per shard its sample count, size and SHA-256), resumable and verified.

How it stays correct when interrupted:
- The plan (which file goes into which shard, in which order) is a function of the source listing, the
  file sizes, --seed and --shard-size only. It is written to OUT/plan.json first; a rerun recomputes it
  and refuses to continue into an OUT planned differently (the source changed), naming the fix.
- Each shard is written to a temporary name with webdataset's TarWriter, flushed, fsync-ed and renamed:
  a shard file under its final name is always complete. Its record (count, bytes, SHA-256 of the file,
  a BLAKE2 digest of every sample's image bytes) is written the same way (OUT/.records/) just before
  the rename, so every shard under its final name has one.
- A rerun keeps each finished shard whose file still has the SHA-256 of its record (it is re-hashed,
  not trusted), and rewrites the others.
- At the end every shard is read back with webdataset's reader: sample count, keys, labels and every
  image's digest are compared with the plan and the source files' digests, and the file hashes with
  the records. index.json is written last, so an OUT with index.json has been verified.
- One job writes an OUT at a time: OUT/.lock (rundir.RunLock, the run folders' lock) refuses a second one.
Tar members have a fixed mtime (0), so the same source, seed and shard size give byte-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

from torchsprint.errors import UsageError
from torchsprint.runtime.files import MAX_FILE_MB, MB, inside, read_regular
from torchsprint.state.checkpoint import atomic_write
from torchsprint.state.rundir import RunLock

FORMAT = "torchsprint-shards/1"
BLOCK, RECORD = 512, 10240  # tar: 512-byte blocks; Python's tarfile pads an archive to 20-block records


def sample_tar_bytes(image_bytes: int) -> int:
    """Bytes one sample takes in a tar: a header and padded data for the image, a header and a block for .cls."""
    return BLOCK + -(-image_bytes // BLOCK) * BLOCK + 2 * BLOCK


def tar_file_bytes(samples_bytes: int) -> int:
    """The shard file's size: its samples, the two zero blocks that end it, padded to a whole record."""
    return -(-(samples_bytes + 2 * BLOCK) // RECORD) * RECORD


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str) -> int:
    """'1GB' / '500MB' / '64MiB' / '1000000' -> bytes (decimal units; KiB/MiB/GiB binary)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"--shard-size {text!r}: write a size such as 1GB, 500MB, 64MiB or a number of bytes.")
    unit = (m.group(2) or "").lower().rstrip("b")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < RECORD:
        raise UsageError(f"--shard-size {text}: at least 10KiB (tar pads every file to a multiple of {RECORD} bytes).")
    return value


def list_source(src: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]], dict[str, list[str]]]:
    """(class names, {split: [(path, class index)]}, {why: paths left out}) of an image folder (<src>/train,
    <src>/val, or class folders directly, all taken as train) or a file list (`path,label` lines; see
    folders.read_file_list). What is left out (hidden files, other extensions, FIFOs, files over the size limit) is
    returned by why, as training's start-up summary says it: never dropped without a word."""
    from torchsprint.data.sources.folders import label_classes, merge_skipped, read_file_list, scan_folder
    from torchsprint.runtime.files import unreadable

    if src.is_file():
        rows, skipped = [], {}
        for path, label in read_file_list(src):
            if why := unreadable(path, MAX_FILE_MB * MB):  # a device would never end, a huge file fill the shard
                skipped.setdefault(why, []).append(path)
            else:
                rows.append((path, label))
        classes, index = label_classes([r[1] for r in rows], None)
        return classes, {"train": [(p, index[lab]) for p, lab in rows]}, skipped
    if not src.is_dir():
        raise UsageError(
            f"{src}: no such folder or file list. SRC is an image folder (class subfolders, optionally "
            "under train/ and val/) or a .csv/.txt list of `path,label` lines."
        )
    if (src / "train").is_dir():
        train = scan_folder(src / "train")
        out, scans = {"train": train.samples}, [train]
        if (src / "val").is_dir():
            val = scan_folder(src / "val")
            if val.classes != train.classes:
                raise UsageError(
                    f"{src}: train/ and val/ have different class folders: {train.classes} vs {val.classes}."
                )
            out["val"], scans = val.samples, [train, val]
        return train.classes, out, merge_skipped(*scans)
    scan = scan_folder(src)
    return scan.classes, {"train": scan.samples}, scan.skipped


def make_plan(classes: list[str], splits: dict[str, list[tuple[str, int]]], shard_size: int, seed: int) -> dict:
    """Shuffle each split (seeded) and cut it into shards of at most `shard_size` bytes (exact tar sizes; a
    single file larger than that gets a shard of its own)."""
    import numpy as np

    shards = []
    for k, (split, samples) in enumerate(splits.items()):
        order = np.random.default_rng([seed, k]).permutation(len(samples)).tolist()
        current, size = [], 0
        for n, i in enumerate(order):
            path, label = samples[i]
            try:
                nbytes = sample_tar_bytes(os.path.getsize(path))
            except OSError as e:
                raise UsageError(f"{path}: cannot read it ({e.strerror}). Fix or remove it, then rerun.") from None
            if current and tar_file_bytes(size + nbytes) > shard_size:
                shards.append(
                    {
                        "name": f"{split}-{sum(s['split'] == split for s in shards):06d}.tar",
                        "split": split,
                        "samples": current,
                    }
                )
                current, size = [], 0
            current.append([f"{split[0]}{n:09d}", path, label, Path(path).suffix.lower().lstrip(".") or "jpg"])
            size += nbytes
        if current:
            shards.append(
                {
                    "name": f"{split}-{sum(s['split'] == split for s in shards):06d}.tar",
                    "split": split,
                    "samples": current,
                }
            )
    return {"format": FORMAT, "classes": classes, "seed": seed, "shard_size": shard_size, "shards": shards}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def write_text(path: Path, text: str) -> None:
    """`text` into `path` atomically (checkpoint.atomic_write: a temp file of this process, fsync, rename)."""
    atomic_write(path, lambda f: f.write(text.encode()))


def write_shard(out: Path, shard: dict, rec_file: Path) -> dict:
    """Write one shard atomically, its record first (so a shard under its final name always has one);
    returns the record (count, bytes, sha256, sample digests)."""
    import webdataset as wds

    final = out / shard["name"]
    tmp = out / f".{shard['name']}.tmp"
    digests = []
    with open(tmp, "wb") as f:
        with wds.TarWriter(f, mtime=0) as w:  # fixed mtime: byte-identical shards for the same plan
            for key, path, label, ext in shard["samples"]:
                try:
                    data = read_regular(path, MAX_FILE_MB * MB)  # a FIFO would block, a device never end
                except OSError as e:
                    raise UsageError(f"{path}: cannot read it ({e.strerror}). Fix or remove it, then rerun.") from None
                w.write({"__key__": key, ext: data, "cls": str(label)})
                digests.append(digest(data))
        f.flush()
        os.fsync(f.fileno())
    rec = {"count": len(shard["samples"]), "bytes": tmp.stat().st_size, "sha256": file_sha256(tmp), "digests": digests}
    write_text(rec_file, json.dumps(rec))
    os.replace(tmp, final)
    return rec


def verify(out: Path, plan: dict, records: dict[str, dict], progress=None) -> list[str]:
    """Read every shard back (webdataset's reader): counts, keys, labels and image digests against the plan and
    records, file hashes against the records. Returns the problems found (none: verified)."""
    import webdataset as wds

    problems = []
    task = progress.add_task("verifying", total=len(plan["shards"])) if progress else None
    for shard in plan["shards"]:
        path, rec = out / shard["name"], records[shard["name"]]
        if file_sha256(path) != rec["sha256"]:
            problems.append(f"{shard['name']}: SHA-256 differs from the one recorded when it was written")
        got = [
            (
                s["__key__"],
                int(s["cls"]),
                digest(next(v for k, v in s.items() if not k.startswith("__") and k != "cls")),
            )
            for s in wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
        ]
        want = [(key, label, d) for (key, _, label, _), d in zip(shard["samples"], rec["digests"])]
        if len(got) != len(shard["samples"]):
            problems.append(f"{shard['name']}: {len(got)} samples, planned {len(shard['samples'])}")
        elif got != want:
            bad = next(g for g, w in zip(got, want) if g != w)
            problems.append(f"{shard['name']}: sample {bad[0]} differs from its source file")
        if progress:
            progress.advance(task)
    return problems


def shard(src: str, out: str, shard_size: str = "1GB", seed: int = 0, progress: bool = True) -> dict:
    """Write SRC as shuffled shards into OUT (see the module docstring); returns the summary."""
    from torchsprint.data.sources.webdataset import require_webdataset

    require_webdataset()
    src_p, out_p = Path(src).expanduser(), Path(out).expanduser()
    if src_p.is_dir() and inside(out_p, src_p):  # shards among the images: SRC would then be detected as shards
        raise UsageError(
            f"OUT {out} is {'SRC itself' if inside(src_p, out_p) else 'inside SRC'} ({src}): the shards "
            "and index.json would be written among its images. Choose an OUT folder outside SRC."
        )
    size = parse_size(shard_size)
    classes, splits, skipped = list_source(src_p)
    plan = make_plan(classes, splits, size, seed)
    try:
        out_p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the OUT folder {out_p}: {e.strerror}. Choose a writable folder.") from None
    # One writer per OUT: two jobs would rename each other's temp files away and race for index.json.
    lock = RunLock(
        out_p,
        role="data shard",
        hint="Another `torchsprint data shard` job is writing this OUT folder; "
        "wait for it to end (rerun then to check it), or choose another OUT folder.",
    )
    try:
        summary = _shard_locked(src_p, out_p, classes, splits, plan, size, seed, progress)
        return summary | {
            "skipped": {why: {"count": len(paths), "examples": paths[:3]} for why, paths in skipped.items()}
        }
    finally:
        lock.release()


def _shard_locked(
    src_p: Path, out_p: Path, classes: list[str], splits: dict, plan: dict, size: int, seed: int, progress: bool
) -> dict:
    """shard()'s work, with the OUT folder locked."""
    from torchsprint.data.sources.webdataset import INDEX_NAME

    (out_p / ".records").mkdir(exist_ok=True)
    plan_file = out_p / "plan.json"
    text = json.dumps(plan)
    if plan_file.is_file() and plan_file.read_text() != text:
        raise UsageError(
            f"{out_p} holds shards of a different plan (the source, --seed or --shard-size changed since "
            "they were written). Use an empty OUT folder, or delete this one."
        )
    if not plan_file.is_file():
        if any(out_p.glob("*.tar")):
            raise UsageError(
                f"{out_p} already holds .tar files that `data shard` did not plan. Use an empty OUT folder."
            )
        write_text(plan_file, text)
    bar = None
    if progress and sys.stderr.isatty():
        from rich.progress import Progress

        bar = Progress(transient=False)
        bar.start()
    kept, written, records = 0, 0, {}
    try:
        task = bar.add_task("writing shards", total=len(plan["shards"])) if bar else None
        for s in plan["shards"]:
            rec_file = out_p / ".records" / f"{s['name']}.json"
            if (out_p / s["name"]).is_file() and rec_file.is_file():
                rec = json.loads(rec_file.read_text())
                if rec.get("count") == len(s["samples"]) and file_sha256(out_p / s["name"]) == rec.get("sha256"):
                    records[s["name"]], kept = rec, kept + 1  # finished before an interruption: re-hashed, kept
                    if bar:
                        bar.advance(task)
                    continue
            rec = write_shard(out_p, s, rec_file)
            records[s["name"]], written = rec, written + 1
            if bar:
                bar.advance(task)
        problems = verify(out_p, plan, records, bar)
    finally:
        if bar:
            bar.stop()
    if problems:
        raise UsageError(
            f"{out_p}: verification failed: {problems[0]} ({len(problems)} problem(s)). Delete the shards "
            "named and rerun to rewrite them."
        )
    index = {
        "format": FORMAT,
        "classes": classes,
        "source": str(src_p),
        "seed": seed,
        "shard_size": size,
        "shards": {
            s["name"]: {k: records[s["name"]][k] for k in ("count", "bytes", "sha256")} | {"split": s["split"]}
            for s in plan["shards"]
        },
    }
    write_text(out_p / INDEX_NAME, json.dumps(index, indent=1))
    counts = {split: sum(len(s["samples"]) for s in plan["shards"] if s["split"] == split) for split in splits}
    return {
        "out": str(out_p),
        "shards": len(plan["shards"]),
        "kept": kept,
        "written": written,
        "samples": counts,
        "bytes": sum(r["bytes"] for r in records.values()),
    }


def shard_cli(args) -> int:
    """`torchsprint data shard SRC OUT [--shard-size 1GB] [--seed 0]`: write, verify, print the summary."""
    r = shard(args.src, args.out, args.shard_size, args.seed)
    per = ", ".join(f"{k} {v}" for k, v in r["samples"].items())
    print(
        f"{r['shards']} shards ({r['written']} written, {r['kept']} kept from an earlier run), samples: {per}, "
        f"{r['bytes'] / 1e6:.1f} MB, verified; index: {Path(r['out']) / 'index.json'}"
    )
    if r["skipped"]:
        print(f"left out {sum(v['count'] for v in r['skipped'].values()):,} file(s) of SRC that are not samples:")
        for why, v in r["skipped"].items():
            print(f"  {v['count']:,} {why}, e.g. {', '.join(v['examples'])}")
    print(f"train on them with: data.dataset=webdataset data.root={r['out']}")
    return 0

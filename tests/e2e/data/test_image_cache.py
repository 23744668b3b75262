"""The decoded-image cache (data.cache, data/image_cache.py) on real JPEG files through the real decoders: built once
and reused, equal to the files where its sizing keeps their pixels (training bit for bit, evaluation always),
rebuilt when a file changes, refused when damaged, shared by two processes building it at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import load_resolved, make_image_folder
from torchsprint.data.build import build_loaders
from torchsprint.data.image_cache import SizeCap, size_cap
from torchsprint.runtime import Runtime

CPU = Runtime(torch.device("cpu"))
# 24x20 JPEGs; random_resized_crop 16 from 50%: the smallest crop is ~12 px across, so nothing is shrunk and the
# cache holds the decoded pixels themselves. Eval: resize 18 then crop 16 (the resize is what the cache applies).
SPEC = [
    "data.train.transforms=[{random_resized_crop: {size: 16, scale: [0.5, 1.0]}}, hflip]",
    "data.eval.transforms=[{resize: 18}, {center_crop: 16}]",
]


def settings(root: Path, cache_dir: Path, *more: str) -> list[str]:
    return [
        f"data.root={root}",
        f"data.cache_dir={cache_dir}",
        "data.backend=cpu",
        "model.name=small_cnn",
        "model.pretrained=null",
        "data.batch_size=4",
        "run.epochs=2",
        "precision.mode=fp32",
        *SPEC,
        *more,
    ]


def batches(cfg, split: str = "train", epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loaders = build_loaders(cfg.data, CPU, seed=cfg.run.seed)
    loader = getattr(loaders, split)
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader], loaders.info.facts["cache"]


def test_cached_batches_equal_the_files_and_the_second_build_reuses_the_first(tmp_path):
    """Training and evaluation batches read from the cache equal those decoded from the files, bit for bit (a
    sizing that keeps the training pixels, the eval resize applied exactly); a second loader reuses the cache.
    Bugs caught: the cache storing pixels another decode or layout gives (HWC/CHW mixed up, a wrong offset), the
    eval resize applied twice or differently, a rebuild on every run, a key that ignores the sizing."""
    root = make_image_folder(tmp_path / "images", per_class=8)
    off = load_resolved(overrides=settings(root, tmp_path / "cache", "data.cache=off"))
    on = load_resolved(overrides=settings(root, tmp_path / "cache", "data.cache=on"))
    for split in ("train", "val"):
        want, state = batches(off, split, epoch=1)
        assert state["state"] == "off"
        got, first = batches(on, split, epoch=1)
        again, second = batches(on, split, epoch=1)
        assert len(got) == len(want) > 0
        for (x, y), (wx, wy), (ax, _) in zip(got, want, again):
            assert torch.equal(x, wx) and torch.equal(y, wy) and torch.equal(ax, wx)
        assert {r["state"] for r in first["splits"].values()} <= {"built", "reused"}
        assert {r["state"] for r in second["splits"].values()} == {"reused"}
    keys = {p.name for p in (tmp_path / "cache").iterdir() if (p / "meta.json").exists()}
    assert len(keys) == 2  # one per split: train and val
    # The sizes the record (and the start-up line) reports, against the images themselves: 16 training JPEGs of
    # 24x20 RGB kept as decoded; 16 validation ones resized by the eval spec's first step to a short side of 18
    # (20x24 -> 18x21, torchvision's rounding). Bug caught: a figure counted from another split or before the sizing.
    from PIL import Image

    w, h = Image.open(next((root / "val").rglob("*.jpg"))).size
    assert (w, h) == (24, 20)
    assert first["splits"]["val"]["bytes"] == 16 * 3 * 18 * int(18 * w / h)
    assert second["splits"]["train"]["bytes"] == 16 * 3 * h * w


def test_training_from_the_cache_equals_training_from_the_files(tmp_path, cli_in_process):
    """Two epochs from the files and two from the cache (the first run building it, a second run reusing it) end
    with the same weights, bit for bit; decisions.json says what the cache did. Bugs caught: cached samples in
    another order or with other seeds, a label mixed up, the record claiming a cache the run did not read."""
    from safetensors.torch import load_file

    root = make_image_folder(tmp_path / "images", per_class=8)
    weights = {}
    for name, extra in (("files", "data.cache=off"), ("built", "data.cache=auto"), ("reused", "data.cache=auto")):
        r = cli_in_process("train", *settings(root, tmp_path / "cache", extra, f"run.dir={tmp_path / name}"))
        assert r.returncode == 0, r.stderr
        weights[name] = load_file(tmp_path / name / "last.safetensors")
        cache = json.loads((tmp_path / name / "decisions.json").read_text())["cache"]
        if name == "files":
            assert cache == {"state": "off", "why": "data.cache=off"}
        else:
            assert {r["state"] for r in cache["splits"].values()} == {name}, cache
            assert "decoded-image cache" in r.stdout
    for name in ("built", "reused"):
        assert weights[name].keys() == weights["files"].keys()
        assert all(torch.equal(weights[name][k], weights["files"][k]) for k in weights["files"]), name


def test_a_touched_file_rebuilds_the_cache_and_says_so(tmp_path):
    """Rewriting one image (new pixels, new mtime) gives a new cache holding the new pixels; the stale one is removed
    and the record says how many files changed. Bugs caught: a key without mtimes or sizes (the old pixels served
    after the file changed), stale caches piling up in the folder."""
    root = make_image_folder(tmp_path / "images", per_class=8)
    cfg = load_resolved(overrides=settings(root, tmp_path / "cache", "data.cache=on"))
    before, _ = batches(cfg, "val")
    victim = sorted((root / "val").rglob("*.jpg"))[0]
    from PIL import Image

    Image.new("RGB", (24, 20), (255, 0, 0)).save(victim, quality=90)
    after, record = batches(cfg, "val")
    rec = record["splits"]["val"]
    assert rec["state"] == "built" and rec["changed"].startswith("1 of 16 files changed"), rec
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(after, before))
    want, _ = batches(load_resolved(overrides=settings(root, tmp_path / "cache", "data.cache=off")), "val")
    assert all(torch.equal(a[0], w[0]) for a, w in zip(after, want))
    vals = [
        p
        for p in (tmp_path / "cache").iterdir()
        if (p / "meta.json").exists() and json.loads((p / "meta.json").read_text())["split"] == "val"
    ]
    assert len(vals) == 1


@pytest.mark.parametrize("damage", ["pixels", "truncated", "index"])
def test_a_damaged_cache_is_refused_in_one_line(tmp_path, cli_in_process, damage):
    """A flipped byte in the pixels, a truncated pixel file or an index of another length: the run stops with exit 2
    and one line naming the cache folder and how to clear it. Bugs caught: damaged pixels trained on silently, an
    index read past its end (garbage images or a numpy traceback)."""
    root = make_image_folder(tmp_path / "images", per_class=8)
    # the pixels case reads in a DataLoader worker: its error crosses the process boundary as one line too
    base = settings(
        root, tmp_path / "cache", "data.cache=on", "run.epochs=1", f"data.num_workers={1 if damage == 'pixels' else 0}"
    )
    r = cli_in_process("data", "cache", "--json", *[x for s in base for x in ("--set", s)])
    assert r.returncode == 0, r.stderr
    folder = Path(json.loads(r.stdout)["splits"]["train"]["dir"])
    if damage == "pixels":
        data = bytearray((folder / "images.u8").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (folder / "images.u8").write_bytes(bytes(data))
    elif damage == "truncated":
        with open(folder / "images.u8", "r+b") as f:
            f.truncate(100)
    else:
        np.save(folder / "index.npy", np.load(folder / "index.npy")[:-1])
    r = cli_in_process("train", *base, f"run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and str(folder) in lines[0] and "damaged" in lines[0], r.stderr


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_two_processes_building_one_cache_build_it_once(tmp_path):
    """Two `torchsprint data cache` processes started together on one folder: one builds each split, the other waits
    and reads it whole (reused), and no temporary folder is left. Bugs caught: both building and one renaming onto
    the other's folder (an error, or a half-read cache), a reader opening the cache before it is complete."""
    root = make_image_folder(tmp_path / "images", per_class=150)  # 600 files: the build takes its worker processes
    args = [
        sys.executable,
        "-m",
        "torchsprint",
        "data",
        "cache",
        str(root),
        "--json",
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        "model.name=small_cnn",
        *[x for s in SPEC for x in ("--set", s)],
    ]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    records = [json.loads(o[0]) for o in outs]
    for split in ("train", "val"):
        states = sorted(r["splits"][split]["state"] for r in records)
        assert states == ["built", "reused"], records
        assert records[0]["splits"][split]["key"] == records[1]["splits"][split]["key"]
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def test_a_killed_builds_leftovers_are_never_read(tmp_path):
    """A build killed before its rename leaves `<key>.tmp-<pid>`: the next build removes it and builds a complete
    cache; nothing reads the leftover. Bugs caught: a half-written folder taken for a cache."""
    root = make_image_folder(tmp_path / "images", per_class=8)
    cfg = load_resolved(overrides=settings(root, tmp_path / "cache", "data.cache=on"))
    want, record = batches(cfg, "val")
    folder = Path(record["splits"]["val"]["dir"])
    leftover = folder.with_name(folder.name + ".tmp-99999")
    folder.rename(leftover)  # what a build killed just before its rename leaves
    (leftover / "images.u8").write_bytes(b"half")
    got, record = batches(cfg, "val")
    assert record["splits"]["val"]["state"] == "built" and not leftover.exists()
    assert all(torch.equal(a[0], w[0]) for a, w in zip(got, want))


def test_the_training_sizing_keeps_what_random_resized_crop_can_use():
    """A 300x300 image for random_resized_crop 128 from 35%: shrunk so that the smallest crop (~154 px) keeps 128 px
    across, never below; an image already that small is returned as it is (the same tensor). Bugs caught: a cap
    that loses resolution the crops use, or shrinks images that are already small."""
    cap = size_cap([{"random_resized_crop": {"size": 128, "scale": [0.35, 1.0]}}], "data.train.transforms", 3)
    big = torch.randint(0, 255, (3, 300, 300), dtype=torch.uint8)
    out = cap(big)
    h, w = out.shape[-2:]
    smallest = (h * w * 0.35 * 0.75) ** 0.5
    assert 128 <= smallest < 129.5 and (h, w) < (300, 300)
    small = torch.randint(0, 255, (3, 150, 150), dtype=torch.uint8)
    assert cap(small) is small
    assert SizeCap("none")(big) is big


def test_data_cache_list_and_clear(tmp_path, cli_in_process):
    """`data cache --list` shows the caches `data cache DIR` built; `--clear` removes this folder's, `--clear-all`
    the rest. Bugs caught: --clear removing another data set's cache, or none."""
    a = make_image_folder(tmp_path / "a", per_class=4)
    b = make_image_folder(tmp_path / "b", per_class=5)
    opts = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "model.name=small_cnn"]
    for root in (a, b):
        assert cli_in_process("data", "cache", str(root), *opts).returncode == 0
    listed = json.loads(cli_in_process("data", "cache", "--list", "--json", *opts).stdout)["caches"]
    assert sorted(e["images"] for e in listed) == [8, 8, 10, 10]
    r = cli_in_process("data", "cache", str(a), "--clear", *opts)
    assert r.returncode == 0 and "removed 2 cache(s)" in r.stdout, r.stdout + r.stderr
    left = json.loads(cli_in_process("data", "cache", "--list", "--json", *opts).stdout)["caches"]
    assert sorted(e["images"] for e in left) == [10, 10]
    assert "removed 2 cache(s)" in cli_in_process("data", "cache", "--clear-all", *opts).stdout


def test_a_cached_run_paused_and_resumed_equals_the_uninterrupted_one(tmp_path):
    """A cached run paused after 3 steps (run.stop_after_steps) and resumed ends with the weights of the uninterrupted
    cached run, bit for bit. Bugs caught: the resumed run reading another cache (rebuilt, other sizes), the
    per-sample seeds or the order not continued across the resume on cached samples."""
    from safetensors.torch import load_file

    from torchsprint import config
    from torchsprint.train.run import train

    root = make_image_folder(tmp_path / "images", per_class=8)
    base = settings(
        root,
        tmp_path / "cache",
        "data.cache=on",
        "log.progress=false",
        "checkpoint.every_steps=1",
        "model.args={dropout: 0.2}",
    )
    train(config.load(None, [*base, f"run.dir={tmp_path / 'whole'}"]), quiet=True)
    first = train(config.load(None, [*base, f"run.dir={tmp_path / 'resumed'}", "run.stop_after_steps=3"]), quiet=True)
    assert first["paused"] and first["global_step"] == 3
    train(config.load(None, [*base, f"run.dir={tmp_path / 'resumed'}", "checkpoint.resume=auto"]), quiet=True)
    a, b = (load_file(tmp_path / d / "last.safetensors") for d in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    decisions = json.loads((tmp_path / "resumed" / "decisions.json").read_text())
    assert {r["state"] for r in decisions["cache"]["splits"].values()} == {"reused"}


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@pytest.mark.dist  # two 2-process runs, ~12 s on 2 cores
def test_ddp_ranks_read_their_shards_from_the_cache_as_from_the_files(tmp_path, run_cli):
    """`--nproc-per-node 2` with data.cache=on (both ranks reach the build at once: one builds, the other waits)
    ends with the weights of the same DDP run from the files, bit for bit: each rank read exactly its shard's
    pixels. Bugs caught: ranks building the cache twice or reading it half-written, a rank reading another rank's
    samples, the cache indexed by position in a rank's shard instead of by sample."""
    from safetensors.torch import load_file

    root = make_image_folder(tmp_path / "images", per_class=8)
    for name, cache in (("files", "off"), ("cached", "on")):
        r = run_cli(
            "train",
            "--nproc-per-node",
            "2",
            *settings(
                root, tmp_path / "cache", f"data.cache={cache}", "log.progress=false", f"run.dir={tmp_path / name}"
            ),
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = (load_file(tmp_path / d / "last.safetensors") for d in ("files", "cached"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "cache").glob("*.tmp-*"))

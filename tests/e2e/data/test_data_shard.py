"""`torchsprint data shard`: shuffled shards + index, killed midway (SIGKILL) and rerun: finished shards kept,
the result byte-identical to an uninterrupted run, every source file in it exactly once, readable by
data.dataset=webdataset."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_image_folder
from fault_env import fault_env
from paths import REPO  # noqa: E402
from torchsprint import config
from torchsprint.commands.data.shard import parse_size, shard
from torchsprint.data import build_loaders
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime


def source_set(root: Path) -> set[tuple[str, str, str]]:
    """(split, class, digest of the bytes) of every image file under an image folder."""
    return {
        (p.parts[-3], p.parts[-2], hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest())
        for p in root.rglob("*.jpg")
    }


def shard_set(out: Path) -> set[tuple[str, str, str]]:
    import webdataset as wds

    classes = json.loads((out / "index.json").read_text())["classes"]
    got = []
    for tar in sorted(out.glob("*.tar")):
        for s in wds.WebDataset(str(tar), shardshuffle=False, empty_check=False):
            got.append(
                (tar.name.split("-")[0], classes[int(s["cls"])], hashlib.blake2b(s["jpg"], digest_size=16).hexdigest())
            )
    assert len(got) == len(set(got))  # no sample twice
    return set(got)


def shard_order(out: Path, split: str) -> list[tuple[str, str]]:
    """(class, digest) of every sample of `split`, in shard order then tar order."""
    import webdataset as wds

    classes = json.loads((out / "index.json").read_text())["classes"]
    return [
        (classes[int(s["cls"])], hashlib.blake2b(s["jpg"], digest_size=16).hexdigest())
        for tar in sorted(out.glob(f"{split}-*.tar"))
        for s in wds.WebDataset(str(tar), shardshuffle=False, empty_check=False)
    ]


def test_killed_midway_then_rerun_is_complete_and_identical(tmp_path, cli_in_process):
    """The killed job is a real process; the rerun runs in this one (a start-up less)."""
    src = make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=12)
    ref = shard(str(src), str(tmp_path / "ref"), "12KB", seed=3, progress=False)
    out = tmp_path / "out"
    env = fault_env(dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1"), shard_pause_s="0.05")
    cmd = [
        sys.executable,
        "-m",
        "torchsprint",
        "data",
        "shard",
        str(src),
        str(out),
        "--shard-size",
        "12KB",
        "--seed",
        "3",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(list(out.glob("*.tar"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.tar")}
    assert 2 <= len(finished) < ref["shards"], "the kill must land midway"
    assert not (out / "index.json").exists()  # written only after verification
    rerun = cli_in_process(*cmd[3:])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{len(finished)} kept" in rerun.stdout and "verified" in rerun.stdout
    for name, stamp in finished.items():  # finished shards were kept, not rewritten
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == stamp
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(p.name for p in (tmp_path / "ref").glob("*.tar"))
    for p in out.glob("*.tar"):  # byte-identical to the uninterrupted run (fixed plan, fixed tar mtime)
        assert p.read_bytes() == (tmp_path / "ref" / p.name).read_bytes()
    assert not list(out.glob(".*.tmp*"))  # write_shard's .<shard>.tmp, atomic_write's .<file>.tmp-<pid>
    assert shard_set(out) == source_set(src)
    index = json.loads((out / "index.json").read_text())
    assert sum(v["count"] for v in index["shards"].values()) == 72 and all(
        v["bytes"] <= 12000 for v in index["shards"].values()
    )


def test_shards_train_and_a_damaged_shard_is_rewritten(tmp_path):
    src = make_image_folder(tmp_path / "src", classes=("a", "b"), per_class=10)
    out = tmp_path / "out"
    first = shard(str(src), str(out), "11KB", progress=False)
    assert first["samples"] == {"train": 20, "val": 20} and first["written"] == first["shards"] > 4
    data = config.load(
        None,
        [
            "data.dataset=webdataset",
            f"data.root={out}",
            "data.batch_size=4",
            "data.drop_last=false",
            "data.train.transforms=[normalize]",
            "data.eval.transforms=[normalize]",
        ],
    ).data
    loaders = build_loaders(data, Runtime(torch.device("cpu")), seed=0)
    assert loaders.info.classes == ["a", "b"] and len(loaders.train) == 5 and len(loaders.val) == 3
    loaders.train.set_epoch(0)
    assert sum(len(y) for _, y in loaders.train) == 20
    victim = sorted(out.glob("train-*.tar"))[1]
    blob = bytearray(victim.read_bytes())
    blob[700] ^= 0xFF  # a flipped byte inside the first image
    victim.write_bytes(bytes(blob))
    again = shard(str(src), str(out), "11KB", progress=False)
    assert again["written"] == 1 and again["kept"] == first["shards"] - 1
    assert shard_set(out) == source_set(src)
    # Shuffled, by the seed: the 10 circles and 10 squares of train/ are not in folder order, and seed 1
    # gives another order of the same samples (a plan that ignored the seed passed everything above).
    order = shard_order(out, "train")
    assert [c for c, _ in order] != sorted(c for c, _ in order)
    shard(str(src), str(tmp_path / "seed1"), "11KB", seed=1, progress=False)
    other = shard_order(tmp_path / "seed1", "train")
    assert sorted(other) == sorted(order) and other != order
    # A different plan into the same OUT is refused; so is a nonsense size.
    with pytest.raises(UsageError, match="different plan"):
        shard(str(src), str(out), "11KB", seed=1, progress=False)
    with pytest.raises(UsageError, match="--shard-size"):
        parse_size("big")
    assert parse_size("1GB") == 10**9 and parse_size("64MiB") == 64 * 2**20 and parse_size("500 MB") == 5 * 10**8


def test_what_data_shard_leaves_out_is_said(tmp_path, cli_in_process):
    """A sparse file over data.max_file_mb (512 MiB apparent size, no disk used), a FIFO named .jpg and a hidden
    file in a class folder: the shards hold the images only, and `data shard` says what it left out and why, as
    training's start-up summary does. Before, each was dropped without a word (scan_class_folders reported
    nothing), so a user's huge file was silently missing from the shards."""
    src = tmp_path / "src"
    make_image_folder(src, splits=("train",))
    images = source_set(src)  # before the files that are not samples (reading them would block or take 512 MiB)
    huge = src / "train" / "circle" / "huge.jpg"
    with open(huge, "wb") as f:
        f.truncate(513 * 1024 * 1024)
    os.mkfifo(src / "train" / "square" / "pipe.jpg")
    (src / "train" / "square" / ".hidden.jpg").write_bytes(b"x")
    r = cli_in_process("data", "shard", str(src), str(tmp_path / "out"), "--shard-size", "64KB")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "left out 3 file(s) of SRC that are not samples:" in out, out
    assert f"1 larger than data.max_file_mb (never read whole into memory), e.g. {huge}" in out, out
    assert "1 hidden" in out and "pipe.jpg" in out, out
    assert {(c, d) for _, c, d in shard_set(tmp_path / "out")} == {(c, d) for _, c, d in images}

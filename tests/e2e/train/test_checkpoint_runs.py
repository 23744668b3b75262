"""The saver (cadence, last-K/best-K, status file, atomic writes), safe loading, exported weights and bad input."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchsprint import cli, config
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime
from torchsprint.runtime.rng import rng_isolated, rng_state, set_rng_state
from torchsprint.state import checkpoint as ckpt_mod
from torchsprint.state.checkpoint import (
    TEMP_RE,
    Saver,
    TrainState,
    atomic_write,
    data_geometry,
    load_checkpoint,
)
from torchsprint.state.precision import Precision
from torchsprint.state.resume import find_checkpoints, find_resume, restore
from torchsprint.train.run import train

CPU = Runtime(torch.device("cpu"))
# No augmentation: these runs test bookkeeping, so keep them as fast as the loader allows.
FAST = [
    "model.args={width: 8}",
    "data.batch_size=128",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "checkpoint.every_epochs=null",
]


def fast_run(run_dir: Path, *extra: str, quiet: bool = True) -> dict:
    return train(config.load(None, [*FAST, f"run.dir={run_dir}", *extra]), quiet=quiet)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- saver bookkeeping


def make_saver(run_dir: Path, *overrides: str, rt: Runtime = CPU) -> tuple[Saver, tuple]:
    cfg = config.load(None, list(overrides))
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    saver = Saver(
        run_dir,
        cfg.checkpoint,
        rt,
        {"config": config.to_dict(cfg), "classes": ["a", "b"]},
        geometry=data_geometry(cfg, rt.world_size),
    )
    return saver, (model, opt, sched, Precision("fp32", CPU.device))


@pytest.mark.parametrize("mode, kept", [("max", {1, 2, 4, 5}), ("min", {0, 3, 4, 5})])
def test_saver_keeps_last_k_and_best_k_and_records_every_save(tmp_path, mode, kept):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=2", "checkpoint.keep_best=2", f"checkpoint.mode={mode}")
    metrics = [0.5, 0.9, 0.7, 0.4, None, None]  # steps 1..6 (None: a mid-epoch save, unscored)
    for i, m in enumerate(metrics):
        saver.save(TrainState(epoch=0, step_in_epoch=i + 1, global_step=i + 1), *objs, metric=m)
    on_disk = {p.name for p in find_checkpoints(tmp_path)}
    assert on_disk == {f"ckpt-e001-s{i + 1:07d}.pt" for i in kept}
    status = json.loads((tmp_path / "checkpoints" / "status.json").read_text())
    assert {e["file"] for e in status["checkpoints"]} == on_disk
    for e in status["checkpoints"]:
        assert e["bytes"] == (tmp_path / "checkpoints" / e["file"]).stat().st_size
        assert e["metric"] == metrics[e["step"] - 1]
    assert [(e["step"], e["metric"]) for e in status["history"]] == [(i + 1, m) for i, m in enumerate(metrics)]
    assert status["latest"] == "ckpt-e001-s0000006.pt"
    assert status["best"] == ("ckpt-e001-s0000002.pt" if mode == "max" else "ckpt-e001-s0000004.pt")


def test_checkpoint_holds_everything_needed_to_continue(tmp_path):
    saver, (model, opt, sched, prec) = make_saver(
        tmp_path, "run.seed=3", "data.batch_size=32", "optim.accum_steps=2", "data.sampler=shuffle"
    )  # a run resolves auto before saving
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    path = saver.save(
        TrainState(
            epoch=1,
            step_in_epoch=5,
            global_step=20,
            best_metric=0.5,
            best_epoch=1,
            epoch_loss_sum=2.5,
            epoch_steps=5,
            epoch_correct=70,
            epoch_samples=160,
        ),
        model,
        opt,
        sched,
        prec,
        metric=None,
    )
    ck = load_checkpoint(path)
    assert torch.equal(ck["model"]["weight"], model.weight.detach())
    assert torch.equal(ck["optimizer"]["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    assert ck["scheduler"]["last_epoch"] == sched.last_epoch and "scaler" in ck
    assert ck["train_state"] == {
        "epoch": 1,
        "step_in_epoch": 5,
        "global_step": 20,
        "best_metric": 0.5,
        "best_epoch": 1,
        "skipped_steps": 0,
        "epoch_loss_sum": 2.5,
        "epoch_steps": 5,
        "epoch_correct": 70,
        "epoch_samples": 160,
        "stop_best": None,
        "stop_wait": 0,
        "stopped_epoch": None,
        "best_step": None,
        "fitted_steps": None,
    }
    assert ck["sampler"] == {
        "epoch": 1,
        "batches_done": 10,
        "batch_size": 32,
        "accum_steps": 2,
        "world_size": 1,
        "seed": 3,
        "repeated_aug": 1,
        "data_sampler": "shuffle",
        "data_sampler_from_epoch": 1,
    }
    assert set(ck["rng"][0]) == {"python", "numpy", "torch"}  # + "cuda" when training on a GPU
    assert ck["config"]["run"]["seed"] == 3 and ck["classes"] == ["a", "b"]


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    saved = rng_state(torch.device("cpu"))
    torch.save({"rng": saved}, tmp_path / "r.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"], torch.device("cpu"))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_iterating_a_dataloader_leaves_the_model_rng_untouched():
    loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=5)
    before = torch.get_rng_state()
    list(rng_isolated(loader, torch.device("cpu")))
    assert torch.equal(torch.get_rng_state(), before)
    list(loader)  # the reason for rng_isolated: a plain DataLoader draws a base seed per iterator
    assert not torch.equal(torch.get_rng_state(), before)


def test_a_loader_drawing_global_random_numbers_gets_fresh_ones_per_batch():
    batches = list(rng_isolated((torch.rand(2) for _ in range(3)), torch.device("cpu")))
    assert not torch.equal(batches[0], batches[1]) and not torch.equal(batches[1], batches[2])  # no replay


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old contents")

    def half_then_fail(f):
        f.write(b"new, partial")
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(OSError):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old contents"
    assert not [p for p in tmp_path.iterdir() if TEMP_RE.match(p.name)]


def test_loading_never_executes_code_from_the_file(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "checkpoints" / "ckpt-e000-s0000001.pt"
    path.parent.mkdir()
    torch.save({"format": ckpt_mod.FORMAT, "model": Payload()}, path)
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


def test_saves_every_n_epochs_every_n_steps_and_at_the_end(tmp_path):
    # 3 epochs x 11 steps; steps 8, 16, 24, 32; after epoch 2 (step 22); the end (step 33).
    fast_run(
        tmp_path, "run.epochs=3", "checkpoint.every_epochs=2", "checkpoint.every_steps=8", "checkpoint.keep_last=10"
    )
    history = json.loads((tmp_path / "checkpoints" / "status.json").read_text())["history"]
    assert [(e["epoch"], e["step_in_epoch"], e["step"]) for e in history] == [
        (1, 8, 8),
        (2, 5, 16),
        (2, 0, 22),
        (3, 2, 24),
        (3, 10, 32),
        (3, 0, 33),
    ]  # 1-based epoch numbers
    assert [e["metric"] is None for e in history] == [True, True, False, True, True, False]


def test_resume_from_an_explicit_file_or_run_folder(tmp_path):
    a = tmp_path / "a"
    fast_run(a, "run.stop_after_steps=2", "checkpoint.every_steps=1")
    s2, s1 = find_checkpoints(a)
    # A run folder resumes from its newest checkpoint; the new run saves into its own folder.
    assert fast_run(tmp_path / "b", f"checkpoint.resume={a}", "run.stop_after_steps=1")["global_step"] == 3
    # An explicit older file of the same folder: the newer one is another timeline now, set aside
    # so that a later `resume: auto` cannot pick it.
    assert (
        fast_run(a, f"checkpoint.resume={s1}", "run.stop_after_steps=2", "checkpoint.every_steps=5")["global_step"] == 3
    )
    assert [p.name for p in find_checkpoints(a)] == ["ckpt-e001-s0000003.pt", s1.name]
    assert [p.name for p in (a / "checkpoints").glob("superseded-*/*.pt")] == [s2.name]


# ---------------------------------------------------------------- exported weights


def test_best_and_last_weights_load_with_plain_safetensors_without_torchsprint(tmp_path):
    fast_run(tmp_path, "run.epochs=2")
    script = f"""
import sys, torch
from torch import nn
from safetensors.torch import load_file
def block(i, o):
    return nn.Sequential(nn.Conv2d(i, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
torch.manual_seed(0)
x = torch.rand(4, 1, 8, 8)
for name in ("best", "last"):
    m = nn.Sequential(block(1, 8), block(8, 16), nn.MaxPool2d(2), block(16, 32), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Identity(), nn.Linear(32, 10)).eval()
    m.load_state_dict(load_file(r"{tmp_path}/" + name + ".safetensors"), strict=True)
    torch.save(m(x).detach(), r"{tmp_path}/" + name + "-logits.pt")
assert "torchsprint" not in sys.modules
"""
    # The same kernels in both processes (ATEN_CPU_CAPABILITY and oneDNN's ISA cap passed on): under other kernels the
    # logits differ in the last bits (the default kernels against AVX2: not equal; oneDNN capped to AVX2 against
    # uncapped: not equal), which would say nothing about the weights.
    kernels = {k: v for k, v in os.environ.items() if k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    subprocess.run(
        [sys.executable, "-c", script], check=True, cwd="/", env={"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", **kernels}
    )
    from torchsprint.models.nets import small_cnn

    torch.manual_seed(0)
    x = torch.rand(4, 1, 8, 8)
    for name in ("best", "last"):
        m = small_cnn(10, 1, width=8).eval()
        m.load_state_dict(load_file(str(tmp_path / f"{name}.safetensors")))
        assert torch.equal(m(x).detach(), torch.load(tmp_path / f"{name}-logits.pt"))


# ---------------------------------------------------------------- bad input


def test_missing_checkpoint_path_is_a_usage_error(tmp_path, capsys):
    missing = tmp_path / "nope" / "ckpt-e001-s0000001.pt"
    assert cli.main(["train", *FAST, f"run.dir={tmp_path / 'run'}", f"checkpoint.resume={missing}"]) == 2
    assert str(missing) in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(tmp_path / "no-run")]) == 2


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(UsageError, match=r"notes\.pt is not a readable checkpoint"):
        load_checkpoint(text)
    weights = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(2)}, str(weights))
    with pytest.raises(UsageError, match=r"w\.safetensors is not a .*checkpoint"):
        load_checkpoint(weights)
    state_dict = tmp_path / "sd.pt"
    torch.save(nn.Linear(2, 2).state_dict(), state_dict)
    with pytest.raises(UsageError, match=r"not a torchsprint checkpoint.*model\.pretrained"):
        load_checkpoint(state_dict)
    with pytest.raises(UsageError, match="not a torchsprint checkpoint"):
        fast_run(tmp_path / "run", f"checkpoint.resume={state_dict}")


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path):
    fast_run(tmp_path, "run.stop_after_steps=2", "checkpoint.every_steps=1")
    saved = find_checkpoints(tmp_path)
    digests = {p: sha(p) for p in saved}
    with pytest.raises(
        UsageError, match=r"does not fit this model.*0\.0\.weight: file \(8, 1, 3, 3\) vs model \(16, 1, 3, 3\)"
    ):
        fast_run(tmp_path, "checkpoint.resume=auto", "model.args={width: 16}")
    assert {p: sha(p) for p in find_checkpoints(tmp_path)} == digests


def test_unwritable_run_folder_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a path through a file cannot be created, even by root (chmod would not stop root)
    assert cli.main(["train", *FAST, f"run.dir={blocker / 'run'}"]) == 2
    assert "cannot write the run folder" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")  # the checkpoint folder cannot be made
    with pytest.raises(UsageError, match="cannot use the checkpoint folder"):
        fast_run(run_dir)


class FullDisk:
    """`open` for torchsprint.state.checkpoint on a disk with `free` bytes left: writes past that fail with ENOSPC."""

    def __init__(self, free: int):
        self.free = free

    def __call__(self, path, mode="r", *args, **kw):
        f = open(path, mode, *args, **kw)
        if "w" not in mode:
            return f
        disk, real_write = self, f.write

        def write(data):
            n = len(memoryview(data).cast("B"))
            if n > disk.free:
                real_write(memoryview(data).cast("B")[: disk.free])  # what fits lands, as on a real disk
                disk.free = 0
                raise OSError(errno.ENOSPC, "No space left on device")
            disk.free -= n
            return real_write(data)

        f.write = write
        return f


def test_full_disk_during_save_is_a_clear_error_and_loses_nothing(tmp_path, monkeypatch):
    # First fill: checkpoints at steps 3, 6 (~80 KB each) and their status files; the disk fills on the third.
    monkeypatch.setattr(ckpt_mod, "open", FullDisk(free=200_000), raising=False)
    with pytest.raises(UsageError, match=r"No space left on device \(ENOSPC\).*previous checkpoints .* are intact"):
        fast_run(tmp_path, "run.epochs=1", "checkpoint.every_steps=3", "checkpoint.keep_last=5")
    monkeypatch.undo()
    saved = find_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["ckpt-e001-s0000006.pt", "ckpt-e001-s0000003.pt"]
    for p in saved:
        load_checkpoint(p)
    status = json.loads((tmp_path / "checkpoints" / "status.json").read_text())
    assert {e["file"] for e in status["checkpoints"]} == {p.name for p in saved}
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if TEMP_RE.match(p.name)]
    # Space freed: the run continues from the newest checkpoint and completes.
    summary = fast_run(
        tmp_path, "run.epochs=1", "checkpoint.every_steps=3", "checkpoint.keep_last=5", "checkpoint.resume=auto"
    )
    assert summary["global_step"] == 11 and not summary["paused"]


# ---------------------------------------------------------------- several processes


def _two_rank_worker(rank: int, run_dir: str, results: str) -> None:
    """One gloo rank: save, reload per-rank RNG, then a save that fails on rank 0 only (full disk)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank, world_size=2)
    rt = Runtime(torch.device("cpu"), rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # each rank has its own stream, as after runtime.setup(seed + rank)
    saver, objs = make_saver(Path(run_dir), rt=rt)
    path = saver.save(TrainState(epoch=0, step_in_epoch=1, global_step=1), *objs, metric=None)
    files_after_save = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())  # every rank waited for rank 0
    expected = torch.rand(3)
    found, ck = find_resume("auto", Path(run_dir), lambda m: None, rt)
    torch.manual_seed(0)
    restore(ck, objs[1], objs[2], objs[3], rt, saver.geometry, lambda m: None)
    rng_ok = torch.equal(torch.rand(3), expected)
    if rank == 0:
        ckpt_mod.open = FullDisk(free=0)
    try:
        saver.save(TrainState(epoch=0, step_in_epoch=2, global_step=2), *objs, metric=None)
        error = None
    except UsageError as e:
        error = str(e)
    Path(results, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "path": str(path),
                "found": str(found),
                "files": files_after_save,
                "rng_ok": rng_ok,
                "n_rng": len(ck["rng"]),
                "error": error,
            }
        )
    )
    dist.destroy_process_group()
    # What this test checks is written. Once in ~14 runs here rank 0 then died of SIGABRT ("terminate called without an
    # active exception": a joinable C++ thread destroyed, gloo's, on 2026-11-29); if that comes from the destructors
    # that run at interpreter exit (not verified), leaving without them keeps it from failing a checkpoint test.
    os._exit(0)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@pytest.mark.dist
def test_two_ranks_rank0_writes_all_wait_and_a_failed_save_stops_every_rank(tmp_path):
    run_dir, results = tmp_path / "run", tmp_path / "results"
    run_dir.mkdir(), results.mkdir()
    torch.multiprocessing.spawn(_two_rank_worker, args=(str(run_dir), str(results)), nprocs=2, join=True)
    r0, r1 = (json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["path"] == r1["path"] == r0["found"] == r1["found"]  # one file, chosen by rank 0, loaded by both
    assert r1["files"] == ["ckpt-e001-s0000001.pt", "status.json"]  # rank 1 saw rank 0's finished save
    assert r0["rng_ok"] and r1["rng_ok"] and r0["n_rng"] == 2  # each rank got its own stream back
    assert "No space left on device" in r0["error"] and r0["error"] == r1["error"]  # no rank left waiting
    assert [p.name for p in find_checkpoints(run_dir)] == ["ckpt-e001-s0000001.pt"]


# ---------------------------------------------------------------- no room outside the checkpoint write

ROOMY = ["model.name=linear", "log.tensorboard=false", "log.progress=false", "checkpoint.keep_last=2"]


def assert_whole_and_once(run_dir: Path) -> None:
    """Every file of the run folder is whole (each PNG decodes, each JSON parses, no temp file is left), and each
    (kind, step) record is in metrics.jsonl once."""
    from collections import Counter

    from PIL import Image

    for p in run_dir.rglob("*"):
        assert ".tmp-" not in p.name, p
        if p.suffix == ".png":
            with Image.open(p) as im:
                im.load()
        elif p.suffix == ".json":
            json.loads(p.read_text())
    rows = Counter(
        (r["kind"], r["step"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    )
    assert [k for k, n in rows.items() if n > 1] == []


def run_with_file_size_limit(tmp_path: Path, overrides: list[str], limit: int) -> subprocess.CompletedProcess:
    """`torchsprint train` in a child process under RLIMIT_FSIZE (`ulimit -f`, bytes) with SIGXFSZ ignored, so a write
    past the limit fails with EFBIG as a full disk's fails with ENOSPC (a real limit of the kernel's; mounting a full
    filesystem needs root, see the tmpfs test below)."""
    import resource
    import signal

    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited through exec: EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "torchsprint", "train", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        preexec_fn=limit_files,
    )


@pytest.mark.parametrize(
    "fills, extra",
    [
        # a linear model's checkpoint is ~27 KB, under the 32 KiB limit; the confusion matrix PNG (~36 KB) is over it
        pytest.param(
            "confusion_matrix.png", ["run.epochs=1", "checkpoint.every_steps=5"], marks=pytest.mark.slow
        ),  # the
        # same path as metrics.jsonl's below (a write outside the checkpoint failing), 10-18 s: in .ci/slow
        # 101 steps per epoch, a record of ~220 bytes each: metrics.jsonl passes 32 KiB in epoch 2
        (
            "metrics.jsonl",
            [
                "run.epochs=2",
                "eval.per_class=false",
                "data.batch_size=16",
                "log.every_steps=1",
                "checkpoint.every_steps=20",
            ],
        ),
    ],
    ids=["confusion-png", "metrics-jsonl"],
)
@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_no_room_outside_the_checkpoint_write_is_one_line_and_resume_finishes(tmp_path, capsys, fills, extra):
    """A write that finds no room outside the checkpoint's own (the confusion matrix PNG, metrics.jsonl): one line
    naming the file and the intact last checkpoint, exit 2, no cut or empty file besides the appended log's last
    line; `--resume` then finishes with every file whole and each record once. It was a traceback (OSError: File
    too large), the PNG was left cut (0 bytes on a full disk), and the resume read what was cut."""
    run_dir = tmp_path / "run"
    first = run_with_file_size_limit(tmp_path, [*ROOMY, *extra, f"run.dir={run_dir}"], 32 * 1024)
    assert first.returncode == 2 and "Traceback" not in first.stderr, first.stderr[-3000:]
    (line,) = [ln for ln in first.stderr.splitlines() if ln.startswith("error:")]
    newest = find_checkpoints(run_dir)[0]
    assert line == (
        f"error: a file reached the file size limit (ulimit -f) (File too large): writing {run_dir / fills} "
        f"failed; the last checkpoint, {newest}, is intact: free space, then continue with `torchsprint "
        f"train --resume {run_dir}`."
    ), line
    if fills.endswith(".png"):
        assert not (run_dir / fills).exists()  # whole or not at all
    assert cli.main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "completed"
    assert (run_dir / "confusion_matrix.png").is_file() == fills.endswith(".png")
    assert_whole_and_once(run_dir)


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path):
    """A real 4 MiB filesystem at tmp_path/disk for the duration (mounting one needs root: skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()[:120]}): needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_real_full_disk_mid_run_is_one_line_and_resume_finishes(tmp_path, capsys):
    """A real full filesystem: a 4 MiB tmpfs (mounting one needs root; skipped elsewhere, where the file size limit
    test above stands in), filled by this test once the run's first checkpoint is on it. The run's next write (a
    metrics record) fails with ENOSPC: one line, "the disk is full", the file, the intact last checkpoint; after the
    filler is deleted `--resume` finishes with every file whole and each record once."""
    import errno as errno_mod
    import time

    with small_tmpfs(tmp_path) as disk:
        run_dir = disk / "run"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchsprint",
                "train",
                *ROOMY,
                "run.epochs=2",
                "eval.per_class=false",
                "data.batch_size=16",
                "log.every_steps=1",
                "checkpoint.every_steps=50",
                f"run.dir={run_dir}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        status = run_dir / "checkpoints" / "status.json"

        def saved() -> bool:  # the first save done, status.json included (its own write would fail otherwise)
            try:
                return json.loads(status.read_text()).get("latest") is not None
            except (OSError, ValueError):
                return False

        deadline = time.monotonic() + 120
        while not saved() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(disk / "filler", "wb") as f:  # every page left, while the run trains on
            with pytest.raises(OSError) as full:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        assert full.value.errno == errno_mod.ENOSPC
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        newest = find_checkpoints(run_dir)[0]
        assert line.startswith(f"error: the disk is full (No space left on device): writing {run_dir}/"), line
        assert line.endswith(
            f"failed; the last checkpoint, {newest}, is intact: free space, then continue with "
            f"`torchsprint train --resume {run_dir}`."
        ), line
        (disk / "filler").unlink()
        assert cli.main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err[-2000:]
        assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "completed"
        assert_whole_and_once(run_dir)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_resume_on_a_full_disk_is_only_the_line_and_leaves_no_empty_event_file(tmp_path, capsys):
    """A run folder on a full filesystem (a 4 MiB tmpfs, root only; skipped elsewhere), resumed with TensorBoard on:
    the first write of the resumed run is TensorBoard's file-version event, from tensorboard's writer thread. Before,
    the right one-line error came with "Exception in thread Thread-1:" and a cut traceback (the thread's re-raise
    through threading.excepthook), and a 0-byte event file stayed in tb/. After the space is freed, the resume
    finishes with every file whole."""
    with small_tmpfs(tmp_path) as disk:
        run_dir = disk / "run"
        tb = ["log.tensorboard=true", "eval.per_class=false"]
        assert cli.main(["train", *ROOMY, *tb, "run.epochs=1", f"run.dir={run_dir}"]) == 0
        events = sorted((run_dir / "tb").iterdir())
        with open(disk / "filler", "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        resumed = subprocess.run(
            [sys.executable, "-m", "torchsprint", "train", "--resume", str(run_dir), "run.epochs=2"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert resumed.returncode == 2, resumed.stderr[-3000:]
        assert "Traceback" not in resumed.stderr and "Exception in thread" not in resumed.stderr, resumed.stderr[-3000:]
        (line,) = resumed.stderr.strip().splitlines()
        assert line.startswith("error: the disk is full (No space left on device): writing "), line
        assert sorted((run_dir / "tb").iterdir()) == events  # no empty event file left
        (disk / "filler").unlink()
        assert cli.main(["train", "--resume", str(run_dir), "run.epochs=2"]) == 0, capsys.readouterr().err[-2000:]
        assert_whole_and_once(run_dir)
        assert all(p.stat().st_size > 0 for p in (run_dir / "tb").iterdir())

"""Exact resume and crash safety, each compared with an uninterrupted run of the same config.

Stopping at step k uses run.stop_after_steps (a pause: checkpoint saved, schedule untouched), not
run.max_steps, which would shorten the learning-rate schedule and so train a different run.
"""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_env import fault_env
from torchsprint import config
from torchsprint.state.checkpoint import TEMP_RE, load_checkpoint
from torchsprint.state.resume import find_checkpoints
from torchsprint.train.run import train

STEPS_PER_EPOCH = 7  # digits with half held out for validation: 898 training images // batch 128 (drop_last)
EVERY_STEPS = 3

# Shuffling, random augmentation and dropout all on: every random stream a resume could disturb.
BASE = [
    "model.args={width: 8, dropout: 0.2}",
    "run.epochs=2",
    "data.batch_size=128",
    "data.val_fraction=0.5",  # fewer augmented training images: the runs are data-bound on 2 cores
    "data.train.transforms=[random_crop: {size: 8, padding: 1}, hflip]",
    "optim.lr=0.05",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "log.every_steps=1",
    f"checkpoint.every_steps={EVERY_STEPS}",
    "checkpoint.keep_last=3",
]


def run(run_dir: Path, *extra: str) -> dict:
    return train(config.load(None, [*BASE, f"run.dir={run_dir}", *extra]), quiet=True)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "last.safetensors"))


def train_lines(run_dir: Path) -> dict[int, dict]:
    """Per-step training log lines by global step (the last one wins when a step was redone)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {x["step"]: x for x in lines if x["kind"] == "train"}


def raw_train_steps(run_dir: Path) -> list[int]:
    """The step of every training log line, in the order written (a redone step appears twice)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x["step"] for x in lines if x["kind"] == "train"]


def assert_same_run(ref_dir: Path, ref: dict, got_dir: Path, got: dict) -> None:
    """Bit-identical weights, optimizer state, metrics and per-step loss/lr."""
    a, b = weights(ref_dir), weights(got_dir)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ from the uninterrupted run: {differ}"
    assert got["final"] == ref["final"]
    assert (got["best_metric"], got["best_epoch"], got["global_step"]) == (
        ref["best_metric"],
        ref["best_epoch"],
        ref["global_step"],
    )
    opt_a = load_checkpoint(find_checkpoints(ref_dir)[0])["optimizer"]["state"]
    opt_b = load_checkpoint(find_checkpoints(got_dir)[0])["optimizer"]["state"]
    assert all(torch.equal(opt_a[i]["momentum_buffer"], opt_b[i]["momentum_buffer"]) for i in opt_a)
    la, lb = train_lines(ref_dir), train_lines(got_dir)
    assert sorted(la) == sorted(lb) == list(range(1, ref["global_step"] + 1))
    for step in la:
        assert (la[step]["train/loss"], la[step]["train/lr"]) == (lb[step]["train/loss"], lb[step]["train/lr"]), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 2 epochs x 7 steps."""
    d = tmp_path_factory.mktemp("reference")
    return d, run(d)


@pytest.mark.parametrize(
    "stops, extra",
    [
        pytest.param([5], [], id="mid-epoch"),
        pytest.param([STEPS_PER_EPOCH], [], id="epoch-boundary"),
        pytest.param([10], ["data.num_workers=2"], id="mid-epoch-2-workers"),
        # Resumed mid-epoch 0, then paused 4 steps into epoch 1: the epoch after a resumed one must
        # still count its full length (it once took the resumed epoch's remainder and ended early).
        pytest.param([3, 8], [], id="two-pauses"),
    ],
)
def test_stop_and_resume_is_bit_identical(reference, tmp_path, stops, extra):
    """Pause after each of `stops` steps (run.stop_after_steps counts per invocation), then finish."""
    ref_dir, ref = reference
    step = 0
    for i, k in enumerate(stops):
        first = run(tmp_path, *extra, f"run.stop_after_steps={k}", *(["checkpoint.resume=auto"] if i else []))
        step += k
        assert first["paused"] and first["global_step"] == step
        assert not (tmp_path / "last.safetensors").exists()  # a pause is not the end of training
        ckpt = load_checkpoint(find_checkpoints(tmp_path)[0])
        assert ckpt["train_state"]["global_step"] == step
        assert ckpt["sampler"]["epoch"] * STEPS_PER_EPOCH + ckpt["sampler"]["batches_done"] == step
    done = run(tmp_path, *extra, "checkpoint.resume=auto")
    assert not done["paused"]
    # Every step logged once over all the invocations: a resume that silently started over (and so
    # trained the same weights) would log steps 1..k again.
    assert raw_train_steps(tmp_path) == list(range(1, ref["global_step"] + 1))
    assert_same_run(ref_dir, ref, tmp_path, done)


def test_corrupt_newest_checkpoint_is_reported_and_skipped(reference, tmp_path, capsys):
    ref_dir, ref = reference
    run(tmp_path, "run.stop_after_steps=6")  # checkpoints at steps 3, 6
    newest, previous = find_checkpoints(tmp_path)[:2]
    assert newest.name == "ckpt-e001-s0000006.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn file, as after a disk fault
    capsys.readouterr()
    done = train(config.load(None, [*BASE, f"run.dir={tmp_path}", "checkpoint.resume=auto"]), quiet=False)
    out = capsys.readouterr().out
    assert "skipping unreadable checkpoint" in out and newest.name in out
    assert "step 3 " in out and previous.name in out
    # The torn file is set aside, never retried by a later `resume: auto`.
    assert list((tmp_path / "checkpoints").glob("superseded-*/" + newest.name))
    assert_same_run(ref_dir, ref, tmp_path, done)


# ---------------------------------------------------------------- crash safety


def _steps_logged(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training log line so far, tolerating a line being written right now."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            x = json.loads(line)
        except json.JSONDecodeError:
            continue
        if x["kind"] == "train":
            out.append((x["step"], x["train/loss"]))
    return out


def _temp_files(run_dir: Path, pid: int | None = None) -> list[Path]:
    d = run_dir / "checkpoints"
    found = [p for p in d.iterdir() if TEMP_RE.match(p.name)] if d.is_dir() else []
    return [p for p in found if pid is None or (p.name.startswith(".ckpt") and p.name.endswith(f"-{pid}"))]


def _wait(pred, proc, timeout=60.0) -> bool:
    """Poll `pred` every 2 ms until it holds (True) or the process ends (False)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise TimeoutError("training made no progress")


@pytest.mark.slow  # four CLI start-ups: ~20 s on an idle 2-core machine, twice that when it is busy
def test_sigkill_at_random_moments_then_resume_completes_exactly(reference, tmp_path):
    """SIGKILL the CLI at random moments (several inside checkpoint writes), resume with --resume until done.

    After every kill: every ckpt-*.pt on disk loads (never a torn file under a final name), at most
    one save interval of steps is lost, and the next run resumes from the newest checkpoint.
    At the end: redone steps repeat the same losses, and the result is bit-identical to the
    uninterrupted run.
    """
    ref_dir, ref = reference
    run_dir = tmp_path / "crash"
    rng = random.Random(0)
    # in-write: killed while a checkpoint's temp file is being written (slow-disk hook below);
    # random: at a random moment after training progressed (training, logging or writing).
    # Three kills keep it to four process start-ups (2-4 s of imports each on a busy 2-core machine).
    modes = ["in-write", "random", "in-write"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="250")
    env = fault_env(env, slow_write_s="0.004")  # 4 ms per 4 KiB: ~0.1 s per checkpoint, so kills land inside writes
    killed, torn_temp_seen, expected_resume = [], 0, None
    for attempt, mode in enumerate([*modes, "finish"]):
        seen = max((s for s, _ in _steps_logged(run_dir)), default=0)
        cli_args = [*BASE, f"run.dir={run_dir}"] if attempt == 0 else ["--resume", str(run_dir)]
        log_path = tmp_path / f"attempt{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torchsprint", "train", *cli_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp_path,
            )

        def progressed(seen=seen):
            return any(s > seen for s, _ in _steps_logged(run_dir))

        def writing(pid=proc.pid):
            return bool(_temp_files(run_dir, pid))

        alive = True
        if mode == "random":
            alive = _wait(progressed, proc)
            time.sleep(rng.uniform(0.0, 0.6))
        elif mode == "in-write":
            alive = _wait(progressed, proc) and _wait(writing, proc)
        if mode != "finish" and alive and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append(mode)
            torn_temp_seen += bool(_temp_files(run_dir, proc.pid))
        else:
            assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        output = log_path.read_text()
        assert "skipping unreadable checkpoint" not in output, output
        if expected_resume is not None:  # killed only after a new step was logged, so after this line was printed
            assert "resuming at" in output and f"from {expected_resume}" in output, output
        if proc.returncode == 0:
            break
        ckpts = find_checkpoints(run_dir)
        for p in ckpts:
            load_checkpoint(p)  # raises on a torn or corrupt file
        saved_step = load_checkpoint(ckpts[0])["train_state"]["global_step"] if ckpts else 0
        done_steps = max((s for s, _ in _steps_logged(run_dir)), default=0)
        assert done_steps - saved_step <= EVERY_STEPS, f"lost more than one save interval: {done_steps} -> {saved_step}"
        expected_resume = ckpts[0] if ckpts else None
    assert len(killed) == len(modes) and torn_temp_seen >= 2, (killed, torn_temp_seen)
    assert not _temp_files(run_dir)  # temp files of killed writes are cleaned on the next start
    losses: dict[int, set[float]] = {}
    for step, loss in _steps_logged(run_dir):
        losses.setdefault(step, set()).add(loss)
    assert all(len(v) == 1 for v in losses.values()), "a redone step gave another loss"
    assert_same_run(ref_dir, ref, run_dir, json.loads((run_dir / "summary.json").read_text()))


def _records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl as a record (json.loads raises on a line that is not one)."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(x) for x in text.splitlines()]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_sigkill_after_a_log_line_then_resume_records_each_step_once(reference, tmp_path, capsys):
    """A real SIGKILL right after step 5 was logged (checkpoint at step 3), a crash that also cut the last line of
    metrics.jsonl in half, then a real `--resume`: metrics.jsonl, the CSV files and TensorBoard each hold every
    step once, in order, with the uninterrupted run's values (metrics.jsonl once held steps 4-5 twice and a
    glued line)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchsprint import cli

    ref_dir, ref = reference
    run_dir = tmp_path / "crash"
    sinks = ["log.tensorboard=true", "log.csv=true"]
    env = fault_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), kill_at="0:5")
    cmd = [sys.executable, "-m", "torchsprint", "train"]
    first = subprocess.run(
        [*cmd, *BASE, *sinks, f"run.dir={run_dir}"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert [p.name for p in find_checkpoints(run_dir)] == ["ckpt-e001-s0000003.pt"]
    assert raw_train_steps(run_dir) == [1, 2, 3, 4, 5]  # step 5's line written, then killed
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind": "train", "step": 6, "train/lo')  # a line the crash cut off mid-write
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run_dir)]) == 0  # in this process: one start-up less
    out = capsys.readouterr().out
    got, want = _records(run_dir), _records(ref_dir)
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    assert "3 record(s) after the checkpoint of step 3 (or cut off by the crash) removed; 3 kept" in out, out[-2000:]
    for a, b in zip(got, want):  # the resumed steps are bit-identical to the uninterrupted run's
        assert {k: v for k, v in a.items() if "loss" in k or "top1" in k or k == "train/lr"} == {
            k: v for k, v in b.items() if "loss" in k or "top1" in k or k == "train/lr"
        }, a["step"]
    for kind in ("train", "epoch", "eval"):
        with open(run_dir / f"metrics_{kind}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["step"]) for r in rows] == [r["step"] for r in want if r["kind"] == kind], kind
    tb = EventAccumulator(str(run_dir / "tb"))  # TensorBoard's own reader, as its UI reads the two event files
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == list(range(1, ref["global_step"] + 1))
    assert [e.value for e in tb.Scalars("train/loss")] == pytest.approx(
        [r["train/loss"] for r in want if r["kind"] == "train"], rel=1e-6
    )  # float32 in the event file: ~6e-8 relative


def test_a_refused_resume_leaves_every_file_of_the_run_as_it_was(tmp_path):
    """A resume refused after the run is built (a mid-epoch checkpoint and another batch size) must change nothing.
    Before, config.yaml, env.json and decisions.json were rewritten (and a TensorBoard file added) before the
    checkpoint was restored, so the refused batch size stood in config.yaml and predict/serve read it as the run's.
    Every file compared byte for byte, except the run folder's lock (it names its holder)."""
    from torchsprint.errors import UsageError

    run(tmp_path, "run.stop_after_steps=3", "log.tensorboard=true")  # a checkpoint at step 3, mid-epoch
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != ".lock"}
    with pytest.raises(UsageError, match="saved in the middle of epoch 1"):
        run(tmp_path, "checkpoint.resume=auto", "data.batch_size=64", "log.tensorboard=true")
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != ".lock"}
    assert sorted(after) == sorted(before)
    assert [p.name for p in before if before[p] != after[p]] == []

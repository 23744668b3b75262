"""Long runs: stop signals (preemption) with exit code 75 and SLURM requeue, run.max_time,
eval.every_steps, each compared with an uninterrupted run of the same config; and their bad inputs.

Signals are real (os.kill to a real `python -m torchsprint train` process); SLURM itself is not here, so
`scontrol` is a small script on PATH that records how it was called.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import BASE, _records, _temp_files, _wait, assert_same_run, raw_train_steps

from fault_env import fault_env
from torchsprint import cli, config
from torchsprint.runtime.preempt import EXIT_PREEMPTED
from torchsprint.state.checkpoint import load_checkpoint, read_safetensors_metadata
from torchsprint.state.resume import find_checkpoints
from torchsprint.train.run import train

TOTAL_STEPS = 14  # BASE: 2 epochs x 7 steps
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="250")
CMD = [sys.executable, "-m", "torchsprint", "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (BASE: 2 epochs x 7 steps, checkpoints every 3 steps)."""
    d = tmp_path_factory.mktemp("reference")
    return d, train(config.load(None, [*BASE, f"run.dir={d}"]), quiet=True)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def fake_scontrol(tmp_path: Path) -> tuple[dict, Path]:
    """An environment inside a 'SLURM job' 1234 whose `scontrol` records its arguments into calls.txt."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return dict(ENV, SLURM_JOB_ID="1234", PATH=f"{bin_dir}{os.pathsep}{ENV['PATH']}"), calls


# 35 s on 2 cores (three CLI runs in processes); the main suite keeps the pause/resume tests of the same path
@pytest.mark.slow
def test_signal_saves_exits_75_requeues_and_the_same_command_continues_exactly(reference, tmp_path, cli_in_process):
    """SIGUSR1 (SLURM's --signal) once training runs, then SIGUSR1, SIGINT and SIGTERM while a checkpoint is being
    written: the run finishes its step, saves a whole checkpoint there, requeues the job and exits 75. The same
    command again (what a requeued job runs) continues; the end equals the uninterrupted run bit for bit, with
    each step logged once."""
    ref_dir, ref = reference
    run_dir = tmp_path / "run"
    env, calls = fake_scontrol(tmp_path)
    env = fault_env(
        env, slow_write_s="0.02"
    )  # a slow disk: each checkpoint write takes ~0.1-0.3 s, so the second signals land in one
    args = [*CMD, *BASE, f"run.dir={run_dir}", "checkpoint.resume=auto", "run.requeue=true", "checkpoint.every_steps=4"]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    assert _wait(lambda: bool(raw_train_steps(run_dir)) if (run_dir / "metrics.jsonl").exists() else False, proc)
    proc.send_signal(signal.SIGUSR1)
    in_write = _wait(lambda: bool(_temp_files(run_dir, proc.pid)), proc)
    if in_write:  # more signals during a checkpoint write (the same one again, and the others) must not cut it short
        for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
            proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    out = (tmp_path / "first.log").read_text()
    assert rc == EXIT_PREEMPTED, out[-3000:]
    assert in_write, "no checkpoint write was seen after the signal"
    first = summary_of(run_dir)
    stop_step = first["global_step"]
    assert (first["stopped"], first["signal"], first["paused"]) == ("signal", "SIGUSR1", True)
    assert 0 < stop_step < TOTAL_STEPS and not (run_dir / "last.safetensors").exists()
    for p in find_checkpoints(run_dir):
        load_checkpoint(p)  # every file whole
    assert load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]["global_step"] == stop_step  # saved at the stop
    assert not _temp_files(run_dir)
    assert f"paused at step {stop_step} (SIGUSR1: preempted)" in out
    assert calls.read_text().split() == ["requeue", "1234"]

    # The same command again, in this process with the job's environment (a start-up less; the signal handling under
    # test is the first process's)
    again = cli_in_process(*args[len(CMD) - 1 :], env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "resuming at epoch" in again.stdout and f"step {stop_step} " in again.stdout
    assert raw_train_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))  # each step logged once
    done = summary_of(run_dir)
    assert done["stopped"] == "completed"
    assert_same_run(ref_dir, ref, run_dir, done)
    assert calls.read_text().split() == ["requeue", "1234"]  # a finished run does not requeue


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_more_stop_signals_after_the_pause_do_not_kill_the_exiting_process(tmp_path):
    """SIGTERM once training runs; from the pause line on, SIGTERM and SIGINT again every few ms until the process is
    gone (a scheduler that repeats its TERM, a user pressing ^C twice). The run saved its checkpoint, so it must
    still exit 75; the handlers restored once the files were written let a late signal kill it (143) or raise
    KeyboardInterrupt (130) while it closed its files and shut down."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "out.log", "w") as log:
        proc = subprocess.Popen(
            [*CMD, *BASE, f"run.dir={run_dir}"], stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path
        )
    assert _wait(lambda: (run_dir / "metrics.jsonl").exists() and bool(raw_train_steps(run_dir)), proc)
    proc.send_signal(signal.SIGTERM)
    assert _wait(lambda: "paused at step" in (tmp_path / "out.log").read_text(), proc, timeout=120)
    sent = 0
    while proc.poll() is None:  # until it is gone: the late ones land after the handlers of the run are done
        proc.send_signal((signal.SIGINT, signal.SIGTERM)[sent % 2])
        sent += 1
        time.sleep(0.005)
    out = (tmp_path / "out.log").read_text()
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, sent, out[-3000:])
    assert "Traceback" not in out and "interrupted" not in out, out[-3000:]
    stop_step = summary_of(run_dir)["global_step"]
    assert load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]["global_step"] == stop_step


def test_max_time_stops_with_a_checkpoint_and_resuming_reaches_the_epoch_target(reference, tmp_path, capsys):
    """run.max_time=0.01s (counted from the start of train: building alone spends it, so the budget is gone by the
    first step boundary, whatever the machine's speed; 0.5 s was flaky: on a quiet machine all 14 steps fit):
    stopped at a step boundary with a checkpoint, exit 0, summary 'stopped: max_time'; the resume trains to
    run.epochs exactly."""
    ref_dir, ref = reference
    run_dir = tmp_path / "run"
    assert cli.main(["train", *BASE, f"run.dir={run_dir}", "run.max_time=0.01s"]) == 0
    first = summary_of(run_dir)
    assert (first["stopped"], first["paused"]) == ("max_time", True) and first["global_step"] < TOTAL_STEPS
    assert load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]["global_step"] == first["global_step"]
    assert "run.max_time" in capsys.readouterr().out
    assert cli.main(["train", "--resume", str(run_dir), "run.max_time=null"]) == 0
    done = summary_of(run_dir)
    assert done["stopped"] == "completed"
    assert raw_train_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))
    assert_same_run(ref_dir, ref, run_dir, done)


# ---------------------------------------------------------------- eval.every_steps

EVERY = ["eval.every_steps=3", "checkpoint.every_steps=null"]


def eval_rows(run_dir: Path) -> list[dict]:
    """The evaluation records of metrics.jsonl without their wall-clock time."""
    return [{k: v for k, v in r.items() if k != "time"} for r in _records(run_dir) if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def every_steps_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("every_steps")
    return d, train(config.load(None, [*BASE, *EVERY, f"run.dir={d}"]), quiet=True)


@pytest.mark.parametrize(
    "pause, extra",
    [(6, []), (5, []), (5, ["data.backend=cpu", "data.num_workers=2"])],
    ids=["pause-at-an-eval-step", "pause-between-evals", "cpu-backend-2-workers"],
)
def test_eval_every_steps_is_exact_across_a_pause(every_steps_reference, tmp_path, pause, extra):
    """Evaluations after global steps 3, 6, 9, 12 and at the epoch ends (7; 14 once, though both settings ask):
    a run paused at `pause` and resumed evaluates at the same steps with the same metrics, none twice, and ends
    with the same best weights and summary."""
    ref_dir, ref = every_steps_reference
    assert [r["step"] for r in eval_rows(ref_dir)] == [3, 6, 7, 9, 12, 14]
    run_dir = tmp_path / "run"
    if extra:  # the cpu backend's train and eval loaders share their workers: its own uninterrupted reference
        ref_dir = tmp_path / "ref"
        ref = train(config.load(None, [*BASE, *EVERY, *extra, f"run.dir={ref_dir}"]), quiet=True)
    train(config.load(None, [*BASE, *EVERY, *extra, f"run.dir={run_dir}", f"run.stop_after_steps={pause}"]), quiet=True)
    done = train(config.load(None, [*BASE, *EVERY, *extra, f"run.dir={run_dir}", "checkpoint.resume=auto"]), quiet=True)
    assert eval_rows(run_dir) == eval_rows(ref_dir)
    assert (done["best_metric"], done["best_epoch"], done["final"]) == (
        ref["best_metric"],
        ref["best_epoch"],
        ref["final"],
    )
    meta = read_safetensors_metadata(run_dir / "best.safetensors")
    meta_ref = read_safetensors_metadata(ref_dir / "best.safetensors")
    assert (meta["step"], meta["epoch"]) == (meta_ref["step"], meta_ref["epoch"])
    assert_same_run(ref_dir, ref, run_dir, done)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_eval_every_steps_is_exact_after_a_crash_right_after_an_eval_step(every_steps_reference, tmp_path):
    """SIGKILL right after step 6 (an evaluation step and a checkpoint step): the checkpoint of step 6 must hold that
    evaluation's outcome (the best so far, from the uninterrupted run's log), or the resumed run would continue as
    if it had not happened; the resumed run's evaluations and best weights are the uninterrupted run's."""
    ref_dir, ref = every_steps_reference
    run_dir = tmp_path / "run"
    # early_stop's count changes at every evaluation (better: reset; not: +1), so the step-6 checkpoint shows it
    over = [*BASE, *EVERY, f"run.dir={run_dir}", "checkpoint.every_steps=3", "early_stop.patience=20"]
    first = subprocess.run(
        [*CMD, *over], env=fault_env(ENV, kill_at="0:6"), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    ckpt = load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]
    best, wait = None, 0  # early_stop over the uninterrupted run's evaluations up to step 6 (Keras semantics)
    for r in (r for r in eval_rows(ref_dir) if r["step"] <= 6):
        best, wait = (r["val/top1"], 0) if best is None or r["val/top1"] > best else (best, wait + 1)
    assert (ckpt["global_step"], ckpt["stop_best"], ckpt["stop_wait"]) == (6, best, wait)
    done = train(config.load(None, [*over, "checkpoint.resume=auto"]), quiet=True)
    assert eval_rows(run_dir) == eval_rows(ref_dir)
    assert (done["best_metric"], done["best_epoch"]) == (ref["best_metric"], ref["best_epoch"])


def test_early_stop_mid_epoch_with_eval_every_steps_and_the_report(tmp_path):
    """early_stop counts step evaluations: patience 1 with an unreachable min_delta stops after the second one
    (step 6, mid-epoch 1), with last.safetensors, a final checkpoint at step 6, and a report that draws them."""
    run_dir = tmp_path / "run"
    s = train(
        config.load(None, [*BASE, *EVERY, f"run.dir={run_dir}", "early_stop.patience=1", "early_stop.min_delta=10"]),
        quiet=True,
    )
    assert (s["stopped"], s["global_step"], s["paused"]) == ("early_stop", 6, False)
    assert [r["step"] for r in eval_rows(run_dir)] == [3, 6]
    assert (run_dir / "last.safetensors").exists() and s["best_epoch"] == 1
    assert load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]["global_step"] == 6
    assert cli.main(["report", str(run_dir), "--wrong", "2"]) == 0
    assert (run_dir / "report" / "report.html").stat().st_size > 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "override, says",
    [
        ("run.max_time=0", "run.max_time: Value error, must be more than 0"),
        ("run.max_time=-5m", "cannot read '-5m' as a duration"),
        ("run.max_time=soon", "cannot read 'soon' as a duration: write e.g. 45m, 2h30m, 90s"),
        ("run.stop_signals=[SIGTREM]", "unknown signal 'SIGTREM'. Did you mean: SIGTERM"),
        ("run.stop_signals=[SIGKILL]", "SIGKILL cannot be caught"),
        ("run.requeue=true", "not a SLURM job (no SLURM_JOB_ID): set run.requeue=false"),
        ("eval.every_steps=8", "eval.every_steps=8 is more than an epoch (7 steps): use eval.every_epochs"),
    ],
)
def test_bad_long_run_settings_exit_2_with_one_line(tmp_path, capsys, monkeypatch, override, says):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert cli.main(["train", *BASE, f"run.dir={tmp_path / 'r'}", override]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()  # refused before the run folder was made


def test_requeue_inside_slurm_needs_run_dir_and_resume_auto(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert cli.main(["train", *BASE, f"run.dir={tmp_path / 'r'}", "run.requeue=true"]) == 2
    assert "needs a fixed run.dir and checkpoint.resume=auto" in capsys.readouterr().err


# ---------------------------------------------------------------- DDP


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of the worker process of `rank` among the launcher's children (RANK in its environment)."""
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" in b"".join(env):
            return int(pid)
    return None


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
@pytest.mark.dist
def test_ddp_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """2 gloo processes; SIGTERM reaches rank 1 only. Both stop after the same step (otherwise rank 0 would wait in
    the checkpoint's collectives until strategy.timeout_s and fail), the checkpoint is whole, the launcher exits 75,
    and `--resume` ends bit-identical to an uninterrupted 2-process run, each step logged once."""
    over = [*BASE, "data.batch_size=64", "strategy.timeout_s=60", "checkpoint.every_steps=4"]
    launch = [*CMD, "--nproc-per-node", "2"]
    env = fault_env(ENV, slow_write_s="0.02")  # ~0.1-0.3 s per checkpoint: time to signal mid-run
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run(
        [*launch, *over, f"run.dir={ref_dir}"], env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            [*launch, *over, f"run.dir={run_dir}"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
        )
    assert _wait(lambda: (run_dir / "metrics.jsonl").exists() and bool(raw_train_steps(run_dir)), proc, timeout=120)
    pid = rank_pid(proc, 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    rc = proc.wait(timeout=180)
    out = (tmp_path / "first.log").read_text()
    assert rc == EXIT_PREEMPTED, out[-4000:]
    first = summary_of(run_dir)
    stop_step = first["global_step"]
    assert first["stopped"] == "signal" and first["signal"] is None  # rank 0 learnt it from rank 1's vote
    assert 0 < stop_step < 2 * 7  # batch 64 x 2 ranks = 128 per step: 7 steps per epoch as BASE
    ckpt = load_checkpoint(find_checkpoints(run_dir)[0])
    assert ckpt["train_state"]["global_step"] == stop_step and len(ckpt["rng"]) == 2  # both ranks' streams
    done = subprocess.run(
        [*launch, "--resume", str(run_dir)], env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert raw_train_steps(run_dir) == list(range(1, 15))
    assert_same_run(ref_dir, summary_of(ref_dir), run_dir, summary_of(run_dir))


@pytest.mark.slow  # 9-11 s of a torchrun group; the one-process pause stays in the main suite
@pytest.mark.dist
def test_ddp_with_max_restarts_a_signal_to_one_rank_pauses_instead_of_restarting(tmp_path):
    """`--max-restarts 2`, SIGTERM to rank 1: the group pauses with its checkpoint and the launcher exits 75. torchrun's
    elastic agent restarts a group on any non-zero exit, 75 included: the paused group was restarted, resumed and
    trained on to exit 0, so a preempted job finished on a machine that was being taken away."""
    run_dir = tmp_path / "run"
    over = [*BASE, "data.batch_size=64", "strategy.timeout_s=60", "checkpoint.every_steps=4", f"run.dir={run_dir}"]
    with open(tmp_path / "out.log", "w") as log:
        proc = subprocess.Popen(
            [*CMD, "--nproc-per-node", "2", "--max-restarts", "2", *over],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=tmp_path,
        )
    assert _wait(lambda: (run_dir / "metrics.jsonl").exists() and bool(raw_train_steps(run_dir)), proc, timeout=120)
    pid = rank_pid(proc, 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    rc = proc.wait(timeout=180)
    out = (tmp_path / "out.log").read_text()
    assert rc == EXIT_PREEMPTED, out[-4000:]
    assert "resuming at" not in out, out[-4000:]  # no second attempt started
    first = summary_of(run_dir)
    assert first["stopped"] == "signal" and first["paused"] and 0 < first["global_step"] < 2 * 7
    assert load_checkpoint(find_checkpoints(run_dir)[0])["train_state"]["global_step"] == first["global_step"]

"""Run folders: no run clobbers another, a finished run keeps its results, a config error leaves nothing behind."""

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

from torchsprint import cli

FAST = ["run.epochs=2", "log.tensorboard=false", "model.args={width: 8}"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(run: Path) -> dict[str, str]:
    """Content hash of every file of a run folder (what 'left alone' must keep)."""
    return {str(p.relative_to(run)): digest(p) for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def cli_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")


# A process that claims one planned run folder (rundir.create_unique, what `train` calls) once `go` exists: started
# together and released at one moment, several of them race for the same name. Imports no torch (starts in ~0.1 s).
CLAIM = """
import sys, time
from pathlib import Path
from torchsprint.state.rundir import create_unique
planned, go = Path(sys.argv[1]), Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
print(create_unique(planned), flush=True)
"""


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
def test_two_runs_with_one_name_started_together_get_their_own_folders(tmp_path):
    """Same run.name in the same second: one folder each (exclusive creation + suffix), never shared files."""
    # The race itself, made certain: 4 processes claim one planned folder at the same moment; each gets its own.
    planned, go = tmp_path / "claims" / "same" / "20260101-000000", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIM, str(planned), str(go)],
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate()[1]
    go.touch()
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    assert sorted(r[0].strip() for r in results) == sorted([str(planned)] + [f"{planned}-{i}" for i in (1, 2, 3)])
    # Two real runs of one name started together, into a second that another run already took: every folder
    # this name could plan for the next 10 minutes exists (empty), so each run must take a suffixed one, and
    # write all its files there (not into the planned folder).
    out = tmp_path / "cli"
    now = time.time()
    taken = {time.strftime("%Y%m%d-%H%M%S", time.localtime(now + s)) for s in range(-2, 600)}
    for name in taken:
        (out / "runs" / "same" / name).mkdir(parents=True)
    argv = [sys.executable, "-m", "torchsprint", "train", *FAST, "run.name=same", "run.epochs=1"]
    procs = [
        subprocess.Popen(argv, cwd=out, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    folders = sorted(p.name for p in (out / "runs" / "same").iterdir() if p.name not in taken)
    assert len(folders) == 2 and all(f.rsplit("-", 1)[0] in taken for f in folders), folders
    assert not any(any((out / "runs" / "same" / name).iterdir()) for name in taken)  # planned folders left alone
    dirs = [out / "runs" / "same" / f for f in folders]
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        assert summary["run_dir"] == str(Path("runs") / "same" / d.name)
        # each folder's metrics are one run's: 1 epoch of evaluation lines, no interleaving
        evals = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
        assert len(evals) == 1


@pytest.mark.slow
def test_a_locked_run_folder_refuses_a_second_process_and_the_kernel_frees_it(tmp_path):
    run = tmp_path / "run"
    a = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchsprint",
            "train",
            "log.tensorboard=false",
            "run.epochs=400",
            f"run.dir={run}",
            "checkpoint.every_epochs=1",
        ],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not list((run / "checkpoints").glob("ckpt-*.pt")):  # A is training (and holds the lock)
            assert a.poll() is None and time.time() < deadline, a.stderr.read() if a.poll() is not None else "timeout"
            time.sleep(0.2)
        t = time.perf_counter()
        b = subprocess.run(
            [sys.executable, "-m", "torchsprint", "train", "--resume", str(run)],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert b.returncode == 2, b.stderr
        assert f"in use by another torchsprint process (PID {a.pid} on" in b.stderr, b.stderr
        assert "Traceback" not in b.stderr
        assert time.perf_counter() - t < 60  # refused at start-up, not after building a run (measured ~3 s)
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
    # The holder was killed: its lock went with it, and the run resumes from its newest checkpoint.
    c = subprocess.run(
        [sys.executable, "-m", "torchsprint", "train", "--resume", str(run), "run.epochs=2", "log.tensorboard=false"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert c.returncode == 0, c.stderr[-2000:]
    assert "resuming at epoch" in c.stdout or "finished run" in c.stdout


def test_train_into_a_finished_run_refuses_unless_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", *FAST, f"run.dir={run}"]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert cli.main(["train", *FAST, f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {run}" in err and "--overwrite" in err
    assert snapshot(run) == before  # nothing touched
    assert cli.main(["train", *FAST, f"run.dir={run}", "--overwrite"]) == 0
    moved = list(run.glob("replaced-*"))
    assert len(moved) == 1
    assert snapshot(moved[0]) == before  # the old run's files, intact, set aside
    assert (run / "summary.json").is_file() and (run / "last.safetensors").is_file()


def test_resume_of_a_finished_run_keeps_its_results_and_a_longer_run_continues(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", *FAST, f"run.dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    before = snapshot(run)
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 0
    assert "is a finished run" in capsys.readouterr().out
    assert snapshot(run) == before  # summary.json keeps its final metrics, weights and metrics.jsonl untouched
    assert cli.main(["train", "--resume", str(run), "run.epochs=3"]) == 0
    longer = json.loads((run / "summary.json").read_text())
    assert longer["global_step"] > summary["global_step"] and longer["final"]["val/top1"] > 0.5


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("model.name=resnet19", "unknown model"),
        ("optim.name=sgdd", "unknown optimizer"),
        ("sched.name=cosin", "unknown scheduler"),
        ("data.train.transforms=[random_flip]", "unknown transform"),
        ("loss.name=crossentropy", "unknown loss"),
    ],
)
def test_config_errors_leave_no_folder_behind(tmp_path, capsys, override, fragment):
    assert cli.main(["train", *FAST, f"run.out_dir={tmp_path / 'runs'}", override]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_missing_data_root_leaves_no_folder_behind(tmp_path, capsys):
    assert (
        cli.main(
            [
                "train",
                *FAST,
                f"run.out_dir={tmp_path / 'runs'}",
                "data.dataset=image_folder",
                f"data.root={tmp_path / 'nowhere'}",
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_resume_of_results_without_checkpoints_refuses_and_overwrite_sets_them_aside(tmp_path, capsys):
    """A finished run whose checkpoints/ is gone: --resume once trained from scratch over its weights and
    summary.json without a word. It refuses (exit 2, one line, nothing touched) and names --overwrite, which
    moves the old files aside before starting over."""
    import shutil

    run = tmp_path / "run"
    assert cli.main(["train", *FAST, "run.max_steps=2", f"run.dir={run}"]) == 0
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no checkpoint" in err and "--overwrite" in err, err
    assert snapshot(run) == before
    assert cli.main(["train", "--resume", str(run), "--overwrite"]) == 0
    moved = list(run.glob("replaced-*"))
    assert len(moved) == 1 and snapshot(moved[0]) == before  # the old results, intact
    assert json.loads((run / "summary.json").read_text())["global_step"] == 2


def test_resume_of_a_run_that_saved_nothing_starts_over_with_a_fresh_metrics_file(tmp_path, capsys):
    """A run killed before its first checkpoint (config.yaml and metrics rows only): --resume starts over, and its
    metrics.jsonl holds each step once (the old rows are moved aside, not appended to)."""
    import shutil

    run = tmp_path / "run"
    assert cli.main(["train", *FAST, "run.max_steps=2", "log.every_steps=1", f"run.dir={run}"]) == 0
    shutil.rmtree(run / "checkpoints")
    for name in ("summary.json", "best.safetensors", "last.safetensors"):
        (run / name).unlink()
    assert cli.main(["train", "--resume", str(run)]) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert steps == [1, 2]
    assert len(list(run.glob("replaced-*/metrics.jsonl"))) == 1


def test_a_run_stopped_by_max_steps_is_told_to_raise_max_steps(tmp_path, capsys):
    """The finished-run message names the limit that ended the run: run.max_steps here (it said run.epochs, which
    changes nothing), and its advice works."""
    from torchsprint.state.rundir import how_to_continue

    run = tmp_path / "run"
    assert cli.main(["train", *FAST, "run.max_steps=3", f"run.dir={run}"]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "is a finished run" in out and "run.max_steps=6" in out and "larger run.epochs" not in out, out
    assert cli.main(["train", "--resume", str(run), "run.max_steps=6"]) == 0  # the advice, followed
    assert json.loads((run / "summary.json").read_text())["global_step"] == 6

    class Run:
        epochs, max_steps = 2, 100

    assert "larger run.epochs" in how_to_continue({"epoch": 2, "global_step": 50}, Run, run)
    both = how_to_continue({"epoch": 2, "global_step": 100}, Run, run)
    assert "run.epochs=12" in both and "run.max_steps=null" in both
    assert "early_stop" in how_to_continue({"epoch": 1, "global_step": 9, "stopped_epoch": 0}, Run, run)


@pytest.mark.parametrize("name", ["../../escape", "sub/name", "a\\b", "..", ".", "", "ABSOLUTE"])
def test_run_name_is_a_plain_name(tmp_path, capsys, name):
    """run.name=../../etc put the run folder outside run.out_dir, an absolute name ignored it: refused in one line
    that points to run.dir, before anything is created."""
    if name == "ABSOLUTE":
        name = str(tmp_path / "elsewhere")
    out_dir = tmp_path / "a" / "b" / "runs"
    assert cli.main(["train", *FAST, "run.max_steps=1", f"run.out_dir={out_dir}", f"run.name={name}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "run.name" in err and "run.dir" in err, err
    assert [p for p in tmp_path.rglob("*")] == []  # nothing created, inside out_dir or out of it

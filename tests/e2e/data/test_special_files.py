"""Special files among a user's data are refused by name, never read: a FIFO named x.png (open() blocks until a
writer comes: train, data check and predict hung), a link to /dev/zero and a sparse 50 GB .jpg (read whole:
MemoryError), the same named in a file list, a FIFO as a run's metrics.jsonl (--resume hung), and a label of
1000000000 in a file list (a list of a billion class names). Each command runs in a child process with a time
limit and an 8 GiB address-space limit, so a regression fails the test (TimeoutExpired, or a MemoryError within
the limit) instead of hanging the suite or taking the machine's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_image_folder

FAST = ["run.epochs=1", "log.tensorboard=false", "log.progress=false", "model.args={width: 4}"]
LIMIT = """import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a file read whole fails here, not in all of RAM
from torchsprint import cli
sys.exit(cli.main(sys.argv[1:]))"""

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")


def run_limited(cwd: Path, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchsprint ARGS` in a child process under the limits above; TimeoutExpired (the test fails) on a hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="300")
    return subprocess.run(
        [sys.executable, "-c", LIMIT, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def add_special_files(folder: Path) -> dict[str, str]:
    """A FIFO, a link to /dev/zero and a sparse 50 GB file, each with an image's name, in `folder`."""
    os.mkfifo(folder / "x.png")
    (folder / "zero.jpg").symlink_to("/dev/zero")
    with open(folder / "huge.jpg", "wb") as f:
        f.truncate(50 << 30)  # sparse: no disk used, but 50 GB to read
    return {"x.png": "not regular files", "zero.jpg": "not regular files", "huge.jpg": "larger than data.max_file_mb"}


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_special_files_in_class_folders_are_left_out_and_named(tmp_path):
    root = make_image_folder(tmp_path / "imgs", per_class=4)
    special = add_special_files(root / "train" / "square")
    run = tmp_path / "run"
    r = run_limited(tmp_path, "train", *FAST, f"data.root={root}", f"run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left out 3 file(s) below data.root" in r.stdout, r.stdout
    skipped = json.loads((run / "decisions.json").read_text())["skipped"]
    for name, why in special.items():
        assert any(why in reason and name in v["examples"] for reason, v in skipped.items()), (name, skipped)
    assert json.loads((run / "summary.json").read_text())["final"]["val/count"] == 8  # the real images only

    r = run_limited(tmp_path, "data", "check", f"data.root={root}", "--out", tmp_path / "chk")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "left out 2 not regular files" in r.stdout and "left out 1 larger than data.max_file_mb" in r.stdout, (
        r.stdout
    )

    r = run_limited(tmp_path, "predict", "-r", run, root / "train" / "square", "--out", tmp_path / "p.jsonl")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {Path(row["input"]).name: row for row in map(json.loads, (tmp_path / "p.jsonl").read_text().splitlines())}
    assert "FIFO" in rows["x.png"]["error"] and "character device" in rows["zero.jpg"]["error"], rows
    assert "over the 512 MB a file may have (data.max_file_mb)" in rows["huge.jpg"]["error"], rows
    assert sum("error" not in row for row in rows.values()) == 4


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_file_list_rows_naming_special_files_are_left_out(tmp_path):
    root = make_image_folder(tmp_path / "imgs", per_class=4, splits=("train",))
    special = add_special_files(tmp_path)
    lines = [f"{p},{p.parent.name}" for p in sorted((root / "train").rglob("*.jpg"))]
    lines += [f"{tmp_path / name},circle" for name in special]
    (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    r = run_limited(
        tmp_path,
        "train",
        *FAST,
        f"data.root={tmp_path / 'list.csv'}",
        "data.val_fraction=0.5",
        "data.train.transforms=[resize: [16, 16]]",
        "data.eval.transforms=[resize: [16, 16]]",
        f"run.dir={run}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = json.loads((run / "decisions.json").read_text())["skipped"]
    assert sorted(n for v in skipped.values() for n in v["examples"]) == sorted(special), skipped


def test_a_label_of_a_billion_in_a_file_list_is_one_line(tmp_path):
    """Before: [str(i) for i in range(10**9 + 1)] as the class names, a MemoryError (or the machine's memory)."""
    root = make_image_folder(tmp_path / "imgs", per_class=2, splits=("train",))
    files = sorted((root / "train").rglob("*.jpg"))
    (tmp_path / "list.csv").write_text(
        "".join(f"{p},{i % 2}\n" for i, p in enumerate(files)) + f"{files[0]},1000000000\n"
    )
    r = run_limited(
        tmp_path, "train", *FAST, f"data.root={tmp_path / 'list.csv'}", f"run.dir={tmp_path / 'run'}", timeout=120
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "label 1000000000 means 1,000,000,001 classes" in line and "5 rows" in line, line


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_fifo_as_the_runs_metrics_jsonl_is_refused_on_resume(tmp_path):
    run = tmp_path / "run"
    r = run_limited(tmp_path, "train", *FAST, "run.epochs=2", "run.stop_after_steps=2", f"run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    r = run_limited(tmp_path, "train", "--resume", run, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"error: {run / 'metrics.jsonl'} (the run's metric rows) is a FIFO (named pipe)" in r.stderr, r.stderr

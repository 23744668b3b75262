"""The run folder: a path no other run can get, an OS lock while a process trains in it, and what it holds.

Two runs must never share a folder: their checkpoints, weights and metrics.jsonl would interleave.
A timestamped folder is created exclusively (mkdir without exist_ok), with a -1, -2... suffix when
another run took the same second; an explicit run.dir is locked while a process trains in it. The
lock is fcntl.flock on <run>/.lock: the kernel releases it when the holder exits or is killed, so a
crashed run never leaves a stale lock behind, and a second process refuses at once, naming the holder.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from torchsprint.errors import UsageError

# What a finished or running torchsprint run leaves in its folder (checkpoints/ is a folder).
RUN_FILES = ("config.yaml", "env.json", "decisions.json", "metrics.jsonl", "summary.json", "best.safetensors", "last.safetensors",
             "ema.safetensors", "checkpoints", "tb", "confusion_matrix.csv", "confusion_matrix.png", "per_class.csv",
             "confusion_matrix_last.csv", "confusion_matrix_last.png", "per_class_last.csv",
             "metrics_train.csv", "metrics_epoch.csv", "metrics_eval.csv", "mlflow.json", "wandb.json", "wandb", "report")
LOCK_NAME = ".lock"


def planned_path(run_cfg) -> tuple[Path, bool]:
    """(the folder this run asks for, whether the user named it): run.dir, or <out_dir>/<name>/<timestamp>."""
    if run_cfg.dir:
        path = Path(run_cfg.dir)
        try:
            path.exists()  # raises for a name the filesystem cannot hold (over 255 bytes) or a parent we may not search
        except OSError as e:
            raise UsageError(f"cannot use the run folder {path}: {e.strerror}. Set run.dir to a writable folder with "
                             "shorter names.") from None
        return path, True
    return Path(run_cfg.out_dir) / run_cfg.name / time.strftime("%Y%m%d-%H%M%S"), False


def holds_run(path: Path) -> bool:
    """Whether a folder already holds (part of) a torchsprint run."""
    files = [n for n in RUN_FILES if n not in ("checkpoints", "tb")]
    return path.is_dir() and ((path / "checkpoints").is_dir() or any((path / n).is_file() for n in files))


def holds_results(path: Path) -> bool:
    """Whether a run folder holds something a run produced by training: checkpoints, weights, a summary.
    A folder with only config.yaml/env.json/metrics.jsonl is a run that failed before its first save."""
    return ((path / "checkpoints").is_dir() and any((path / "checkpoints").glob("ckpt-*.pt"))) or any(
        (path / n).is_file() for n in ("best.safetensors", "last.safetensors", "summary.json"))


def create_unique(path: Path) -> Path:
    """Create `path`, or `path-1`, `path-2`... when it exists: a folder no other process can get."""
    for i in range(10_000):
        candidate = path if i == 0 else path.with_name(f"{path.name}-{i}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)  # atomic: exactly one process creates a name
            return candidate
        except FileExistsError:
            continue
        except OSError as e:
            raise UsageError(f"cannot create the run folder {candidate}: {e.strerror}. Set run.out_dir or run.dir "
                             "to a writable folder.") from None
    raise UsageError(f"{path}: 10,000 runs of this name in this second; set run.name or run.dir.")


def make_folder(path: Path) -> Path:
    """Create an explicit run.dir (and its parents) if needed, checking it is writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot write the run folder {path}: {e.strerror}. Set run.out_dir or run.dir to a "
                         "writable folder.") from None
    return path


class RunLock:
    """An exclusive lock on a run folder for as long as this object lives (or until release()).

    Raises UsageError at once when another process holds it, naming that process (PID, host and what it
    does). Also locks other folders one process must own while writing (`data shard`'s OUT): `role` says
    what the holder does, `hint` what the refused user can do instead.
    """

    def __init__(self, run_dir: Path, role: str = "a run", hint: str = "Wait for it to end, or use another run.dir."):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no flock; the exclusive creation still protects new folders
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"cannot lock the run folder {run_dir}: {e.strerror}. Set run.dir to a writable folder.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise UsageError(f"{run_dir} is in use by another torchsprint process ({holder}). {hint}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"PID {os.getpid()} on {socket.gethostname()}: {role}".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


def set_aside(run_dir: Path) -> Path | None:
    """--overwrite: move the files of the run already in `run_dir` into run_dir/replaced-<time>/ (nothing is
    deleted); returns that folder, or None when there was nothing to move."""
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    dest = create_unique(run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    for name in present:
        os.replace(run_dir / name, dest / name)
    return dest


def writable_file(path: str | Path, option: str) -> Path:
    """Check, before any work, that `path` can be written: its folder is created if needed and a probe file
    is written and removed there (os.access says yes to root even on a read-only filesystem).

    `option` names the flag or key in the error, e.g. '--out'.
    """
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write there ({e.strerror or e}). Choose a writable folder.") from None
    return path

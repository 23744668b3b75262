"""The run folder: a path no other run can get, an OS lock while a process trains in it, and what it holds.

Two runs must never share a folder: their checkpoints, weights and metrics.jsonl would interleave.
A timestamped folder is created exclusively (mkdir without exist_ok), with a -1, -2... suffix when
another run took the same second; an explicit run.dir is locked while a process trains in it. The
lock is fcntl.flock on <run>/.lock: the kernel releases it when the holder exits or is killed, so a
crashed run never leaves a stale lock behind, and a second process refuses at once, naming the holder.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from torchsprint.errors import UsageError
from torchsprint.runtime.files import inside

# What a finished or running torchsprint run leaves in its folder (checkpoints/ is a folder).
RUN_FILES = (
    "config.yaml",
    "env.json",
    "decisions.json",
    "metrics.jsonl",
    "summary.json",
    "best.safetensors",
    "last.safetensors",
    "ema.safetensors",
    "checkpoints",
    "tb",
    "confusion_matrix.csv",
    "confusion_matrix.png",
    "per_class.csv",
    "confusion_matrix_last.csv",
    "confusion_matrix_last.png",
    "per_class_last.csv",
    "metrics_train.csv",
    "metrics_epoch.csv",
    "metrics_eval.csv",
    "mlflow.json",
    "wandb.json",
    "wandb",
    "report",
)
LOCK_NAME = ".lock"


def planned_path(run_cfg) -> tuple[Path, bool]:
    """(the folder this run asks for, whether the user named it): run.dir, or <out_dir>/<name>/<timestamp>."""
    if run_cfg.dir:
        path = Path(run_cfg.dir)
        try:
            path.exists()  # raises for a name the filesystem cannot hold (over 255 bytes) or a parent we may not search
        except OSError as e:
            raise UsageError(
                f"cannot use the run folder {path}: {e.strerror}. Set run.dir to a writable folder with shorter names."
            ) from None
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
        (path / n).is_file() for n in ("best.safetensors", "last.safetensors", "summary.json")
    )


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
            raise UsageError(
                f"cannot create the run folder {candidate}: {e.strerror}. Set run.out_dir or run.dir "
                "to a writable folder."
            ) from None
    raise UsageError(f"{path}: 10,000 runs of this name in this second; set run.name or run.dir.")


def make_folder(path: Path) -> Path:
    """Create an explicit run.dir (and its parents) if needed, checking it is writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"cannot write the run folder {path}: {e.strerror}. Set run.out_dir or run.dir to a writable folder."
        ) from None
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
            raise UsageError(
                f"cannot lock the run folder {run_dir}: {e.strerror}. Set run.dir to a writable folder."
            ) from None
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


# A run's own files: what training wrote and what resuming, eval, export and report read back. An output of
# another command never replaces one (`average A B -o B/last.safetensors` replaced run B's weights), --overwrite
# or not. report/ is not among them: `torchsprint report` writes it, and a new report replaces the last.
OWN_FILES = (*(n for n in RUN_FILES if n != "report"), LOCK_NAME)


def run_file_of(path: Path) -> tuple[Path, str] | None:
    """(run folder, the entry of it) when `path` is, or lies inside, one of a run's own files (OWN_FILES: its
    weights, config.yaml, metrics.jsonl, checkpoints/...), through links too; else None."""
    for p in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):
        for folder in p.parents:
            name = p.relative_to(folder).parts[0]
            # <run>/report/ holds report's own confusion_matrix.png (a run file's name): it is not a run folder
            if folder.name == "report" and holds_run(folder.parent):
                continue
            if name in OWN_FILES and holds_run(folder):
                return folder, name
    return None


def writable_file(
    path: str | Path, option: str, overwrite: bool = True, folder: bool = False, create: bool = True
) -> Path:
    """The one check of an output path, made before any work: returns `path`, or raises UsageError naming the
    option, the path and what to do. Every command's output flags (commands/args.py Output) and every writer call it.

    Refused: a run's own file (run_file_of), even with --overwrite; an existing file unless `overwrite`; a folder
    where a file is meant (`folder=False`) or a file where a folder is (`folder=True`); a place that cannot be
    written (below a file, read-only: a probe file is written and removed there, as os.access says yes to root
    even on a read-only filesystem).

    Args:
        path: the output file, or with `folder=True` the output folder.
        option: the flag or key in the error, e.g. '--out' ('' where the caller names it).
        overwrite: whether an existing file may be replaced (the command's --overwrite).
        create: create the folder (`folder=True`) or the file's folder; False (a flag checked while parsing, before
            the command runs) creates nothing and probes the nearest folder that exists.
    """
    path = Path(path)
    name = f"{option} {path}".strip()
    own = run_file_of(path)
    if own is not None:
        raise UsageError(
            f"{name} is {own[1]} of the run in {own[0]}: writing there would replace the run's own file. "
            f"Choose a path outside the run's files, e.g. {Path(own[0].name + '-' + path.name)}."
        )
    if folder and path.exists() and not path.is_dir():
        raise UsageError(f"{name} is a file; give a folder.")
    if not folder and path.is_dir():
        raise UsageError(f"{name} is a folder; give a file name.")
    if not folder and path.exists() and not overwrite:
        raise UsageError(f"{name} already exists; add --overwrite to replace it, or choose another name.")
    where = path if folder else path.parent
    try:
        if create:
            where.mkdir(parents=True, exist_ok=True)
        else:
            where = next(p for p in (where, *where.parents) if p.exists())
            if not where.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{where} is a file")
        probe = where / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{name}: cannot write there ({e.strerror or e}). Choose a writable folder.") from None
    return path


# ---------------------------------------------------------------- claiming a run folder for a run


def claim_run_dir(cfg, overwrite: bool, log, dry_run: bool = False):
    """Decide the run folder and refuse to clobber another run (rank 0). Returns (path, exists, lock or None).

    A folder that already holds a run is locked at once (another process training there is refused)
    and used only to resume it (checkpoint.resume / --resume) or, with --overwrite, to start over after
    its files are moved into replaced-<time>/. A new folder is created later, after the whole run has
    been built (so a config error leaves nothing behind), exclusively (see rundir.create_unique).
    """
    from torchsprint.state.resume import find_checkpoints

    path, explicit = planned_path(cfg.run)
    outside_data(path, cfg.data.root)
    if not (explicit and holds_run(path)):
        return path, False, None
    # resume=auto in a folder whose results (weights, summary) outlived its checkpoints would train from scratch
    # over them: refused, like a fresh run there. A folder with neither is a run that failed before its first
    # save; its files (metrics.jsonl rows of the lost steps...) are moved aside, so the new start never appends
    # to them.
    resume_auto = cfg.checkpoint.resume == "auto"
    orphaned = resume_auto and not overwrite and bool(results_of(path)) and not find_checkpoints(path)
    if dry_run:  # the same refusals, without locking or moving anything
        if orphaned:
            raise UsageError(no_checkpoint_left(path))
        if holds_results(path) and cfg.checkpoint.resume is None and not overwrite:
            raise UsageError(f"{path} already holds a run: add --resume or --overwrite, or choose another run.dir.")
        return path, True, None
    lock = RunLock(path)
    if not holds_results(path) and (cfg.checkpoint.resume is None or resume_auto):  # failed before saving anything
        log(
            f"{path} holds only the start of a run that saved nothing (no checkpoint, weights or summary): its "
            f"files are moved into {set_aside(path)}"
        )
    elif overwrite:
        moved = set_aside(path)
        log(f"--overwrite: moved the files of the run that was in {path} into {moved}")
    elif orphaned:
        lock.release()
        raise UsageError(no_checkpoint_left(path))
    elif cfg.checkpoint.resume is None:
        lock.release()
        raise UsageError(
            f"{path} already holds a run (config.yaml, weights, checkpoints). To continue it: "
            f"`torchsprint train --resume {path}`; to start over there (its files are moved into "
            f"{path}/replaced-<time>/): add --overwrite; or choose another run.dir."
        )
    return path, True, lock


def outside_data(run_dir: Path, data_root: str | None) -> None:
    """Refuse a run folder inside the data folder: the next run would list its folders (checkpoints/, tb/, report/)
    as classes and its PNG plots as images."""
    if data_root is None or not Path(data_root).expanduser().is_dir():
        return
    if inside(run_dir, data_root):
        raise UsageError(
            f"the run folder {run_dir} is inside data.root={data_root}: the next run would read its "
            "files (plots, checkpoints) as data. Set run.dir (or run.out_dir) to a folder outside data.root."
        )


def results_of(path: Path) -> list[str]:
    """The result files (summary, weights) a run folder holds."""
    return [
        n for n in ("summary.json", "best.safetensors", "last.safetensors", "ema.safetensors") if (path / n).is_file()
    ]


def no_checkpoint_left(path: Path) -> str:
    """The refusal for resuming a run folder that holds results but no checkpoint to continue from."""
    return (
        f"cannot resume {path}: it holds a run's results ({', '.join(results_of(path))}) but no checkpoint "
        "(checkpoints/ckpt-*.pt is missing), so resuming would train from scratch over them. To start over "
        f"there, add --overwrite (its files are moved into {path}/replaced-<time>/, nothing is deleted); or "
        "train into another run.dir."
    )


def finished(ckpt: dict, run_cfg) -> bool:
    """Whether a checkpoint's run already did everything `run_cfg` asks for (all epochs, run.max_steps, or it
    stopped early)."""
    ts = ckpt["train_state"]
    return (
        ts.get("stopped_epoch") is not None
        or ts["epoch"] >= run_cfg.epochs
        or (run_cfg.max_steps is not None and ts["global_step"] >= run_cfg.max_steps)
    )


def how_to_continue(ts: dict, run_cfg, run_dir: Path) -> str:
    """What to change to train a finished run further, named after the limit that ended it (early_stop,
    run.max_steps, run.epochs or both): raising run.epochs does nothing for a run that run.max_steps stopped.

    Args:
        ts: the checkpoint's train_state; run_cfg: the `run` section it was resumed with; run_dir: its folder.
    """
    if ts.get("stopped_epoch") is not None:
        return (
            f"it stopped early after epoch {ts['stopped_epoch'] + 1} (early_stop); to train on, start a new run "
            f"from its weights with model.pretrained={run_dir / 'last.safetensors'}"
        )
    by_steps = run_cfg.max_steps is not None and ts["global_step"] >= run_cfg.max_steps
    by_epochs = ts["epoch"] >= run_cfg.epochs
    resume = f"`torchsprint train --resume {run_dir}"
    if by_steps and by_epochs:
        return (
            f"it reached both run.epochs={run_cfg.epochs} and run.max_steps={run_cfg.max_steps}; to train it longer, "
            f"raise both (or remove the step limit), e.g. {resume} run.epochs={run_cfg.epochs + 10} run.max_steps=null`"
        )
    if by_steps:
        return (
            f"it stopped at run.max_steps={run_cfg.max_steps}; to train it longer, resume with a larger run.max_steps, "
            f"e.g. {resume} run.max_steps={2 * run_cfg.max_steps}`, or remove the limit with run.max_steps=null "
            f"(then it trains to run.epochs={run_cfg.epochs})"
        )
    return f"to train it longer, resume with a larger run.epochs, e.g. {resume} run.epochs={run_cfg.epochs + 10}`"

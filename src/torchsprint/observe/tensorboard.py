"""TensorBoard's writer opened so that a failed write is the run's one line: no thread traceback, no empty file.

tensorboard's event writer writes from a thread of its own (`_AsyncWriterThread`). When a write fails (a full disk,
a file size limit), that thread stores the exception, re-raises it (Python then prints "Exception in thread
Thread-1:" and a traceback through threading.excepthook), and the next `add_scalar`/`flush` of the foreground
raises the same exception (`_AsyncWriter._check_worker_status`). The foreground's raise is the one torchsprint turns
into its one-line error, so the thread's printout is only noise. And a writer that fails while it opens (its first
event, the file version, is flushed in its constructor) leaves a 0-byte event file behind.
"""

from __future__ import annotations

import threading
from pathlib import Path

_hook_installed = False


def _quiet_tensorboard_threads(args) -> None:
    """threading.excepthook: tensorboard's writer thread's OSError is said by the foreground; everything else as
    before."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
        return
    _previous(args)


_previous = threading.excepthook


def install_quiet_hook() -> None:
    """Install the excepthook once per process (idempotent)."""
    global _hook_installed, _previous
    if not _hook_installed:
        _previous = threading.excepthook
        threading.excepthook = _quiet_tensorboard_threads
        _hook_installed = True


def open_writer(tb_dir: Path, purge_step: int | None):
    """A torch SummaryWriter on `tb_dir` (purge_step as torch's), or the OSError of its first write with the event
    file's name, the file it left removed."""
    from torch.utils.tensorboard import SummaryWriter

    install_quiet_hook()
    before = set(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else set()
    try:
        return SummaryWriter(str(tb_dir), purge_step=purge_step)
    except OSError as e:
        new = sorted(set(tb_dir.glob("events.out.tfevents.*")) - before) if tb_dir.is_dir() else []
        for path in new:
            path.unlink(missing_ok=True)  # its first event never reached the disk: an empty or cut file
        raise OSError(e.errno, e.strerror, str(new[0] if new else tb_dir)) from e

"""Reading a user's files: regular files only, each under a size limit, checked on the open descriptor.

A FIFO named x.png blocks open() until some process writes to it (train, data check and predict hung on one);
/dev/zero behind a link, or a sparse 50 GB .jpg, is read whole into memory (MemoryError). Every reader of a
data file or a run's rows opens it here: refused with a reason that names what the file is, never read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# data.max_file_mb's default: room for an uncompressed 8-bit RGB image at data.max_image_pixels (PIL's
# decompression-bomb limit, 89.5 MP x 3 bytes = 268 MB) and for 16-bit scans of most of that size.
MAX_FILE_MB = 512
MB = 2**20

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


class RefusedFile(OSError):
    """A path that is not a regular file, or is larger than the limit: refused before a byte of it is read.
    An OSError, so every reader that reports an unreadable file (a bad sample, a failed prediction) reports it."""

    def __str__(self) -> str:
        return self.strerror


def special_kind(mode: int) -> str | None:
    """What a file that is not a regular file is ('a FIFO (named pipe)', 'a character device', ...); None for a
    regular file. `mode`: st_mode of os.stat (links followed)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def refusal(st: os.stat_result, max_bytes: int | None, setting: str = "data.max_file_mb") -> str | None:
    """Why a file of this stat is not read (not a regular file; over `max_bytes`), or None. `setting` names the
    limit in the reason, so the user knows what to raise."""
    kind = special_kind(st.st_mode)
    if kind is not None:
        return f"{kind}, not a regular file: never read (it could block or never end)"
    if max_bytes is not None and st.st_size > max_bytes:
        return (
            f"{st.st_size / MB:,.0f} MB, over the {max_bytes / MB:,.0f} MB a file may have ({setting}); "
            "raise the limit if it is really one image"
        )
    return None


# Why a file is not a sample (the skipped-files reasons of the data sources, in the start-up summary's words).
NOT_REGULAR = "not regular files (FIFOs, devices, sockets: never read, reading could block or never end)"
TOO_LARGE = "larger than data.max_file_mb (never read whole into memory)"


def unreadable(path: str | Path, max_bytes: int | None) -> str | None:
    """The skipped-files reason of a data file that is not read (NOT_REGULAR, TOO_LARGE), or None. A path that
    cannot be stat-ed is left to the reader, which reports it (data.on_bad_sample)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return None if refusal(st, max_bytes) is None else TOO_LARGE if stat.S_ISREG(st.st_mode) else NOT_REGULAR


def open_regular(path: str | Path, max_bytes: int | None = None, setting: str = "data.max_file_mb"):
    """`path` opened for binary reading, or RefusedFile when it is not a regular file or is over `max_bytes`.

    The path is stat-ed first (a device is never opened), then opened with O_NONBLOCK (a FIFO that appeared in
    between opens at once instead of waiting for a writer) and checked again on the descriptor, which is what
    is read (no gap between the check and the read). Other OSErrors (missing, no permission) pass through.
    """
    why = refusal(os.stat(path), max_bytes, setting)
    if why is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            why = refusal(os.fstat(fd), max_bytes, setting)
            if why is None:
                os.set_blocking(fd, True)
                return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise RefusedFile(errno.EINVAL, why, str(path))  # str(): the reason alone; readers name the path themselves


def read_regular(path: str | Path, max_bytes: int | None = None, setting: str = "data.max_file_mb") -> bytes:
    """The bytes of a regular file of at most `max_bytes` (else RefusedFile; see open_regular)."""
    with open_regular(path, max_bytes, setting) as f:
        return f.read()


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` is `folder` or lies below it, links resolved (neither needs to exist)."""
    p, f = os.path.realpath(Path(path).expanduser()), os.path.realpath(Path(folder).expanduser())
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)


def check_regular(path: str | Path, what: str) -> None:
    """Refuse (UsageError) a path that exists but is not a regular file, before it is opened for reading or
    appending (a FIFO as a run's metrics.jsonl blocked --resume). `what` says what the file is for."""
    from torchsprint.errors import UsageError

    try:
        kind = special_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{path} ({what}): cannot read it ({e.strerror or e}).") from None
    if kind is not None:
        raise UsageError(
            f"{path} ({what}) is {kind}, not a regular file; torchsprint does not read or write it. "
            "Remove it or move it away."
        )

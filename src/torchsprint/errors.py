"""Errors a user can fix: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations

import difflib
import errno
from collections.abc import Iterable


class UsageError(Exception):
    """Bad input from the user (config, names, paths). Printed as-is; exit code 2."""


class Diverged(UsageError, FloatingPointError):
    """Training went non-finite under precision.on_nonfinite=stop: a setting to change (the learning rate,
    clipping, precision), so a one-line usage error; still a FloatingPointError for code that catches that."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The registered names closest to `name`, best first (case-insensitive)."""
    candidates = list(candidates)
    lower = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(name.lower(), list(lower), n=n, cutoff=0.5)
    # Substring hits catch "resnet" -> "resnet18" that ratio-based matching ranks low.
    subs = [c for c in candidates if name.lower() in c.lower() and lower.get(c.lower()) not in hits]
    return [lower[h] for h in hits] + sorted(subs, key=len)[: max(0, n - len(hits))]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' Did you mean: a, b?' or '' when nothing is close."""
    hits = closest(name, candidates)
    return f" Did you mean: {', '.join(hits)}?" if hits else ""


def one_line(error: BaseException) -> str:
    """The user-facing text of a UsageError, also when it crossed a process boundary.

    A DataLoader worker's exception is re-raised in the main process with the worker's whole traceback
    folded into its message ("Caught UsageError in DataLoader worker process 0. Original Traceback ...");
    the user needs only the original message, its last line.
    """
    msg = str(error)
    if "Original Traceback" in msg:
        last = msg.rstrip().splitlines()[-1]
        msg = last.split(f"{type(error).__name__}: ", 1)[-1]
    return msg


# The errors of a write that found no room, and what each means for the user.
DISK_FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file reached the file size limit (ulimit -f)",
}


def disk_full(error: BaseException, where: str | None = None) -> str | None:
    """'the disk is full (No space left on device): writing FILE failed' for a write that found no room (ENOSPC,
    EDQUOT, EFBIG), None for any other error. `where`: said when the error does not name its file."""
    if not isinstance(error, OSError) or error.errno not in DISK_FULL:
        return None
    target = error.filename or where
    return f"{DISK_FULL[error.errno]} ({error.strerror}): writing {target or 'a file'} failed"

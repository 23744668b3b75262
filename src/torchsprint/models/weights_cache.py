"""Whether a file is weights, for the weights cache: loaded as a run loads it (models/init.py's read_weights reads
through `read_state`), and when it is not, what it is instead in a few words (an HTML login page, a zip archive cut
short, a pickle of Python objects) rather than torch's weights_only text. models/download.py checks every download
with it before the file takes the cache's name, and every file it finds in the cache before a run uses it (a URL's
`#sha256=` pin included); `download_lock` makes two processes downloading one file fetch it once. No network here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

HTML_STARTS = (b"<!doctype", b"<html", b"<head", b"<body", b"<?xml")
HEAD_BYTES = 4096  # enough of a page to find its <title>


class NotWeights(Exception):
    """A file that does not load as weights; the message says what it is instead ("an HTML page titled ...")."""


def looks_like_html(head: bytes) -> bool:
    """Whether the first bytes of a body are a web page (a login or error page), not a weights file."""
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").lower().startswith(HTML_STARTS)


def html_page(head: bytes, size: int | None = None) -> str:
    """'an HTML page titled 'Sign in' (1,234 bytes)': a page in a few words, its title when it has one."""
    found = re.search(rb"<title[^>]*>(.*?)</title", head, re.I | re.S)
    title = " ".join(found.group(1).decode(errors="replace").split())[:80] if found else ""
    return "an HTML page" + (f" titled {title!r}" if title else "") + (f" ({size:,} bytes)" if size is not None else "")


def describe(path: Path, error: BaseException) -> str:
    """What a file that failed to load is, as a noun phrase for a one-line message (never torch's weights_only
    paragraph, which tells the user to trust a file that may be a login page)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    text = str(error)
    if size == 0:
        return "an empty file"
    if looks_like_html(head):
        return html_page(head, size)
    if found := re.search(r"Unsupported global: GLOBAL ([\w.]+)", text):
        return (
            f"a pickle of Python objects ({found.group(1)}), not a state dict of tensors: torch.load("
            "weights_only=True) does not run code from a file"
        )
    if head.startswith(b"PK\x03\x04"):
        first = text.split(". ")[0].splitlines()[0][:160]
        return f"a zip archive of {size:,} bytes that does not load ({first}): cut short or corrupt"
    if type(error).__name__ == "SafetensorError":
        return (
            f"{size:,} bytes that are not a safetensors file "
            f"({text.splitlines()[0][:160]}): cut short or another format"
        )
    return f"{size:,} bytes that are neither a torch.save file nor safetensors (they start {head[:16]!r})"


def read_state(path: Path, suffix: str | None = None, mmap: bool = False) -> dict:
    """The state dict in a weights file, loaded as a run loads it: safetensors by the name's suffix (`suffix`: the
    name it will have, for a download still under a temporary one), else torch.load(weights_only=True), which never
    runs code from the file; a torchsprint checkpoint's "model" or a {"state_dict": ...} file unwrapped.

    mmap: torch.load maps the tensors' bytes instead of reading them (a check of a file's structure: a zip's index
    sits at its end, so a file cut short fails all the same); safetensors then reads its header only, which it
    checks against the file's length. NotWeights, saying what the file is, when it is not weights.
    """
    import torch

    try:
        if (suffix or path.suffix) == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return {k: (torch.empty(0) if mmap else f.get_tensor(k)) for k in f.keys()}
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not (mmap and "mmap can only be used" in str(e)):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # a legacy (not zip) torch.save file
    except Exception as e:
        raise NotWeights(describe(path, e)) from None
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a torchsprint checkpoint
    elif isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # Lightning and many reference scripts
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise NotWeights(f"a {type(state).__name__} that holds no state dict of tensors")
    return state


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


# Cached files found good in this process, by (path, size, mtime, inode, pin): a run asks for its weights more than
# once (fetched before anything is built, then read by the model's initialisation), and checks each file once.
_GOOD: set[tuple] = set()


def known_good(path: Path, pin: str | None = None) -> None:
    """`path` was just checked whole (a download: hashed and loaded): the next look at it in this process is free."""
    st = path.stat()
    _GOOD.add((str(path), st.st_size, st.st_mtime_ns, st.st_ino, pin))


def cached_problem(path: Path, pin: str | None = None) -> str | None:
    """Why the cached file at `path` must not be used ("is not weights: it is an HTML page ...", "does not have the
    pinned sha256 ..."), or None.

    `pin`: the start of the sha256 the file must have (a URL's `#sha256=`): the whole file is hashed (about a second
    a GB), since another file under the same name loads as weights all the same. Its structure is checked too
    (read_state with mmap: milliseconds, not a second load of every tensor); the run's own load then reads it.
    """
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, pin)
    if key in _GOOD:
        return None
    if pin and not (digest := sha256_of(path)).startswith(pin):
        return (
            f"does not have the pinned sha256 (expected {pin[:8]}..., got {digest[:8]}...): another file under "
            "the URL's name"
        )
    try:
        read_state(path, mmap=True)
    except NotWeights as e:
        return f"is not weights: it is {e}"
    _GOOD.add(key)
    return None


@contextlib.contextmanager
def download_lock(target: Path, what: str, log):
    """An exclusive flock on `<target>.lock` while this process downloads `target`, as state/rundir.py's RunLock
    (the kernel releases it when the holder exits or is killed: no stale lock ever blocks a later run). A second
    process waits for the first, saying so once, and then finds the file in the cache.

    The lock file is removed on release, while still held, so none is left beside the weights: a process that
    opened it meanwhile sees on waking that the name now points elsewhere (or nowhere) and opens it again, so two
    processes never hold locks on two files of one name. Its open is the first write into the folder: a folder that
    cannot be written fails here (OSError, for the caller's one line). Without fcntl (Windows) there is no lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path = target.with_name(f"{target.name}.lock")
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    log(f"pretrained: waiting for another process downloading {what} (it holds {path})")
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)  # as long as the other downloads: its own timeouts bound a stall
            held = os.fstat(fd)
            try:
                named = os.stat(path)
            except FileNotFoundError:
                named = None
        except BaseException:
            os.close(fd)
            raise
        if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # the holder before us removed the file we locked: lock the one the name has now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)

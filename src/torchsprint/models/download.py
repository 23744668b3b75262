"""Fetching pretrained weights into the libraries' own caches: torchvision's through torch.hub, timm's and hf-hub's
through huggingface_hub, URLs into torch.hub's cache; offline modes, timeouts, one rank per machine downloading.

Every download lands under a temporary name and is renamed into place only once its size and hash are checked and
it loads as weights (models/weights_cache.py), so an interrupted or corrupt download, or a login page, never leaves a
file that a later run trusts (torch.hub and huggingface_hub do the same: `<file>.<uuid>.partial`,
`<blob>.<id>.incomplete`); a file found in the cache is checked before it is used. Into torch.hub's cache one process
at a time downloads a file (weights_cache.download_lock); huggingface_hub locks its own.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import re
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import HTTPRedirectHandler, Request, urlopen

from torchsprint.errors import UsageError, disk_full
from torchsprint.models.weights import WeightsSource, hf_endpoint, hf_hub_cache, is_remote, locate
from torchsprint.models.weights_cache import (
    HEAD_BYTES,
    NotWeights,
    cached_problem,
    download_lock,
    html_page,
    known_good,
    looks_like_html,
    read_state,
    sha256_of,
)

OFFLINE_ENVS = ("TORCHSPRINT_OFFLINE", "HF_HUB_OFFLINE")
TIMEOUT_ENV = "TORCHSPRINT_DOWNLOAD_TIMEOUT"
# How long the ranks that do not download wait for the one that does (fetch_for_run): long, since a download that
# progresses may take hours on a slow link; a dead downloading rank is seen within seconds regardless.
DOWNLOAD_WAIT_S = 24 * 3600.0
DEFAULT_TIMEOUT_S = 10.0  # huggingface_hub's own default (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT)


def offline() -> str | None:
    """The variable that forbids downloads ("TORCHSPRINT_OFFLINE=1"), or None (read now, as huggingface_hub's
    truthy values: 1, true, yes, on)."""
    for name in OFFLINE_ENVS:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def timeout_s() -> float:
    """Seconds to wait for a connection, and for each read once connected (TORCHSPRINT_DOWNLOAD_TIMEOUT, default 10)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise UsageError(
            f"{TIMEOUT_ENV}={value}: not a number of seconds; set e.g. {TIMEOUT_ENV}=30 or unset it."
        ) from None


def get_command(src: WeightsSource, model_name: str | None) -> str:
    """The `torchsprint weights get` that fetches `src` (torchvision:DEFAULT needs its model)."""
    return f"torchsprint weights get {src.spec}" + (
        f" --model {model_name}" if model_name and src.spec.endswith(":DEFAULT") else ""
    )


def missing(src: WeightsSource, key: str, why: str, model_name: str | None = None) -> UsageError:
    """The one line for weights that are not in the cache and cannot be fetched: where to put them, where from."""
    get = get_command(src, model_name)
    error = UsageError(
        f"{key}={src.spec}: not in the local cache ({why}): put the file at {src.target} (download it "
        f"on a machine with network from {src.published}, or run `{get}` there)."
    )
    error.reason = why  # models/start.py words its own line from it
    return error


def network_reason(error: BaseException, url: str) -> str | None:
    """Why a download from `url` failed, in a few words, when the cause is the network or the server; else None."""
    if isinstance(error, HTTPError):
        if 300 <= error.code < 400:  # urllib's HTTPRedirectHandler: its reason is a paragraph over three lines
            return (
                f"{url} redirects in a loop (HTTP {error.code} to {error.headers.get('Location', '?')} again and "
                f"again; urllib stops at {HTTPRedirectHandler.max_repeats} to one address, "
                f"{HTTPRedirectHandler.max_redirections} in all)"
            )
        return f"{url} answered HTTP {error.code} {' '.join(str(error.reason).split())}"
    if isinstance(error, (TimeoutError, socket.timeout)) or "timed out" in str(error):
        return f"no answer from {url} within {timeout_s():g} s ({TIMEOUT_ENV})"
    if isinstance(error, URLError):
        return f"cannot reach {url}: {error.reason}"
    if isinstance(error, (ConnectionError, http.client.HTTPException)):
        return f"the connection to {url} failed: {type(error).__name__}: {error}"
    if type(error).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
        return f"cannot reach {url}: {type(error).__name__}: {error}"  # huggingface_hub's HTTP client
    return None


def hash_mismatch(key: str, src: WeightsSource, url: str, expected: str, got: str) -> UsageError:
    return UsageError(
        f"{key}={src.spec}: the bytes downloaded from {url} do not have the published sha256 (expected "
        f"{expected[:8]}..., got {got[:8]}...): the download broke off or the server sent another file; "
        f"nothing was kept in the cache. Run again to retry, or check the address ({src.url})."
    )


def not_weights(key: str, src: WeightsSource, url: str, what: str) -> UsageError:
    return UsageError(
        f"{key}={src.spec}: {url} sent {what}, not weights; nothing was kept in the cache. Check the "
        f"address (a file behind a login: download it in a browser and set {key} to its path), or run "
        "again if the download broke off."
    )


def bad_cached(src: WeightsSource, key: str, problem: str, why: str, model_name: str | None = None) -> UsageError:
    """The one line for a file in the cache that must not be used, where it cannot be downloaded again now."""
    get = get_command(src, model_name)
    return UsageError(
        f"{key}={src.spec}: the cached file at {src.cached} {problem}; it was not used ({why}): remove "
        f"it and run again where downloads are allowed, or put the weights there (from {src.published}, "
        f"or `{get}` on a machine with network)."
    )


def pin(src: WeightsSource) -> str | None:
    """The sha256 prefix a cached file must have: a URL's `#sha256=`. Not torchvision's name's: as torch.hub's loader,
    a file in the cache under that name is used as it is (a file put there by hand, as the docs say one may)."""
    return src.hash_prefix if src.kind == "url" else None


def temp_name(dst: Path) -> Path:
    return dst.with_name(f"{dst.name}.{uuid.uuid4().hex}.partial")


def discard(tmp: Path) -> None:
    """A temporary file removed, if it is there; an error doing so (a read-only folder: EROFS even for a file that
    is not there) never hides the error that the download itself met."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


# A folder a write was refused in (a read-only mount, no permission); a full disk is errors.disk_full.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def not_writable(error: BaseException, src: WeightsSource, key: str, model_name: str | None) -> UsageError | None:
    """The one line for a cache folder that cannot be written (what, where, what to do), None for other errors."""
    if not isinstance(error, OSError) or error.errno not in NOT_WRITABLE:
        return None
    hf = src.kind in ("timm", "hf-hub")
    folder, setting = (hf_hub_cache(), "HF_HOME (or HF_HUB_CACHE)") if hf else (src.target.parent, "TORCH_HOME")
    where = f"{error.filename}: " if error.filename else ""
    get = get_command(src, model_name)
    return UsageError(
        f"{key}={src.spec}: the weights cache {folder} is not writable ({where}{error.strerror}): set "
        f"{setting} to a writable folder, or run `{get}` where that folder is writable (a login node: "
        f"this run then finds the file at {src.target})."
    )


def accept(tmp: Path, src: WeightsSource, key: str, digest: str | None = None) -> None:
    """A complete body at `tmp` renamed to src.target once it is what was asked for: not a web page, the pinned
    sha256 when there is one (`digest`: computed while it came, else here), loading as weights as the run will
    load it (read_state, by the name it will have). Else one UsageError naming the URL and what came back."""
    with open(tmp, "rb") as f:
        head = f.read(HEAD_BYTES)
    if looks_like_html(head):  # before the hash: "a login page" says more than "another sha256"
        raise not_weights(key, src, src.url, html_page(head, tmp.stat().st_size))
    if src.hash_prefix and not (digest := digest or sha256_of(tmp)).startswith(src.hash_prefix):
        raise hash_mismatch(key, src, src.url, src.hash_prefix, digest)
    try:
        read_state(tmp, src.target.suffix)
    except NotWeights as e:
        raise not_weights(key, src, src.url, str(e)) from None
    os.replace(tmp, src.target)
    known_good(src.target, pin(src))


@contextlib.contextmanager
def socket_timeout(seconds: float):
    """A default socket timeout for the duration: torch.hub's urlopen takes none, and would wait forever on a server
    that accepts and never answers. Process-wide while it lasts (a download happens before the run's threads)."""
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(before)


def fetch_torchvision(src: WeightsSource, key: str, progress: bool) -> None:
    """torchvision's file through torch.hub.download_url_to_file (its urlopen, its bar) to a temporary name of ours,
    then checked as every download is (accept: the sha256 prefix of its name included). Not torch.hub's own hash
    check: it removes the bytes before anything can say that they were a mirror's login page."""
    import torch.hub

    src.target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(src.target)
    try:
        tmp.touch()  # torch.hub connects before it opens its file: a folder that cannot be written fails first here
        with socket_timeout(timeout_s()):
            torch.hub.download_url_to_file(src.url, str(tmp), None, progress=progress)
        accept(tmp, src, key)
    finally:
        discard(tmp)


def fetch_url(src: WeightsSource, key: str, progress: bool) -> None:
    """An http(s) file into torch.hub's cache: written to a temp name, its size checked against Content-Length and
    its sha256 against `#sha256=` when given, then renamed. Not torch.hub.download_url_to_file: http.client ends a
    body cut short without an error (HTTPResponse.read(n) returns what came), and without a hash to check torch.hub
    would keep the truncated file."""
    from torch.hub import tqdm

    src.target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(src.target)
    sha, size = hashlib.sha256(), 0
    try:
        # the file first: a cache folder that cannot be written fails before a connection is made
        with (
            open(tmp, "wb") as f,
            urlopen(Request(src.url, headers={"User-Agent": "torchsprint"}), timeout=timeout_s()) as r,
        ):
            if r.headers.get_content_type() in ("text/html", "application/xhtml+xml"):  # a login or error page
                page = html_page(r.read(HEAD_BYTES))
                raise not_weights(key, src, src.url, f"{page} (Content-Type {r.headers.get_content_type()})")
            total = int(r.headers["Content-Length"]) if r.headers.get("Content-Length") else None
            with tqdm(total=total, disable=not progress, unit="B", unit_scale=True, unit_divisor=1024) as bar:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    sha.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())  # on disk before the name says it is complete
        if total is not None and size != total:
            raise ConnectionError(f"the body broke off after {size:,} of {total:,} bytes")
        accept(tmp, src, key, sha.hexdigest())
    finally:
        discard(tmp)


def fetch_hf(src: WeightsSource, key: str, progress: bool) -> Path:
    """A Hugging Face repo's weights file through huggingface_hub.hf_hub_download, into the hub cache (HF_ENDPOINT:
    a mirror). First one HEAD with our timeout and no retries (huggingface_hub retries a timed-out HEAD for a
    minute): it says fast whether the network is there and which of the candidate files the repo has.
    huggingface_hub's own progress bar shows on a terminal only (`progress` is not needed: only local rank 0
    downloads). The file is checked as every download is (check_hf_blob); huggingface_hub locks a download of its
    own, so two processes downloading the same blob fetch it once."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = hf_endpoint()
    for filename in src.filenames:
        url = hf_hub_url(src.repo, filename, revision=src.revision, endpoint=endpoint)
        try:
            get_hf_file_metadata(url, timeout=timeout_s())
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise UsageError(
                f"{key}={src.spec}: {endpoint} has no repo {src.repo} at revision {src.revision} "
                f"({type(e).__name__}); check the name (and a token for a private repo: HF_TOKEN)."
            ) from None
        except HfHubHTTPError as e:
            if e.response is not None and e.response.status_code == 404:
                continue  # not this file name: the next candidate
            raise
        try:
            path = Path(
                hf_hub_download(
                    src.repo,
                    filename,
                    revision=src.revision,
                    cache_dir=str(hf_hub_cache()),
                    endpoint=endpoint,
                    etag_timeout=timeout_s(),
                )
            )
        except OSError as e:  # its size check is a bare OSError: a mirror's login page, a body cut short
            if e.errno is not None or "Consistency check failed" not in str(e):
                raise
            found = re.search(r"size (\d+) but has size (\d+)", str(e))
            got = (
                f"{int(found.group(2)):,} bytes where it announced {int(found.group(1)):,}" if found else "another size"
            )
            raise not_weights(key, src, url, f"{got} (huggingface_hub's size check)") from None
        check_hf_blob(path, src, key, url)
        return path
    raise UsageError(
        f"{key}={src.spec}: the repo {src.repo} has none of {', '.join(src.filenames)} at revision "
        f"{src.revision}; pass the weights file's URL or path instead."
    )


def check_hf_blob(path: Path, src: WeightsSource, key: str, url: str) -> None:
    """huggingface_hub checks a download's size only; an LFS file's blob is named by its sha256 (the ETag): check it,
    and that it loads as weights; on a failure remove the blob and its snapshot link, so that no later run trusts
    them."""
    blob = path.resolve()
    error = None
    if re.fullmatch(r"[0-9a-f]{64}", blob.name) and (digest := sha256_of(blob)) != blob.name:
        error = hash_mismatch(key, src, url, blob.name, digest)  # (a small git file is named by its git sha1)
    else:
        try:
            read_state(blob, path.suffix)
        except NotWeights as e:
            error = not_weights(key, src, url, str(e))
    if error is not None:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise error


def remove_cached(src: WeightsSource) -> None:
    """A cached file that must not be used, removed: for the Hugging Face cache its blob too (else huggingface_hub
    would link the same bytes again rather than download them)."""
    if src.kind in ("timm", "hf-hub"):
        src.cached.resolve().unlink(missing_ok=True)
    src.cached.unlink(missing_ok=True)


def download(src: WeightsSource, key: str, log, progress: bool, model_name: str | None = None) -> Path:
    """Fetch `src` into its cache (a network or server failure: one UsageError naming where to put the file; a
    folder that cannot be written, a full disk: one line each)."""
    try:
        if src.kind not in ("torchvision", "url"):  # huggingface_hub locks a download of its own
            return locked_download(src, key, log, progress, model_name)
        src.target.parent.mkdir(parents=True, exist_ok=True)
        with download_lock(src.target, src.spec, log):
            return locked_download(src, key, log, progress, model_name)
    except UsageError:
        raise
    except Exception as e:
        if (refused := not_writable(e, src, key, model_name)) is not None:
            raise refused from None
        if disk_full(e):
            raise UsageError(
                f"{key}={src.spec}: {disk_full(e, str(src.target))}; free space there (or move the cache: "
                "TORCH_HOME, HF_HOME) and run again."
            ) from None
        where = src.url or src.published
        reason = network_reason(e, where)
        if reason is None and type(e).__module__.startswith("huggingface_hub"):
            reason = f"huggingface_hub: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if reason is None:
            raise
        raise missing(src, key, f"the download failed: {reason}", model_name) from None


def locked_download(src: WeightsSource, key: str, log, progress: bool, model_name: str | None) -> Path:
    """The download itself, under download_lock: first the cache looked at again, since another process may have
    downloaded the file while this one waited (or left a file that must not be used: removed)."""
    src = locate(src.spec, model_name, key)
    if src.cached is not None:
        if (problem := cached_problem(src.cached, pin(src))) is None:
            log(f"pretrained: {src.cached} (downloaded meanwhile by another process)")
            return src.cached
        log(f"pretrained: the cached file at {src.cached} {problem}: removed, downloading it again")
        remove_cached(src)
    where = src.url or src.published
    log(f"pretrained: downloading {src.spec} from {where}")
    start = time.perf_counter()
    if src.kind in ("timm", "hf-hub"):
        path = fetch_hf(src, key, progress)
    else:
        {"torchvision": fetch_torchvision, "url": fetch_url}[src.kind](src, key, progress)
        path = src.target
    log(f"pretrained: {path} ({path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s)")
    return path


def fetch(
    spec: str,
    model_name: str | None,
    key: str = "model.pretrained",
    log=None,
    download_ok: bool = True,
    progress: bool | None = None,
) -> Path:
    """The local file of a model.pretrained value, downloaded into the library's cache when it is not there yet.

    Args:
        spec: a file path, torchvision:<weights>, timm:<arch.tag>, hf-hub:<repo>[@rev], or an http(s) URL.
        model_name: the model the weights are for (torchvision:DEFAULT needs it); None: not checked.
        key: the setting named in messages.
        log: one-line messages (what is downloaded, from where); default stderr.
        download_ok: False: the cache only (a rank whose local rank 0 downloaded).
        progress: a progress bar (default: when stderr is a terminal).
    Offline (TORCHSPRINT_OFFLINE=1, HF_HUB_OFFLINE=1), no connection is attempted; a file that is not cached is
    then, as after a failed download, one UsageError naming the path to put it at and the URL. A cached file is
    checked before it is returned (weights_cache.cached_problem: it loads as weights, a URL's pin): one that fails
    is downloaded again where downloads are allowed, else one UsageError (bad_cached).
    """
    src = locate(spec, model_name, key)
    if src.kind == "file":
        return src.target
    if src.cached is not None:  # a cached file is checked before it is used (a page renamed there by an older version)
        if (problem := cached_problem(src.cached, pin(src))) is None:
            return src.cached
        if (why := "a rank that does not download" if not download_ok else offline()) is not None:
            raise bad_cached(src, key, problem, f"offline: {why}" if download_ok else why, model_name)
    elif not download_ok:
        raise missing(src, key, "the rank that downloads did not leave it there", model_name)
    elif (why := offline()) is not None:
        raise missing(src, key, f"offline: {why}", model_name)
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    return download(src, key, log, sys.stderr.isatty() if progress is None else progress, model_name)


def fetch_for_run(spec: str, model_name: str | None, rt, log, key: str = "model.pretrained") -> Path:
    """fetch() under DDP: local rank 0 of each machine downloads (the bar on global rank 0 only), the others wait at
    a barrier and then read the file from the cache. A failure on the downloading rank is raised on it after the
    barrier (so no rank hangs); the others then find no file and say so.

    The barrier is on a gloo group of its own whose limit is DOWNLOAD_WAIT_S, not strategy.timeout_s (the run's
    collectives' limit, 300 s by default): a large file on a slow link may take longer than that, and the waiting
    ranks must not give up on a download that progresses. A downloading rank that dies closes its sockets, so the
    others stop within seconds (as for any collective); one that stalls is bounded by the download's own timeout
    between bytes (TORCHSPRINT_DOWNLOAD_TIMEOUT).
    """
    if not rt.distributed:
        return fetch(spec, model_name, key, log)
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=DOWNLOAD_WAIT_S))  # every rank, in this order
    try:
        if rt.local_rank != 0:
            dist.barrier(group=group)
            return fetch(spec, model_name, key, log, download_ok=False)
        error = None
        try:
            path = fetch(spec, model_name, key, log, progress=rt.is_main and sys.stderr.isatty())
        except Exception as e:  # raised after the barrier: the other ranks must not wait for a rank that left
            error = e
        dist.barrier(group=group)
        if error is not None:
            raise error
        return path
    finally:
        dist.destroy_process_group(group)


def fetch_run_weights(model_cfg, teacher_cfg, rt, log, resuming: bool = False) -> None:
    """The library or URL weights a run will load, fetched into their caches before anything is built (fetch_for_run:
    local rank 0 downloads): model.pretrained unless a checkpoint comes first, and the distillation teacher's
    (`teacher_cfg`: distill.teacher when distilling, else None). The builders then find the files in the cache."""
    if not resuming and is_remote(model_cfg.pretrained):
        fetch_for_run(model_cfg.pretrained, model_cfg.name, rt, log)
    if teacher_cfg is not None and teacher_cfg.model and not teacher_cfg.run and is_remote(teacher_cfg.weights):
        fetch_for_run(teacher_cfg.weights, teacher_cfg.model, rt, log, key="distill.teacher.weights")

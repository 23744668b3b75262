"""The weights cache trusts only weights (models/download.py, models/weights_cache.py): an HTML page or a body cut
short is refused before it takes the cache's name, a file found in the cache is checked before it is used (that it
loads as weights; a URL's #sha256= pin), a cache folder that is not writable is one line, a redirect loop is one
line, and two processes downloading the same file fetch it once. The server and fixtures are those of
tests/e2e/models/test_weights_download.py: a real HTTP server on 127.0.0.1 counting what it is asked, real torch.save'd
weights, TORCH_HOME / HF_HOME in tmp folders.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from test_weights_download import HF_PATH, HF_REPO, LOGIN_PAGE, TV_PATH, build, checkpoints, sha256

from torchsprint.errors import UsageError
from torchsprint.models.download import fetch

pytest_plugins = ("test_weights_download",)  # its fixtures: online, server, r18


def one_line(error: pytest.ExceptionInfo) -> str:
    msg = str(error.value)
    assert "\n" not in msg, msg
    return msg


def saved(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


# ---------------------------------------------------------------- 1. only weights take the cache's name


@pytest.mark.parametrize("kind", ["url", "url-pinned", "torchvision"])
def test_an_html_login_page_is_refused_and_nothing_is_cached(online, server, r18, monkeypatch, kind):
    """Bug: a 200 text/html answer (a proxy's or a mirror's login page) was renamed into the cache under the weights'
    name (a URL without a pin), or refused as a hash mismatch that did not say it was a page (a URL's pin,
    torchvision's name through TORCHSPRINT_WEIGHTS_MIRROR); every later run then failed on the cached page, blaming
    weights_only. Now: refused before it takes the name, in one line naming the URL and the page."""
    monkeypatch.setenv("TORCHSPRINT_WEIGHTS_MIRROR", server.url)
    path, spec = {
        "url": ("/w/r18.pth", f"{server.url}/w/r18.pth"),
        "url-pinned": ("/w/r18.pth", f"{server.url}/w/r18.pth#sha256={sha256(r18.pth)}"),
        "torchvision": (TV_PATH, "torchvision:ResNet18_Weights.IMAGENET1K_V1"),
    }[kind]
    server.files[path] = r18.pth
    server.misbehave[path] = ["html"]
    with pytest.raises(UsageError) as e:
        fetch(spec, "resnet18", log=lambda _: None)
    msg = one_line(e)
    assert f"{server.url}{path}" in msg and "HTML page" in msg and "'Sign in - Example SSO'" in msg, msg
    assert "nothing was kept in the cache" in msg and "weights_only" not in msg, msg
    assert checkpoints(online) == []
    if kind != "torchvision":  # the page is gone from the server: run again, and the weights come
        assert fetch(spec, None, log=lambda _: None).read_bytes() == r18.pth and checkpoints(online) == ["r18.pth"]


def test_an_html_page_from_a_hub_mirror_is_one_line(online, server, r18, monkeypatch):
    """Bug: an HF_ENDPOINT mirror answering the HEAD as the hub does and the GET with a login page: huggingface_hub
    raised its size check as a bare OSError ("Consistency check failed: ...", over two lines), which escaped as a
    traceback. Now: one line naming the URL and what came; no blob or snapshot link is left."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    server.files[HF_PATH] = r18.safetensors
    server.misbehave[HF_PATH] = ["html"]
    msg = one_line(pytest.raises(UsageError, fetch, f"hf-hub:{HF_REPO}", None, log=lambda _: None))
    assert f"{server.url}{HF_PATH}" in msg and f"{len(LOGIN_PAGE):,} bytes" in msg, msg
    assert "nothing was kept in the cache" in msg, msg
    assert not list((online / "hf").rglob("model.safetensors")) and not list((online / "hf").glob("hub/*/blobs/*"))


def test_a_body_cut_without_content_length_is_refused(online, server, r18):
    """Bug: a server answering 200 with no Content-Length that closes half-way: http.client ends the body without an
    error, and with no size to compare and no pin the third of a file was renamed into the cache, where every later
    run read it. Now: the body is loaded as weights before it takes the name; one line naming the URL and what came."""
    server.files["/w/plain.pth"] = r18.pth
    server.misbehave["/w/plain.pth"] = ["cut"]
    spec = f"{server.url}/w/plain.pth"
    with pytest.raises(UsageError) as e:
        fetch(spec, None, log=lambda _: None)
    msg = one_line(e)
    assert spec in msg and f"{len(r18.pth) // 3:,} bytes" in msg and "cut short" in msg, msg
    assert "nothing was kept in the cache" in msg and checkpoints(online) == []
    assert fetch(spec, None, log=lambda _: None).read_bytes() == r18.pth and checkpoints(online) == ["plain.pth"]


def put_in_cache(home: Path, name: str, data: bytes) -> Path:
    """`data` as torch.hub's cached file `name` under the test's TORCH_HOME (home/torch), as a user or a bug left it."""
    cached = home / "torch" / "hub" / "checkpoints" / name
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(data)
    return cached


def test_a_cached_file_that_is_not_weights_is_one_line_then_replaced(
    online, server, r18, monkeypatch, cli_in_process, tmp_path
):
    """Bug: a page already in the cache under the weights' name (left there by the bug above, or copied by hand) was
    used by every run, which failed with torch's weights_only text (never saying the file was a page), and was never
    fetched again; `weights path` said "in the cache". Now: offline, one line saying the cached file at PATH is not
    weights and to remove it (`weights get` and a run alike; `weights path` says it, exit 1); with downloads allowed
    it is removed and downloaded again. A local file that is a page
    says so too."""
    cached = put_in_cache(online, "r18.pth", LOGIN_PAGE)
    server.files["/w/r18.pth"] = r18.pth
    spec = f"{server.url}/w/r18.pth"
    monkeypatch.setenv("TORCHSPRINT_OFFLINE", "1")
    r = cli_in_process("weights", "get", spec)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    line = r.stderr.strip()
    for msg in (line, one_line(pytest.raises(UsageError, build, f"model.pretrained={spec}"))):
        assert "\n" not in msg and f"the cached file at {cached} is not weights" in msg, msg
        assert "HTML page" in msg and "remove it" in msg and "weights_only" not in msg, msg
    r = cli_in_process("weights", "path", spec)  # where it is, and that it is not weights: not "in the cache"
    assert r.returncode == 1 and r.stdout.strip() == str(cached) and "is not weights" in r.stderr, r.stderr
    assert server.requests == [] and cached.read_bytes() == LOGIN_PAGE
    page = tmp_path / "page.pth"  # model.pretrained=<a file>: never removed, but named for what it is
    page.write_bytes(LOGIN_PAGE)
    msg = one_line(pytest.raises(UsageError, build, f"model.pretrained={page}"))
    assert f"cannot read {page} as weights" in msg and "HTML page" in msg and "weights_only" not in msg, msg

    monkeypatch.delenv("TORCHSPRINT_OFFLINE")
    logs: list[str] = []
    assert fetch(spec, None, log=logs.append) == cached and cached.read_bytes() == r18.pth
    assert server.gets("/w/r18.pth") == 1 and checkpoints(online) == ["r18.pth"]
    assert any(f"the cached file at {cached} is not weights" in m and "downloading it again" in m for m in logs), logs


# ---------------------------------------------------------------- 2. a #sha256= pin holds for a cached file too


def test_a_pinned_url_checks_the_file_already_in_the_cache(online, server, r18, monkeypatch):
    """Bug: with `#sha256=` a file already in the cache under the URL's name was used without being hashed: another
    model's weights loaded with exit 0, the log claiming the pinned hash. Now: the cached file is hashed against the
    pin: offline, one line naming the path and both hashes; with downloads allowed, downloaded again (once)."""
    other = saved({"encoder.weight": torch.ones(4, 3), "encoder.bias": torch.zeros(4)})  # another model's weights
    cached = put_in_cache(online, "r18.pth", other)
    server.files["/w/r18.pth"] = r18.pth
    spec = f"{server.url}/w/r18.pth#sha256={sha256(r18.pth)}"
    monkeypatch.setenv("TORCHSPRINT_OFFLINE", "1")
    msg = one_line(pytest.raises(UsageError, fetch, spec, None))
    assert f"the cached file at {cached} does not have the pinned sha256" in msg, msg
    assert f"expected {sha256(r18.pth)[:8]}" in msg and f"got {sha256(other)[:8]}" in msg and "remove it" in msg, msg
    assert server.requests == [] and cached.read_bytes() == other

    monkeypatch.delenv("TORCHSPRINT_OFFLINE")
    logs: list[str] = []
    assert fetch(spec, None, log=logs.append) == cached and cached.read_bytes() == r18.pth
    assert any("does not have the pinned sha256" in m and "downloading it again" in m for m in logs), logs
    assert fetch(spec, None, log=logs.append) == cached and server.gets("/w/r18.pth") == 1  # now it holds: the cache


# ---------------------------------------------------------------- 3. a cache folder that is not writable


# Run in a child process, whose file system the test makes read-only: each case is (name, TORCH_HOME, spec); what
# fetch returned or refused is printed as JSON. Any other exception is a traceback and a non-zero exit.
READONLY_CHILD = """
import json, os, sys
from torchsprint.errors import UsageError
from torchsprint.models.download import fetch
out = {}
for name, torch_home, spec in json.loads(sys.argv[1]):
    os.environ["TORCH_HOME"] = torch_home
    try:
        out[name] = {"path": str(fetch(spec, "resnet18", log=lambda _: None))}
    except UsageError as e:
        out[name] = {"error": str(e)}
print(json.dumps(out))
"""


def readonly_child(how: str, base: Path) -> list[str]:
    """The command prefix that runs a child for which `base` cannot be written, for real.

    erofs: `base` bind-mounted read-only in a mount namespace of the child's own (unshare; -r as a user: a user
    namespace), so every write there is EROFS, root's too. eacces: the folders chmod 0o555; root ignores permission
    bits, so as root the child runs as nobody (setpriv to uid 65534), for whom they hold. Skipped where the child
    cannot be made so (no unshare or setpriv, or a Python that nobody cannot run)."""
    probe = base / "probe"
    probe.mkdir()
    if how == "erofs":
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        prefix = [*unshare, "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(base)]
    else:
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        probe.chmod(0o555)
    touch = f"import torchsprint, pathlib, sys\ntry: pathlib.Path('{probe}/x').touch()\nexcept OSError: sys.exit(3)"
    try:
        ok = subprocess.run([*prefix, sys.executable, "-c", touch], capture_output=True, timeout=60).returncode == 3
    except (OSError, subprocess.SubprocessError):
        ok = False
    probe.chmod(0o755)
    probe.rmdir()
    if not ok:
        pytest.skip(f"cannot make a folder read-only for a child process here ({how})")
    return prefix


@pytest.fixture
def readonly_base():
    """A folder outside pytest's tmp folder (which is 0o700: a child running as nobody could not reach it)."""
    base = Path(tempfile.mkdtemp(prefix="torchsprint-readonly-"))
    base.chmod(0o755)
    yield base
    for folder, dirs, _ in os.walk(base):
        for d in dirs:
            (Path(folder) / d).chmod(0o755)
    shutil.rmtree(base)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@pytest.mark.parametrize("how", ["erofs", "eacces"])
def test_a_cache_folder_that_is_not_writable_is_one_line(server, r18, readonly_base, how):
    """Bug: a read-only TORCH_HOME (a shared cache mounted read-only on compute nodes, or one without write
    permission) was a traceback, `OSError: [Errno 30] Read-only file system`, from download.py's mkdir or open;
    huggingface_hub's into a read-only HF_HOME likewise. Now: one line saying the cache folder is not writable,
    where, and what to do (TORCH_HOME / HF_HOME, or `torchsprint weights get` where it is writable). Weights already
    in the read-only cache are still used (nothing is written to read them)."""
    base = readonly_base
    checkpoints_dir = base / "torch" / "hub" / "checkpoints"
    checkpoints_dir.mkdir(parents=True)
    (checkpoints_dir / "good.pth").write_bytes(r18.pth)
    (base / "empty").mkdir()
    (base / "hf").mkdir()
    server.files["/w/r18.pth"] = server.files[TV_PATH] = r18.pth
    server.files[HF_PATH] = r18.safetensors
    prefix = readonly_child(how, base)
    if how == "eacces":
        for folder in (checkpoints_dir, checkpoints_dir.parent, base / "torch", base / "empty", base / "hf"):
            folder.chmod(0o555)
    torch_home = str(base / "torch")
    cases = [
        ("url", torch_home, f"{server.url}/w/r18.pth"),
        ("fresh", str(base / "empty"), f"{server.url}/w/r18.pth"),
        ("torchvision", torch_home, "torchvision:DEFAULT"),
        ("hf-hub", torch_home, f"hf-hub:{HF_REPO}"),
        ("cached", torch_home, f"{server.url}/w/good.pth#sha256={sha256(r18.pth)}"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHSPRINT_OFFLINE", "HF_HUB_OFFLINE", "HF_HUB_CACHE")}
    env.update(
        HF_HOME=str(base / "hf"),
        HF_ENDPOINT=server.url,
        TORCHSPRINT_WEIGHTS_MIRROR=server.url,
        NO_PROXY="127.0.0.1,localhost",
        HOME=str(base),
        CUDA_VISIBLE_DEVICES="",
    )
    r = subprocess.run(
        [*prefix, sys.executable, "-c", READONLY_CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cached"] == {"path": str(checkpoints_dir / "good.pth")}, out
    for name, folder, setting in (
        ("url", checkpoints_dir, "TORCH_HOME"),
        ("fresh", base / "empty", "TORCH_HOME"),
        ("torchvision", checkpoints_dir, "TORCH_HOME"),
        ("hf-hub", base / "hf", "HF_HOME"),
    ):
        msg = out[name].get("error", "")
        assert "\n" not in msg and "is not writable" in msg and str(folder) in msg, (name, msg)
        assert f"set {setting}" in msg and "to a writable folder" in msg and "`torchsprint weights get" in msg, (
            name,
            msg,
        )
    assert server.gets("/w/r18.pth") == server.gets(TV_PATH) == server.gets(HF_PATH) == 0
    assert sorted(p.name for p in checkpoints_dir.iterdir()) == ["good.pth"]


# ---------------------------------------------------------------- 4. a redirect loop; two processes, one download


@pytest.mark.parametrize("kind", ["url", "torchvision"])
def test_a_redirect_loop_is_one_line(online, server, monkeypatch, kind):
    """Bug: a server redirecting in a loop gave urllib's HTTPError text in the message, over three lines ("The HTTP
    server returned a redirect error that would lead to an infinite loop.\\nThe last 30x error message was:\\nFound").
    Now: one line saying the address redirects in a loop."""
    monkeypatch.setenv("TORCHSPRINT_WEIGHTS_MIRROR", server.url)
    path, spec = {
        "url": ("/w/loop.pth", f"{server.url}/w/loop.pth"),
        "torchvision": (TV_PATH, "torchvision:ResNet18_Weights.IMAGENET1K_V1"),
    }[kind]
    server.redirect[path] = path
    msg = one_line(pytest.raises(UsageError, fetch, spec, "resnet18", log=lambda _: None))
    assert f"{server.url}{path} redirects in a loop" in msg and "put the file at" in msg, msg
    assert checkpoints(online) == []


# Each of two child processes: ready once imported, both start fetch together, each loads what it got.
LOCK_CHILD = """
import json, sys, time
from pathlib import Path
import torch
from torchsprint.models.download import fetch
spec, ready, me = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
(ready / me).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.005)
logs = []
path = fetch(spec, None, log=logs.append)
state = torch.load(path, map_location="cpu", weights_only=True)
print(json.dumps({"path": str(path), "tensors": len(state), "logs": logs}))
"""


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_two_processes_downloading_the_same_weights_fetch_them_once(online, server, r18, tmp_path):
    """Bug: two runs starting at once with the same weights not cached each downloaded a copy (the server saw two
    GETs), each under its own temporary name. Now: a flock on <target>.lock beside the cache target: the second
    process says once that it waits for the other, then finds the file cached and downloads nothing. Both get a
    file that loads; no lock file is left where a loader would look."""
    server.files["/w/r18.pth"] = r18.pth
    server.slow["/w/r18.pth"] = 3.0  # the body over 3 s: the second process asks while the first downloads
    spec = f"{server.url}/w/r18.pth#sha256={sha256(r18.pth)}"
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHSPRINT_OFFLINE"}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", LOCK_CHILD, spec, str(ready), str(i)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in (0, 1)
    ]
    outs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outs.append(json.loads(out))
    cached = online / "torch" / "hub" / "checkpoints" / "r18.pth"
    assert [o["path"] for o in outs] == [str(cached)] * 2 and [o["tensors"] for o in outs] == [len(r18.state)] * 2
    assert server.gets("/w/r18.pth") == 1, server.requests
    waits = [m for o in outs for m in o["logs"] if "waiting for another process downloading" in m]
    assert len(waits) == 1 and spec in waits[0], [o["logs"] for o in outs]
    assert cached.read_bytes() == r18.pth and checkpoints(online) == ["r18.pth"]  # no lock file, no temp file

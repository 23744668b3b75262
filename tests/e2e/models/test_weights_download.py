"""Pretrained weights downloaded into the libraries' caches (models/download.py), with no internet: a real HTTP
server on 127.0.0.1 started by the test serves a real resnet18 state dict; TORCH_HOME / HF_HOME point at tmp
folders; torchvision's fixed URLs reach the server through TORCHSPRINT_WEIGHTS_MIRROR, huggingface_hub's through
HF_ENDPOINT. Real sockets, real torch.hub / huggingface_hub code; the server counts what it was asked.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import torchvision
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from torchsprint import config, runtime
from torchsprint.errors import UsageError
from torchsprint.models.download import fetch
from torchsprint.train.build import build_training
from torchsprint.train.run import train

BASE = [
    "log.tensorboard=false",
    "log.progress=false",
    "run.epochs=1",
    "eval.per_class=false",
    "data.train.transforms=[resize: 32]",
    "data.eval.transforms=[resize: 32]",
    "model.name=resnet18",
]
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the X-Repo-Commit huggingface_hub needs from a hub
TV_PATH = "/models/resnet18-f37072fd.pth"  # torchvision's ResNet18_Weights.IMAGENET1K_V1, under the mirror
HF_REPO = "timm/resnet18.a1_in1k"
HF_PATH = f"/{HF_REPO}/resolve/main/model.safetensors"
HEAD_AND_STEM = {"conv1.weight", "fc.weight", "fc.bias"}  # digits: 1 channel (conv1 adapted), 10 classes (fc)
LOGIN_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>Sign in - Example SSO</title></head>"
    b"<body><form action='/login'>user <input name=u></form></body></html>\n"
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Weights:
    state: dict[str, torch.Tensor]
    pth: bytes  # torch.save of the state dict
    safetensors: bytes


@pytest.fixture(scope="module")
def r18() -> Weights:
    """A real torchvision resnet18 state dict (1000 classes, as the published file), seeded, and its bytes."""
    torch.manual_seed(7)
    state = torchvision.models.resnet18(weights=None).state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    return Weights(state, buf.getvalue(), safetensors_bytes({k: v.contiguous() for k, v in state.items()}))


class Server:
    """A threaded HTTP server on 127.0.0.1: `files` (path -> bytes) answered to HEAD and GET with the headers
    huggingface_hub reads (Content-Length, ETag = the file's sha256 as the hub's LFS files have, X-Repo-Commit),
    404 otherwise. `misbehave[path]` lists what successive GETs of that path do: "drop" (the full Content-Length
    announced, a third of the body sent, the connection closed), "cut" (no Content-Length, a third sent, closed),
    "other" (the bytes reversed: same length) or "html" (200 text/html: LOGIN_PAGE, as a proxy's or a mirror's login
    page answers). `redirect[path]`: a 302 to that location."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.misbehave: dict[str, list[str]] = {}
        self.slow: dict[str, float] = {}  # path -> seconds over which a GET's body is sent, in four parts
        self.redirect: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                state.answer(self, head=True)

            def do_GET(self):
                state.answer(self, head=False)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def gets(self, path: str) -> int:
        return sum(1 for method, p in self.requests if method == "GET" and p == path)

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlsplit(h.path).path
        self.requests.append((h.command, path))
        if path in self.redirect:
            h.send_response(302)
            h.send_header("Location", self.redirect[path])
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        body = self.files.get(path)
        if body is None:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        how = self.misbehave.get(path, []).pop(0) if not head and self.misbehave.get(path) else "ok"
        data = {"other": body[::-1], "html": LOGIN_PAGE}.get(how, body)
        h.send_response(200)
        headers = {
            "Content-Length": str(len(data)),
            "ETag": f'"{sha256(body)}"',
            "X-Repo-Commit": COMMIT,
            "Content-Type": "text/html; charset=utf-8" if how == "html" else "application/octet-stream",
        }
        for k, v in headers.items():
            if not (how == "cut" and k == "Content-Length"):  # HTTP/1.0: the body then ends where the server closes
                h.send_header(k, v)
        h.end_headers()
        if not head and path in self.slow:
            quarter = -(-len(data) // 4)
            for i in range(0, len(data), quarter):
                time.sleep(self.slow[path] / 4)
                h.wfile.write(data[i : i + quarter])
                h.wfile.flush()
        elif not head:
            h.wfile.write(data[: len(data) // 3] if how in ("drop", "cut") else data)
            h.wfile.flush()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.http.shutdown()
    s.http.server_close()


@pytest.fixture
def online(tmp_path, monkeypatch):
    """Downloads allowed (tests/conftest.py sets TORCHSPRINT_OFFLINE=1 for the suite), the caches in tmp_path."""
    for name in ("TORCHSPRINT_OFFLINE", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "TORCHSPRINT_WEIGHTS_MIRROR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # a proxy of the machine's must not see 127.0.0.1
    return tmp_path


def checkpoints(tmp_path: Path) -> list[str]:
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def build(*over: str):
    cfg = config.load(None, [*BASE, *over])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    logs: list[str] = []
    try:
        return build_training(cfg, rt, logs.append), logs
    finally:
        runtime.teardown(rt)


def check_body(model, saved: dict[str, torch.Tensor]) -> None:
    """Every tensor of `saved` but the head and stem is in `model` as saved; the head has this run's 10 classes."""
    own = model.state_dict()
    for k, v in saved.items():
        if k not in HEAD_AND_STEM:
            assert torch.equal(own[k], v), k
    assert own["fc.weight"].shape == (10, 512) and own["conv1.weight"].shape[1] == 1


def test_a_url_is_downloaded_once_and_a_run_trains_from_it(online, server, r18):
    # Catches: a URL refused or not fetched; the file cached elsewhere than torch.hub's TORCH_HOME/hub/checkpoints
    # under the URL's name; the download kept but not loaded into the model; a cached file downloaded again.
    name = f"resnet18-{sha256(r18.pth)[:8]}.pth"  # torchvision's naming: the sha256 prefix of the bytes served
    server.files[f"/models/{name}"] = r18.pth
    spec = f"{server.url}/models/{name}#sha256={sha256(r18.pth)[:8]}"
    run = online / "run"
    over = [f"model.pretrained={spec}", "run.max_steps=1", "model.freeze=['layer1.*']", "checkpoint.every_epochs=null"]
    summary = train(config.load(None, [*BASE, *over, f"run.dir={run}"]), quiet=True)
    cached = online / "torch" / "hub" / "checkpoints" / name
    assert cached.read_bytes() == r18.pth and checkpoints(online) == [name]  # no temp file left beside it
    assert summary["init"]["file"] == str(cached) and summary["init"]["head_replaced"] == ["fc.weight", "fc.bias"]
    trained = load_file(str(run / "last.safetensors"))
    key = "layer1.0.conv1.weight"  # frozen: still the served file's after the step
    assert torch.equal(trained[key], r18.state[key])
    assert not torch.equal(trained["layer4.0.conv1.weight"], r18.state["layer4.0.conv1.weight"])  # it trained
    assert fetch(spec, "resnet18") == cached and server.gets(f"/models/{name}") == 1  # the second time: the cache


def test_a_download_cut_short_leaves_nothing_and_a_retry_succeeds(online, server, r18):
    # Catches: a truncated body kept as the file (http.client ends a short body without an error, so without a size
    # check the next run would trust a third of a file); a temp file left behind; a traceback instead of one line.
    server.files["/w/plain.pth"] = r18.pth
    server.misbehave["/w/plain.pth"] = ["drop"]
    spec = f"{server.url}/w/plain.pth"  # no #sha256: only the announced size can tell
    with pytest.raises(UsageError) as e:
        fetch(spec, None)
    msg = str(e.value)
    assert "\n" not in msg and "broke off after" in msg and "put the file at" in msg, msg
    assert checkpoints(online) == []
    assert fetch(spec, None).read_bytes() == r18.pth and checkpoints(online) == ["plain.pth"]  # run again: it works


def test_torchvision_weights_through_torch_hub_land_under_their_name(online, server, r18):
    # Catches: torch.hub's download (the path torchvision: specs take) not landing at the cached name, or a temp file
    # left beside it. torchvision's own enums carry fixed hashes (resnet18-f37072fd) that no served test file can
    # have, so the source is the one torchvision_source would build, for the bytes this server has.
    from torchsprint.models.download import fetch_torchvision
    from torchsprint.models.weights import WeightsSource, hub_checkpoints

    name = f"resnet18-{sha256(r18.pth)[:8]}.pth"
    server.files[f"/models/{name}"] = r18.pth
    src = WeightsSource(
        "torchvision:test",
        "torchvision",
        hub_checkpoints() / name,
        url=f"{server.url}/models/{name}",
        hash_prefix=sha256(r18.pth)[:8],
    )
    fetch_torchvision(src, "model.pretrained", progress=False)
    assert (online / "torch/hub/checkpoints" / name).read_bytes() == r18.pth and checkpoints(online) == [name]


@pytest.mark.parametrize(
    "kind, how", [("torchvision", "other"), ("torchvision", "drop"), ("url", "other"), ("hf-hub", "other")]
)
def test_bytes_that_are_not_the_published_ones_are_not_kept(online, server, r18, monkeypatch, kind, how):
    # Catches: a file whose sha256 does not match the published one left in the cache (torchvision: the prefix in
    # its name, through torch.hub's own check; a URL's #sha256=; hf-hub: the LFS blob's sha256, which
    # huggingface_hub itself does not check), and the error not naming what was expected and what came.
    monkeypatch.setenv("TORCHSPRINT_WEIGHTS_MIRROR", server.url)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    body = r18.safetensors if kind == "hf-hub" else r18.pth
    path, spec, expected = {
        "torchvision": (TV_PATH, "torchvision:ResNet18_Weights.IMAGENET1K_V1", "f37072fd"),
        "url": ("/w/r18.pth", f"{server.url}/w/r18.pth#sha256={sha256(body)}", sha256(body)[:8]),
        "hf-hub": (HF_PATH, f"hf-hub:{HF_REPO}", sha256(body)[:8]),
    }[kind]
    server.files[path] = body
    server.misbehave[path] = [how]
    with pytest.raises(UsageError) as e:
        fetch(spec, "resnet18")
    sent = {"other": body[::-1], "drop": body[: len(body) // 3]}[how]
    msg = str(e.value)
    assert "\n" not in msg and f"expected {expected}" in msg and f"got {sha256(sent)[:8]}" in msg, msg
    assert "nothing was kept" in msg and checkpoints(online) == []
    blobs = online / "hf" / "hub" / "models--timm--resnet18.a1_in1k" / "blobs"
    assert not blobs.is_dir() or list(blobs.iterdir()) == []
    assert not list((online / "hf").rglob("model.safetensors"))  # no snapshot link to a removed blob


@pytest.mark.parametrize("env", ["TORCHSPRINT_OFFLINE", "HF_HUB_OFFLINE"])
@pytest.mark.parametrize("kind", ["torchvision", "url", "hf-hub", "timm-github"])
def test_offline_no_connection_is_attempted(online, server, monkeypatch, cli_in_process, env, kind):
    # Catches: a connection attempted although the user said offline (the server would count it); an offline refusal
    # that is a traceback or does not say where to put the file and where it comes from; a timm tag published on
    # GitHub only (no Hugging Face repo) sent to a repo that does not exist instead of torch.hub's cache and its URL.
    if kind == "timm-github":
        pytest.importorskip("timm")
    monkeypatch.setenv("TORCHSPRINT_WEIGHTS_MIRROR", server.url)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv(env, "1")
    spec, target, published = {
        "torchvision": (
            "torchvision:DEFAULT",
            online / "torch/hub/checkpoints/resnet18-f37072fd.pth",
            "https://download.pytorch.org/models/resnet18-f37072fd.pth",
        ),
        "url": (f"{server.url}/w/r18.pth", online / "torch/hub/checkpoints/r18.pth", f"{server.url}/w/r18.pth"),
        "hf-hub": (
            f"hf-hub:{HF_REPO}",
            online / "hf/hub/models--timm--resnet18.a1_in1k/snapshots/main/model.safetensors",
            f"https://huggingface.co/{HF_PATH[1:]}",
        ),
        "timm-github": (
            "timm:gcvit_tiny.in1k",
            online / "torch/hub/checkpoints/gcvit_tiny_224_nvidia-ac783954.pth",
            "https://github.com/rwightman/pytorch-image-models/releases/download/v0.1-weights-morevit/"
            "gcvit_tiny_224_nvidia-ac783954.pth",
        ),
    }[kind]
    r = cli_in_process("weights", "get", spec, *(["--model", "resnet18"] if kind == "torchvision" else []))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and f"offline: {env}=1" in line and f"put the file at {target} " in line, line
    assert f"from {published}" in line and "`torchsprint weights get" in line
    assert server.requests == []


@pytest.mark.parametrize("kind", ["torchvision", "url", "hf-hub"])
def test_a_server_that_never_answers_times_out(online, monkeypatch, kind):
    # Catches: no timeout on the connection (torch.hub's urlopen takes none: the run would hang forever on a
    # firewall that accepts and drops) and huggingface_hub's minute of retries before the offline message.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever accepts or answers them
    address = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setenv("TORCHSPRINT_WEIGHTS_MIRROR", address)
    monkeypatch.setenv("HF_ENDPOINT", address)
    monkeypatch.setenv("TORCHSPRINT_DOWNLOAD_TIMEOUT", "1")
    spec = {"torchvision": "torchvision:DEFAULT", "url": f"{address}/w/r18.pth", "hf-hub": f"hf-hub:{HF_REPO}"}[kind]
    start = time.perf_counter()
    try:
        with pytest.raises(UsageError) as e:
            fetch(spec, "resnet18")
    finally:
        silent.close()
    assert time.perf_counter() - start < 5
    msg = str(e.value)
    assert "\n" not in msg and "within 1 s (TORCHSPRINT_DOWNLOAD_TIMEOUT)" in msg and "put the file at" in msg, msg
    assert checkpoints(online) == []


def test_hf_hub_through_huggingface_hub_then_found_offline(online, server, r18, monkeypatch, cli_in_process):
    # Catches: hf-hub: not fetched through huggingface_hub into HF_HOME's hub cache (its layout: blobs/<etag>,
    # snapshots/<commit>/<file>), HF_ENDPOINT ignored (read by huggingface_hub at import only), the downloaded file
    # not found again offline, by hf-hub: and by timm:'s tag for the same repo, or not loaded into the model.
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    server.files[HF_PATH] = r18.safetensors
    spec = f"hf-hub:{HF_REPO}"
    assert cli_in_process("weights", "path", spec).returncode == 1 and server.requests == []
    r = cli_in_process("weights", "get", spec)
    assert r.returncode == 0, r.stderr
    snapshot = online / "hf" / "hub" / "models--timm--resnet18.a1_in1k" / "snapshots" / COMMIT / "model.safetensors"
    assert r.stdout.strip() == str(snapshot) and snapshot.read_bytes() == r18.safetensors
    assert server.gets(HF_PATH) == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(server.requests)
    r = cli_in_process("weights", "path", spec)
    assert r.returncode == 0 and r.stdout.strip() == str(snapshot) and "in the cache" in r.stderr
    b, logs = build(f"model.pretrained={spec}")
    check_body(b.model, r18.state)
    assert b.init["file"] == str(snapshot) and any("classifier head replaced" in m for m in logs)
    if pytest.importorskip("timm"):
        assert fetch("timm:resnet18.a1_in1k", "timm/resnet18") == snapshot
    assert len(server.requests) == seen


def test_a_file_with_another_head_and_other_keys_says_so_in_one_line(tmp_path, r18):
    # Catches: the body not loaded when the head differs (a file source, as torchvision: and timm: in
    # test_recipes_pretrained.py); the head left as the file's; keys beyond the head that did not load not named,
    # or named over several lines, or the head repeated among them.
    state = {k: v for k, v in r18.state.items() if k != "layer4.1.bn2.num_batches_tracked"}
    state["extra.weight"] = torch.zeros(3)
    path = tmp_path / "r18.pth"
    torch.save(state, path)
    b, logs = build(f"model.pretrained={path}")
    check_body(b.model, {k: v for k, v in state.items() if k != "extra.weight"})
    assert not torch.equal(b.model.state_dict()["fc.bias"], state["fc.bias"][:10])  # a new head, not a slice
    head = [m for m in logs if "classifier head replaced" in m]
    assert len(head) == 1 and "fc.weight" in head[0] and "this run's 10" in head[0]
    beyond = [m for m in logs if m.startswith("pretrained: not loaded")]
    assert len(beyond) == 1, logs
    assert all(k in beyond[0] for k in ("conv1.weight", "extra.weight", "layer4.1.bn2.num_batches_tracked"))
    assert "fc." not in beyond[0]


@pytest.mark.dist
def test_under_ddp_local_rank_0_downloads_and_the_others_wait(online, server, r18):
    # Catches: every rank downloading the same file (the server would count two GETs); a rank reading before the file
    # is complete; a failed download on rank 0 leaving rank 1 waiting (the spawn would hang) or trying itself.
    server.files["/w/r18.pth"] = r18.pth
    out = online / "out"
    out.mkdir()
    from weights_ddp_worker import rank

    torch.multiprocessing.spawn(
        rank,
        args=(str(online / "pg"), f"{server.url}/w/r18.pth", f"{server.url}/w/gone.pth", str(out)),
        nprocs=2,
        join=True,
    )
    r0, r1 = (json.loads((out / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["path"] == r1["path"] == str(online / "torch/hub/checkpoints/r18.pth")
    assert Path(r0["path"]).read_bytes() == r18.pth
    assert server.gets("/w/r18.pth") == 1 and server.gets("/w/gone.pth") == 1
    assert "HTTP 404" in r0["error"] and "the rank that downloads did not leave it there" in r1["error"]


@pytest.mark.slow  # 8-12 s (ranks wait past strategy.timeout_s); the plain under-DDP download stays in the main suite
@pytest.mark.dist
def test_under_ddp_the_other_ranks_wait_for_a_download_longer_than_the_runs_timeout(online, server, r18):
    # Catches: the waiting rank's barrier bounded by strategy.timeout_s (the process group's timeout, 2 s here): a
    # download that progresses for 4 s failed rank 1 with a gloo timeout while rank 0 was still receiving bytes.
    server.files["/w/r18.pth"] = r18.pth
    server.slow["/w/r18.pth"] = 4.0
    out = online / "out"
    out.mkdir()
    from weights_ddp_worker import rank_waits

    torch.multiprocessing.spawn(
        rank_waits, args=(str(online / "pg"), f"{server.url}/w/r18.pth", 2.0, str(out)), nprocs=2, join=True
    )
    r0, r1 = (json.loads((out / f"{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 == {"path": str(online / "torch/hub/checkpoints/r18.pth")}, (r0, r1)
    assert Path(r0["path"]).read_bytes() == r18.pth and server.gets("/w/r18.pth") == 1

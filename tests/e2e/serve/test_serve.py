"""`torchsprint serve`: real uvicorn servers on 127.0.0.1 (in a thread, or the CLI in a subprocess) driven by real
HTTP clients. Answers are checked against `torchsprint predict` (Predictor) on the same files: the independent
reference. Tests that hold a batch in the model inject the serve_gate fault (tests/faults/sitecustomize.py:
the model thread waits for a file before each forward), so overload, timeout, disconnect and SIGTERM are certain
events, never races against a sleep."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fault_env import fault_env, faults
from paths import REPO  # noqa: E402
from serve_helpers import (
    TOL,
    ThreadServer,
    digit_images,
    encode,
    in_background,
    listening,
    metric,
    result,
    unusual_files,
    wait_until,
)
from torchsprint import cli
from torchsprint.commands.predict import Predictor
from torchsprint.commands.serve_engine import bucket, powers_of_two


@pytest.fixture(scope="module")
def run(serve_run):
    """A tiny digits run (conftest.py) whose saved config says serve.topk=7."""
    return serve_run


@pytest.fixture(scope="module")
def files(run, tmp_path_factory):
    """{path: predict's {class: probability}} for 24 distinct digits and the unusual files."""
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i, arr in enumerate(digit_images(24)):
        paths.append(folder / f"d{i}.png")
        paths[-1].write_bytes(encode(arr, "PNG"))
    paths += unusual_files(folder / "unusual")
    results = Predictor.from_run(run).predict([str(p) for p in paths], topk=10)
    assert all("top" in r for r in results), results
    return {p: {t["class"]: t["prob"] for t in r["top"]} for p, r in zip(paths, results)}


def same_as_predict(answer: dict, expected: dict[str, float]) -> None:
    got = {t["class"]: t["prob"] for t in answer["top"]}
    assert got.keys() == expected.keys()
    assert max(abs(got[c] - expected[c]) for c in got) <= TOL, (got, expected)


def post(url: str, path: Path | None = None, timeout: float = 60, **kw) -> httpx.Response:
    if path is not None:
        kw = {"content": path.read_bytes(), "headers": {"content-type": "application/octet-stream"}, **kw}
    return httpx.post(url + "/predict", timeout=timeout, **kw)


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """The serve_gate fault (tests/faults/): servers in this process hold every forward until gate.touch()."""
    path = tmp_path / "gate"
    faults().serve_gate(str(path), patch=monkeypatch.setattr)
    return path


def test_buckets_are_powers_of_two_up_to_max_batch():
    # Bug caught: a bucket below the batch (rows cut off) or a shape per batch size (no static shapes).
    assert powers_of_two(8) == [1, 2, 4, 8] and powers_of_two(12) == [1, 2, 4, 8, 12]
    assert [bucket(n, 12) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]


def test_a_batch_runs_with_the_threads_measured_for_its_size():
    """Batcher.threads_for: the count measured for a batch of one serves batches up to sqrt(max_batch), max_batch's
    the rest. Bug caught: a lone client's batch of one run with the count a full batch won (the digits net: 0.82 ms
    with 1 thread, 1.71 with 2 at warm-up on this project's 2-core VM)."""
    from types import SimpleNamespace

    from torchsprint.commands.serve_engine import Batcher

    b = SimpleNamespace(torch_threads={1: 1, 32: 2}, max_batch=32)
    assert [Batcher.threads_for(b, n) for n in (1, 2, 5, 6, 16, 32)] == [1, 1, 1, 2, 2, 2]
    assert Batcher.threads_for(SimpleNamespace(torch_threads={1: 3}, max_batch=1), 1) == 3


def test_concurrent_answers_equal_predict_however_batched(run, files, gate):
    """Distinct images sent at once (raw bodies and multipart forms of 2-3 images) are batched together (the gate
    holds the first batch until the rest wait), padded to buckets; every answer equals predict's for its own file.
    Bugs caught: answers crossed between requests or images, padding rows read back, a decode or preprocessing
    that differs from predict's (CMYK, 16-bit, alpha, EXIF, BMP), images of two shapes in one batch."""
    server = ThreadServer(run, max_batch=8, max_wait_ms=50, buckets="on")
    try:
        paths = list(files)
        groups = [paths[i : i + 1] if i % 3 else paths[i : i + 3] for i in range(0, len(paths), 3)]

        async def send_all():
            async with httpx.AsyncClient(timeout=120) as http:

                async def one(group):
                    if len(group) == 1:
                        r = await http.post(
                            server.url + "/predict?topk=10",
                            content=group[0].read_bytes(),
                            headers={"content-type": "image/png"},
                        )
                    else:
                        r = await http.post(
                            server.url + "/predict?topk=10", files=[("image", (p.name, p.read_bytes())) for p in group]
                        )
                    return group, r

                return await asyncio.gather(*(one(g) for g in groups))

        box = in_background(asyncio.run, send_all())
        total = len(paths)
        wait_until(
            lambda: (
                (m := server.metrics())
                and metric(m, "torchsprint_serve_in_flight") == len(groups)
                and metric(m, "torchsprint_serve_waiting") == metric(m, "torchsprint_serve_queue_depth")
                and metric(m, "torchsprint_serve_waiting") + metric(m, "torchsprint_serve_in_model") == total
            ),
            what="every image decoded and waiting behind the held batch",
        )
        gate.touch()
        for group, r in result(box):
            assert r.status_code == 200, r.text
            answers = r.json()["predictions"]
            assert len(answers) == len(group)
            for p, a in zip(group, answers):
                assert a.get("name", p.name) == p.name
                same_as_predict(a, files[p])
        m = server.metrics()
        batches = metric(m, "torchsprint_serve_batch_size_count")
        assert metric(m, "torchsprint_serve_batch_size_sum") == total
        assert metric(m, "torchsprint_serve_batch_size_bucket", '{le="4.0"}') < batches  # a batch of more than 4
    finally:
        server.close()


@pytest.mark.gpu
def test_on_cuda_concurrent_answers_equal_predict_on_cuda(run, files, gate, figure):
    """serve.device=cuda (buckets on, its default there): distinct images batched together behind a held batch;
    every answer equals `predict --device cuda` on its own file. Bugs caught: answers crossed between requests on
    the GPU path, padding rows read back, a device copy that changes an image. The bound is provisional (no GPU in
    the session that wrote it; the GPU window's FIGURE line gives the measured difference): 1e-3, where two
    different digits' probabilities differ by >= 4e-3 (serve_helpers.TOL), so a swapped answer still fails."""
    paths = [p for p in files if p.suffix == ".png"][:12]
    on_gpu = Predictor.from_run(run, device="cuda").predict([str(p) for p in paths], topk=10)
    expected = {p: {t["class"]: t["prob"] for t in r["top"]} for p, r in zip(paths, on_gpu)}
    server = ThreadServer(run, device="cuda", max_batch=8, max_wait_ms=50)
    try:

        async def send_all():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(
                    *(
                        http.post(
                            server.url + "/predict?topk=10",
                            content=p.read_bytes(),
                            headers={"content-type": "image/png"},
                        )
                        for p in paths
                    )
                )

        box = in_background(asyncio.run, send_all())
        wait_until(lambda: server.metric("torchsprint_serve_in_flight") == len(paths), what="every request in flight")
        gate.touch()
        worst = 0.0
        for p, r in zip(paths, result(box)):
            assert r.status_code == 200, r.text
            got = {t["class"]: t["prob"] for t in r.json()["predictions"][0]["top"]}
            assert got.keys() == expected[p].keys()
            worst = max(worst, *(abs(got[c] - expected[p][c]) for c in got))
        figure("serve_cuda_vs_predict_cuda_max_prob_diff", worst, "digits small_cnn, batches of 1-8 padded to buckets")
        assert worst <= 1e-3
        assert server.metric("torchsprint_serve_batch_size_bucket", '{le="1.0"}') < server.metric(
            "torchsprint_serve_batch_size_count"
        )  # at least one batch of more than one
    finally:
        server.close()


def test_max_wait_ms_holds_an_image_for_one_on_its_way_and_no_longer(run, files):
    """max_wait_ms=10000, max_batch=2. While B's body is still arriving, A (decoded, waiting) waits for it: the two
    run as one batch as soon as B is in. With nothing on its way, a lone request runs at once, not after 10 s.
    Bugs caught: max_wait_ms ignored (two forwards of one image), a full batch or a lone client's request waiting
    out max_wait_ms."""
    server = ThreadServer(run, max_batch=2, max_wait_ms=10_000)
    try:
        a, b, c = list(files)[:3]
        body = b.read_bytes()
        slow = raw_request(server.url, body, len(body) // 2)
        wait_until(lambda: server.metric("torchsprint_serve_in_flight") == 1, what="B arriving")
        first = in_background(post, server.url, a)
        wait_until(lambda: server.metric("torchsprint_serve_waiting") == 1, what="A waiting for B")
        slow.sendall(body[len(body) // 2 :])
        status, answer = read_response(slow)
        assert status == 200 and result(first).status_code == 200
        same_as_predict(answer["predictions"][0], _top(files[b], 7))
        m = server.metrics()
        assert (
            metric(m, "torchsprint_serve_batch_size_count") == 1 and metric(m, "torchsprint_serve_batch_size_sum") == 2
        )
        started = time.monotonic()
        assert post(server.url, c).status_code == 200
        assert time.monotonic() - started < 9  # not held for the 10 s of max_wait_ms
        assert server.metric("torchsprint_serve_batch_size_count") == 2
    finally:
        server.close()


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP/1.1 response read from a bare socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    sock.close()
    return int(head.split()[1]), json.loads(rest[:length])


def test_full_queue_answers_503_with_retry_after_then_recovers(run, files, gate):
    """queue_limit=3 with one image held in the model and three waiting: the next request gets 503 + Retry-After
    at once (not a longer wait), a form of more images than queue_limit gets 413; once the model moves, every
    accepted request is answered exactly and new ones are accepted again. Bugs caught: an unbounded queue (latency
    grows without limit), a 503 without Retry-After, accepted requests lost after an overload."""
    server = ThreadServer(run, max_batch=1, max_wait_ms=0, queue_limit=3)
    try:
        paths = list(files)[:5]
        held = [in_background(post, server.url, paths[0])]
        wait_until(lambda: server.metric("torchsprint_serve_in_model") == 1, what="the first image in the model")
        held += [in_background(post, server.url, p) for p in paths[1:4]]
        wait_until(lambda: server.metric("torchsprint_serve_queue_depth") == 3, what="three images queued")
        r = post(server.url, paths[4])
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["kind"] == "queue_full"
        r = post(server.url, files=[("image", (p.name, p.read_bytes())) for p in paths[:4]])
        assert r.status_code == 413 and "queue_limit=3" in r.json()["error"]
        gate.touch()
        for p, box in zip(paths, held):
            r = result(box)
            assert r.status_code == 200, r.text
            same_as_predict(r.json()["predictions"][0], _top(files[p], 7))
        assert post(server.url, paths[4]).status_code == 200
    finally:
        server.close()


def _top(expected: dict[str, float], k: int) -> dict[str, float]:
    """predict's k most probable classes (the server's default top-k: serve.topk of the run = 7)."""
    return dict(sorted(expected.items(), key=lambda kv: -kv[1])[:k])


def test_timeout_answers_503_and_drops_the_queued_image(run, files, gate):
    """timeout_s=0.5 while the model is held: both the image in the model and the one queued get 503 (timeout) with
    Retry-After; the queued one never runs (one forward, not two); the server answers the next request. Bugs
    caught: no per-request timeout, timed-out images still taking the model's time under overload."""
    server = ThreadServer(run, max_batch=1, max_wait_ms=0, timeout_s=0.5)
    try:
        a, b, c = list(files)[:3]
        first = in_background(post, server.url, a)
        wait_until(lambda: server.metric("torchsprint_serve_in_model") == 1, what="the first image in the model")
        r = post(server.url, b)
        assert r.status_code == 503 and r.json()["kind"] == "timeout" and r.headers["retry-after"] == "1"
        assert result(first).status_code == 503
        gate.touch()
        wait_until(
            lambda: (
                (m := server.metrics())
                and metric(m, "torchsprint_serve_queue_depth") == 0
                and metric(m, "torchsprint_serve_in_model") == 0
            ),
            what="the queue drained",
        )
        assert server.metric("torchsprint_serve_forward_seconds_count") == 1  # a's forward; b was dropped
        r = post(server.url, c)
        assert r.status_code == 200 and server.metric("torchsprint_serve_forward_seconds_count") == 2
    finally:
        server.close()


def raw_request(url: str, body: bytes, send: int) -> socket.socket:
    """A client on a bare socket that sends the headers and the first `send` bytes of the body, and stays open."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/png\r\nContent-Length: {len(body)}"
        f"\r\n\r\n".encode()
        + body[:send]
    )
    return s


def test_a_client_that_leaves_does_not_poison_its_batch(run, files, gate):
    """Behind a held batch: B waits (httpx), C sends its whole request and closes, D closes in the middle of its body.
    C is dropped before its batch runs; B is answered exactly, alone; the server goes on. Bugs caught: a closed
    connection failing its batch-mates or the worker, a departed client's image still run."""
    server = ThreadServer(run, max_batch=4, max_wait_ms=0)
    try:
        a, b, c, d = list(files)[:4]
        held = in_background(post, server.url, a)
        wait_until(lambda: server.metric("torchsprint_serve_in_model") == 1, what="the first image in the model")
        waiting = in_background(post, server.url, b)
        leaver = raw_request(server.url, c.read_bytes(), len(c.read_bytes()))
        wait_until(lambda: server.metric("torchsprint_serve_waiting") == 2, what="B and C waiting")
        leaver.close()
        disconnected = '{kind="disconnected"}'
        wait_until(lambda: server.metric("torchsprint_serve_errors_total", disconnected) == 1, what="C noticed")
        half = raw_request(server.url, d.read_bytes(), len(d.read_bytes()) // 2)
        wait_until(lambda: server.metric("torchsprint_serve_in_flight") == 3, what="D reading its body")
        half.close()
        wait_until(lambda: server.metric("torchsprint_serve_errors_total", disconnected) == 2, what="D noticed")
        gate.touch()
        for p, box in ((a, held), (b, waiting)):
            r = result(box)
            assert r.status_code == 200, r.text
            same_as_predict(r.json()["predictions"][0], _top(files[p], 7))
        m = server.metrics()
        assert metric(m, "torchsprint_serve_batch_size_sum") == 2  # a, then b alone: c never ran
        assert post(server.url, d).status_code == 200
    finally:
        server.close()


def bad_requests(tmp_path: Path) -> list[tuple[str, dict, int, str]]:
    """(what, httpx arguments, expected status, expected kind) of requests a server with max_body_mb=0.05 and
    max_pixels=10000 must refuse."""
    import numpy as np

    png = encode(digit_images(1)[0], "PNG")
    jpg = encode(digit_images(1)[0], "JPEG")
    bomb = bytearray(png)
    bomb[16:24] = (100_000).to_bytes(4, "big") * 2  # the IHDR claims 100000 x 100000 pixels
    tiny = encode(np.zeros((1, 1), np.uint8), "PNG")  # the model's max-pool cannot take 1x1
    raw = {"content-type": "image/png"}
    return [
        ("text as an image", {"content": b"hello, I am text", "headers": raw}, 422, "bad_image"),
        ("a path, not an image", {"content": b"/etc/passwd", "headers": raw}, 422, "bad_image"),
        ("truncated PNG", {"content": png[:40], "headers": raw}, 422, "bad_image"),
        ("truncated JPEG", {"content": jpg[: len(jpg) // 2], "headers": raw}, 422, "bad_image"),
        ("empty body", {"content": b"", "headers": raw}, 400, "empty_body"),
        ("oversized body", {"content": b"x" * 60_000, "headers": raw}, 413, "body_too_large"),
        ("oversized, chunked", {"content": iter([b"x" * 30_000] * 2), "headers": raw}, 413, "body_too_large"),
        ("decompression bomb (header)", {"content": bytes(bomb), "headers": raw}, 422, "too_many_pixels"),
        (
            "too many pixels (BMP, no header sniffing)",
            {"content": encode(np.zeros((120, 120), np.uint8), "BMP"), "headers": raw},
            422,
            "too_many_pixels",
        ),
        ("JSON", {"json": {"path": "/etc/passwd"}}, 415, "unsupported_media_type"),
        ("no content type", {"content": png, "headers": {"content-type": ""}}, 415, "unsupported_media_type"),
        ("wrong field name", {"files": [("file", ("a.png", png))]}, 400, "wrong_field"),
        ("a text field", {"data": {"image": "not a file"}, "files": [("image", ("a.png", png))]}, 400, "wrong_field"),
        (
            "malformed multipart",
            {"content": b"--zz\r\nnonsense", "headers": {"content-type": "multipart/form-data; boundary=yy"}},
            400,
            "bad_multipart",
        ),
        ("two 1x1 images", {"files": [("image", ("a.png", tiny)), ("image", ("b.png", tiny))]}, 422, "model_refused"),
        ("topk=0", {"content": png, "headers": raw, "params": {"topk": 0}}, 422, "bad_request"),
    ]


def _chunked(kw: dict) -> bool:
    return "content" in kw and not isinstance(kw["content"], bytes)


async def chunks(parts):
    """A body sent with Transfer-Encoding: chunked (no Content-Length for the server to check first)."""
    for part in parts:
        yield part


def test_bad_input_gets_one_line_4xx_and_batch_mates_are_unaffected(run, files, tmp_path):
    """Every kind of bad request, sent at once with good images: each gets its 4xx and one line of JSON, never a
    500; the good answers equal predict; the server stays up. Bugs caught: a decoder or model exception escaping
    as a 500 or killing the model thread, a bomb decoded, a body read past max_body_mb, a failure spilling into
    other requests of the same batch."""
    server = ThreadServer(run, max_batch=8, max_wait_ms=20, max_body_mb=0.05, max_pixels=10_000)
    try:
        bad = bad_requests(tmp_path)
        good = list(files)[:8]

        async def send_all():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                jobs = [
                    http.post("/predict", **({**kw, "content": chunks(kw["content"])} if _chunked(kw) else kw))
                    for _, kw, _, _ in bad
                ]
                jobs += [
                    http.post("/predict?topk=10", content=p.read_bytes(), headers={"content-type": "image/png"})
                    for p in good
                ]
                return await asyncio.gather(*jobs)

        answers = asyncio.run(send_all())
        for (what, _, status, kind), r in zip(bad, answers):
            body = r.json()
            assert (r.status_code, body["kind"]) == (status, kind), (what, r.text)
            assert body["error"] and "\n" not in body["error"] and "\n" not in r.text.strip(), what
        for p, r in zip(good, answers[len(bad) :]):
            assert r.status_code == 200, r.text
            same_as_predict(r.json()["predictions"][0], files[p])
        mixed = post(server.url, files=[("image", ("good.png", good[0].read_bytes())), ("image", ("bad.png", b"nope"))])
        assert mixed.status_code == 200  # one answered: per-image entries, the bad one with its error
        assert [("top" in e, e.get("kind")) for e in mixed.json()["predictions"]] == [
            (True, None),
            (False, "bad_image"),
        ]
        assert httpx.get(server.url + "/predict").status_code == 405
        m = server.metrics()
        assert metric(m, "torchsprint_serve_requests_total", '{code="500"}') == 0
        assert httpx.get(server.url + "/health").json() == {"status": "alive"}
    finally:
        server.close()


def test_token_is_required_where_it_guards_and_the_api_is_described(run, files):
    """serve.token: /predict and /metrics answer 401 (WWW-Authenticate: Bearer) without it or with a wrong one;
    /health, /ready, the page and the OpenAPI page stay open (probes and people). Bug caught: an open endpoint
    when a token is set, or a probe locked out."""
    server = ThreadServer(run, token="s3cret")
    try:
        p = next(iter(files))
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = post(server.url, p, headers={"content-type": "image/png", **headers})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(server.url + "/metrics").status_code == 401
        ok = post(server.url, p, headers={"content-type": "image/png", "authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()["predictions"][0]["top"]) == 7  # serve.topk of the run
        assert server.metric("torchsprint_serve_errors_total", '{kind="unauthorized"}') == 4
        for path in ("/health", "/ready", "/", "/docs"):
            assert httpx.get(server.url + path).status_code == 200, path
        assert 'id="token-row" >' in httpx.get(server.url + "/").text  # the page asks for the token
        api = httpx.get(server.url + "/openapi.json").json()
        assert {"/predict", "/health", "/ready", "/metrics"} <= set(api["paths"])
        assert "multipart/form-data" in api["paths"]["/predict"]["post"]["requestBody"]["content"]
    finally:
        server.close()


def test_onnxruntime_answers_equal_predict_on_onnx(run, files):
    """serve.runtime=onnxruntime on a run folder (exported once) equals predict --backend onnx. Bug caught: the
    runtime setting ignored, or the ONNX path given another preprocessing."""
    paths = list(files)[:4] + [p for p in files if p.name == "cmyk.jpg"]
    ref = Predictor.from_run(run, backend="onnx").predict([str(p) for p in paths], topk=10)
    server = ThreadServer(run, runtime="onnxruntime")
    try:
        assert hasattr(server.served.predictor.forward, "session")  # onnxruntime runs it
        for p, r in zip(paths, ref):
            answer = post(server.url, p, params={"topk": 10}).json()["predictions"][0]
            same_as_predict(answer, {t["class"]: t["prob"] for t in r["top"]})
    finally:
        server.close()


def test_an_exported_file_is_served_with_the_settings_it_carries(run, files, tmp_path, capsys):
    """A .safetensors file from `torchsprint export` (no run folder): answers equal predict's on the run, and the
    serve section inside the file applies (serve.topk=7). Bug caught: MODEL_FILE refused or read without its
    config; its serve settings lost on export."""
    from torchsprint.commands.export import export

    path = Path(export(run, "safetensors", out=tmp_path / "model.safetensors")["path"])
    server = ThreadServer(path)
    try:
        for p in list(files)[:3]:
            answer = post(server.url, p).json()["predictions"][0]
            same_as_predict(answer, _top(files[p], 7))
    finally:
        server.close()
    assert cli.main(["serve", str(path), "--runtime", "onnxruntime", "--port", "0"]) == 2
    assert "a .safetensors file runs on torch" in capsys.readouterr().err


def test_short_soak_mix_has_no_5xx_and_no_lost_request(run, files):
    """A few seconds of benchmarks/serve/serve_load.py's soak mix (concurrency 64, 5% bad requests). Bugs caught: a 5xx
    or a dropped connection under load, a bad request answered 200 or a good one refused."""
    # the repository root is on sys.path (pyproject.toml's pytest pythonpath)
    from benchmarks.serve.serve_load import soak

    server = ThreadServer(run)
    try:
        images = [p.read_bytes() for p in list(files)[:24]]
        out = asyncio.run(soak(server.url, images, "image/png", 3.0, concurrency=64, pid=os.getpid(), windows=3))
        assert out["requests"] >= 64 and out["bad_sent"] > 0, out  # every client answered at least once
        assert (out["5xx"], out["no_answer"], out["wrong_status"]) == (0, 0, 0), out
    finally:
        server.close()


def test_the_long_lived_objects_are_frozen_out_of_the_collector_while_serving(run, files):
    """A full cyclic collection walked the ~370,000 objects of torch, FastAPI and the model (177 ms on this project's
    2-core VM: the p99 tail under load); the server freezes them once warm and gives them back when it stops. Bugs
    caught: the freeze missing or done before the warm-up's objects exist, requests' garbage never collected
    (freezing per request), the objects left frozen after stop."""
    import gc

    server = ThreadServer(run)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 100_000, frozen  # torch alone is more than that
        for path in list(files)[:8]:
            assert post(server.url, path).status_code == 200
        assert gc.get_freeze_count() <= frozen  # requests are not frozen (frozen objects still die by refcount)
    finally:
        server.close()
    assert gc.get_freeze_count() == 0


def test_a_lone_request_runs_on_the_model_thread_while_health_answers(run, files):
    """A request alone on an idle server is decoded and run by the model thread itself (Batcher.put_if_idle: two
    threads, not three), counted by torchsprint_serve_lone_images_total; while its forward pass runs (held here by
    a forward that waits for the test's event: no timing), /health and /ready answer. Bugs caught: a forward pass
    (or a decode) on the event loop (serve_engine's former run_lone: a 6000x6000 PNG of 35 KB held /health for
    over 10 minutes), the lone path never taken (the decode pool's extra hop), a lone answer that differs from
    predict's."""
    server = ThreadServer(run)
    predictor = server.served.predictor
    forward, entered, release, threads = predictor.forward, threading.Event(), threading.Event(), []

    def held(x):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(120), "the test never released the forward"
        return forward(x)

    try:
        p = next(p for p in files if p.suffix == ".png")
        predictor.forward = held
        box = in_background(post, server.url, p)
        assert entered.wait(60), "the forward never started"
        try:
            assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "alive"}
            assert httpx.get(server.url + "/ready", timeout=30).status_code == 200
        finally:
            release.set()
        r = result(box)
        assert r.status_code == 200, r.text
        same_as_predict(r.json()["predictions"][0], _top(files[p], 7))
        assert threads == ["torchsprint-serve-model"]
        m = server.metrics()
        assert metric(m, "torchsprint_serve_lone_images_total") == 1
        assert metric(m, "torchsprint_serve_batch_size_count") == 1
    finally:
        predictor.forward = forward
        server.close()


def serve_process(run: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m torchsprint serve RUN --port 0 ...` with this tree's torchsprint; (process, URL)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchsprint", "serve", str(run), *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert " on http://127.0.0.1:" in line, line + proc.stdout.read()
    url = "http://" + line.split("http://")[1].split()[0]
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return proc, url


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_sigterm_stops_accepting_answers_what_was_accepted_and_exits_0(run, files, gate):
    """The CLI under SIGTERM with three requests accepted (one in the model, two queued): new connections are
    refused, the three are answered exactly, the process exits 0. Bugs caught: accepted requests cut off, exit by
    the signal (uvicorn re-raises it) instead of 0, a server that keeps accepting while it drains."""
    proc, url = serve_process(run, "serve.max_wait_ms=0", "--max-batch", "1", env=fault_env({}, serve_gate=str(gate)))
    try:
        wait_until(lambda: _ready(proc, url), 120, "ready")
        paths = list(files)[:3]
        boxes = [in_background(post, url, p) for p in paths]
        wait_until(
            lambda: (
                (m := httpx.get(url + "/metrics").text)
                and metric(m, "torchsprint_serve_in_flight") == 3
                and metric(m, "torchsprint_serve_in_model") == 1
                and metric(m, "torchsprint_serve_queue_depth") == 2
            ),
            what="three requests accepted",
        )
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not listening(url), 60, "the listening socket closed")
        gate.touch()
        for p, box in zip(paths, boxes):
            r = result(box)
            assert r.status_code == 200, r.text
            same_as_predict(r.json()["predictions"][0], _top(files[p], 7))
        assert proc.wait(60) == 0
    finally:
        proc.kill()


def _ready(proc: subprocess.Popen, url: str) -> bool:
    assert proc.poll() is None, f"the server exited with {proc.returncode}"
    return listening(url) and httpx.get(url + "/ready").status_code == 200


def test_settings_come_from_the_run_a_file_overrides_and_flags(run, tmp_path, monkeypatch):
    """Precedence: the run's saved serve section < -c FILE < serve.KEY=VALUE < flags; the token from
    TORCHSPRINT_SERVE_TOKEN unless given; every flag sets its serve.* field; 127.0.0.1 unless told otherwise.
    Bug caught: a flag or a layer ignored (e.g. the run's own serve section), an exposed default address."""
    from torchsprint.commands.serve import FLAGS, bind, resolve_settings
    from torchsprint.config.serve import ServeConfig

    monkeypatch.delenv("TORCHSPRINT_SERVE_TOKEN", raising=False)
    cfg = resolve_settings(run, None, [], {})
    assert (cfg.topk, cfg.host, cfg.token) == (7, "127.0.0.1", None)
    sock = bind(cfg.host, 0)
    assert sock.getsockname()[0] == "127.0.0.1"
    sock.close()
    conf = tmp_path / "serve.yaml"
    conf.write_text("serve: {topk: 3, max_batch: 16}\n")
    assert (resolve_settings(run, str(conf), [], {}).topk, resolve_settings(run, str(conf), [], {}).max_batch) == (
        3,
        16,
    )
    assert resolve_settings(run, str(conf), ["serve.topk=2"], {}).topk == 2
    assert resolve_settings(run, str(conf), ["serve.topk=2"], {"topk": 4}).topk == 4
    monkeypatch.setenv("TORCHSPRINT_SERVE_TOKEN", "from-env")
    assert resolve_settings(run, None, [], {}).token == "from-env"
    assert resolve_settings(run, None, [], {"token": "flag"}).token == "flag"
    values = {
        "host": "0.0.0.0",
        "port": "9999",
        "max_batch": "5",
        "max_wait_ms": "7.5",
        "queue_limit": "9",
        "timeout_s": "3",
        "workers": "2",
        "runtime": "onnxruntime",
        "device": "cpu",
        "token": "t",
        "max_body_mb": "2",
        "max_pixels": "1234",
        "max_model_pixels": "5000",
        "topk": "3",
        "buckets": "off",
        "precision": "fp32",
    }
    assert set(values) == set(FLAGS) == set(ServeConfig.model_fields)
    assert resolve_settings(run, None, ["serve.max_model_pixels=5000"], {}).max_model_pixels == 5000
    assert cli.build_parser().parse_args(["serve", str(run), "--max-model-pixels", "auto"]).max_model_pixels == "auto"
    args = cli.build_parser().parse_args(
        ["serve", str(run), *[x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", v)]]
    )
    got = resolve_settings(run, None, [], {k: getattr(args, k) for k in FLAGS}).model_dump()
    assert {k: str(v) for k, v in got.items() if k in FLAGS} == {
        **values,
        "max_wait_ms": "7.5",
        "timeout_s": "3.0",
        "max_body_mb": "2.0",
    }


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["serve", "{tmp}/missing"], {}, "no such run folder"),
        (["serve", "{run}", "--port", "{busy}"], {}, "cannot listen on 127.0.0.1:"),
        (["serve", "{run}", "--token", ""], {}, "serve.token"),
        (["serve", "{run}"], {"TORCHSPRINT_SERVE_TOKEN": ""}, "TORCHSPRINT_SERVE_TOKEN is set but empty"),
        (["serve", "{run}", "serve.prot=1"], {}, "Did you mean: serve.port"),
        (["serve", "{run}", "run.epochs=3"], {}, "serve.KEY=VALUE overrides only"),
        (["serve", "{run}", "--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, "no CUDA device"),
        (["serve", "{tmp}/model.txt"], {}, "serve takes a run folder, a .onnx or a .safetensors"),
    ],
)
def test_bad_settings_are_one_line_errors(run, tmp_path, capsys, monkeypatch, argv, env, message):
    """Bug caught: a traceback (or a server that starts) instead of `error: ...` and exit 2."""
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: serve.device=cuda is valid here")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "model.txt").write_text("x")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = {"tmp": str(tmp_path), "run": str(run), "busy": str(busy.getsockname()[1])}
        assert cli.main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


@pytest.mark.slow
def test_workers_share_the_port_and_metrics_add_up(run, files):
    """serve.workers=2: two worker processes, each with its model, both answering; /metrics sums them. Bug caught:
    workers>1 ignored or metrics of one process only."""
    proc, url = serve_process(run, "--workers", "2")
    try:
        wait_until(lambda: _ready(proc, url), 180, "ready")
        children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
        assert len(children) >= 2, children
        for p in list(files)[:20]:  # new connections: the kernel spreads them over both workers
            assert (
                httpx.post(url + "/predict", content=p.read_bytes(), headers={"content-type": "image/png"}).status_code
                == 200
            )
        assert metric(httpx.get(url + "/metrics").text, "torchsprint_serve_images_total") == 20
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        proc.kill()


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_every_response_of_the_page_is_self_contained(run):
    """The page fetches nothing from elsewhere (no http(s) URL, no external script). Bug caught: a CDN script."""
    from torchsprint.commands.serve_page import page_html

    text = page_html("<run>", 5, False)
    assert "http://" not in text and "https://" not in text and "&lt;run&gt;" in text
    assert json.dumps(5) in text

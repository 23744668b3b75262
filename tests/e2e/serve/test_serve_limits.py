"""What one request may cost `torchsprint serve` (commands/serve_limits.py), and what the server says at start-up:
real servers on 127.0.0.1 (the CLI in its own process, or serve_helpers.ThreadServer) of real trained runs, real
HTTP, real onnxruntime. The model thread is held with the serve_gate fault (tests/faults/sitecustomize.py),
never timed: every bound below is one that a stalled server blows by minutes."""

from __future__ import annotations

import json
import shutil
import signal
import socket
from pathlib import Path

import httpx
import pytest

from fault_env import fault_env, faults
from serve_helpers import (
    CliServer,
    ThreadServer,
    digit_images,
    encode,
    in_background,
    large_png,
    listening,
    metric,
    result,
    wait_until,
)
from torchsprint import cli

TOKEN_ENV = "TORCHSPRINT_SERVE_TOKEN"
PNG = {"content-type": "image/png"}
# The issue's file: 6000x6000 pixels in 35 KB, under serve.max_pixels' 40 M. The default small_cnn took 19.4 GB on it.
BIG = (6000, 6000)


def predict_post(url: str, body: bytes, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/predict", content=body, headers=PNG, timeout=timeout)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_large_png_of_few_bytes_is_refused_before_it_costs_and_sigterm_still_ends_the_server(serve_run, tmp_path):
    """A keep-size run (digits: data.eval.transforms keeps each file's size, trained on 8x8): the 35 KB 6000x6000 PNG
    is refused with a one-line 422 (too_many_pixels) naming its size and serve.max_model_pixels' auto limit, whether
    it comes alone (the model thread reads it) or while the model thread holds another request; the server's peak
    memory stays far below the gigabytes its forward pass would take; /health answers meanwhile; SIGTERM then ends
    the server with 0 once the held request is answered. Bugs caught: a model input bounded only by serve.max_pixels
    (the 36 Mpx forward: 19.4 GB, /health unanswered for minutes), a decode or forward on the event loop, a refusal
    that is not one line or does not say the limit, a server that SIGTERM does not end."""
    gate = tmp_path / "gate"
    gate.touch()  # forwards run freely until the test holds them
    server = CliServer(serve_run, env=fault_env({}, serve_gate=str(gate)), drop_env=(TOKEN_ENV,))
    try:
        big = large_png(*BIG)
        assert len(big) < 64 * 1024
        for _ in range(2):  # twice: the second time the model thread is warm and the image still alone
            r = predict_post(server.url, big)
            assert r.status_code == 422, r.text
            body = r.json()
            assert body["kind"] == "too_many_pixels" and "\n" not in body["error"], body
            assert "6000x6000" in body["error"] and "serve.max_model_pixels=262,144" in body["error"], body
        assert server.peak_rss_mb() < 2048, server.peak_rss_mb()
        limits = next(x for x in server.lines if x.startswith("limits: "))
        assert "serve.max_model_pixels=262,144" in limits and "serve.max_pixels=40,000,000" in limits, limits

        gate.unlink()  # the next forward waits for the gate: the model thread holds a request
        digit = encode(digit_images(1)[0], "PNG")
        held = in_background(predict_post, server.url, digit)
        wait_until(
            lambda: metric(httpx.get(server.url + "/metrics", timeout=30).text, "torchsprint_serve_in_model") == 1,
            what="a digit held in the model",
        )
        assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "alive"}
        r = predict_post(server.url, big, timeout=30)  # decoded (its header) by the pool while the model is held
        assert r.status_code == 422 and r.json()["kind"] == "too_many_pixels", r.text
        assert server.peak_rss_mb() < 2048, server.peak_rss_mb()

        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not listening(server.url), 60, "the listening socket closed")
        gate.touch()
        assert result(held).status_code == 200
        assert server.proc.wait(60) == 0
    finally:
        server.close()


def test_a_batch_never_holds_more_pixels_than_the_limit_and_larger_images_are_refused(serve_run, tmp_path, monkeypatch):
    """serve.max_model_pixels=150 on the keep-size digits run (8x8 = 64 pixels an image), max_batch=8: behind a held
    batch, the other digits wait, and every forward pass takes at most two of them (128 <= 150 < 192); a 16x16 image
    (256 pixels) is refused with a one-line 422 naming its size and the limit; the answers equal predict's. Bugs
    caught: a batch of same-shape images stacked up to max_batch whatever their size (32 big images in one
    forward), the setting accepted and ignored, a warm-up that stops at its own 32x32 image."""
    from torchsprint.commands.predict import Predictor

    gate = tmp_path / "gate"
    faults().serve_gate(str(gate), patch=monkeypatch.setattr)
    digits = [encode(a, "PNG") for a in digit_images(6)]
    paths = []
    for i, data in enumerate(digits):
        paths.append(tmp_path / f"d{i}.png")
        paths[-1].write_bytes(data)
    expected = [
        {t["class"]: t["prob"] for t in r["top"]}
        for r in Predictor.from_run(serve_run).predict([str(p) for p in paths], topk=10)
    ]
    server = ThreadServer(serve_run, max_batch=8, max_wait_ms=50, max_model_pixels=150)
    try:
        assert "stopped" not in httpx.get(server.url + "/ready", timeout=30).json()["warm_up"]
        r = predict_post(server.url, encode(digit_images(1)[0].repeat(2, 0).repeat(2, 1), "PNG"))
        assert r.status_code == 422 and r.json()["kind"] == "too_many_pixels", r.text
        assert "16x16" in r.json()["error"] and "serve.max_model_pixels=150" in r.json()["error"], r.text
        boxes = [
            in_background(lambda d=d: httpx.post(server.url + "/predict?topk=10", content=d, headers=PNG, timeout=120))
            for d in digits
        ]
        # The held batch holds one digit or two (two arrive within max_wait_ms on a loaded machine): either way
        # all six are in, the rest waiting behind it.
        wait_until(
            lambda: (
                (m := server.metrics())
                and 1 <= metric(m, "torchsprint_serve_in_model") <= 2
                and metric(m, "torchsprint_serve_in_model") + metric(m, "torchsprint_serve_waiting") == 6
            ),
            what="one or two digits held, the rest waiting",
        )
        gate.touch()
        for box, want in zip(boxes, expected):
            r = result(box)
            assert r.status_code == 200, r.text
            got = {t["class"]: t["prob"] for t in r.json()["predictions"][0]["top"]}
            assert max(abs(got[c] - want[c]) for c in want) <= 1e-6
        m = server.metrics()
        assert metric(m, "torchsprint_serve_batch_size_sum") == 6
        assert metric(m, "torchsprint_serve_batch_size_bucket", '{le="2.0"}') == metric(
            m, "torchsprint_serve_batch_size_count"
        )  # no forward of more than two
    finally:
        server.close()


def rewrite_metadata(source: Path, out: Path, **entries: str) -> Path:
    """A copy of a torchsprint .safetensors file with some metadata entries replaced (as a damaged or hand-edited
    file would have them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(source), "pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    save_file(tensors, str(out), metadata={**meta, **entries})
    return out


@pytest.fixture(scope="module")
def exported(serve_run, tmp_path_factory) -> Path:
    from torchsprint.commands.export import export

    return Path(export(serve_run, "safetensors", out=tmp_path_factory.mktemp("exported") / "m.safetensors")["path"])


def test_max_model_pixels_auto_follows_the_run_and_a_fixed_eval_size_is_not_undercut(
    serve_run, exported, tmp_path, capsys
):
    """auto: 4x the largest training image the run's decisions.json records, at least 512x512 (the digits run:
    262,144; a copy of it whose record says 400x300: 480,000); an eval spec that fixes the size (resize: [12, 12])
    bounds the model input itself, and a serve.max_model_pixels below it is refused at start-up in one line. Bugs
    caught: auto not read from the run, a setting accepted and ignored (every image refused, or the limit not
    applied), a traceback."""
    from torchsprint.commands.serve import load_predictor, resolve_settings
    from torchsprint.commands.serve_limits import resolve_limits

    def limits(target: Path, *overrides: str):
        cfg = resolve_settings(target, None, list(overrides), {})
        return resolve_limits(cfg, load_predictor(target, cfg), target)

    got = limits(serve_run)
    assert (got.model_pixels, got.fixed, got.batch_pixels) == (262_144, None, 262_144)
    assert "8x8" in got.why and "512x512" in got.why
    bigger = tmp_path / "run"
    shutil.copytree(serve_run, bigger, ignore=shutil.ignore_patterns(".lock"))
    decisions = json.loads((bigger / "decisions.json").read_text())
    decisions["image_size"]["max"] = [300, 400]
    (bigger / "decisions.json").write_text(json.dumps(decisions))
    assert limits(bigger).model_pixels == 480_000 and "400x300" in limits(bigger).why
    assert limits(bigger, "serve.max_model_pixels=5000").model_pixels == 5000

    from safetensors import safe_open

    with safe_open(str(exported), "pt") as f:
        config = json.loads(f.metadata()["config"])
    config["data"]["eval"]["transforms"] = [{"resize": [12, 12]}]
    fixed = rewrite_metadata(
        exported,
        tmp_path / "fixed.safetensors",
        config=json.dumps(config),
        eval_transforms=json.dumps([{"resize": [12, 12]}]),
    )
    got = limits(fixed)
    assert (got.fixed, got.model_pixels, got.batch_pixels) == ((12, 12), 144, 32 * 144)
    assert limits(fixed, "serve.max_model_pixels=144").model_pixels == 144
    assert cli.main(["serve", str(fixed), "serve.max_model_pixels=100", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "serve.max_model_pixels=100" in err and "12x12" in err, err


def test_serve_of_a_safetensors_whose_config_is_not_json_is_predicts_one_line(serve_run, exported, tmp_path, capsys):
    """A .safetensors file whose metadata `config` is not JSON: `serve` exits 2 with the very line `predict` gives,
    before it binds its port (a port in use is not what it reports). Bugs caught: a JSONDecodeError traceback from
    serve's reading of the file's serve section, the port bound (or a model loaded) before the file is checked."""
    bad = rewrite_metadata(exported, tmp_path / "bad.safetensors", config="{not json")
    image = tmp_path / "d.png"
    image.write_bytes(encode(digit_images(1)[0], "PNG"))
    assert cli.main(["predict", "-r", str(bad), str(image)]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: ") and "'config' is not valid JSON" in said, said
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert cli.main(["serve", str(bad), "--port", str(busy.getsockname()[1])]) == 2
    assert capsys.readouterr().err.strip() == said


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_host_other_than_loopback_without_a_token_warns_at_start_up(serve_run):
    """--host 0.0.0.0 and no token: one warning line at start-up (anyone who can reach the machine can use the model;
    serve.token / TORCHSPRINT_SERVE_TOKEN), and the server serves (a warning, not a refusal). 127.0.0.1, ::1 or a
    token: no warning. Bug caught: the model exposed to the network without a word."""
    from torchsprint.commands.serve import exposure_warning

    server = CliServer(serve_run, "--host", "0.0.0.0", drop_env=(TOKEN_ENV,))
    try:
        warnings = [x for x in server.lines if x.startswith("warning: ")]
        assert len(warnings) == 1, server.lines
        assert all(w in warnings[0] for w in ("0.0.0.0", "serve.token", TOKEN_ENV)), warnings
        assert predict_post(server.url, encode(digit_images(1)[0], "PNG")).status_code == 200
    finally:
        server.close()
    assert exposure_warning("192.168.1.7", None) is not None
    assert [exposure_warning(a, t) for a, t in (("127.0.0.1", None), ("::1", None), ("0.0.0.0", "s3cret"))] == [
        None
    ] * 3


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_onnxruntime_says_its_fixed_input_size_at_start_up_and_refuses_another_in_predicts_line(serve_run, tmp_path):
    """serve --runtime onnxruntime of the keep-size digits run: the exported graph takes 8x8 only, so the start-up
    says so (the size, and which images will be refused where the torch runtime answers them); a 10x12 image gets
    a one-line 422 (model_refused), the same line `predict --backend onnx` gives that file; an 8x8 one is answered.
    Bugs caught: the torch and ONNX runtimes of one run refusing different files without a word, onnxruntime's
    exception text as the refusal, the check made in two places that disagree."""
    from torchsprint.commands.predict import Predictor

    wide = tmp_path / "wide.png"
    wide.write_bytes(encode(digit_images(1)[0].repeat(2, 0).repeat(2, 1)[:10, :12], "PNG"))
    row = Predictor.from_run(serve_run, backend="onnx").predict([str(wide)])[0]
    assert "top" not in row and "1x8x8" in row["error"], row
    server = CliServer(serve_run, "--runtime", "onnxruntime", drop_env=(TOKEN_ENV,))
    try:
        notes = [x for x in server.lines if "onnx" in x.lower() and "8x8" in x and "refused" in x]
        assert len(notes) == 1, server.lines
        r = predict_post(server.url, wide.read_bytes())
        assert r.status_code == 422 and (r.json()["error"], r.json()["kind"]) == (row["error"], "model_refused"), r.text
        assert predict_post(server.url, encode(digit_images(1)[0], "PNG")).status_code == 200
    finally:
        server.close()


@pytest.mark.parametrize(
    "spec",
    [
        [],
        ["hflip"],
        [{"resize": 16}],
        [{"resize": {"size": 16, "max_size": 20}}, "hflip"],
        [{"resize": 12}, {"center_crop": 8}],
        [{"resize": [6, 9]}],
    ],
)
def test_the_model_input_size_read_from_a_header_is_what_the_eval_spec_makes(spec):
    """Limits.model_size (what serve refuses from a file's header, before decoding) against the compiled eval spec's
    real output for files of several shapes. Bug caught: a rule that differs from torchvision's resize (an image
    refused that the model could take, or a large one let through to the decode)."""
    import torch

    from torchsprint.commands.serve_limits import Limits
    from torchsprint.data.preprocess.transforms import compile_spec

    pipe = compile_spec(spec, "data.eval.transforms", 1)
    limits = Limits(10**9, pipe.out_size, 10**9, 10**9, "test", tuple(pipe.steps))
    for h, w in ((30, 20), (20, 30), (7, 50), (16, 16)):
        image = torch.zeros(1, h, w, dtype=torch.uint8)
        out = pipe.cpu(image) if pipe.cpu is not None else image
        assert limits.model_size(h, w) == tuple(out.shape[-2:]), (spec, h, w)

"""Helpers of tests/e2e/serve/test_serve*.py: a real uvicorn server of a run in a thread of the test process, its
/metrics read back, the images the tests send (distinct digits, and files predict decodes in its own ways)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

# |serve - predict| of any probability: measured 4.5e-8 over batches of 1-32 (padded to powers of two or not) and 1
# or 2 torch threads, against predict's batch of 64 (the digits small_cnn, AMD EPYC;
# benchmarks/numerics/serve_tolerance.py). Two different images' probability vectors differ by >= 4e-3 there: an answer
# swapped between requests fails.
TOL = 1e-6
REPO = Path(__file__).resolve().parents[1]


class ThreadServer:
    """`torchsprint serve`'s app (commands/serve_app.py) on a real uvicorn, listening on 127.0.0.1 at a free port, in
    a thread; the same objects serve_cli builds (settings, Predictor, bind, uvicorn config). `settings`: serve.*
    values, applied as the flags are."""

    def __init__(self, run: Path, **settings):
        import uvicorn

        from torchsprint.commands.serve import bind, load_predictor, resolve_settings, uvicorn_config
        from torchsprint.commands.serve_app import Metrics, Served, build_app

        cfg = resolve_settings(Path(run), None, [], {"port": 0, **settings})  # as flags: over the run's serve section
        self.served = Served(cfg, load_predictor(Path(run), cfg), str(run), Metrics(cfg.max_batch))
        sock = bind(cfg.host, 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(build_app(self.served), cfg))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: get(self.url + "/ready") == 200, 120, "the server never became ready")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", headers=self.auth(), timeout=30).text

    def metric(self, name: str, labels: str = "") -> float:
        return metric(self.metrics(), name, labels)

    def auth(self) -> dict:
        token = self.served.cfg.token
        return {"authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


def get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return None


def metric(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (0 when absent): metric(text, "torchsprint_serve_errors_total",
    '{kind="timeout"}')."""
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(condition, timeout: float = 60, what: str = "condition") -> None:
    """Poll `condition` (an event the test waits for, never a fixed sleep) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.02)


def listening(url: str) -> bool:
    """Whether something accepts TCP connections at `url`'s host and port (http://HOST:PORT)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return True
    except OSError:
        return False


def in_background(fn, *args, **kw) -> dict:
    """Run fn in a thread; the returned dict gets "result" (or "error") when it ends."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - reported by the test that reads the box
            box["error"] = e

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def result(box: dict, timeout: float = 60):
    box["thread"].join(timeout)
    assert "result" in box, box.get("error", "still running")
    return box["result"]


class CliServer:
    """`python -m torchsprint serve TARGET ARGS --port 0` with this tree's torchsprint, in its own process: every line
    it prints kept in `lines` (stdout and stderr), `url` on 127.0.0.1 (whatever --host), ready once built."""

    def __init__(self, target: Path, *args: str, env: dict | None = None, drop_env: tuple = ()):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
        for name in drop_env:
            env.pop(name, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchsprint", "serve", str(target), *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self.serving() is not None or self.proc.poll() is not None, 180, "the serving line")
        line = self.serving()
        assert line is not None, "\n".join(self.lines)
        self.url = "http://127.0.0.1:" + line.split("http://")[1].split()[0].rsplit(":", 1)[1]
        wait_until(lambda: self.up() and get(self.url + "/ready") == 200, 120, "ready")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def serving(self) -> str | None:
        return next((x for x in list(self.lines) if x.startswith("serving ") and " on http://" in x), None)

    def up(self) -> bool:
        assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}: " + "\n".join(self.lines)
        return get(self.url + "/health") == 200

    def peak_rss_mb(self) -> float:
        """The server process's peak resident memory so far (VmHWM), MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) / 1024

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(60)


def large_png(width: int, height: int) -> bytes:
    """A grey PNG of width x height zeros: millions of pixels in a few KB (6000x6000: ~35 KB)."""
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def encode(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def digit_images(n: int) -> list[np.ndarray]:
    """n distinct 8x8 uint8 digits (scikit-learn's, scaled to 0-255): the default run's own kind of image."""
    from sklearn.datasets import load_digits

    return [(img * 255 / 16).round().astype(np.uint8) for img in load_digits().images[:n]]


def unusual_files(folder: Path) -> list[Path]:
    """Files that predict decodes its own way (each must come back from serve exactly as predict reads it):
    RGB and CMYK JPEGs (to grey), a 16-bit PNG (the top byte), a grey+alpha PNG, an EXIF-rotated JPEG (turned
    upright: 6x8 -> 8x6), a BMP (Pillow) and a larger PNG (its own batch shape)."""
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    rgb = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    files = {
        "rgb.jpg": encode(rgb, "JPEG", quality=95),
        "cmyk.jpg": _cmyk(rng),
        "grey16.png": encode(rng.integers(0, 65536, (8, 8), dtype=np.uint16), "PNG"),
        "grey_alpha.png": _grey_alpha(rng),
        "rotated.jpg": _rotated(rng),
        "bmp.bmp": encode(rng.integers(0, 256, (8, 8), dtype=np.uint8), "BMP"),
        "big.png": encode(rng.integers(0, 256, (12, 10), dtype=np.uint8), "PNG"),
    }
    if Image.open(io.BytesIO(files["cmyk.jpg"])).mode != "CMYK":
        raise AssertionError("Pillow did not write a CMYK JPEG")
    paths = []
    for name, data in files.items():
        (folder / name).write_bytes(data)
        paths.append(folder / name)
    return paths


def _cmyk(rng) -> bytes:
    im = Image.frombytes("CMYK", (8, 8), rng.integers(0, 256, (8, 8, 4), dtype=np.uint8).tobytes())
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _grey_alpha(rng) -> bytes:
    im = Image.fromarray(rng.integers(0, 256, (8, 8, 2), dtype=np.uint8), "LA")
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _rotated(rng) -> bytes:
    im = Image.fromarray(rng.integers(0, 256, (6, 8), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue()

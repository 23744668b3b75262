"""Load test of `torchsprint serve` beside a hand-written FastAPI endpoint and LitServe, over loopback HTTP.

Cases: the digits small_cnn (8x8 grey PNGs) and a ResNet-18 at 224 (500x375 JPEGs, eval spec resize 256 +
center_crop 224), random weights (speed does not depend on them). Servers, each in its own process, one at a time:
  torchsprint  `torchsprint serve RUN` (dynamic batching, --max-batch/--max-wait-ms)
  fastapi      a hand-written FastAPI endpoint: one forward per request (in FastAPI's thread pool), the same model
               and preprocessing (torchsprint's decoder and eval spec)
  litserve     LitServe with its batching (max_batch_size, batch_timeout as above); requests are JSON with the image
               in base64, LitServe's usual way (its default handler parses JSON or form data, not a raw body)
Each server may carry a precision (`torchsprint:fp32`, `fastapi:bf16`): torchsprint without one runs its default
(serve.precision auto: bf16 on a CPU with native bf16, as the runs say they trained; see TRAINED), the baselines
fp32 (the model as loaded). The default list puts torchsprint's default and its fp32 beside the fp32 baselines.
The load generator (aiohttp: httpx's AsyncClient itself topped out near 100 requests/s at 32 connections here,
where aiohttp made 2,200; `concurrency` requests always in flight) runs in this process and shares
the machine's cores with the server: on a small machine it takes a share of them from every server alike.

    python -m benchmarks.serve.serve_load [--configs digits,resnet18]
        [--servers torchsprint,torchsprint:fp32,fastapi,litserve]
        [--concurrency 1,8,32,128] [--duration 10] [--rounds 1] [--device cpu] [--json out.json]
    python -m benchmarks.serve.serve_load --soak [SECONDS]   # torchsprint alone, concurrency 64, 5% bad requests

Soak: counts of 5xx (must be 0), requests without an answer (0), requests answered with the wrong status, the
server's RSS over time (growth after the warm-up share must stay under 5%) and p99 per time window; exit 1 if a
check fails. tests/e2e/serve/test_serve.py runs a few seconds of the same mix (`soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import io
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.child import REPO, child_env
from benchmarks.common.inference import make_images, make_run

MAX_BATCH, MAX_WAIT_MS = 32, 5.0  # the same batching settings for torchsprint and LitServe
# What `precision: auto` chose when training ResNet-18 on photos on a CPU with native bf16 (BENCHMARKS.md "precision
# auto: what the speed probe measured"): amp_bf16 in channels_last, as the ResNet-18 run's saved config says. `serve`
# (precision auto) then runs it in bf16 on such a CPU and in fp32 elsewhere; `torchsprint:fp32` forces fp32. The
# digits run says fp32: the default run is too short for the probe and trains in fp32.
TRAINED = ["precision=amp_bf16", "speed.channels_last=true"]


# ---------------------------------------------------------------- the cases and their images


def make_cases(tmp: Path, which: list[str]) -> dict:
    """{name: (run folder, [image bytes], content type)}: random-weight runs (common/inference.py's make_run)."""
    cases = {}
    if "digits" in which:
        run = make_run(tmp / "digits", "small_cnn", [], 1, 10)  # precision fp32: as the default run trains
        files = make_images(tmp / "png", 64, (8, 8), True, ".png")
        cases["digits small_cnn 8x8 PNG"] = (run, [Path(f).read_bytes() for f in files], "image/png")
    if "resnet18" in which:
        spec = [{"resize": 256}, {"center_crop": 224}, {"normalize": "imagenet"}]
        files = make_images(tmp / "jpg" / "c0", 32, (500, 375), False, ".jpg")
        run = make_run(
            tmp / "r18",
            "resnet18",
            spec,
            3,
            1000,
            ["data.dataset=image_folder", f"data.root={tmp / 'jpg'}", f"data.train.transforms={spec}", *TRAINED],
        )
        cases["resnet18 224 JPEG 500x375"] = (run, [Path(f).read_bytes() for f in files], "image/jpeg")
    return cases


def bad_requests() -> list[tuple[str, dict, bytes | dict]]:
    """(kind, headers, body or multipart files) of the requests a server must refuse with a 4xx."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    bomb = bytearray(png)
    bomb[16:24] = (100_000).to_bytes(4, "big") * 2  # IHDR says 100000x100000: refused from the header
    return [
        ("not an image", {"content-type": "image/png"}, b"hello, I am text"),
        ("truncated", {"content-type": "image/png"}, png[: len(png) // 2]),
        ("empty", {"content-type": "image/png"}, b""),
        ("wrong content type", {"content-type": "application/json"}, b'{"path": "/etc/passwd"}'),
        ("decompression bomb", {"content-type": "image/png"}, bytes(bomb)),
        ("wrong field", {}, {"file": ("a.png", png, "image/png")}),
    ]


# ---------------------------------------------------------------- the servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    entry: str, run: Path, device: str, log: Path, threads: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start one server process; (process, base URL) once its health check answers. `threads`: the baselines' torch
    threads (torchsprint measures its own)."""
    py = sys.executable
    kind, precision = server_kind(entry)
    if isinstance(threads, dict):  # torchsprint's choice per batch size: a batch of one for the one-per-request
        threads = threads["1" if kind == "fastapi" else str(MAX_BATCH)]  # endpoint, max_batch for LitServe's
    if kind == "torchsprint":
        cmd = [
            py,
            "-m",
            "torchsprint",
            "serve",
            str(run),
            "--port",
            "0",
            "--max-batch",
            str(MAX_BATCH),
            "--max-wait-ms",
            str(MAX_WAIT_MS),
            "--device",
            device,
            "--queue-limit",
            "1024",
            *(["--precision", precision] if precision else []),
        ]
        health = "/ready"
    else:
        port = free_port()
        cmd = [
            py,
            "-m",
            __spec__.name,
            f"--{kind}-server",
            str(run),
            "--port",
            str(port),
            "--device",
            device,
            "--precision",
            precision or "fp32",
            *(["--threads", str(threads)] if threads else []),
        ]
        health = "/health"
    out = open(log, "w")
    # Its own process group: LitServe's worker processes go down with it (stop_server signals the group), and so
    # does everything if this script dies (atexit); terminating the parent alone left LitServe's workers running.
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=child_env()
    )
    STARTED.append(proc)
    deadline = time.monotonic() + 300
    url = None
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited {proc.returncode}: {log.read_text()[-2000:]}")
        if url is None:
            m = re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text()) if kind == "torchsprint" else True
            url = f"http://127.0.0.1:{m.group(1) if kind == 'torchsprint' else port}" if m else None
        if url is not None:
            try:
                if httpx.get(url + health, timeout=2).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    stop_server(proc, sig=signal.SIGKILL)
    raise RuntimeError(f"{kind} server did not start: {log.read_text()[-2000:]}")


STARTED: list[subprocess.Popen] = []


def server_kind(entry: str) -> tuple[str, str | None]:
    """'torchsprint', 'fastapi:bf16' -> (server, precision or None). None: torchsprint's own default (auto); the
    baselines run fp32 then (a hand-written endpoint runs the model as loaded)."""
    kind, _, precision = entry.partition(":")
    if kind not in ("torchsprint", "fastapi", "litserve") or precision not in ("", "auto", "fp32", "bf16"):
        raise SystemExit(
            f"--servers {entry}: use torchsprint, fastapi or litserve, each optionally :fp32, :bf16 or :auto"
        )
    return kind, precision or None


def stop_server(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    """SIGTERM to the server's process group (its workers too), SIGKILL after 60 s; the server's exit code."""

    def group(s):
        try:
            os.killpg(proc.pid, s)
        except (ProcessLookupError, PermissionError):
            pass

    group(sig)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        group(signal.SIGKILL)
        code = proc.wait()
    group(signal.SIGKILL)  # any worker still alive after its parent exited
    return code


@atexit.register
def _stop_all() -> None:
    for proc in STARTED:
        if proc.poll() is None:
            stop_server(proc, sig=signal.SIGKILL)


def same_threads(threads: int | None) -> None:
    """The baselines run torch with the intra-op thread count torchsprint serve measured best for their batches (its
    /ready says, per batch size): the hand-written endpoint its batch-of-one count, LitServe its max_batch count. The
    comparison is of the serving, not of a thread setting."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def plain_server(run: str, port: int, device: str, threads: int | None, precision: str) -> None:
    """(a) The hand-written endpoint: read the body, preprocess, one forward per request, top-5."""
    import torch
    import uvicorn
    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from torchsprint.commands.predict import Predictor
    from torchsprint.commands.serve_decode import Decoder

    pred = Predictor.from_run(run, device=device, precision=precision)
    decoder = Decoder(pred, 40_000_000)
    app = FastAPI()

    def infer(data: bytes):
        same_threads(threads)  # per thread: OpenMP's count is a thread's own
        x = decoder.prepare(data, 5).image[None]
        with torch.inference_mode():
            return pred.task.postprocess(pred.logits(x), pred.classes, {"topk": 5})[0]

    async def health(request):
        return JSONResponse({"ok": True})

    async def predict(request):
        return JSONResponse({"predictions": [await run_in_threadpool(infer, await request.body())]})

    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/predict", predict, methods=["POST"])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


try:  # optional: `pip install litserve`; its API class must be at module level (LitServe pickles it to workers)
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:

    class LitImageAPI(ls.LitAPI):
        """(b) LitServe with its batching: decode in decode_request, stack in batch, one forward per batch."""

        def __init__(self, run: str, device: str, threads: int | None, precision: str, **kw):
            super().__init__(**kw)
            self.run, self.device_name, self.threads, self.precision = run, device, threads, precision

        def setup(self, dev):
            from torchsprint.commands.predict import Predictor
            from torchsprint.commands.serve_decode import Decoder

            self.pred = Predictor.from_run(self.run, device=self.device_name, precision=self.precision)
            self.decoder = Decoder(self.pred, 40_000_000)
            same_threads(self.threads)

        def decode_request(self, request):
            return self.decoder.prepare(base64.b64decode(request["image"]), 5).image

        def batch(self, inputs):
            import torch

            return torch.stack(inputs)

        def predict(self, x):
            return self.pred.logits(x)

        def unbatch(self, output):
            return list(output)

        def encode_response(self, row):
            return {"predictions": self.pred.task.postprocess(row[None], self.pred.classes, {"topk": 5})}


def litserve_server(run: str, port: int, device: str, threads: int | None, precision: str) -> None:
    if ls is None:
        raise SystemExit("LitServe is not installed: pip install litserve")
    api = LitImageAPI(run, device, threads, precision, max_batch_size=MAX_BATCH, batch_timeout=MAX_WAIT_MS / 1000)
    server = ls.LitServer(api, accelerator="cuda" if device.startswith("cuda") else "cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, generate_client_file=False, log_level="warning", num_api_servers=1)


# ---------------------------------------------------------------- the load


def request_of(kind: str, data: bytes, ctype: str) -> dict:
    """aiohttp request arguments for one image to this kind of server."""
    if kind == "litserve":
        return {"json": {"image": base64.b64encode(data).decode()}}
    return {"data": data, "headers": {"content-type": ctype}}


async def post(http, url: str, kw: dict) -> int:
    """POST one request (a multipart `files` entry becomes a fresh form) and read the answer; its status."""
    import aiohttp

    if "files" in kw:
        form = aiohttp.FormData()
        for name, (filename, data, ctype) in kw["files"].items():
            form.add_field(name, data, filename=filename, content_type=ctype)
        kw = {"data": form}
    async with http.post(url + "/predict", **kw) as r:
        await r.read()
        return r.status


def session(concurrency: int):
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency), timeout=aiohttp.ClientTimeout(total=120)
    )


def prime(url: str, requests: list[dict]) -> None:
    """A few sequential requests before measuring: a server's first decode and forward import and allocate
    (seconds); none of the servers should be timed on that."""
    import httpx

    with httpx.Client(timeout=300) as http:
        for kw in requests[:8]:
            http.post(url + "/predict", **{"content" if k == "data" else k: v for k, v in kw.items()})


def quiet_collector() -> None:
    """Freeze this process's long-lived objects (torch and PIL are imported here) out of the cyclic collector: a full
    collection over them stalls every client for a tenth of a second, a tail that would be charged to the server."""
    import gc

    gc.collect()
    gc.freeze()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def load(url: str, requests: list[dict], concurrency: int, seconds: float, warmup: float = 1.0) -> dict:
    """`concurrency` clients, each sending the next request as soon as its last is answered, for `seconds` after
    `warmup` seconds; requests/s, images/s, latency percentiles (ms) and statuses of the measured part."""
    import aiohttp

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    quiet_collector()
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def client(i: int, http) -> None:
        n = i
        while (now := time.perf_counter()) < end:
            kw = requests[n % len(requests)]
            n += concurrency
            try:
                code = str(await post(http, url, kw))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                code = type(e).__name__
            if now >= measure_from:
                latencies.append(time.perf_counter() - now)
                statuses[code] = statuses.get(code, 0) + 1

    async with session(concurrency) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    return summary(concurrency, latencies, statuses, seconds)


def summary(concurrency: int, latencies: list[float], statuses: dict[str, int], seconds: float) -> dict:
    """One level's figures from its measured requests (pooled over rounds: `seconds` is their total)."""
    ok = statuses.get("200", 0)
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "requests_per_s": len(latencies) / seconds,
        "images_per_s": ok / seconds,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p95_ms": 1000 * percentile(latencies, 95),
        "p99_ms": 1000 * percentile(latencies, 99),
        "statuses": statuses,
        "_latencies": latencies,
    }


def rss_mb(pid: int) -> float:
    """Resident memory of a process (MiB) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(
    url: str,
    images: list[bytes],
    ctype: str,
    seconds: float,
    concurrency: int = 64,
    bad_share: float = 0.05,
    pid: int | None = None,
    windows: int = 10,
) -> dict:
    """The soak mix: good images with `bad_share` of bad_requests() among them, `concurrency` in flight for
    `seconds`. Counts 5xx, requests without an answer, wrong statuses; RSS of `pid` each second; p99 per window."""
    import aiohttp

    bad = bad_requests()
    counts = {"requests": 0, "5xx": 0, "no_answer": 0, "wrong_status": 0, "bad_sent": 0}
    samples: list[tuple[float, float, bool]] = []  # (time from start, latency, good)
    rss: list[tuple[float, float]] = []
    quiet_collector()
    start = time.perf_counter()
    end = start + seconds

    async def client(i: int, http) -> None:
        n = i
        while (now := time.perf_counter()) < end:
            n += concurrency
            is_bad = (n * 0.618034) % 1 < bad_share  # a fixed, evenly spread share
            if is_bad:
                _, headers, body = bad[n % len(bad)]
                kw = {"files": body} if isinstance(body, dict) else {"data": body, "headers": headers}
                counts["bad_sent"] += 1
            else:
                kw = {"data": images[n % len(images)], "headers": {"content-type": ctype}}
            try:
                status = await post(http, url, kw)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                counts["no_answer"] += 1
                continue
            counts["requests"] += 1
            counts["5xx"] += status >= 500
            counts["wrong_status"] += (400 <= status < 500) != is_bad
            samples.append((now - start, time.perf_counter() - now, not is_bad))

    async def sample_rss() -> None:
        while pid is not None and time.perf_counter() < end:
            rss.append((time.perf_counter() - start, rss_mb(pid)))
            await asyncio.sleep(min(1.0, seconds / 20))

    async with session(concurrency) as http:
        await asyncio.gather(sample_rss(), *(client(i, http) for i in range(concurrency)))
    width = seconds / windows
    p99 = [
        1000 * percentile([lat for t, lat, good in samples if good and k * width <= t < (k + 1) * width], 99)
        for k in range(windows)
    ]
    after_warmup = [m for t, m in rss if t >= 0.2 * seconds]  # the first fifth is warm-up (allocator, caches)
    growth = (max(after_warmup) / after_warmup[0] - 1) if len(after_warmup) >= 2 else 0.0
    return {
        **counts,
        "seconds": seconds,
        "concurrency": concurrency,
        "p99_ms_per_window": p99,
        "rss_mb": [(round(t, 1), round(m, 1)) for t, m in rss],
        "rss_growth_after_warmup": growth,
        "ok": counts["5xx"] == 0 and counts["no_answer"] == 0 and counts["wrong_status"] == 0 and growth < 0.05,
    }


# ---------------------------------------------------------------- the report


def machine() -> dict:
    import torch

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else "?"
    )
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "git_revision": rev or "?",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": os.getloadavg(),
    }


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's goals per case and concurrency: torchsprint's throughput >= the better other, p99 <= theirs,
    and at concurrency 32 >= 2x the hand-written endpoint."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        for c in dict.fromkeys(r["concurrency"] for r in rows if r["case"] == case):
            at = {r["server"]: r for r in rows if r["case"] == case and r["concurrency"] == c}
            ours = at.get("torchsprint")
            others = [r for k, r in at.items() if not k.startswith("torchsprint") and r["images_per_s"] > 0]
            if ours is None or not others:
                continue
            best = max(others, key=lambda r: r["images_per_s"])
            line = (
                f"{case} c={c}: throughput {ours['images_per_s']:.0f} vs best other {best['images_per_s']:.0f} "
                f"({best['server']}) {'ok' if ours['images_per_s'] >= best['images_per_s'] else 'NOT MET'}; p99 "
                f"{ours['p99_ms']:.1f} vs {min(r['p99_ms'] for r in others):.1f} ms "
                f"{'ok' if ours['p99_ms'] <= min(r['p99_ms'] for r in others) else 'NOT MET'}"
            )
            if c == 32 and "fastapi" in at:
                x = ours["images_per_s"] / max(at["fastapi"]["images_per_s"], 1e-9)
                line += f"; {x:.2f}x the hand-written endpoint {'ok' if x >= 2 else 'NOT MET'}"
            out.append(line)
    return out


def compare(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    cases = make_cases(tmp, args.configs.split(","))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    print("| case | server | concurrency | requests/s | images/s | p50 ms | p95 ms | p99 ms | non-200 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, (run, images, ctype) in cases.items():
        if args.rounds > 1:
            rows += interleaved(args, case, run, images, ctype, levels, tmp)
            continue
        threads = None
        for entry in args.servers.split(","):
            proc, url, reqs, threads = start_primed(entry, run, images, ctype, args.device, tmp, threads)
            try:
                for c in levels:
                    r = asyncio.run(load(url, reqs, c, args.duration, args.warmup))
                    r.update(case=case, server=entry)
                    rows.append(r)
                    print_row(r)
            finally:
                stop_server(proc)
    for r in rows:
        r.pop("_latencies", None)
    lines = verdicts(rows)
    print("\n".join(lines))
    return {
        "rows": rows,
        "goals": lines,
        "settings": {
            "max_batch": MAX_BATCH,
            "max_wait_ms": MAX_WAIT_MS,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "device": args.device,
        },
    }


def start_primed(entry: str, run: Path, images: list[bytes], ctype: str, device: str, tmp: Path, threads):
    """Start one server of a case and prime it: (process, URL, its requests, the torch threads the baselines get:
    torchsprint's measured counts, read from its /ready, once the first torchsprint server is up)."""
    import httpx

    kind, _ = server_kind(entry)
    proc, url = start_server(entry, run, device, tmp / f"{entry.replace(':', '-')}.log", threads)
    if kind == "torchsprint":
        ready = httpx.get(url + "/ready").json()
        threads = threads or ready.get("torch_threads")
        print(f"<!-- {entry}: precision {ready.get('precision')}, torch threads {ready.get('torch_threads')} -->")
    reqs = [request_of(kind, data, ctype) for data in images]
    prime(url, reqs)
    return proc, url, reqs, threads


def print_row(r: dict) -> None:
    bad = sum(v for k, v in r["statuses"].items() if k != "200")
    print(
        f"| {r['case']} | {r['server']} | {r['concurrency']} | {r['requests_per_s']:.0f} | {r['images_per_s']:.0f} | "
        f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['p99_ms']:.1f} | {bad} |",
        flush=True,
    )


def interleaved(
    args, case: str, run: Path, images: list[bytes], ctype: str, levels: list[int], tmp: Path
) -> list[dict]:
    """--rounds N: every server of the case up at once; each round measures every level on every server in turn
    (args.duration / N seconds each), so that a slow spell of a shared machine falls on all servers alike rather
    than on whichever ran then. A level's figures pool its rounds' requests. Only the server being measured runs:
    the others are stopped (SIGSTOP to their process groups), since an idle LitServe polls its queues (13% of a
    core measured here; printed at the start)."""
    up, threads = {}, None
    try:
        for entry in args.servers.split(","):
            proc, url, reqs, threads = start_primed(entry, run, images, ctype, args.device, tmp, threads)
            up[entry] = (proc, url, reqs)
        idle = idle_cpu([proc.pid for proc, _, _ in up.values()], 3.0)
        print(
            f"<!-- idle CPU share of each server over 3 s (all up, none loaded): "
            f"{dict(zip(up, (round(x, 3) for x in idle)))}; each is stopped (SIGSTOP) while another is measured -->"
        )
        pooled: dict = {}
        seconds = args.duration / args.rounds
        for _ in range(args.rounds):
            for c in levels:
                for entry, (_, url, reqs) in up.items():
                    for other, (proc, _, _) in up.items():  # LitServe's workers poll their queues when idle
                        os.killpg(proc.pid, signal.SIGCONT if other == entry else signal.SIGSTOP)
                    r = asyncio.run(load(url, reqs, c, seconds, args.warmup))
                    p = pooled.setdefault((entry, c), {"latencies": [], "statuses": {}})
                    p["latencies"] += r["_latencies"]
                    for k, v in r["statuses"].items():
                        p["statuses"][k] = p["statuses"].get(k, 0) + v
    finally:
        for proc, _, _ in up.values():
            os.killpg(proc.pid, signal.SIGCONT)
            stop_server(proc)
    rows = []
    for (entry, c), p in pooled.items():
        rows.append(
            {
                **summary(c, p["latencies"], p["statuses"], args.duration),
                "case": case,
                "server": entry,
                "rounds": args.rounds,
            }
        )
        print_row(rows[-1])
    return rows


def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    """Each process tree's CPU time over `seconds` as a share of one core (its children's too: LitServe's workers)."""

    def tree_cpu(pid: int) -> float:
        total = 0.0
        for p in [pid, *children(pid)]:
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return total

    before = [tree_cpu(p) for p in pids]
    time.sleep(seconds)
    return [(tree_cpu(p) - b) / seconds for p, b in zip(pids, before)]


def children(pid: int) -> list[int]:
    """Every descendant of a process (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def run_soak(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="serve-soak-"))
    case, (run, images, ctype) = next(iter(make_cases(tmp, [args.configs.split(",")[0]]).items()))
    proc, url = start_server("torchsprint", run, args.device, tmp / "torchsprint.log")
    try:
        r = asyncio.run(soak(url, images, ctype, args.soak, concurrency=64, pid=proc.pid))
    finally:
        code = stop_server(proc)
    r.update(case=case, exit_code_after_sigterm=code)
    r["ok"] = r["ok"] and code == 0
    print(json.dumps({k: v for k, v in r.items() if k != "rss_mb"}, indent=1))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="digits,resnet18", help="digits, resnet18 (comma-separated)")
    ap.add_argument(
        "--servers",
        default="torchsprint,torchsprint:fp32,fastapi,litserve",
        help="which servers (comma-separated), each optionally :fp32, :bf16 or :auto (its precision; "
        "torchsprint without one: its default, auto; the others: fp32)",
    )
    ap.add_argument("--concurrency", default="1,8,32,128", help="requests in flight (comma-separated levels)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="split each level's --duration into this many rounds, the servers (all up at once) taking "
        "turns within each round: a shared machine's slow spells then fall on every server alike",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for every server")
    ap.add_argument(
        "--soak",
        type=float,
        nargs="?",
        const=600.0,
        default=None,
        metavar="SECONDS",
        help="soak mode instead: torchsprint alone, concurrency 64, 5%% bad requests (default 600 s)",
    )
    ap.add_argument("--json", help="write the figures and the machine's description to this file")
    ap.add_argument("--fastapi-server", metavar="RUN", help=argparse.SUPPRESS)
    ap.add_argument("--litserve-server", metavar="RUN", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fastapi_server:
        return plain_server(args.fastapi_server, args.port, args.device, args.threads, args.precision)
    if args.litserve_server:
        return litserve_server(args.litserve_server, args.port, args.device, args.threads, args.precision)
    out = run_soak(args) if args.soak is not None else compare(args)
    out["machine"] = machine()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.soak is not None and not out["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

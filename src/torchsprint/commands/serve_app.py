"""`torchsprint serve`'s HTTP face (FastAPI on uvicorn): /predict, /health, /ready, /metrics (Prometheus), the page
at / and the OpenAPI page at /docs. Bodies are read here under their limits and handed to the engine
(commands/serve_engine.py); every refusal is one line of JSON with a 4xx (bad input) or a 503 (overload), never
a 500. No endpoint reads a path on the server: images arrive only as request bodies.

Why FastAPI + uvicorn and not LitServe (both measured by benchmarks/serve/serve_load.py): the batching must answer
each image from the run's own preprocessing, drop a request that timed out or left before its batch runs, refuse
at once when the queue is full (503 + Retry-After) and drain on SIGTERM; that is the engine's own code here, in
one process with the model thread beside the event loop. LitServe runs the model in another process behind
queues (a pickled payload per request: JSON or form data, not a raw image body), has no queue limit, and its
batching cannot drop a cancelled request. Measured on the loopback load test (a shared 2-core VM at load 6-10,
2026-11-28, 4 s per level: figures to redo on a quiet machine), LitServe served the digits net at 142 images/s
at concurrency 32 where this server served 336 (44 vs 148 at concurrency 1); on ResNet-18 at 224 both were
bound by the busy CPU (13 vs 8 images/s at 32, 11 vs 8 at 8, neither reliable there).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import time
from concurrent.futures import Future, InvalidStateError
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from torchsprint.commands.serve_decode import Decoder, ImageError, Job
from torchsprint.commands.serve_engine import Batcher, Overloaded
from torchsprint.commands.serve_page import page_html

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FIELD = "image"  # the multipart field name of every image (repeatable)


class Metrics:
    """The Prometheus series of one server process (with several workers, prometheus_client's multiprocess mode
    adds the processes up at /metrics)."""

    def __init__(self, max_batch: int, multiprocess_dir: str | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        from torchsprint.commands.serve_engine import powers_of_two

        disable_created_metrics()  # the *_created series: a timestamp per series that nobody graphs
        self.multiprocess_dir = multiprocess_dir
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "torchsprint_serve_requests", "HTTP requests answered, by status code", ["code"], registry=r
        )
        self.errors = Counter("torchsprint_serve_errors", "Refused requests and images, by kind", ["kind"], registry=r)
        self.images = Counter("torchsprint_serve_images", "Images answered with a prediction", registry=r)
        self.lone = Counter(
            "torchsprint_serve_lone_images",
            "Images of a lone request on an idle server, handed to the "
            "model thread undecoded: it decodes them itself, no decode-pool hop (Batcher.put_if_idle)",
            registry=r,
        )
        self.latency = Histogram(
            "torchsprint_serve_request_seconds",
            "Time from a /predict request's arrival to its answer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "torchsprint_serve_forward_seconds", "Time of one batch's forward pass", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "torchsprint_serve_batch_size",
            "Images per forward pass",
            buckets=[float(b) for b in powers_of_two(max_batch)],
            registry=r,
        )
        self.queue_depth = Gauge(
            "torchsprint_serve_queue_depth",
            "Images accepted and not yet in a forward pass",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waiting = Gauge(
            "torchsprint_serve_waiting",
            "Images decoded and waiting for a forward pass",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.in_model = Gauge(
            "torchsprint_serve_in_model",
            "Images in the forward pass running now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.in_flight = Gauge(
            "torchsprint_serve_in_flight",
            "/predict requests accepted and not yet answered",
            registry=r,
            multiprocess_mode="livesum",
        )

    def exposition(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)


@dataclass
class Served:
    """Everything one server process holds: its settings, the model's Predictor, the decoder and model thread."""

    cfg: object  # config ServeConfig (token resolved from the environment)
    predictor: object
    name: str  # what is served (the run folder or file), for /ready and the page
    metrics: Metrics
    decoder: Decoder = field(init=False)
    batcher: Batcher = field(init=False)
    pool: object = field(init=False)
    limits: object = field(init=False)  # serve_limits.Limits: what one image and one batch may cost
    ready: bool = False
    warm_up: str = ""

    def __post_init__(self):
        from pathlib import Path

        from torchsprint.commands.serve_decode import decode_pool, decode_threads
        from torchsprint.commands.serve_limits import resolve_limits

        c = self.cfg
        buckets = c.buckets == "on" or (c.buckets == "auto" and self.predictor.device.type == "cuda")
        self.limits = resolve_limits(c, self.predictor, Path(self.name))
        self.decoder = Decoder(self.predictor, self.limits)
        self.batcher = Batcher(
            self.decoder,
            max_batch=c.max_batch,
            max_wait_s=c.max_wait_ms / 1000,
            queue_limit=c.queue_limit,
            buckets=buckets,
            metrics=self.metrics,
        )
        self.pool = decode_pool(decode_threads())

    def start(self) -> None:
        self.warm_up = self.batcher.start()
        # Everything loaded so far (torch, FastAPI, the model: ~370,000 objects for the digits net) lives as long as
        # the server: frozen out of the cyclic collector, so that a full collection under load no longer walks it.
        # Measured: a full collection took 177 ms there (0.0 ms frozen), a stall that every request in flight waited
        # for, the p99 tail of BENCHMARKS.md's first serve figures (p95 23 ms, p99 194 ms at concurrency 32).
        gc.collect()
        gc.freeze()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.batcher.stop()
        self.pool.shutdown(wait=True)
        gc.unfreeze()  # a server run inside another program (the tests) gives its objects back to the collector

    def submit(self, data: bytes, topk: int) -> Future:
        """The image's answer: one Future that the model thread answers, or the decode's refusal (a single hop back
        to the event loop per image); decoded by the model thread itself when it is idle (Batcher.put_if_idle).
        Cancelled before its batch forms (the request timed out or left), it is dropped, never run; cancelled while
        decoding, the model thread drops it when it would take it."""
        answer: Future = Future()
        if not self.batcher.put_if_idle(Job(None, None, topk, answer, data)):
            self.pool.submit(self._prepare_and_put, data, topk, answer)
        return answer

    def _prepare_and_put(self, data: bytes, topk: int, answer: Future) -> None:
        """Pool thread: decode + preprocess, then queue for the model (its reserved place given back on failure)."""
        try:
            job = self.decoder.prepare(data, topk)
        except BaseException as e:  # noqa: BLE001 - the image's own answer (refusal_of)
            self.batcher.release(1)
            try:
                answer.set_exception(e)
            except InvalidStateError:  # cancelled meanwhile: nobody waits for it
                pass
            return
        job.future = answer
        self.batcher.put(job)


class Refusal(Exception):
    """A request answered with an error: status, kind (the errors metric's label), one line, extra headers."""

    def __init__(self, status: int, kind: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers or {}


RETRY = {"Retry-After": "1"}
WATCH_AFTER_S = 0.05  # a request not answered by then starts watching for its client leaving


def refusal_of(e: Exception) -> Refusal:
    """An image's failure as the answer it gets."""
    if isinstance(e, ImageError):
        return Refusal(422, e.kind, str(e))
    if isinstance(e, Overloaded):
        return Refusal(503, "queue_full", str(e), RETRY)
    return Refusal(
        500, "internal", f"internal error ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    )


async def read_body(request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length before reading, else while reading)."""
    too_big = Refusal(413, "body_too_large", f"the body is larger than serve.max_body_mb={limit / 2**20:g} MiB")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def images_of(request, body: bytes, most: int) -> list[tuple[str | None, bytes]]:
    """[(file name or None, bytes)] of a raw image body or of a multipart form's `image` fields."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind.startswith("image/") or kind == "application/octet-stream":
        if not body:
            raise Refusal(400, "empty_body", "the body is empty: send the image's bytes")
        return [(None, body)]
    if kind != "multipart/form-data":
        raise Refusal(
            415,
            "unsupported_media_type",
            f"Content-Type {kind or '(none)'} is not an image: send the image "
            f"as the body (image/jpeg, image/png, application/octet-stream) or as multipart/form-data field "
            f"'{FIELD}'",
        )
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream():
        yield body
        yield b""

    try:
        form = await MultiPartParser(request.headers, stream(), max_files=most, max_fields=most).parse()
    except MultiPartException as e:
        if "Too many" in str(e):
            raise Refusal(413, "too_many_images", f"more images than serve.queue_limit={most} in one request") from None
        raise Refusal(400, "bad_multipart", f"malformed multipart form: {e}") from None
    out = []
    try:
        for key, value in form.multi_items():
            if key != FIELD:
                raise Refusal(
                    400,
                    "wrong_field",
                    f"multipart field '{key}' is not expected: send each image as a file "
                    f"in field '{FIELD}' (curl -F {FIELD}=@cat.jpg)",
                )
            if isinstance(value, str):
                raise Refusal(
                    400, "wrong_field", f"field '{FIELD}' must be a file upload (curl -F {FIELD}=@cat.jpg), not text"
                )
            out.append((value.filename, await value.read()))
    finally:
        await form.close()  # the parts' spooled temporary files
    if not out:
        raise Refusal(400, "empty_body", f"no '{FIELD}' file in the form")
    for name, data in out:
        if not data:
            raise Refusal(400, "empty_body", f"image '{name}' is empty (0 bytes)")
    return out


async def until_disconnected(request) -> None:
    """Returns when the client closes the connection (the body is read by then: only http.disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


UNAUTHORIZED = ("missing or wrong bearer token (Authorization: Bearer <serve.token>)", {"WWW-Authenticate": "Bearer"})


def refused(s: Served, r: Refusal) -> JSONResponse:
    """A refusal as its one line of JSON, counted by kind."""
    s.metrics.errors.labels(r.kind).inc()
    return JSONResponse({"error": str(r), "kind": r.kind}, status_code=r.status, headers=r.headers)


def authorized(s: Served, request) -> bool:
    if s.cfg.token is None:
        return True
    got = request.headers.get("authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {s.cfg.token}".encode())  # constant time


async def answer(s: Served, request, topk: int) -> JSONResponse:
    """A /predict request's response: its predictions, or the refusal of the whole request."""
    from starlette.requests import ClientDisconnect

    if not authorized(s, request):
        return refused(s, Refusal(401, "unauthorized", *UNAUTHORIZED))
    try:
        items, results = await within(answer_within(s, request, topk), s.cfg.timeout_s)
    except Refusal as r:
        return refused(s, r)
    except ClientDisconnect:
        return refused(s, Refusal(499, "disconnected", "the client closed the connection while sending"))
    except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
        return refused(
            s, Refusal(503, "timeout", f"not answered within serve.timeout_s={s.cfg.timeout_s:g} s; retry later", RETRY)
        )
    return respond(s, items, results)


async def within(coro, seconds: float):
    """`coro` under a timeout: asyncio.timeout where it exists (Python 3.11: no extra task, as wait_for makes)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)


async def answer_within(s: Served, request, topk: int):
    """Read, parse and predict under the request's timeout; a client that leaves first gets its images dropped."""
    s.batcher.arriving(1)
    try:
        body = await read_body(request, int(s.cfg.max_body_mb * 2**20))
        items = await images_of(request, body, s.cfg.queue_limit)
        s.batcher.reserve(len(items))  # admitted before it stops arriving: a waiting batch never misses it
    except Overloaded as e:
        raise Refusal(503, "queue_full", str(e), RETRY) from None
    finally:
        s.batcher.arriving(-1)
    # Never decoded nor run here: the event loop answers /health and /ready while the model thread works (a forward
    # pass once ran here for a lone request, and a 35 KB PNG of 6000x6000 held /health for over 10 minutes).
    # Submitted with no await after the reservation: every reserved place is either queued or given back.
    # Each image's result dict or exception, in order; cancelling `work` cancels every image not yet in a batch.
    work = asyncio.gather(*(asyncio.wrap_future(s.submit(data, topk)) for _, data in items), return_exceptions=True)
    try:
        # Most answers come within WATCH_AFTER_S: only a request still waiting then gets a task that watches for
        # its client leaving (a task per request cost the event loop time a lone client waits for).
        done, _ = await asyncio.wait({work}, timeout=WATCH_AFTER_S)
        if not done:
            gone = asyncio.ensure_future(until_disconnected(request))
            try:
                done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
    finally:  # also when the timeout cancels this
        if not work.done():
            work.cancel()
    if work not in done:
        raise Refusal(499, "disconnected", "the client closed the connection")
    return items, work.result()


def respond(s: Served, items, results) -> JSONResponse:
    """One entry per image (its top-k, or its error); the request fails as its first image did when none succeeded."""
    entries, failures = [], []
    for (name, _), r in zip(items, results):
        entry = {} if name is None else {"name": name}
        if isinstance(r, Exception):
            failures.append(refusal_of(r))
            s.metrics.errors.labels(failures[-1].kind).inc()
            entry.update(error=str(r), kind=failures[-1].kind)
        else:
            s.metrics.images.inc()
            entry.update(r)
        entries.append(entry)
    if len(failures) == len(entries):
        f = failures[0]
        return JSONResponse(
            {"error": str(f), "kind": f.kind, "predictions": entries}, status_code=f.status, headers=f.headers
        )
    return JSONResponse({"predictions": entries})


def build_app(s: Served) -> FastAPI:
    """The FastAPI app of one server process: its start-up warms the model (/ready says when), its shutdown
    answers every accepted image before the model thread ends."""
    from torchsprint.version import __version__

    @asynccontextmanager
    async def lifespan(app):
        starting = asyncio.get_running_loop().run_in_executor(None, s.start)  # /health answers while it warms up
        try:
            yield
        finally:
            await starting
            await asyncio.get_running_loop().run_in_executor(None, s.stop)  # every accepted image answered

    app = FastAPI(
        title="torchsprint serve",
        version=__version__,
        lifespan=lifespan,
        description=f"Predictions of {s.name} with the run's own eval preprocessing (docs/serve.md).",
    )

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # 404, 405: one line of JSON as every other refusal
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "bad_request")
        return refused(s, Refusal(e.status_code, kind, str(e.detail), dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):  # a bug of ours: still one line of JSON, and the server goes on
        return refused(s, refusal_of(e))

    @app.exception_handler(RequestValidationError)
    async def bad_query(request, e: RequestValidationError):  # ?topk=abc
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        return refused(s, Refusal(422, "bad_request", problems))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(page_html(s.name, s.cfg.topk, s.cfg.token is not None))

    @app.get("/health", summary="The process is alive")
    async def health():
        return {"status": "alive"}

    @app.get("/ready", summary="The model is loaded and warmed up (503 until then)")
    async def ready():
        if not s.ready:
            return JSONResponse(
                {"error": "the model is loading or warming up", "kind": "not_ready"}, status_code=503, headers=RETRY
            )
        return {
            "status": "ready",
            "model": s.name,
            "task": s.predictor.task.name,
            "classes": len(s.predictor.classes),
            "device": str(s.predictor.device),
            "precision": s.predictor.inference.precision,
            "torch_threads": s.batcher.torch_threads,
            "warm_up": s.warm_up,
        }

    @app.get("/metrics", summary="Prometheus text format", response_class=Response)
    async def metrics(request: Request):
        if not authorized(s, request):
            return refused(s, Refusal(401, "unauthorized", *UNAUTHORIZED))
        return Response(s.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post(
        "/predict",
        summary="Top-k classes of one image (raw body) or several (multipart field 'image')",
        openapi_extra=PREDICT_OPENAPI,
    )
    async def predict(
        request: Request,
        topk: int | None = Query(None, ge=1, le=10_000, description="classes per image (default serve.topk)"),
    ):
        started = time.perf_counter()
        s.metrics.in_flight.inc()
        try:
            response = await answer(s, request, topk or s.cfg.topk)
        finally:
            s.metrics.in_flight.dec()
        s.metrics.requests.labels(str(response.status_code)).inc()
        s.metrics.latency.observe(time.perf_counter() - started)
        return response

    app.router.routes.insert(0, plain_route(s, predict))
    return app


def plain_route(s: Served, predict):
    """What answers POST /predict: `predict` (build_app's endpoint) without FastAPI's per-request dependency solving
    and validation (`topk` checked here, with the same bounds and one-line 422), which a lone client of a small net
    waited for on every request. The decorated endpoint stays: it describes the route on the OpenAPI page."""
    from starlette.routing import Route

    async def predict_plain(request: Request):
        raw = request.query_params.get("topk")
        if raw is None:
            return await predict(request, None)
        if not raw.strip().isdigit() or not 1 <= int(raw) <= 10_000:
            return refused(
                s, Refusal(422, "bad_request", f"query.topk: must be a whole number from 1 to 10000, not {raw!r}")
            )
        return await predict(request, int(raw))

    return Route("/predict", predict_plain, methods=["POST"], include_in_schema=False)


PREDICT_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": [FIELD],
                    "properties": {FIELD: {"type": "array", "items": {"type": "string", "format": "binary"}}},
                }
            },
        },
    }
}

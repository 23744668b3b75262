"""`torchsprint serve RUN_DIR|MODEL_FILE`: an HTTP server of a run's model (FastAPI on uvicorn; why not LitServe:
commands/serve_app.py). Settings: the `serve` section of the run's saved config, then -c FILE's, then serve.KEY=VALUE
overrides, then the flags (--port ...); the token also from TORCHSPRINT_SERVE_TOKEN. The port is bound before the
model loads, so a port in use is a one-line error; SIGTERM stops accepting, answers what was accepted, exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

from torchsprint.commands.args import FLAGS
from torchsprint.commands.serve_limits import graph_note, resolve_limits
from torchsprint.errors import UsageError

TOKEN_ENV = "TORCHSPRINT_SERVE_TOKEN"
SPEC_ENV = "TORCHSPRINT_SERVE_SPEC"  # what each worker process serves (serve.workers > 1), set by serve_cli
TASKS = ("classification", "multilabel")  # the tasks whose predictions are labels and probabilities


def saved_serve_section(target: Path) -> dict:
    """The `serve` section stored with the model: the run folder's config.yaml, or a model file's metadata (its
    `config` entry read by config/saved.py's metadata_entry, as predict reads it: a damaged one is predict's line)."""
    from torchsprint.config.saved import load_run_config, metadata_entry

    if target.is_dir():
        return load_run_config(target).serve.model_dump()
    raw = None
    if target.suffix == ".safetensors":
        from torchsprint.state.checkpoint import read_safetensors_metadata

        try:
            raw = read_safetensors_metadata(target).get("config")
        except Exception as e:  # noqa: BLE001 - reported as the file's problem, one line
            raise UsageError(f"{target} is not a readable safetensors file ({type(e).__name__}).") from None
    elif target.suffix == ".onnx":
        import onnx

        try:
            meta = {p.key: p.value for p in onnx.load(str(target), load_external_data=False).metadata_props}
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"{target} is not a readable ONNX file ({type(e).__name__}).") from None
        raw = meta.get("config")
    else:
        raise UsageError(f"{target}: serve takes a run folder, a .onnx or a .safetensors file.")
    config = metadata_entry({"config": raw}, "config", target) if raw is not None else None
    serve = config.get("serve") if config else None
    return serve if isinstance(serve, dict) else {}


def resolve_settings(target: Path, config_path: str | None, overrides: list[str], flags: dict):
    """The ServeConfig of this server: saved section < -c FILE's serve section < serve.KEY=VALUE < flags; the token
    from TORCHSPRINT_SERVE_TOKEN unless an override or --token gives one."""
    from torchsprint import config as config_mod
    from torchsprint.config.serve import ServeConfig

    if not target.exists():
        raise UsageError(
            f"{target}: no such run folder or model file (serve takes the folder `train` printed, or a "
            "file from `torchsprint export`)."
        )
    data = {"serve": saved_serve_section(target)}
    if config_path is not None:
        data = {"serve": {**data["serve"], **(config_mod.read_with_extends(config_path).get("serve") or {})}}
    for item in overrides:
        if not item.startswith("serve."):
            raise UsageError(f"{item}: serve takes serve.KEY=VALUE overrides only (e.g. serve.port=8080).")
        data = config_mod.apply_override(data, item)
    data["serve"].update({k: v for k, v in flags.items() if v is not None})
    token_given = flags.get("token") is not None or any(o.startswith("serve.token=") for o in overrides)
    if not token_given and TOKEN_ENV in os.environ:
        data["serve"]["token"] = os.environ[TOKEN_ENV]
        if not os.environ[TOKEN_ENV].strip():
            raise UsageError(f"{TOKEN_ENV} is set but empty: set a token, or unset it to serve without one.")
    return config_mod.validate(data, "serve settings").serve if "serve" in data else ServeConfig()


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"serve.device={device}, but this machine has no CUDA device; use serve.device=cpu or auto.")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"serve.device={device}: use auto, cpu, cuda or cuda:N.")
    return device


def load_predictor(target: Path, cfg, weights: str = "best", tta: str | None = None):
    """The Predictor of a run folder or model file under serve.runtime and serve.device (one-line errors)."""
    from torchsprint.commands.predict import Predictor

    device = resolve_device(cfg.device)
    runtime = cfg.runtime
    if target.is_dir():
        backend = "onnx" if runtime == "onnxruntime" else "torch"
        predictor = Predictor.from_run(
            target, weights, backend, device, cfg.max_batch, tta=tta, precision=cfg.precision
        )
    else:
        implied = "onnxruntime" if target.suffix == ".onnx" else "torch"
        if runtime not in ("auto", implied):
            raise UsageError(
                f"serve.runtime={runtime} cannot run {target.name}: a {target.suffix} file runs on {implied}"
                f" (export the run again with `torchsprint export --format "
                f"{'onnx' if runtime == 'onnxruntime' else 'safetensors'}`, or serve its run folder)."
            )
        predictor = Predictor.from_file(target, device, cfg.max_batch, tta=tta, precision=cfg.precision)
    if predictor.task.name not in TASKS:
        raise UsageError(
            f"task={predictor.task.name}: serve answers with labels and probabilities (tasks "
            f"{', '.join(TASKS)}); use `torchsprint predict` for this run."
        )
    return predictor


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is a one-line error, not a traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"serve.host={host}: not an address of this machine ({e.strerror}).") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once after a stop (TIME_WAIT)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({e.strerror}): another server holds that port? Choose "
            "another with --port (0 takes a free one)."
        ) from None
    sock.set_inheritable(True)  # the workers (serve.workers > 1) accept on it
    return sock


def worker_app():
    """A worker process's app (uvicorn's factory, serve.workers > 1): it loads the model itself from SPEC_ENV."""
    from torchsprint.commands.serve_app import Metrics, Served, build_app
    from torchsprint.config.serve import ServeConfig

    spec = json.loads(os.environ[SPEC_ENV])
    cfg = ServeConfig.model_validate(spec["cfg"])
    predictor = load_predictor(Path(spec["target"]), cfg, spec["weights"], spec["tta"])
    return build_app(
        Served(cfg, predictor, spec["target"], Metrics(cfg.max_batch, os.environ.get("PROMETHEUS_MULTIPROC_DIR")))
    )


def serve_cli(args) -> int:
    """`torchsprint serve`: resolve the settings, bind the port, load the model, run uvicorn until SIGTERM/SIGINT."""
    from importlib.util import find_spec

    missing = [
        name
        for name, modules in (
            ("fastapi", ["fastapi"]),
            ("uvicorn", ["uvicorn"]),
            ("python-multipart", ["python_multipart", "multipart"]),
            ("prometheus_client", ["prometheus_client"]),
        )
        if not any(find_spec(m) for m in modules)
    ]
    if missing:
        raise UsageError(f"torchsprint serve needs {', '.join(missing)}: pip install 'torchsprint[serve]'")
    flags = {name: getattr(args, name, None) for name in FLAGS}
    target = Path(args.target)
    cfg = resolve_settings(target, args.config, list(args.overrides), flags)
    sock = bind(cfg.host, cfg.port)
    predictor = load_predictor(target, cfg, args.weights, args.tta)  # also with workers: errors here, in one line
    limits = resolve_limits(cfg, predictor, target)  # a serve.max_model_pixels no image could meet: refused here
    port = sock.getsockname()[1]
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(
        f"serving {target} ({predictor.task.name}, {len(predictor.classes)} classes, {predictor.device}, "
        f"{'onnxruntime' if hasattr(predictor.forward, 'session') else 'torch'}) on http://{host}:{port} "
        f"with {cfg.workers} worker(s): POST /predict, page /, API /docs; {predictor.inference.note}",
        flush=True,
    )
    print(limits.describe(cfg.max_batch), flush=True)
    if (note := graph_note(predictor)) is not None:
        print(note, flush=True)
    if (warning := exposure_warning(sock.getsockname()[0], cfg.token)) is not None:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    # uvicorn re-raises the stop signal after its graceful shutdown; a handled SIGTERM then ends `serve` with 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    if cfg.workers == 1:
        return run_one(cfg, predictor, str(target), sock)
    del predictor  # each worker loads its own copy
    return run_workers(cfg, target, args, sock)


def exposure_warning(address: str, token: str | None) -> str | None:
    """What to say when the bound address is not a loopback one and no token guards /predict, or None."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if token is not None or loopback:
        return None
    return (
        f"serving on {address} without a token: anyone who can reach this machine's port can use the model and "
        f"read /metrics; set serve.token (--token) or {TOKEN_ENV} to require one, or --host 127.0.0.1 for this "
        "machine only"
    )


def uvicorn_config(app, cfg, **kw):
    import uvicorn

    # access_log off: a line per request costs throughput; /metrics counts requests by code instead.
    return uvicorn.Config(
        app, host=cfg.host, port=cfg.port, access_log=False, log_level="info", timeout_graceful_shutdown=None, **kw
    )


def run_one(cfg, predictor, name: str, sock: socket.socket) -> int:
    import uvicorn

    from torchsprint.commands.serve_app import Metrics, Served, build_app

    served = Served(cfg, predictor, name, Metrics(cfg.max_batch))
    uvicorn.Server(uvicorn_config(build_app(served), cfg)).run(sockets=[sock])
    return 0


def run_workers(cfg, target: Path, args, sock: socket.socket) -> int:
    import inspect
    import shutil
    import tempfile

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    metrics_dir = tempfile.mkdtemp(prefix="torchsprint-serve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any worker imports prometheus_client
    os.environ[SPEC_ENV] = json.dumps(
        {"target": str(target), "cfg": cfg.model_dump(), "weights": args.weights, "tta": args.tta}
    )
    config = uvicorn_config("torchsprint.commands.serve:worker_app", cfg, factory=True, workers=cfg.workers)
    try:
        # uvicorn before 0.30 takes the worker's function as `target`; later versions build it themselves.
        old = "target" in inspect.signature(Multiprocess).parameters
        Multiprocess(config, sockets=[sock], **({"target": uvicorn.Server(config).run} if old else {})).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0

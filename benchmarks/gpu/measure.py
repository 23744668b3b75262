"""The GPU job's measurements M1-M6, written incrementally into one results JSON.

    python -m benchmarks.gpu.measure --out results.json [--only M1,M5] [--deadline-s 540] [--quick]
    python -m benchmarks.gpu.measure --smoke-cpu --out /tmp/r.json   # every code path on the CPU, tiny sizes

--smoke-cpu is the rehearsal a machine without a GPU can run (tests/e2e/cli/test_benchmark_scripts.py does): each
measurement's code on the CPU with a few images and steps, so a script that would crash on the GPU machine
crashes here first. Its figures mean nothing; compile and CUDA-graph variants are left out (CPU compile
takes minutes, CUDA graphs are refused without CUDA).

M1 model only (synthetic batches on the GPU, torchsprint's own train_step, wrap_model and Precision):
   ResNet-18 and ResNet-50 at 224, images/s for fp32 -> amp_bf16 -> + channels_last -> + compile ->
   + CUDA graphs, each beside a hand-written PyTorch loop (PlainLoop: torchvision model, zero_grad/forward/
   backward/step, torch.autocast, channels_last, torch.compile, whole-network CUDA-graph capture) on the same
   batch with the same switches, timed in alternating windows; ratio_to_plain per variant (goal >= 0.98).
   Goals: ResNet-18 best >= 25,000 images/s (stretch 35,000); anchors for ResNet-50:
   2,470 images/s on an A100 with AMP (NVIDIA DeepLearningExamples), about 7,000 per H100 (MLPerf v3.0).
M2 loader only on >= 20,000 generated 500x375 JPEGs at quality 90, RandomResizedCrop 224 + flip +
   normalise: cpu backend with 16 workers (and per core), gpu backend (cpu_fraction 0 and auto), DALI.
   Goal: gpu backend >= 8,000 images/s (stretch 20,000; anchor: batched nvJPEG 7,800 images/s, A100).
   A torch.profiler table of the gpu backend's batches goes to the log. Each loader also records the
   consuming thread's own CPU per batch (thread_cpu_ms_per_batch; gpu backend goal <= 1 ms a batch of 256).
M3 end to end: ResNet-18 at 224 on those JPEGs with the fastest M2 backend and M1's best switches;
   images/s, data-wait share, the loader's CPU on the training thread per batch, ratio to M1's figure with
   the same switches (goal >= 0.90).
M4 memory backend on 50,000 CIFAR-sized (32x32) images, cifar_resnet18: seconds per epoch, and the
   loader's share of the step time (goal <= 5%).
M5 `torchsprint bench` on the default run and on a 224-pixel JPEG config.
M6 predict throughput on CUDA (benchmarks/serve/predict_throughput.py: torch, onnxruntime's CUDA provider if any).

Every figure is timed with CUDA events or a host clock after torch.cuda.synchronize(), after warm-up
steps (compilation, cuDNN autotuning, CUDA-graph capture excluded). A measurement that would not fit
in the time left (--deadline-s) is recorded as skipped with that reason, so a partial run still
leaves a valid JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common.loader_timing import cpu_seconds_per_image, time_epoch

REPO = Path(__file__).resolve().parents[2]
STARTED = time.time()
LOGS = Path(".")  # set to the results file's folder in main()

# Sizes per mode (main() picks one): full figures, --quick (a short GPU run), --smoke (CPU rehearsal).
SIZES = {
    "full": dict(
        device="cuda",
        m1_batch=256,
        m1_steps=(20, 10),
        m1_repeats=3,
        m1_image=224,
        jpegs=20000,
        m2_epochs=3,
        jpeg_batch=256,
        workers=min(16, os.cpu_count() or 1),
        m3_steps=(150, 25),
        cifar=50000,
        cifar_batch=512,
        bench=("20", "5", "2"),
        bench_variants=None,
        predict_images="256",
    ),
    "quick": dict(
        device="cuda",
        m1_batch=256,
        m1_steps=(10, 5),
        m1_repeats=2,
        m1_image=224,
        jpegs=4000,
        m2_epochs=2,
        jpeg_batch=256,
        workers=min(16, os.cpu_count() or 1),
        m3_steps=(40, 10),
        cifar=10000,
        cifar_batch=512,
        bench=("20", "5", "2"),
        bench_variants=None,
        predict_images="64",
    ),
    "smoke": dict(
        device="cpu",
        m1_batch=2,
        m1_steps=(2, 1),
        m1_repeats=2,
        m1_image=32,
        jpegs=48,
        m2_epochs=1,
        jpeg_batch=8,
        workers=1,
        m3_steps=(2, 1),
        cifar=256,
        cifar_batch=64,
        bench=("2", "1", "1"),
        bench_variants="baseline (seeds),+ channels_last",
        predict_images="16",
    ),
}
SIZE = SIZES["full"]


def cuda() -> bool:
    return SIZE["device"] == "cuda"


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- results file


class Results:
    """The results JSON, rewritten after every measurement (a killed run keeps what it finished)."""

    def __init__(self, path: Path, command: str):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data = json.loads(path.read_text()) if path.is_file() else {}
        self.data.update(environment())
        self.data["command"] = command
        self.data.setdefault("commands", []).append(command)  # every measure.py run that wrote into this file
        self.data.setdefault("measurements", {})
        self.save()

    def put(self, key: str, value: dict) -> None:
        self.data["measurements"][key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def environment() -> dict:
    """device, torch, cuda, date and what else a reader needs to compare runs."""
    import torchvision

    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = None
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "nvidia_smi": smi,
        "git_revision": rev,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def left(deadline: float) -> float:
    return deadline - (time.time() - STARTED)


# ---------------------------------------------------------------- M1: model only, beside a plain PyTorch loop


def switches(overrides: list[str]) -> dict:
    """A variant's switches read off its torchsprint overrides, for the plain loop to apply by hand."""
    kv = dict(o.split("=", 1) for o in overrides)
    return {
        "amp_bf16": kv.get("precision") == "amp_bf16",
        "channels_last": kv.get("speed.channels_last") == "true",
        "compile": kv.get("speed.compile") == "true",
        "compile_mode": kv.get("speed.compile_mode"),
        "cuda_graphs": kv.get("speed.cuda_graphs") == "true",
    }


def synthetic_batch(batch: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One on-device batch of images (224x224; 32x32 in the CPU smoke run, whose 224 px took minutes a variant
    on 2 busy cores) and labels, shared by both sides of a variant."""
    g = torch.Generator(device=SIZE["device"]).manual_seed(0)
    x = torch.randn(batch, 3, SIZE["m1_image"], SIZE["m1_image"], device=SIZE["device"], generator=g)
    y = torch.randint(0, 1000, (batch,), device=SIZE["device"], generator=g)
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format), y


class TorchsprintSide:
    """torchsprint's own train_step with wrap_model, build_optimizer and Precision, as a run builds them."""

    def __init__(self, model: str, overrides: list[str], x: torch.Tensor, y: torch.Tensor):
        from torch._dynamo.utils import counters

        from torchsprint import config, runtime
        from torchsprint.models import build_model
        from torchsprint.optim import build_loss, build_optimizer
        from torchsprint.runtime.parallel import wrap_model
        from torchsprint.state.precision import Precision
        from torchsprint.train.plan import decide_speed

        # speed.cuda_graphs=auto would capture on CUDA: a variant says when it wants graphs (same switches as its name).
        cfg = config.load(
            None, [f"model.name={model}", f"run.device={SIZE['device']}", "speed.cuda_graphs=false", *overrides]
        )
        rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
        self.batch = [(x, y)]
        self.prec = Precision(
            cfg.precision.mode,
            rt.device,
            on_nonfinite=cfg.precision.on_nonfinite,
            graph_safe=cfg.speed.cuda_graphs is True,
        )
        counters.clear()
        net = build_model(cfg.model, 1000, 3)
        self.net = wrap_model(
            net,
            cfg.strategy,
            rt,
            speed=decide_speed(cfg.speed, cfg.strategy, net, rt.device),
            prec=self.prec,
            example=lambda: x,
        )
        self.opt = build_optimizer(cfg.optim, self.net)
        self.prec.attach(self.opt)
        self.loss_fn = build_loss(cfg.loss).to(rt.device)
        self.net.train()

    def step(self) -> None:
        from torchsprint.train.context import Trainable
        from torchsprint.train.engine import train_step

        train_step(Trainable(self.net, self.loss_fn, self.opt, self.prec), self.batch)

    def info(self) -> dict:
        from torch._dynamo.utils import counters

        return {
            "fused_optimizer": bool(self.opt.defaults.get("fused")),
            "compiled_frames": dict(counters["frames"]),
            "graph_breaks": sum(counters["graph_break"].values()),
            "cuda_graph_replays": getattr(unwrap_graphed(self.net), "replays", None),
        }


class PlainLoop:
    """The same job as a hand-written PyTorch loop, nothing of torchsprint's: torchvision's model, SGD with
    torchsprint's default hyper-parameters (lr 0.1, momentum 0.9, Nesterov, weight decay 5e-4; fused on CUDA),
    cross-entropy, and each switch the way PyTorch's documentation writes it: torch.autocast (bf16),
    channels_last on the model and the input, torch.compile(model, mode=...), and CUDA graphs as whole-network
    capture (zero_grad, forward, backward and optimizer.step in one torch.cuda.graph after warm-up steps on a
    side stream; https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture). TF32 and cuDNN's
    autotuner are on, as torchsprint's defaults on CUDA set them."""

    def __init__(self, model: str, sw: dict, x: torch.Tensor, y: torch.Tensor):
        import torchvision

        dev = torch.device(SIZE["device"])
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        net = torchvision.models.get_model(model, weights=None, num_classes=1000).to(dev)
        if sw["channels_last"]:
            net = net.to(memory_format=torch.channels_last)
        net.train()
        self.net = (
            torch.compile(net, **({"mode": sw["compile_mode"]} if sw["compile_mode"] else {})) if sw["compile"] else net
        )
        self.opt = torch.optim.SGD(
            net.parameters(),
            lr=0.1,
            momentum=0.9,
            nesterov=True,
            weight_decay=5e-4,
            fused=True if dev.type == "cuda" else None,
        )
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.x, self.y, self.dev, self.amp = x, y, dev, sw["amp_bf16"]
        self.graph = None
        if sw["cuda_graphs"]:
            self.capture()

    def forward_backward_step(self, x: torch.Tensor, y: torch.Tensor, cache: bool = True) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp, cache_enabled=cache):
            loss = self.loss_fn(self.net(x), y)
        loss.backward()
        self.opt.step()
        return loss

    def capture(self) -> None:
        self.static_x, self.static_y = self.x.clone(), self.y.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream (cuDNN autotuning, the optimizer's buffers)
            for _ in range(3):
                self.forward_backward_step(self.static_x, self.static_y, cache=False)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):  # autocast's cast cache off inside a capture (PyTorch's CUDA-graph notes)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp, cache_enabled=False):
                loss = self.loss_fn(self.net(self.static_x), self.static_y)
            loss.backward()
            self.opt.step()

    def step(self) -> None:
        if self.graph is not None:
            self.static_x.copy_(self.x)  # a new batch goes into the captured input, as in the docs' loop
            self.static_y.copy_(self.y)
            self.graph.replay()
        else:
            self.forward_backward_step(self.x, self.y)


def timed_ms(step, steps: int) -> float:
    """Milliseconds per step over `steps` steps: CUDA events on the GPU, the host clock on the CPU."""
    if cuda():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3 / steps


def warm(step, steps: int) -> float:
    """Warm-up steps (compilation, cuDNN autotuning, graph capture's first replays), seconds."""
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - t


def model_step_rate(model: str, overrides: list[str], batch: int, steps: int, warmup: int) -> dict:
    """images/s of torchsprint's train_step alone on synthetic on-device batches (M3's reference when M1 did
    not run)."""
    x, y = synthetic_batch(batch, switches(overrides)["channels_last"])
    ts = TorchsprintSide(model, overrides, x, y)
    warm(ts.step, warmup)
    ms = timed_ms(ts.step, steps)
    out = {"images_per_s": batch / ms * 1e3, "ms_per_step": ms, "batch": batch, **ts.info()}
    del ts
    if cuda():
        torch.cuda.empty_cache()
    return out


def model_pair_rate(model: str, overrides: list[str], batch: int, steps: int, warmup: int, repeats: int) -> dict:
    """torchsprint beside the plain loop, same batch, same switches: both built and warmed up, then `repeats`
    timed windows of `steps` steps each, alternating plain, torchsprint, plain, torchsprint... so drift (clocks,
    temperature, a neighbour) hits both sides alike. The ratio is the median of the per-window-pair ratios."""
    from torch._dynamo.utils import counters

    sw = switches(overrides)
    torch._dynamo.reset()  # a fresh compile per variant: no cache carried over, no recompile limit reached
    x, y = synthetic_batch(batch, sw["channels_last"])
    ts = TorchsprintSide(model, overrides, x, y)
    ts_warm = warm(ts.step, warmup)
    ts_info = ts.info()
    peak = None
    if cuda():  # its peak alone, before the plain loop's model shares the GPU
        torch.cuda.reset_peak_memory_stats()
        timed_ms(ts.step, steps)
        peak = torch.cuda.max_memory_allocated() / 2**30
    counters.clear()
    plain = PlainLoop(model, sw, x, y)
    plain_warm = warm(plain.step, warmup)
    plain_frames = dict(counters["frames"])
    ts_ms, plain_ms = [], []
    for _ in range(repeats):
        plain_ms.append(timed_ms(plain.step, steps))
        ts_ms.append(timed_ms(ts.step, steps))
    ts_info["cuda_graph_replays"] = ts.info()["cuda_graph_replays"]
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    ms = med(ts_ms)
    out = {
        "images_per_s": batch / ms * 1e3,
        "ms_per_step": ms,
        "batch": batch,
        "warmup_s": ts_warm,
        "peak_memory_gib": peak,
        **ts_info,
        "runs": [batch / m * 1e3 for m in ts_ms],
        "plain": {
            "images_per_s": batch / med(plain_ms) * 1e3,
            "ms_per_step": med(plain_ms),
            "warmup_s": plain_warm,
            "runs": [batch / m * 1e3 for m in plain_ms],
            "compiled_frames": plain_frames,
            "cuda_graph": plain.graph is not None,
        },
        "ratio_to_plain": med([p / t for p, t in zip(plain_ms, ts_ms)]),
    }  # rate ratio = inverse time ratio
    del ts, plain
    if cuda():
        torch.cuda.empty_cache()
    return out


def unwrap_graphed(model):
    """The CudaGraphed wrapper inside a wrapped model, if any (its replay count proves the graph ran)."""
    from torchsprint.runtime.parallel import CudaGraphed

    m = getattr(model, "_orig_mod", model)
    while not isinstance(m, CudaGraphed) and hasattr(m, "module"):
        m = m.module
    return m if isinstance(m, CudaGraphed) else None


M1_VARIANTS = {
    "fp32": ["precision=fp32", "speed.channels_last=false"],  # NCHW: channels_last's gain is its own variant
    "amp_bf16": ["precision=amp_bf16", "speed.channels_last=false"],
    "amp_bf16 + channels_last": ["precision=amp_bf16", "speed.channels_last=true"],
    "amp_bf16 + channels_last + compile": ["precision=amp_bf16", "speed.channels_last=true", "speed.compile=true"],
    "amp_bf16 + channels_last + cuda_graphs": [
        "precision=amp_bf16",
        "speed.channels_last=true",
        "speed.cuda_graphs=true",
    ],
    "amp_bf16 + channels_last + compile reduce-overhead": [
        "precision=amp_bf16",
        "speed.channels_last=true",
        "speed.compile=true",
        "speed.compile_mode=reduce-overhead",
    ],
}


def m1_summary(out: dict) -> None:
    """The flat tables a reader (and merge_results.py) wants, rebuilt after every variant: a killed run keeps them."""
    rows = [
        (f"{model} | {name}", v)
        for model in ("resnet18", "resnet50")
        for name, v in out.get(model, {}).items()
        if "images_per_s" in v
    ]
    r18 = [v["images_per_s"] for k, v in rows if k.startswith("resnet18")]
    out["resnet18_best_images_per_s"] = max(r18) if r18 else None
    out["images_per_s"] = {k: v["images_per_s"] for k, v in rows}
    out["plain_images_per_s"] = {k: v["plain"]["images_per_s"] for k, v in rows if "plain" in v}
    out["ratio_to_plain"] = {k: v["ratio_to_plain"] for k, v in rows if "ratio_to_plain" in v}


def m1(res: Results, deadline: float) -> None:
    out: dict = {
        "note": "synthetic on-device batches (one batch reused), SGD (fused), torchsprint train_step beside a "
        "plain PyTorch loop (measure.py's PlainLoop) with the same switches, timed in alternating "
        "windows (plain, torchsprint, ...); fp32 uses TF32 on both sides (speed.tf32=true)",
        "goal": {"resnet18_best": 25000, "stretch": 35000, "ratio_to_plain": 0.98},
        "anchors": {"resnet50_amp_A100_DeepLearningExamples": 2470, "resnet50_H100_MLPerf_v3.0": 7000},
    }
    # In priority order: a short deadline drops the last ones (ResNet-50's second compile and its slow eager runs).
    plans = [
        ("resnet18", "fp32"),
        ("resnet18", "amp_bf16"),
        ("resnet18", "amp_bf16 + channels_last"),
        ("resnet18", "amp_bf16 + channels_last + cuda_graphs"),
        ("resnet18", "amp_bf16 + channels_last + compile"),
        ("resnet50", "amp_bf16 + channels_last"),
        ("resnet18", "amp_bf16 + channels_last + compile reduce-overhead"),
        ("resnet50", "amp_bf16 + channels_last + cuda_graphs"),
        ("resnet50", "amp_bf16 + channels_last + compile"),
        ("resnet50", "amp_bf16"),
        ("resnet50", "fp32"),
    ]
    steps, warmup = SIZE["m1_steps"]
    for model, name in plans:
        out.setdefault(model, {})
        # Seconds a variant needs on the H200 (2026-11-26: a compile warm-up 20-21 s per side, eager 2-7 s),
        # both sides, with margin; on the CPU (smoke) the sizes are tiny.
        need = (110 if "compile" in name else 40) if cuda() else 5
        if left(deadline) < need:
            out[model][name] = {"skipped": "time budget of this call"}
            continue
        if not cuda() and (
            "compile" in name or "cuda_graphs" in name or (model == "resnet50" and "channels_last" not in name)
        ):
            out[model][name] = {"skipped": "smoke run on the CPU"}  # (one ResNet-50 variant covers its code)
            continue
        try:
            r = out[model][name] = model_pair_rate(
                model, M1_VARIANTS[name], SIZE["m1_batch"], steps, warmup, SIZE["m1_repeats"]
            )
            print(
                f"M1 {model} {name}: {r['images_per_s']:.0f} images/s, plain loop {r['plain']['images_per_s']:.0f}: "
                f"{r['ratio_to_plain']:.3f}x",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            out[model][name] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
            print(f"M1 {model} {name}: FAILED {e}", flush=True)
        m1_summary(out)
        res.put("M1", out)
    m1_summary(out)
    res.put("M1", out)


# ---------------------------------------------------------------- data for M2/M3


def _write_chunk(args) -> int:
    root, start, count, classes, seed, n_train = args
    import numpy as np
    from PIL import Image

    from torchsprint.data.sources.synthetic import render_synthetic

    rng = np.random.default_rng(seed + start)
    for i in range(start, start + count):
        split = "train" if i < n_train else "val"
        cls = i % classes
        d = Path(root) / split / f"class_{cls:02d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(render_synthetic(rng, cls, classes, 500, 375)).save(d / f"{i:06d}.jpg", quality=90)
    return count


def make_jpegs(root: Path, n: int, classes: int = 10, procs: int | None = None) -> Path:
    """n training JPEGs of 500x375 at quality 90 (synthetic_jpeg's pictures) and 2% more for validation, in an
    image-folder tree, in parallel; reused."""
    from concurrent.futures import ProcessPoolExecutor

    done = root / "done.json"
    total = n + max(classes, n // 50)
    if done.is_file() and json.loads(done.read_text()).get("train") == n:
        return root
    shutil.rmtree(root, ignore_errors=True)  # another size or a half-written set: start clean
    chunk = 500
    t = time.time()
    with ProcessPoolExecutor(procs or os.cpu_count()) as ex:
        list(
            ex.map(_write_chunk, [(str(root), s, min(chunk, total - s), classes, 0, n) for s in range(0, total, chunk)])
        )
    done.write_text(json.dumps({"train": n, "val": total - n, "seconds": time.time() - t}))
    return root


ALL_BACKENDS = ("cpu", "gpu", "dali")  # M2's loaders (M3 picks the fastest)
# M2's variants under the names data.backend takes (M2["by_backend"]: the figures auto's rule reads).
BACKEND_KEY = {
    "cpu backend": "cpu",
    "gpu backend, cpu_fraction 0": "gpu",
    "gpu backend, cpu_fraction auto": "gpu_split_auto",
    "dali backend": "dali",
}


def jpeg_cfg(root: Path, backend: str, *extra: str) -> list[str]:
    workers = SIZE["workers"]
    return [
        "data.dataset=image_folder",
        f"data.root={root}",
        f"data.backend={backend}",
        f"data.batch_size={SIZE['jpeg_batch']}",
        f"run.device={SIZE['device']}",
        f"data.num_workers={workers}",
        "data.decoder=auto",
        "data.train.transforms=[{random_resized_crop: {size: 224}}, hflip, {normalize: imagenet}]",
        "data.eval.transforms=[{resize: 256}, {center_crop: 224}, {normalize: imagenet}]",
        *extra,
    ]


# ---------------------------------------------------------------- M2: loader only


def loader_rate(overrides: list[str], epochs: int) -> dict:
    from torchsprint import config, runtime
    from torchsprint.data import build_loaders

    cfg = config.load(None, overrides)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    tr = build_loaders(cfg.data, rt, seed=0).train
    rates, thread_ms = [], []
    for e in range(epochs):
        stats: dict = {}
        rates.append(time_epoch(tr, e, stats=stats))
        if stats["thread_cpu_ms_per_batch"] is not None:
            thread_ms.append(stats["thread_cpu_ms_per_batch"])
    out = {
        "images_per_s": sorted(rates)[len(rates) // 2],
        "runs": rates,
        # the consuming thread's own CPU per next() (the gpu backend's goal is <= 1 ms a batch of 256)
        "thread_cpu_ms_per_batch": sorted(thread_ms)[len(thread_ms) // 2] if thread_ms else None,
    }
    for attr in ("cpu_fraction", "cpu_fallbacks"):
        if hasattr(tr, attr):
            out[attr] = getattr(tr, attr)
    return out


def profile_gpu_loader(overrides: list[str], batches: int = 12) -> str:
    """torch.profiler over `batches` batches of the gpu backend: where the loader's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from torchsprint import config, runtime
    from torchsprint.data import build_loaders

    cfg = config.load(None, overrides)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    tr = build_loaders(cfg.data, rt, seed=0).train
    tr.set_epoch(0)
    it = iter(tr)
    batches = min(batches, len(tr) - 3)
    for _ in range(3):
        next(it)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda() else [])]) as prof:
        for _ in range(batches):
            x, _ = next(it)
            x.sum()
        sync()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    if not cuda():
        return table
    return table + "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def m2(res: Results, deadline: float, root: Path, backends: set[str]) -> None:
    from torchsprint.data.backends.dali import dali_available

    n = SIZE["jpegs"]
    make_jpegs(root, n)
    epochs = SIZE["m2_epochs"]
    workers = SIZE["workers"]
    out: dict = {
        "train_images": n,
        "jpeg": "500x375 quality 90",
        "batch": SIZE["jpeg_batch"],
        "workers": workers,
        "goal": {"gpu_backend": 8000, "stretch": 20000, "anchor_batched_nvjpeg_A100": 7800},
        "images_per_s": {},
    }
    variants = {
        f"cpu backend, {workers} workers": jpeg_cfg(root, "cpu"),
        "gpu backend, cpu_fraction 0": jpeg_cfg(root, "gpu", "data.cpu_fraction=0.0"),
        "gpu backend, cpu_fraction auto": jpeg_cfg(root, "gpu", "data.cpu_fraction=auto"),
    }
    if dali_available() and "dali" in backends:
        variants["dali backend"] = jpeg_cfg(root, "dali")
        out["dali"] = "measured"
    elif "dali" in backends:
        out["images_per_s"]["dali backend"] = None
        out["dali"] = (
            "not measured: NVIDIA DALI is not installed on the device; its CUDA 13 wheel and what it "
            "needs (170 MiB packed) travel in parts: benchmarks/gpu/fetch_wheels.sh --dali, run_all.sh dali"
        )
    # --backends dali (run_all.sh dali, a later call): only DALI here; merge_results.py merges M2 key by key
    variants = {k: v for k, v in variants.items() if k.split()[0] in backends}
    out["details"] = {}
    for name, over in variants.items():
        if left(deadline) < 45:
            out["details"][name] = {"skipped": "time budget of this call"}
            continue
        try:
            r = loader_rate(over, epochs)
            out["images_per_s"][name] = r["images_per_s"]
            out["details"][name] = r
            # For data.backend: auto's rule: images/s per backend for a folder of JPEGs on this device,
            # keyed by the backend's name; merge_results.py adds "fastest" once every call's figures are merged.
            out.setdefault("by_backend", {})[BACKEND_KEY[name.split(",")[0] if name.startswith("cpu") else name]] = r[
                "images_per_s"
            ]
            print(
                f"M2 {name}: {r['images_per_s']:.0f} images/s, training thread {r['thread_cpu_ms_per_batch']} ms CPU "
                "per batch",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            out["details"][name] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
            print(f"M2 {name}: FAILED {e}", flush=True)
        res.put("M2", out)
    if "cpu" not in backends:
        res.put("M2", out)
        return
    cpu_loader_cfg = variants[f"cpu backend, {workers} workers"]
    try:
        from torchsprint import config, runtime
        from torchsprint.data import build_loaders

        cfg = config.load(None, [*cpu_loader_cfg, "run.device=cpu", "data.num_workers=0"])  # normalises on the CPU
        tr = build_loaders(cfg.data, runtime.setup(cfg.run, cfg.strategy, cfg.speed), seed=0).train
        out["images_per_s"]["cpu backend per core (CPU time)"] = 1 / cpu_seconds_per_image(tr, False)
    except Exception as e:  # noqa: BLE001
        out["details"]["cpu backend per core"] = {"error": str(e)[:300]}
    if left(deadline) > 40 and "gpu" in backends:
        try:
            table = profile_gpu_loader(variants["gpu backend, cpu_fraction 0"])
            (LOGS / "m2_profile.txt").write_text(table)
            out["profile"] = "m2_profile.txt"
        except Exception as e:  # noqa: BLE001
            out["profile"] = f"failed: {e}"[:300]
    res.put("M2", out)


# ---------------------------------------------------------------- M3: end to end


def end_to_end_rate(overrides: list[str], steps: int, warmup: int) -> dict:
    """images/s and data-wait share of build_training + train_step on real JPEG batches."""
    from torchsprint import config, runtime
    from torchsprint.train.build import build_training
    from torchsprint.train.engine import train_step

    cfg = config.load(None, overrides)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    b = build_training(cfg, rt, lambda msg: None)
    b.model.train()
    epoch, it = 0, None

    def batch():
        nonlocal epoch, it
        while True:
            if it is None:
                b.loaders.train.set_epoch(epoch)
                it = iter(b.loaders.train)
            nxt = next(it, None)
            if nxt is not None:
                return nxt
            epoch, it = epoch + 1, None

    for _ in range(warmup):
        train_step(b, [batch()])
    sync()
    wait, images, loader_cpu = 0.0, 0, 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        tw, cw = time.perf_counter(), time.thread_time()
        x, y = batch()
        wait += time.perf_counter() - tw
        loader_cpu += time.thread_time() - cw  # the training thread's own CPU in the loader (its host work)
        train_step(b, [(x, y)])
        images += x.shape[0]
    sync()
    seconds = time.perf_counter() - t0
    return {
        "images_per_s": images / seconds,
        "data_wait_share": wait / seconds,
        "steps": steps,
        "loader_thread_cpu_ms_per_batch": 1e3 * loader_cpu / steps,
    }


def m3(res: Results, deadline: float, root: Path, previous: dict, backends: set[str]) -> None:
    """End to end with the fastest M2 backend among `backends`; the figures also go under by_backend[name], so
    a later call's run with another backend (run_all.sh dali) merges beside them."""
    m = previous | res.data["measurements"]
    m2r = (m.get("M2") or {}).get("images_per_s") or {}
    best_backend = "gpu" if "gpu" in backends and cuda() else "cpu" if "cpu" in backends else sorted(backends)[0]
    measured = {k: v for k, v in m2r.items() if v and "per core" not in k and k.split()[0] in backends}
    if measured:
        best = max(measured, key=measured.get)
        best_backend = "dali" if best.startswith("dali") else "gpu" if best.startswith("gpu") else "cpu"
    r18 = (m.get("M1") or {}).get("resnet18") or {}
    switches = {
        "amp_bf16 + channels_last + compile": ["speed.compile=true"],
        "amp_bf16 + channels_last + cuda_graphs": ["speed.cuda_graphs=true"],
        "amp_bf16 + channels_last + compile reduce-overhead": [
            "speed.compile=true",
            "speed.compile_mode=reduce-overhead",
        ],
        "amp_bf16 + channels_last": ["speed.cuda_graphs=false"],
    }  # auto would add graphs on CUDA
    rated = {k: r18[k]["images_per_s"] for k in switches if "images_per_s" in (r18.get(k) or {})}
    if not rated and left(deadline) > 240:  # no M1 figures from this or an earlier call: measure the reference here
        for k in ("amp_bf16 + channels_last + cuda_graphs", "amp_bf16 + channels_last"):
            try:
                rated[k] = model_step_rate("resnet18", M1_VARIANTS[k], SIZE["m1_batch"], *SIZE["m1_steps"])[
                    "images_per_s"
                ]
            except Exception as e:  # noqa: BLE001
                print(f"M3 reference {k}: FAILED {e}", flush=True)
    chosen = max(rated, key=rated.get) if rated else "amp_bf16 + channels_last"
    make_jpegs(root, SIZE["jpegs"])
    over = jpeg_cfg(
        root,
        best_backend,
        "model.name=resnet18",
        "precision=amp_bf16",
        "speed.channels_last=true",
        "log.tensorboard=false",
        *switches[chosen],
    )
    out = {"backend": best_backend, "switches": chosen, "goal_ratio": 0.90, "stretch_ratio": 0.95}
    if left(deadline) < 40:  # 175 steps took ~10 s on the H200 (2026-11-26), the build a few more
        out["skipped"] = "time budget of this call"
    else:
        try:
            r = end_to_end_rate(over, *SIZE["m3_steps"])
            out.update(r)
            ref = rated.get(chosen)
            out["m1_images_per_s"] = ref
            out["ratio_to_m1"] = r["images_per_s"] / ref if ref else None
            print(
                f"M3 {best_backend} + {chosen}: {r['images_per_s']:.0f} images/s, data wait "
                f"{r['data_wait_share']:.1%}, loader on the training thread {r['loader_thread_cpu_ms_per_batch']:.2f} "
                f"ms CPU per batch, ratio to M1 {out['ratio_to_m1']}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"[:500]
            out["trace"] = traceback.format_exc()[-2000:]
    if backends != {"dali"}:
        res.put("M3", out | {"by_backend": {best_backend: dict(out)}})
    else:  # DALI alone, in a later call (window.sh 3): its figures under by_backend beside the headline's
        res.put("M3", {"by_backend": {best_backend: out}})


# ---------------------------------------------------------------- M4: memory backend, CIFAR-sized


def register_random_cifar(n: int = 50000) -> None:
    """`random_cifar`: n random 32x32 RGB uint8 images, 10 classes, 1,000 for validation (shape and size of
    CIFAR-10's training set; throughput does not depend on the pixels)."""
    from torchsprint.data.core import DATASETS, Splits, TensorImages

    if "random_cifar" in DATASETS:
        return

    @DATASETS.register("random_cifar")
    def random_cifar(data_cfg):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (n + 1000, 3, 32, 32), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n + 1000,), generator=g)
        return Splits(TensorImages(x[:n], y[:n]), TensorImages(x[n:], y[n:]), [str(i) for i in range(10)], 3)


def m4(res: Results, deadline: float) -> None:
    from torchsprint import config, runtime
    from torchsprint.train.build import build_training
    from torchsprint.train.engine import train_step

    register_random_cifar(SIZE["cifar"])
    over = [
        "data.dataset=random_cifar",
        "data.backend=memory",
        f"data.batch_size={SIZE['cifar_batch']}",
        "model.name=cifar_resnet18",
        f"run.device={SIZE['device']}",
        "precision=amp_bf16",
        "speed.channels_last=true",
        "log.tensorboard=false",
        "data.train.transforms=[{random_crop: {size: 32, padding: 4}}, hflip, {normalize: cifar10}]",
        "data.eval.transforms=[{normalize: cifar10}]",
    ]
    out: dict = {
        "images": SIZE["cifar"],
        "model": "cifar_resnet18",
        "batch": SIZE["cifar_batch"],
        "switches": "amp_bf16 + channels_last",
        "goal_loader_share": 0.05,
    }
    if left(deadline) < 30:  # three epochs of 50,000 (1.1 s each) and the build: ~10 s on the H200 (2026-11-26)
        out["skipped"] = "time budget of this call"
        res.put("M4", out)
        return
    try:
        cfg = config.load(None, over)
        rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
        b = build_training(cfg, rt, lambda msg: None)
        tr = b.loaders.train
        tr.set_epoch(0)
        for x, y in tr:  # warm-up epoch: cuDNN autotuning, allocator
            train_step(b, [(x, y)])
        sync()
        tr.set_epoch(1)
        t = time.perf_counter()
        for x, y in tr:
            train_step(b, [(x, y)])
        sync()
        epoch_s = time.perf_counter() - t
        tr.set_epoch(2)
        t = time.perf_counter()
        for x, _ in tr:  # the loader alone: gather + batched crop/flip + normalise, same batches
            x.sum()
        sync()
        loader_s = time.perf_counter() - t
        out.update(
            {
                "seconds_per_epoch": epoch_s,
                "images_per_s": out["images"] / epoch_s,
                "loader_seconds_per_epoch": loader_s,
                "loader_share": loader_s / epoch_s,
            }
        )
        print(f"M4: {epoch_s:.2f} s/epoch, loader {loader_s / epoch_s:.1%} of it", flush=True)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["trace"] = traceback.format_exc()[-2000:]
    res.put("M4", out)


# ---------------------------------------------------------------- M5: torchsprint bench


# `torchsprint bench` on the 224-pixel JPEG config: the variants that fit the call. Left out: the memory loader
# (it decodes all 20,000 JPEGs into GPU memory in every repeat's process, about a minute each), compile (a
# cold ResNet-18 compile per process), the foreach optimizer (fused is the default on CUDA anyway).
JPEG_BENCH_VARIANTS = (
    "+ tuned cpu loader,+ gpu loader,+ dali,+ tf32 + cudnn autotune,+ channels_last,+ amp_bf16,"
    "+ cuda graphs,best,your config"
)


def run_bench(name: str, args: list[str], folder: Path, timeout: float, variants: str | None = None) -> dict:
    """`torchsprint bench` in its own process group: at the time limit the whole tree (the bench and the variant
    process it waits on, which holds the GPU) is killed, and the variants measured by then are kept (bench
    rewrites bench.json after each)."""
    import signal

    steps, warmup, repeats = SIZE["bench"]
    variants = SIZE["bench_variants"] or variants
    cmd = [
        sys.executable,
        "-m",
        "torchsprint",
        "bench",
        *args,
        "--out",
        str(folder),
        "--steps",
        steps,
        "--warmup",
        warmup,
        "--repeats",
        repeats,
        *(["--variants", variants] if variants else []),
    ]
    t = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder.parent, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    out = {"command": " ".join(cmd[1:]), "seconds": time.time() - t, "exit_code": proc.returncode}
    (LOGS / f"m5_{name}.log").write_text(stdout + "\n" + stderr)
    if timed_out:
        out["error"] = f"stopped at the call's time limit ({timeout:.0f} s); the variants measured by then are kept"
    if (folder / "bench.json").is_file():
        rows = json.loads((folder / "bench.json").read_text())["rows"]
        out["rows"] = rows
        out["images_per_s"] = {r.get("variant"): r.get("images_per_s") for r in rows}
    elif not timed_out:
        out["error"] = (stderr or stdout)[-1500:]
    return out


def m5(res: Results, deadline: float, root: Path, configs: set[str]) -> None:
    work = root.parent / "torchsprint-m5"  # bench folders stay off $OUT (few files may come back); logs go there
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    make_jpegs(root, SIZE["jpegs"])
    jpeg_yaml = work / "jpeg224.yaml"
    lines = ["model: {name: resnet18}", "log: {tensorboard: false}"]
    jpeg_yaml.write_text("\n".join(lines) + "\n")
    for name, args, variants in (
        ("default run", [], None),
        ("jpeg 224", ["-c", str(jpeg_yaml), *jpeg_cfg(root, "cpu")], JPEG_BENCH_VARIANTS),
    ):
        if name not in configs:
            continue
        budget = left(deadline) - 20
        if budget < (60 if cuda() else 30):  # a bench stopped at its limit keeps the variants measured
            out[name] = {"skipped": "time budget of this call"}
            continue
        folder = work / name.replace(" ", "_")
        shutil.rmtree(folder, ignore_errors=True)  # a bench.json from an earlier call must not pass for this one's
        out[name] = run_bench(name.replace(" ", "_"), args, folder, budget, variants)
        print(f"M5 {name}: exit {out[name]['exit_code']} in {out[name]['seconds']:.0f} s", flush=True)
        out["images_per_s"] = {
            f"{config} | {variant}": v
            for config in ("default run", "jpeg 224")
            for variant, v in (out.get(config, {}).get("images_per_s") or {}).items()
        }
        res.put("M5", out)
    res.put("M5", out)


# ---------------------------------------------------------------- M6: predict


def m6(res: Results, deadline: float) -> None:
    path = LOGS / "m6_predict.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serve.predict_throughput",
        "--device",
        SIZE["device"],
        "--images",
        SIZE["predict_images"],
        "--repeats",
        "3" if cuda() else "1",
        "--json",
        str(path),
    ]
    out: dict = {"command": " ".join(cmd[1:])}
    try:
        import onnxruntime as ort

        out["onnxruntime_providers"] = ort.get_available_providers()
    except ImportError:
        out["onnxruntime_providers"] = "onnxruntime not installed"
    if left(deadline) < 35:  # ~25 s on the H200 (2026-11-26)
        out["skipped"] = "time budget of this call"
    else:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, left(deadline) - 10), cwd=REPO)
        out["exit_code"] = p.returncode
        out["table"] = p.stdout[-3000:]
        if path.is_file():
            rows = json.loads(path.read_text())["rows"]
            out["rows"] = rows
            out["images_per_s"] = {f"{r['case']} | {r['backend']}": r["end_to_end_images_per_s"] for r in rows}
        else:
            out["error"] = p.stderr[-1500:]
    res.put("M6", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results.json", help="the results JSON (updated in place after each measurement)")
    ap.add_argument("--only", default="M1,M2,M3,M4,M5,M6", help="comma-separated measurements to run")
    ap.add_argument("--deadline-s", type=float, default=540, help="stop starting measurements after this many seconds")
    ap.add_argument("--quick", action="store_true", help="small sizes (a short GPU run, not figures to publish)")
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="every measurement's code on the CPU with tiny sizes: a rehearsal without a GPU, no figures",
    )
    ap.add_argument("--data", default="/tmp/torchsprint-m2", help="where the generated JPEGs live")
    ap.add_argument(
        "--backends",
        default=",".join(ALL_BACKENDS),
        help="M2/M3: the loaders to measure (run_all.sh dali passes dali alone, in a later call)",
    )
    ap.add_argument(
        "--previous", action="append", default=[], help="results JSON of an earlier call (M3 reads M1/M2 there)"
    )
    ap.add_argument(
        "--m5-configs",
        default="default run,jpeg 224",
        help="M5: which `torchsprint bench` configs (window.sh runs the JPEG one; the default run's was measured)",
    )
    ap.add_argument(
        "--make-data",
        type=int,
        metavar="PROCESSES",
        default=0,
        help="only generate M2/M3/M5's JPEGs (in PROCESSES processes) and exit: window.sh runs this beside "
        "the gpu tests, so the measurements find them made",
    )
    args = ap.parse_args()
    global LOGS
    LOGS = Path(args.out).resolve().parent
    previous: dict = {}
    for f in args.previous:
        if Path(f).is_file():
            previous |= json.loads(Path(f).read_text()).get("measurements", {})
    global SIZE
    SIZE = SIZES["smoke" if args.smoke_cpu else "quick" if args.quick else "full"]
    if args.make_data:
        t = time.time()
        make_jpegs(Path(args.data), SIZE["jpegs"], procs=args.make_data)
        print(f"{SIZE['jpegs']} JPEGs in {args.data} ({time.time() - t:.0f} s, {args.make_data} processes)", flush=True)
        return
    if cuda() and not torch.cuda.is_available():
        sys.exit("measure.py needs a CUDA GPU (--smoke-cpu rehearses its code on the CPU)")
    res = Results(Path(args.out), " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    root = Path(args.data)
    todo = [m.strip() for m in args.only.split(",") if m.strip()]
    backends = {b.strip() for b in args.backends.split(",") if b.strip()}
    if not backends <= set(ALL_BACKENDS):
        sys.exit(f"--backends: {sorted(backends - set(ALL_BACKENDS))} unknown; use some of {ALL_BACKENDS}")
    table = {
        "M1": lambda: m1(res, args.deadline_s),
        "M2": lambda: m2(res, args.deadline_s, root, backends),
        "M3": lambda: m3(res, args.deadline_s, root, previous, backends),
        "M4": lambda: m4(res, args.deadline_s),
        "M5": lambda: m5(res, args.deadline_s, root, {c.strip() for c in args.m5_configs.split(",")}),
        "M6": lambda: m6(res, args.deadline_s),
    }
    for key in todo:
        print(f"== {key} ({left(args.deadline_s):.0f} s left)", flush=True)
        try:
            table[key]()
        except Exception as e:  # noqa: BLE001 - record and go on to the next measurement
            res.put(key, {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]})
    print(
        json.dumps(
            {k: v.get("images_per_s") if isinstance(v, dict) else v for k, v in res.data["measurements"].items()},
            indent=1,
            default=str,
        )[:4000]
    )


if __name__ == "__main__":
    main()

"""The first GPU run's defects on a real GPU (../shared/gpu-runs/2026-11-26-h200): each defect has a test here that
fails without its fix, and the behaviour it asks for (every backend trains, exact resume, AMP accuracy, no host sync,
graphs and compile really used, GPU/CPU preprocessing parity, nvJPEG fallback, ONNX/TensorRT/predict on CUDA).

All tests are marked `gpu` (skipped on CPU machines). Bounds marked "provisional" were set before the
first GPU run: the test reports the measured number through the `figure` fixture (collected by
benchmarks/gpu/run_all.sh into results.json); set the bound to 3x the measured value afterwards.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from paths import DATA
from torchsprint import config
from torchsprint.data import DATASETS, build_loaders
from torchsprint.data.backends.gpu import build_gpu_loaders
from torchsprint.data.preprocess.on_device import decode_on_device
from torchsprint.models.core import MODELS
from torchsprint.runtime.core import Runtime
from torchsprint.train.context import Trainable
from torchsprint.train.run import train

pytestmark = pytest.mark.gpu

CUDA = Runtime(torch.device("cuda")) if torch.cuda.is_available() else None
CPU = Runtime(torch.device("cpu"))
LEVELS = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255  # imagenet-normalised units -> uint8 levels
VARIANTS = DATA / "jpeg_variants"
QUIET = ["log.tensorboard=false", "log.progress=false", "eval.per_class=false"]


@MODELS.register("det_cnn")
def det_cnn(num_classes: int, in_channels: int = 3, width: int = 8) -> nn.Module:
    """conv-BN-ReLU x2 and a spatial mean: no op that torch flags as nondeterministic on CUDA
    (AdaptiveAvgPool2d's and MaxPool2d's backward are), so run.deterministic can be strict with it."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, 2, 1),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Conv2d(width, 2 * width, 3, 2, 1),
                nn.BatchNorm2d(2 * width),
                nn.ReLU(),
            )
            self.head = nn.Linear(2 * width, num_classes)

        def forward(self, x):
            return self.head(self.body(x).mean((2, 3)))

    return Net()


def jpeg_data(root, *extra, n=120, size="[64, 48]", classes=4, val=40):
    return [
        "data.dataset=synthetic_jpeg",
        f"data.root={root}",
        f"data.options={{num_images: {n}, val_images: {val}, size: {size}, classes: {classes}}}",
        "data.batch_size=16",
        "data.num_workers=2",
        "data.train.transforms=[{random_resized_crop: {size: 32}}, hflip, {normalize: imagenet}]",
        "data.eval.transforms=[{resize: 36}, {center_crop: 32}, {normalize: imagenet}]",
        *extra,
    ]


def train_losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x["train/loss"] for x in lines if x["kind"] == "train"]


# ---------------------------------------------------------------- defect 1: decode and stream order


def test_decode_never_writes_memory_the_callers_stream_still_reads(figure):
    """pytorch/vision#9606's harness: tensors with known contents, a long kernel queued, one reduction
    per tensor queued behind it, the tensors freed (their blocks go back to the caller stream's pool)
    while the reductions still wait, then a decode. torchvision's nvJPEG path allocates its outputs on
    the caller's stream and its hardware engine writes them at once; decode_on_device decodes on a
    stream of its own, so no freed block with pending reads is handed to the decoder."""
    from torchvision.io import ImageReadMode, decode_jpeg

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (375, 500, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    data = [torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)] * 4
    numel = 375 * 500 * 3 // 4  # victims of the decoded image's byte size, so their blocks fit its outputs

    def corrupted(decode, iterations=40) -> int:
        bad = 0
        for _ in range(iterations):
            victims = [torch.full((numel,), float(i + 1), device="cuda") for i in range(8)]
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # ~50 ms of queued work on the caller's stream
            sums = [v.sum() for v in victims]
            del victims
            decode()
            torch.cuda.synchronize()
            bad += any(float(s) != (i + 1) * numel for i, s in enumerate(sums))
        return bad

    plain = corrupted(lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda"))
    ours = corrupted(lambda: decode_on_device(data, torch.device("cuda")))
    figure("decode_jpeg_corrupted_iterations", plain, "of 40, torchvision's call as is")
    assert ours == 0
    if plain == 0:  # then this machine cannot tell the fix from no fix: say so instead of passing
        pytest.skip(
            "torchvision's decode_jpeg showed no corruption in 40 iterations here (pytorch/vision#9606 did "
            "not reproduce): decode_on_device was clean, but the harness is not shown to be sensitive"
        )


def test_the_decode_stream_is_never_a_prefetch_stream():
    """torch.cuda.Stream() hands out 32 pooled streams per priority in turn; the prefetcher takes one per
    loader pass, so a decode stream from the same pool was the prefetch stream of one pass in 32, and the
    decode's ordering (wait_stream, record_stream on itself) did nothing there."""
    from torchsprint.data.preprocess.on_device import decode_stream

    dev = torch.device("cuda")
    ours = decode_stream(dev)
    assert all(torch.cuda.Stream(dev) != ours for _ in range(70))  # two full turns of the default pool
    with torch.cuda.stream(ours), pytest.raises(RuntimeError, match="decode stream as the current stream"):
        decode_on_device([torch.zeros(4, dtype=torch.uint8)], dev)


def test_a_deterministic_run_after_other_cuda_work_in_one_process(tmp_path):
    """PyTorch reads CUBLAS_WORKSPACE_CONFIG once, at the process's first cuBLAS call: set only when a
    deterministic run starts, it came too late after any earlier matrix product, and the run raised
    "Deterministic behavior was enabled ... CUBLAS_WORKSPACE_CONFIG". A fresh process, as a user's script."""
    overrides = [
        *jpeg_data(tmp_path / "d", n=64),
        "model.name=linear",
        "run.deterministic=true",
        "run.epochs=1",
        f"run.dir={tmp_path / 'run'}",
        *QUIET,
    ]
    script = (
        "import torch, torchsprint\n"
        "a = torch.randn(64, 64, device='cuda', requires_grad=True)\n"
        "(a @ a).sum().backward()\n"  # cuBLAS, non-deterministic mode
        "from torchsprint import config\n"
        "from torchsprint.train.run import train\n"
        f"s = train(config.load(None, {overrides!r}), quiet=True)\n"
        "print('ok', s['final']['val/top1'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_gpu_loader_batches_equal_a_synchronous_decode_over_many_batches(tmp_path):
    """The pipelined loader (decode + crop of batch i+1 on a side stream while the main stream is busy)
    against the same items assembled one at a time with the device idle: bit for bit, 30 batches."""
    d = config.load(None, jpeg_data(tmp_path, "data.num_workers=4", n=480, size="[500, 375]")).data
    splits = DATASETS.get("synthetic_jpeg")(d)
    tr = build_gpu_loaders(d, splits, CUDA, seed=0).train
    tr.set_epoch(0)
    keys = list(tr.batches)
    ds = tr.loader.dataset
    ref = []
    for k in keys:
        torch.cuda.synchronize()
        x, y = tr._assemble(ds[k])
        torch.cuda.synchronize()
        ref.append((x.cpu(), y.cpu()))
    assemble = tr._assemble

    def slow_assemble(item):  # runs on the prefetch stream: ~10 ms of queued work before its kernels, so a
        torch.cuda._sleep(20_000_000)  # consumer that did not wait_stream would read batches not yet written
        return assemble(item)

    tr._assemble = slow_assemble
    tr.set_epoch(0)
    got = []
    for x, y in tr:
        got.append((x.clone(), y.clone()))  # read at once, as a training step's first kernel would
        torch.cuda._sleep(20_000_000)  # then the "training step", while batch i+1 is prepared
    assert len(got) == len(ref) == 30
    for (a, ya), (b, yb) in zip(got, ref):
        assert torch.equal(a.cpu(), b) and torch.equal(ya.cpu(), yb)


# ---------------------------------------------------------------- defect 2: CUDA graphs


def bn_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 16 * 16, 5),
    ).cuda()


def accumulate(model, batches):
    model.train()
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        (nn.functional.cross_entropy(model(x), y) / len(batches)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_cuda_graphs_accumulate_gradients_like_eager(figure):
    """4 micro-batches through the captured graph against the same model run eagerly. Without the
    gradient-copy hook, .grad aliases the graph's static buffer: micro-batches 1-3 lost, 4 doubled."""
    from torchsprint.runtime.parallel import CudaGraphed

    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (torch.randn(8, 3, 16, 16, device="cuda", generator=g), torch.randint(0, 5, (8,), device="cuda", generator=g))
        for _ in range(4)
    ]
    eager = bn_net()
    graphed = CudaGraphed(copy.deepcopy(eager), batches[0][0], None)
    ref = accumulate(eager, batches)
    got = accumulate(graphed, batches)
    worst = max(
        float(((got[f"module.{n}"] if f"module.{n}" in got else got[n]) - g_).abs().max() / g_.abs().max())
        for n, g_ in ref.items()
    )
    figure("cuda_graphs_accumulation_rel_diff", worst, "graphed vs eager, 4 micro-batches")
    assert graphed.replays == 4
    assert worst < 1e-4  # provisional: same kernels eager and captured; the bug gives differences of order 1


def test_cuda_graphs_keep_frozen_batchnorm_in_eval_mode():
    """model.freeze_bn_stats: a frozen BatchNorm uses and keeps its running statistics in the graph too."""
    from torchsprint.models.init import frozen_norm_layers
    from torchsprint.runtime.parallel import capture_cuda_graphs

    net = bn_net()
    for p in net[1].parameters():
        p.requires_grad_(False)
    before = net[1].running_mean.clone()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    graphed = capture_cuda_graphs(net, lambda: x, None, frozen_norms=frozen_norm_layers)  # what train/run.py passes
    graphed.train()
    for _ in range(3):
        graphed(x * 3 + 1).sum().backward()  # inputs whose batch statistics differ from the running ones
    assert graphed.replays == 3 and torch.equal(net[1].running_mean, before)
    assert not torch.equal(net[4].running_mean, torch.zeros(8, device="cuda"))  # the unfrozen one still learns


def test_cuda_graphs_really_replay_in_training(tmp_path):
    """speed.cuda_graphs through wrap_model and train_step: every full training batch is a replay."""
    from torchsprint.runtime.parallel import wrap_model
    from torchsprint.state.precision import Precision
    from torchsprint.train.context import Trainable
    from torchsprint.train.engine import train_step
    from torchsprint.train.plan import decide_speed

    cfg = config.load(None, ["speed.cuda_graphs=true", "precision=amp_bf16"])
    prec = Precision("amp_bf16", CUDA.device, graph_safe=True)
    x, y = torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 5, (16,), device="cuda")
    net = bn_net()
    model = wrap_model(
        net,
        cfg.strategy,
        CUDA,
        speed=decide_speed(cfg.speed, cfg.strategy, net, CUDA.device),
        prec=prec,
        example=lambda: x,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), [(x, y)])
    assert model.replays == 5


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_really_compiles_on_gpu(mode):
    """speed.compile with inductor on CUDA: every frame compiled, forward and backward graphs, no breaks;
    reduce-overhead also runs CUDA graphs (no cudagraph skips)."""
    from torch._dynamo.utils import counters

    from torchsprint.runtime.parallel import wrap_model
    from torchsprint.state.precision import Precision
    from torchsprint.train.engine import train_step
    from torchsprint.train.plan import decide_speed

    torch._dynamo.reset()
    counters.clear()
    cfg = config.load(None, ["speed.compile=true", *([f"speed.compile_mode={mode}"] if mode else [])])
    prec = Precision("amp_bf16", CUDA.device)
    net = bn_net()
    model = wrap_model(
        net, cfg.strategy, CUDA, speed=decide_speed(cfg.speed, cfg.strategy, net, CUDA.device), prec=prec
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 5, (16,), device="cuda")
    for _ in range(4):
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), [(x, y)])
    frames = counters["frames"]
    assert frames["ok"] >= 1 and frames["ok"] == frames["total"], dict(frames)
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1
    assert sum(counters["graph_break"].values()) == 0
    if mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# ---------------------------------------------------------------- defect 3: files nvJPEG rejects


def variant_folder(root: Path) -> Path:
    from test_data_gpu_backend import pillow_variants

    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True, exist_ok=True)
        pillow_variants(root / split / "a")
    return root


@pytest.mark.parametrize("force_nvjpeg", [False, True], ids=["routed-by-header", "every-file-to-nvjpeg"])
def test_every_file_a_decoder_reads_is_trained_on(tmp_path, monkeypatch, figure, force_nvjpeg):
    """CMYK, gray, progressive, lossless, arithmetic-coded and 12-bit JPEGs on the gpu backend. Routed by
    header, nvJPEG sees only what it takes; sent to nvJPEG regardless (the header check bypassed), what
    it rejects comes back through the CPU fallback. Either way only the 12-bit file (no decoder here
    reads it) is a bad sample."""
    import torchsprint.data.backends.gpu as gpu

    if force_nvjpeg:
        monkeypatch.setattr(gpu, "nvjpeg_ok", lambda header: header.format == "jpeg")
    root = variant_folder(tmp_path / "v")
    d = config.load(
        None,
        [
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.batch_size=8",
            "data.drop_last=false",
            "data.on_bad_sample=skip",
            "data.cpu_fraction=0.0",
            "data.train.transforms=[{center_crop: 24}, {normalize: imagenet}]",
            "data.eval.transforms=[{center_crop: 24}, {normalize: imagenet}]",
        ],
    ).data
    tr = build_gpu_loaders(d, DATASETS.get("image_folder")(d), CUDA, seed=0).train
    tr.set_epoch(0)
    n = sum(len(x) for x, _ in tr)
    figure(f"nvjpeg_cpu_fallbacks_{'forced' if force_nvjpeg else 'routed'}", tr.cpu_fallbacks, "files nvJPEG rejected")
    skipped = [s.split(":")[0].split("/")[-1] for s in tr.skipped]
    if force_nvjpeg:  # nvJPEG may read the 12-bit file that no CPU decoder here reads: then nothing is skipped
        figure("nvjpeg_reads_12bit", int(not skipped), "1: CUDA's nvJPEG decoded 12bit.jpg")
        assert n + len(skipped) == 7 and skipped in ([], ["12bit.jpg"])
    else:
        assert n == 6 and skipped == ["12bit.jpg"]


def test_predict_on_cuda_reads_every_variant_and_mixes_tensors_with_files(tmp_path, monkeypatch):
    """Predict on CUDA: tensors and files in one call (they failed to stack across devices), every
    readable variant predicted, the 12-bit one an error entry; the tensors (same CPU preprocessing on
    both) get the CPU predictor's top-1 class."""
    from torchsprint.commands.predict import Predictor

    run = tmp_path / "run"
    train(
        config.load(
            None,
            [
                *jpeg_data(tmp_path / "d"),
                f"run.dir={run}",
                "run.epochs=1",
                "run.device=cpu",
                *QUIET,
                "model.args={width: 8}",
            ],
        ),
        quiet=True,
    )
    files = sorted(str(p) for p in variant_folder(tmp_path / "v").rglob("train/a/*.jpg"))
    tensor = torch.randint(0, 255, (3, 40, 30), dtype=torch.uint8)
    inputs = [tensor, *files, tensor]
    # cuDNN convolutions default to TF32, which can swap a near tie of this one-epoch model on a noise image;
    # this test is about mixing tensors and files, so both sides compute in full fp32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gpu = Predictor.from_run(run, device="cuda").predict(inputs, topk=1)
    cpu = Predictor.from_run(run, device="cpu").predict(inputs, topk=1)
    errors = [r["input"].split("/")[-1] for r in gpu if "error" in r]
    assert errors == ["12bit.jpg"] and all("top" in r for r in gpu if "error" not in r)
    for i in (0, len(inputs) - 1):
        assert gpu[i]["top"][0]["class"] == cpu[i]["top"][0]["class"]


# ---------------------------------------------------------------- defect 5: export on CUDA


def test_onnx_export_and_predict_on_cuda(tmp_path):
    import onnxruntime as ort

    from torchsprint.commands.export import export
    from torchsprint.commands.predict import Predictor

    run = tmp_path / "run"
    train(
        config.load(
            None, [*jpeg_data(tmp_path / "d"), f"run.dir={run}", "run.epochs=1", *QUIET, "model.args={width: 8}"]
        ),
        quiet=True,
    )
    r = export(run, "onnx", uint8_input=True)
    files = sorted(str(p) for p in (tmp_path / "d").rglob("val/*/*.jpg"))[:32]
    onnx_pred = Predictor.from_file(r["path"], device="cuda").predict(
        files, topk=1
    )  # onnxruntime's CUDA provider if any
    torch_pred = Predictor.from_run(run, device="cpu").predict(files, topk=1)  # the same CPU decoding as the onnx path
    agree = np.mean([a["top"][0]["class"] == b["top"][0]["class"] for a, b in zip(onnx_pred, torch_pred)])
    print("onnxruntime providers here:", ort.get_available_providers())
    assert r["max_abs_diff"] <= 1e-3 and agree >= 30 / 32  # same pixels; float differences may swap a near tie


def test_tensorrt_export_builds_and_checks_an_engine_or_says_why_not(tmp_path):
    from torchsprint.commands.export import export
    from torchsprint.errors import UsageError

    run = tmp_path / "run"
    train(
        config.load(
            None, [*jpeg_data(tmp_path / "d"), f"run.dir={run}", "run.epochs=1", *QUIET, "model.args={width: 8}"]
        ),
        quiet=True,
    )
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(UsageError, match="TensorRT's Python package"):
            export(run, "tensorrt")
        return
    r = export(run, "tensorrt")
    assert Path(r["path"]).stat().st_size > 0 and r["max_abs_diff"] is not None


# ---------------------------------------------------------------- every backend trains on CUDA


BACKENDS = ["cpu", "memory", "gpu", pytest.param("dali", marks=pytest.mark.dali)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_trains_on_cuda_and_the_loss_falls(tmp_path, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    run = tmp_path / "run"
    summary = train(
        config.load(
            None,
            [
                *jpeg_data(tmp_path / "d", n=400),
                f"data.backend={backend}",
                f"run.dir={run}",
                "run.epochs=4",
                "log.every_steps=5",
                *QUIET,
            ],
        ),
        quiet=True,
    )
    losses = train_losses(run)
    assert len(losses) >= 8 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert summary["final"]["val/top1"] > 1 / 4 + 0.1  # better than chance (4 classes)


@pytest.mark.parametrize("backend", ["cpu", "memory", "gpu"])
def test_pause_resume_on_cuda_is_bit_exact(tmp_path, backend):
    """run.deterministic on CUDA: a run paused after 5 steps and resumed ends bit-identical to one that
    never stopped (weights), with shuffling, random crops and flips on."""
    base = [
        *jpeg_data(tmp_path / "d", n=200),
        f"data.backend={backend}",
        "model.name=det_cnn",
        "run.deterministic=true",
        "run.epochs=2",
        "checkpoint.every_epochs=null",
        *QUIET,
    ]
    train(config.load(None, [*base, f"run.dir={tmp_path / 'full'}"]), quiet=True)
    part = [*base, f"run.dir={tmp_path / 'part'}"]
    assert train(config.load(None, [*part, "run.stop_after_steps=5"]), quiet=True)["paused"]
    train(config.load(None, [*part, "checkpoint.resume=auto"]), quiet=True)
    full, resumed = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("full", "part"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


# ---------------------------------------------------------------- precision


def test_amp_reaches_fp32_accuracy(tmp_path, figure):
    """amp_fp16 (with its loss scaler) and amp_bf16 against fp32 on the same small job."""
    acc = {}
    for mode in ("fp32", "amp_fp16", "amp_bf16"):
        s = train(
            config.load(
                None,
                [
                    *jpeg_data(tmp_path / "d", n=800, classes=4, val=200),
                    "data.backend=gpu",
                    f"precision={mode}",
                    f"run.dir={tmp_path / mode}",
                    "run.epochs=6",
                    *QUIET,
                ],
            ),
            quiet=True,
        )
        acc[mode] = s["final"]["val/top1"]
    for mode in ("amp_fp16", "amp_bf16"):
        figure(f"{mode}_minus_fp32_top1", acc[mode] - acc["fp32"], f"fp32 top-1 {acc['fp32']:.3f}")
    assert acc["fp32"] > 0.5
    assert all(abs(acc[m] - acc["fp32"]) <= 0.05 for m in ("amp_fp16", "amp_bf16")), acc  # provisional


def test_auto_optimizer_impl_is_fused_on_cuda():
    from torchsprint.optim import build_optimizer

    for name in ("sgd", "adamw"):
        opt = build_optimizer(config.load(None, [f"optim.name={name}"]).optim, nn.Linear(4, 2).cuda())
        assert opt.defaults["fused"] is True


@pytest.mark.parametrize("mode", ["fp32", "amp_fp16", "amp_bf16", "fp16", "bf16"])
@pytest.mark.parametrize("setup", ["sgd", "adamw-clip", "sgd-skip", "sgd-foreach-accum2"])
def test_steady_state_train_step_never_syncs(mode, setup):
    """N steps of train_step under torch.cuda.set_sync_debug_mode("error") after warm-up: any host sync
    (an .item(), a bool() of a device tensor, a blocking copy) raises."""
    from torchsprint.optim import build_optimizer
    from torchsprint.state.precision import Precision
    from torchsprint.train.engine import train_step

    name, *flags = setup.split("-")
    over = [f"optim.name={name}"] + (["optim.impl=foreach"] if "foreach" in flags else [])
    cfg = config.load(None, over)
    prec = Precision(mode, CUDA.device, on_nonfinite="skip" if "skip" in flags else "stop")
    model = prec.prepare(bn_net())
    opt = build_optimizer(cfg.optim, model)
    prec.attach(opt)
    g = torch.Generator(device="cuda").manual_seed(0)
    micro = 2 if "accum2" in flags else 1
    batches = [
        (torch.randn(8, 3, 16, 16, device="cuda", generator=g), torch.randint(0, 5, (8,), device="cuda", generator=g))
        for _ in range(micro)
    ]
    clip = 1.0 if "clip" in flags else None
    for _ in range(10):  # warm-up: cuDNN autotuning, the optimizer's first (state-creating) step, the scaler's start
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), batches, clip)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            loss = train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), batches, clip)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)


def test_memory_loader_steady_state_never_syncs():
    d = config.load(
        None,
        [
            "data.backend=memory",
            "data.batch_size=64",
            "data.train.transforms=[{random_resized_crop: {size: 8}}, hflip, {cutout: {size: 3}}]",
        ],
    ).data
    tr = build_loaders(d, CUDA, seed=0).train
    tr.set_epoch(0)
    it = iter(tr)
    next(it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, _ in it:
            x.sum()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------- preprocessing parity GPU vs CPU


def test_gpu_vs_cpu_preprocessing_parity_where_it_really_resizes(tmp_path, figure):
    """The gpu backend on CUDA (nvJPEG + resample_batch) against the same code on the CPU device
    (libjpeg-turbo via torchvision): 200x150 photos-like JPEGs cropped and resized to 64 (train) and
    resized 72 + centre-cropped 64 (eval). Same crops and flips; the pixels differ by the decoders'
    IDCT and chroma upsampling."""
    d = config.load(
        None,
        [
            "data.dataset=synthetic_jpeg",
            f"data.root={tmp_path}",
            "data.batch_size=16",
            "data.options={num_images: 64, val_images: 32, size: [200, 150], classes: 4}",
            "data.decoder=torchvision",
            "data.drop_last=false",
            "data.train.transforms=[{random_resized_crop: {size: 64}}, hflip, {normalize: imagenet}]",
            "data.eval.transforms=[{resize: 72}, {center_crop: 64}, {normalize: imagenet}]",
        ],
    ).data
    splits = DATASETS.get("synthetic_jpeg")(d)
    for split in ("train", "val"):
        a_loader = getattr(build_gpu_loaders(d, splits, CUDA, seed=3), split)
        b_loader = getattr(build_gpu_loaders(d, splits, CPU, seed=3), split)
        a_loader.set_epoch(0)
        b_loader.set_epoch(0)
        diffs = []
        for (a, ya), (b, yb) in zip(a_loader, b_loader):
            assert torch.equal(ya.cpu(), yb)
            diffs.append(((a.cpu() - b) * LEVELS).abs().flatten())
        lv = torch.cat(diffs)
        mean, p99 = float(lv.mean()), float(lv.quantile(0.99))
        figure(f"gpu_vs_cpu_{split}_mean_levels", mean)
        figure(f"gpu_vs_cpu_{split}_p99_levels", p99)
        assert mean < 2.0 and p99 < 12  # provisional; a different crop or flip gives tens of levels


def test_memory_backend_random_resized_crop_is_bit_identical_on_cpu_and_cuda():
    """resample_batch uses only IEEE-exact weights and separate multiply/add kernels: same pixels anywhere."""
    d = config.load(
        None,
        [
            "data.backend=memory",
            "data.batch_size=64",
            "data.train.transforms=[{random_resized_crop: {size: 6}}, hflip, {normalize: half}]",
            "data.eval.transforms=[{normalize: half}]",
        ],
    ).data
    a, b = build_loaders(d, CPU, seed=1).train, build_loaders(d, CUDA, seed=1).train
    a.set_epoch(0)
    b.set_epoch(0)
    for (xa, _), (xb, _) in zip(a, b):
        assert torch.equal(xa, xb.cpu())

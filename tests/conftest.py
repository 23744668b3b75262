"""Shared fixtures: tiny CPU configs and a real JPEG image folder generated on the fly.

Unmarked tests run on the CPU on every machine (`pytest_runtest_protocol` below): on a GPU machine
run.device=auto would otherwise put them on CUDA (the DDP tests would ask for cuda:1 on a one-GPU
machine, the bit-exact tests would compare CUDA with CPU references). GPU behaviour lives in tests
marked `gpu` (and `dali`), which see the GPU as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import torchsprint  # noqa: F401  (sets CUBLAS_WORKSPACE_CONFIG before any test runs a CUDA matrix product)

# Two cores on CI: keep each test process to one intra-op thread so xdist workers don't oversubscribe.
torch.set_num_threads(1)

# The suite never downloads from the internet: library weights (model.pretrained=torchvision:..., timm:..., URLs)
# that a test has not put in its cache are refused as offline (models/download.py) instead of fetched from
# download.pytorch.org or huggingface.co on a machine that has network. tests/e2e/models/test_weights_download.py turns
# it off for its downloads, which go to a server of its own on 127.0.0.1.
os.environ.setdefault("TORCHSPRINT_OFFLINE", "1")
# A developer's own torch.hub cache (~/.cache/torch) must not change what a folder of photos chooses (models/start.py
# fine-tunes the picked model's weights when they are cached): the suite's cache starts empty, and the tests that
# need weights put them in a TORCH_HOME of their own.
os.environ["TORCH_HOME"] = tempfile.mkdtemp(prefix="torchsprint-tests-torch-")
# The decoded-image cache (data.cache=auto, data/image_cache.py) of every run in the suite goes to a folder of the
# suite's own, never the developer's ~/.cache/torchsprint/images.
os.environ["TORCHSPRINT_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchsprint-tests-cache-")
# ...and what the start-up probes measured (runtime/measurements.py) is stored there too, never read from a developer's
os.environ["TORCHSPRINT_MEASURED_DIR"] = tempfile.mkdtemp(prefix="torchsprint-tests-measured-")
# precision=auto / speed.channels_last=auto never measure in the suite (train/speed_probe.py): a test's run that a
# loaded machine makes look long could otherwise pick amp_bf16 on a CPU with native bf16 and not on another.
# tests/e2e/train/test_speed_probe.py lifts it where it measures on purpose.
os.environ.setdefault("TORCHSPRINT_SPEED_PROBE", "off")

REPO = Path(__file__).resolve().parents[1]
# Every test folder on sys.path: the DDP workers (e2e/workers/) are modules some tests import in this process too
# (and multiprocessing's spawn gives its children this sys.path), and some tests reuse another file's helpers
# (`from test_resume import assert_same_run`), which must import when that file alone is run.
sys.path += [
    str(d)
    for d in sorted(Path(__file__).resolve().parent.glob("*/*"))
    if d.is_dir() and d.parent.name in ("unit", "e2e") and d.name != "__pycache__"
]

# The harness's own test (test_test_harness.py) runs a pytest inside a pytest on a CPU machine with this set, to
# check that the GPU is hidden before any fixture of an unmarked test runs: torch then claims a GPU.
if os.environ.get("TORCHSPRINT_TEST_PRETEND_CUDA") == "1":
    torch.cuda.is_available = lambda: True

# Read once, before any test hides the GPU: the CUDA driver enumerates devices (and reads
# CUDA_VISIBLE_DEVICES) when it first initialises, so setting the variable later changes children only.
HAS_CUDA = torch.cuda.is_available()


def needs_gpu(item) -> bool:
    return item.get_closest_marker("gpu") is not None or item.get_closest_marker("dali") is not None


def hide_gpu(mp: pytest.MonkeyPatch) -> None:
    """Unmarked tests see a machine without CUDA, in this process and in every process they start.

    In process: torch.cuda.is_available() and device_count() say no GPU, so run.device=auto resolves
    to the CPU exactly as on a CPU machine (torchsprint asks only these). Child processes (the CLI,
    torchrun's DDP workers) get CUDA_VISIBLE_DEVICES="" whether they inherit os.environ or are given
    their own env. What users get from run.device=auto is unchanged: only the test harness hides it.
    """
    mp.setenv("CUDA_VISIBLE_DEVICES", "")
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "device_count", lambda: 0)
    popen_init = subprocess.Popen.__init__

    def init_without_gpu(self, *args, env=None, **kwargs):
        if env is not None:
            env = {**env, "CUDA_VISIBLE_DEVICES": ""}
        popen_init(self, *args, env=env, **kwargs)

    mp.setattr(subprocess.Popen, "__init__", init_without_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Hide the GPU around an unmarked test's whole protocol: setup, call and teardown. An autouse fixture
    would be too late: module-scoped fixtures (a reference run shared by a module's tests) are set up before
    function-scoped ones, and would have trained on CUDA."""
    if not HAS_CUDA or needs_gpu(item):
        yield
        return
    mp = pytest.MonkeyPatch()
    hide_gpu(mp)
    try:
        yield
    finally:
        mp.undo()


UNIT = Path(__file__).resolve().parent / "unit"


@pytest.fixture(autouse=True)
def unit_tier_starts_no_process(request, monkeypatch):
    """The fast tier (tests/unit/<package>/test_<module>.py) starts no subprocess and no worker process, whatever a
    test calls: one that needs them belongs in tests/e2e/ (this fails it, naming what it started)."""
    if UNIT not in Path(request.node.path).resolve().parents:
        return

    def refuse(what):
        def start(*args, **kwargs):
            raise AssertionError(f"a unit test started {what}: move it to tests/e2e/ (tests/README.md)")

        return start

    import multiprocessing.process

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a worker process"))


@pytest.fixture(autouse=True)
def restore_torch_flags():
    """Process-wide switches a run sets (runtime.setup) go back after each test: a test whose run failed
    midway must not leave deterministic mode, cuDNN autotuning or TF32 on for the next tests in the process."""
    import torch.utils.deterministic

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.benchmark,
        cudnn.deterministic,
        cudnn.allow_tf32,
        matmul.allow_tf32,
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32, matmul.allow_tf32 = saved[2:6]
    torch.utils.deterministic.fill_uninitialized_memory = saved[6]


# Files whose tests compare numbers from two computations within a tolerance, or check where training lands: the
# ones `.ci/kernels` runs under every set of CPU kernels PyTorch can pick here (ATEN_CPU_CAPABILITY=default, avx2,
# avx512 where the CPU has it), so a bound measured on one kind of CPU is seen to hold on the others (TESTING.md,
# "Tolerances on any CPU"). A new test of that kind goes in one of these files or adds its file here.
NUMERICS_FILES = {
    "test_auto_augment.py",
    "test_backend_agreement.py",
    "test_checkpoint_runs.py",
    "test_comm_hooks.py",
    "test_data_backends.py",
    "test_batch_ops.py",
    "test_ddp.py",
    "test_distill.py",
    "test_engine.py",
    "test_engine_units.py",
    "test_eval_exported.py",
    "test_evaluation.py",
    "test_export_predict.py",
    "test_imbalance.py",
    "test_int8.py",
    "test_lr_find.py",
    "test_metrics.py",
    "test_metrics_reference.py",
    "test_mix.py",
    "test_optim.py",
    "test_parallel.py",
    "test_precision.py",
    "test_progressive.py",
    "test_readme_examples.py",
    "test_recipes_early_stop.py",
    "test_recipes_ema.py",
    "test_recipes_param_groups.py",
    "test_recipes_repeated_aug.py",
    "test_recipes_swa.py",
    "test_registries.py",
    "test_smoke.py",
    "test_task_everything.py",
    "test_task_image_to_image.py",
    "test_task_multilabel.py",
    "test_task_video.py",
    "test_tta.py",
}


# A CPU without native bf16 (AVX-512 BF16 or AMX) emulates bf16 arithmetic: the digits run to 98% in amp_bf16 took
# 44 s there against 4.6 s with it, ResNet-50's two recipe steps 40 s against 4.4 s (an AMD EPYC with AVX-512 BF16
# running under ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and a /proc/cpuinfo without the AVX-512 flags,
# 2026-12-02). On such a CPU the tests marked bf16_training are also `slow`: .ci/slow runs them, the main suite
# keeps within its time. Read once, here (torchsprint.runtime.machine.native_bf16: the flags the runs themselves read).
def slow_here(item) -> bool:
    from torchsprint.runtime.machine import native_bf16

    return item.get_closest_marker("bf16_training") is not None and not native_bf16()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in NUMERICS_FILES:
            item.add_marker(pytest.mark.numerics)
        if slow_here(item):
            item.add_marker(pytest.mark.slow)
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in items:
            if needs_gpu(item):
                item.add_marker(skip)


@pytest.fixture
def figure(request):
    """figure(name, value, note=""): report a measured number a tolerance is set from. Printed, and
    appended as a JSON line to $TORCHSPRINT_FIGURES when set (benchmarks/gpu/run_all.sh collects them),
    so the GPU session reads the measured values instead of guessing bounds."""
    import json

    def record(name: str, value, note: str = ""):
        line = {"test": request.node.nodeid, "name": name, "value": value, "note": note}
        print(f"FIGURE {name} = {value} {note}")
        path = os.environ.get("TORCHSPRINT_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return value

    return record


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m torchsprint ...` in a subprocess; returns CompletedProcess (text)."""

    def run(*args, timeout=300, cwd=None, env=None):
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")
        e.update(env or {})
        return subprocess.run(
            [sys.executable, "-m", "torchsprint", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or tmp_path,
            env=e,
        )

    return run


@pytest.fixture
def cli_in_process(tmp_path, capfd):
    """`torchsprint ARGS` as cli.main(ARGS) in this process, in tmp_path; returns what run_cli returns
    (returncode, stdout, stderr). For refusals (exit 2, one line) and short commands: it skips the ~3 s of imports
    a `python -m torchsprint` pays, which is most of what such a test costs. The real process's exit code and clean
    stderr stay covered by the subprocess cases kept in test_cli.py. What a fresh process would show is kept: an
    exception that escapes main is a traceback in stderr (exit 1), argparse's SystemExit is its exit code, and
    warnings raised during the call (other than the deprecation kinds Python hides by default) are printed to
    stderr as Python prints them, so a "one line" assertion still sees warning noise. The working folder,
    environment and sys.path the call ran with are undone when it returns, as a child process leaves its parent."""
    import traceback
    import warnings

    from torchsprint import cli

    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)

    def run(*args, cwd=None, env=None):
        tb = ""
        with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
            mp.chdir(cwd or tmp_path)
            # `python -m torchsprint` has the working folder first on sys.path (a module there is importable, which
            # the tests of untrusted files rely on); --import appends it otherwise.
            mp.setattr(sys, "path", [str(cwd or tmp_path), *sys.path])
            # run_cli's environment, which the processes a command starts (bench's variants, DDP workers) inherit
            for k, v in {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}.items():
                mp.setenv(k, v)
            warnings.simplefilter("default")
            capfd.readouterr()  # drop what the test printed before
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                code, tb = 1, traceback.format_exc()
        out, err = capfd.readouterr()
        err += (
            "".join(
                warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                for w in caught
                if not issubclass(w.category, hidden)
            )
            + tb
        )
        return subprocess.CompletedProcess(["torchsprint", *map(str, args)], code, out, err)

    return run


def load_resolved(path=None, overrides=(), imports=()):
    """A config as a run trains it: `config.load` (files and overrides, validated: pure) and then the resolve phase
    (train/resolve.py: the task's defaults, data.root's detection and the photo defaults)."""
    from torchsprint import config
    from torchsprint.train.resolve import resolve

    return resolve(config.load(path, overrides, imports=imports))


def train_digits_fp32(folder: Path) -> Path:
    """The default digits run (8x8 grey images, a width-8 small CNN), 2 epochs, fp32 (so eval and an export agree on
    any CPU), trained into `folder`/run; the export tests' module fixtures share it."""
    from torchsprint import config
    from torchsprint.train.run import train

    run = folder / "run"
    train(
        config.load(
            None,
            [
                f"run.dir={run}",
                "run.epochs=2",
                "log.tensorboard=false",
                "log.progress=false",
                "model.args={width: 8}",
                "precision.mode=fp32",
            ],
        ),
        quiet=True,
    )
    return run


def make_image_folder(
    root: Path, classes=("circle", "square"), per_class: int = 6, size=(24, 20), splits=("train", "val")
):
    """Real JPEG files: class 0 bright disc, class 1 dark square on noise (learnable, decodable)."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(0)
    for split in splits:
        for ci, c in enumerate(classes):
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                noise = (torch.rand(size[1], size[0], 3, generator=g) * 80).to(torch.uint8).numpy()
                im = Image.fromarray(noise)
                draw = ImageDraw.Draw(im)
                if ci == 0:
                    draw.ellipse([4, 4, size[0] - 4, size[1] - 4], fill=(250, 250, 250))
                else:
                    draw.rectangle([4, 4, size[0] - 4, size[1] - 4], fill=(20, 200, 20))
                im.save(d / f"{i}.jpg", quality=90)
    return root


@pytest.fixture
def image_folder(tmp_path):
    return make_image_folder(tmp_path / "images")


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory):
    """One tiny trained digits run for tests/e2e/serve/test_serve*.py; its saved config carries a serve section
    (serve.topk=7), which the settings test reads back."""
    from torchsprint import cli

    d = tmp_path_factory.mktemp("serve") / "run"
    assert (
        cli.main(
            [
                "train",
                "run.epochs=1",
                "model.args={width: 8}",
                f"run.dir={d}",
                "log.tensorboard=false",
                "log.progress=false",
                "serve.topk=7",
            ]
        )
        == 0
    )
    return d

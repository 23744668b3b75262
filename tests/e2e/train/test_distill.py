"""Knowledge distillation (train/distill.py): the loss against the formula in plain torch, a frozen teacher that stays
in eval mode, exact resume, a teacher from every source, and bad input refused in one line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from torchsprint import config, runtime
from torchsprint.errors import UsageError
from torchsprint.train.build import build_training
from torchsprint.train.distill import Distilled, DistillLoss, Teacher
from torchsprint.train.run import train

QUIET = ["log.tensorboard=false", "log.progress=false", "eval.per_class=false"]


# benchmarks/recipes/distill_digits.py: the measured setting (teacher, student, the few-images data set)
BENCH = importlib.import_module("benchmarks.recipes.distill_digits")


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> Path:
    """The teacher of BENCH on digits' whole training split: small_cnn with BatchNorm (its running statistics
    show a teacher left in train mode); 98% top-1 on the validation split."""
    d = tmp_path_factory.mktemp("teacher")
    train(config.load(None, [*BENCH.QUIET, *BENCH.TEACHER, f"run.dir={d}"]), quiet=True)
    return d


def build(*over, base=QUIET):
    cfg = config.load(None, [*base, *over])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        return cfg, build_training(cfg, rt, lambda m: None)
    finally:
        runtime.teardown(rt)


# ---------------------------------------------------------------- the loss


def reference_loss(s: torch.Tensor, t: torch.Tensor, y: torch.Tensor, temp: float, alpha: float) -> torch.Tensor:
    """The documented formula, written out: (1 - a) CE + a T^2 mean_b sum_c p_t (log p_t - log p_s), float64."""
    s, t = s.double(), t.double()
    p_t = torch.exp(t / temp) / torch.exp(t / temp).sum(1, keepdim=True)
    log_p_s = s / temp - torch.log(torch.exp(s / temp).sum(1, keepdim=True))
    kl = (p_t * (torch.log(p_t) - log_p_s)).sum(1).mean()
    if y.ndim == 1:
        ce = -(s - torch.log(torch.exp(s).sum(1, keepdim=True)))[torch.arange(len(y)), y].mean()
    else:  # soft (Mixup/CutMix) targets
        ce = -(y.double() * (s - torch.log(torch.exp(s).sum(1, keepdim=True)))).sum(1).mean()
    return (1 - alpha) * ce + alpha * temp * temp * kl


@pytest.mark.parametrize("temp, alpha", [(1.0, 0.5), (4.0, 0.9), (2.5, 1.0), (3.0, 0.0)])
@pytest.mark.parametrize("soft", [False, True])
def test_kd_loss_equals_the_formula_in_plain_torch(temp, alpha, soft):
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(16, 10, generator=g) * 3).requires_grad_(True)
    t = torch.randn(16, 10, generator=g) * 3
    y = torch.randint(0, 10, (16,), generator=g)
    if soft:
        y = torch.softmax(torch.randn(16, 10, generator=g), 1)
    loss = DistillLoss(torch.nn.CrossEntropyLoss(), temp, alpha)(s, Distilled(y, t))
    ref = reference_loss(s, t, y, temp, alpha)
    # Measured: |loss - ref| <= 1.9e-6 over these 8 cases (float32 against float64; losses up to ~20); 3x rounded down.
    assert abs(loss.item() - ref.item()) < 5e-6, (loss.item(), ref.item())
    # The gradient of the soft term is alpha * T * (p_s - p_t) / B (Hinton et al., eq. 2, T^2 included): checks the
    # T^2 factor and that the teacher's side is a constant, with an independent formula.
    (grad,) = torch.autograd.grad(loss, s)
    p_s, p_t = torch.softmax(s.detach() / temp, 1), torch.softmax(t / temp, 1)
    q = torch.softmax(s.detach(), 1)
    hard = (q - (F.one_hot(y, 10).float() if not soft else y)) / 16
    expected = (1 - alpha) * hard + alpha * temp * (p_s - p_t) / 16
    assert torch.allclose(grad, expected, rtol=0, atol=4.5e-8), (grad - expected).abs().max()  # measured 1.5e-8; 3x


def test_plain_targets_get_the_task_loss_alone():
    """Evaluation batches carry plain targets: the student's task loss, no teacher."""
    s, y = torch.randn(8, 5), torch.randint(0, 5, (8,))
    assert DistillLoss(torch.nn.CrossEntropyLoss(), 4.0, 0.7)(s, y) == F.cross_entropy(s, y)


# ---------------------------------------------------------------- the teacher during training


def test_teacher_stays_frozen_in_eval_mode_while_the_student_trains(teacher_run):
    """Real training steps through the run's own loader, loss and optimizer: the teacher gets no gradient, keeps
    its weights and BatchNorm statistics, and stays in eval mode when train() is called on it (as fit calls
    train() on models); the batches carry its logits, and training accuracy counts the real labels."""
    from torchsprint.train.engine import hits_sum, set_train_mode, train_step

    cfg, b = build(f"distill.teacher.run={teacher_run}", "model.args={width: 4}", "data.batch_size=32")
    teacher = b.loaders.train.teacher
    assert (
        isinstance(teacher, Teacher)
        and b.plan.distill["model"] == "small_cnn"
        and b.plan.distill["args"] == {"width": 8}
    )
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert any("running_mean" in k for k in before)
    student_before = {k: v.clone() for k, v in b.model.state_dict().items()}
    set_train_mode(b.model, b.frozen_norms)
    teacher.train()  # what a stray model.train() would do
    b.loaders.train.set_epoch(0)
    hits, n = [], 0
    for i, (x, y) in enumerate(b.loaders.train):
        assert isinstance(y, Distilled) and y.teacher.shape == (x.shape[0], 10) and not y.teacher.requires_grad
        train_step(b, [(x, y)], correct=hits)
        n += x.shape[0]
        if i == 5:
            break
    assert not teacher.training and not any(m.training for m in teacher.modules())
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    after = teacher.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"the teacher changed: {changed}"
    assert any(not torch.equal(student_before[k], v) for k, v in b.model.state_dict().items())
    # Training accuracy is counted against the task's labels (a (B,) tensor), not the teacher's logits.
    assert all(t.ndim == 1 and t.dtype == torch.int64 for _, t in hits)
    assert 0 <= hits_sum(hits).item() <= n


def test_teacher_matches_its_run_and_runs_in_the_runs_precision(teacher_run):
    """The teacher's logits are its run's best weights' (bf16 autocast on CPU: the same autocast as the student)."""
    from torchsprint.commands.trained import load_run

    ref = load_run(teacher_run, "best").model
    # channels_last off: the reference runs in NCHW, and NHWC kernels may round differently.
    plain = [f"distill.teacher.run={teacher_run}", "data.batch_size=32", "speed.channels_last=false"]
    _, b = build(*plain)
    _, b16 = build(*plain, "precision=amp_bf16")
    b.loaders.train.set_epoch(0)
    x, y = next(iter(b.loaders.train))
    with torch.no_grad():
        expected = ref(x)
    assert torch.equal(y.teacher, expected)
    b16.loaders.train.set_epoch(0)
    x16, y16 = next(iter(b16.loaders.train))
    assert torch.equal(x16, x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected16 = ref(x).float()
    assert torch.equal(y16.teacher, expected16) and not torch.equal(y16.teacher, expected)


def test_half_weight_precision_gives_the_teacher_half_weights_and_mixup_reaches_it(teacher_run):
    """precision=bf16 (half weights, as the student's): the teacher's convolutions in bf16, BatchNorm in fp32, logits
    fp32. With Mixup on, the teacher's logits are those of the mixed images the student sees."""
    from torchsprint.commands.trained import load_run
    from torchsprint.state.precision import HalfModel

    plain = [f"distill.teacher.run={teacher_run}", "data.batch_size=32", "speed.channels_last=false"]
    _, b = build(*plain, "precision=bf16")
    half = b.loaders.train.teacher.model
    assert isinstance(half, HalfModel)
    dtypes = {type(m).__name__: m.weight.dtype for m in half.modules() if hasattr(m, "weight")}
    assert dtypes == {"Conv2d": torch.bfloat16, "BatchNorm2d": torch.float32, "Linear": torch.bfloat16}, dtypes
    b.loaders.train.set_epoch(0)
    x, y = next(iter(b.loaders.train))
    assert y.teacher.dtype == torch.float32
    ref = load_run(teacher_run, "best").model
    with torch.no_grad():
        full = ref(x.float())
    # bf16 weights and activations against fp32: measured max |diff| 0.080 over 21 batches (logits up to ~7); 3x.
    assert (y.teacher - full).abs().max() < 0.24 and not torch.equal(y.teacher, full)

    _, b = build(*plain, "mix.mixup_alpha=0.4")
    b.loaders.train.set_epoch(0)
    x, y = next(iter(b.loaders.train))
    assert y.targets.shape == (32, 10) and y.targets.max() < 1  # soft targets: the batch was mixed
    with torch.no_grad():
        assert torch.equal(y.teacher, ref(x))


# ---------------------------------------------------------------- it pays off


def test_a_distilled_student_beats_the_same_student_trained_alone(teacher_run, tmp_path):
    """BENCH's setting (100 training images, the teacher trained on all 1,437): over seeds 0-4 the student alone
    reached 0.75-0.83 top-1 and distilled 0.87-0.93, gaining 8.3 points or more on every seed (BENCHMARKS.md)."""
    BENCH.register_digits_few()
    for seed in (0, 1):
        alone = BENCH.top1(tmp_path / "alone", *BENCH.STUDENT, f"run.seed={seed}")
        kd = BENCH.top1(tmp_path / "kd", *BENCH.STUDENT, f"run.seed={seed}", f"distill.teacher.run={teacher_run}")
        print(f"seed {seed}: alone {alone:.4f}, distilled {kd:.4f}")
        assert kd > alone + 0.04, (seed, alone, kd)  # half the smallest gain measured over 5 seeds (8.3 points)


# ---------------------------------------------------------------- exact resume


def test_paused_and_resumed_distillation_equals_an_uninterrupted_run(teacher_run, tmp_path):
    """The teacher is not in the checkpoint: the resumed run rebuilds it and continues bit for bit."""
    from test_resume import BASE, assert_same_run

    over = [*BASE, f"distill.teacher.run={teacher_run}", "distill.alpha=0.7", "distill.temperature=3"]

    def run(d, *extra):
        return train(config.load(None, [*over, f"run.dir={d}", *extra]), quiet=True)

    ref = run(tmp_path / "ref")
    first = run(tmp_path / "cut", "run.stop_after_steps=5")
    assert first["paused"] and first["global_step"] == 5
    done = run(tmp_path / "cut", "checkpoint.resume=auto")
    assert_same_run(tmp_path / "ref", ref, tmp_path / "cut", done)
    decided = json.loads((tmp_path / "cut" / "decisions.json").read_text())
    assert decided["distill"]["file"] == str(teacher_run / "best.safetensors")
    # The same run without a teacher trains other weights: the comparison above can fail.
    alone = train(config.load(None, [*BASE, f"run.dir={tmp_path / 'alone'}"]), quiet=True)
    assert alone["final"] != ref["final"]


# ---------------------------------------------------------------- where the teacher comes from


def test_teacher_from_a_weights_file_and_a_library_cache(teacher_run, tmp_path, monkeypatch):
    """A torchsprint weights file names its model; a plain state dict needs teacher.model; torchvision's cached
    file is found where torchvision keeps it (TORCH_HOME); offline (tests/conftest.py), a missing one is refused."""
    import torchvision

    best = teacher_run / "best.safetensors"
    _, b = build(f"distill.teacher.weights={best}")
    assert b.plan.distill["model"] == "small_cnn" and b.plan.distill["source"] == "file"
    plain = tmp_path / "plain.safetensors"
    save_file(load_file(str(best)), str(plain))  # no metadata
    with pytest.raises(UsageError, match="does not say which model"):
        build(f"distill.teacher.weights={plain}")
    _, b = build(
        f"distill.teacher.weights={plain}", "distill.teacher.model=small_cnn", "distill.teacher.args={width: 8}"
    )
    assert b.plan.distill["args"] == {"width": 8}
    # A library name: torchvision's resnet18 for the digits' 10 classes and 1 channel, its file in the hub cache.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    lib = [
        "distill.teacher.model=resnet18",
        f"distill.teacher.weights=torchvision:ResNet18_Weights.{weights.name}",
        "data.train.transforms=[resize: 32]",
        "data.eval.transforms=[resize: 32]",
    ]
    with pytest.raises(UsageError, match=r"not in the local cache .*put the file at .*resnet18-f37072fd\.pth"):
        build(*lib)
    from torchsprint.models import build_model

    net = build_model(config.ModelConfig(name="resnet18"), 10, 1)
    cached = tmp_path / "hub" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"  # torch.hub.get_dir(): $TORCH_HOME/hub
    cached.parent.mkdir(parents=True)
    torch.save(net.state_dict(), cached)  # a stand-in with the digits' head and stem: the file, found by its name
    _, b = build(*lib)
    assert b.plan.distill["source"] == "library" and b.plan.distill["file"] == str(cached)


# ---------------------------------------------------------------- bad input


def _five_class_file(tmp_path: Path) -> Path:
    from torchsprint.models import build_model

    path = tmp_path / "five.safetensors"
    save_file(build_model(config.ModelConfig(name="small_cnn", args={"width": 8}), 5, 1).state_dict(), str(path))
    return path


@pytest.mark.parametrize(
    "case",
    [
        "unknown model",
        "no run folder",
        "no such run weights",
        "missing file",
        "corrupt file",
        "truncated file",
        "other class count",
        "other class names",
        "restoration task",
        "multilabel task",
        "off but set",
        "run and model",
        "model without weights",
        "batch auto",
        "library without model",
    ],
)
def test_bad_teacher_is_one_line_naming_the_fix(case, teacher_run, tmp_path):
    best = teacher_run / "best.safetensors"
    bad = tmp_path / "bad.safetensors"
    if case == "corrupt file":
        bad.write_bytes(b"\x00garbage" * 10)
    elif case == "truncated file":
        bad.write_bytes(best.read_bytes()[:300])
    elif case == "other class names":
        meta = {"classes": json.dumps([str(9 - i) for i in range(10)]), "in_channels": "1"}
        save_file(load_file(str(best)), str(bad), metadata=meta)
    over, match = {
        "unknown model": (
            [f"distill.teacher.weights={best}", "distill.teacher.model=small_cnnn"],
            "unknown model 'small_cnnn'. Did you mean: small_cnn",
        ),
        "no run folder": ([f"distill.teacher.run={tmp_path / 'nowhere'}"], "not a torchsprint run folder"),
        "no such run weights": (
            [f"distill.teacher.run={teacher_run}", "distill.teacher.weights=ema"],
            "has no ema.safetensors",
        ),
        "missing file": (
            [f"distill.teacher.weights={tmp_path / 'gone.safetensors'}", "distill.teacher.model=small_cnn"],
            "not found",
        ),
        "corrupt file": (
            [f"distill.teacher.weights={bad}", "distill.teacher.model=small_cnn"],
            "not a readable safetensors",
        ),
        "truncated file": (
            [f"distill.teacher.weights={bad}", "distill.teacher.model=small_cnn"],
            "not a readable safetensors",
        ),
        "other class count": (
            [
                f"distill.teacher.weights={_five_class_file(tmp_path)}",
                "distill.teacher.model=small_cnn",
                "distill.teacher.args={width: 8}",
            ],
            "has 5 output classes.*this run's data has 10",
        ),
        "other class names": (
            [f"distill.teacher.weights={bad}", "distill.teacher.model=small_cnn", "distill.teacher.args={width: 8}"],
            "names or order differ",
        ),
        "restoration task": (
            [
                "task=image_to_image",
                "data.dataset=synthetic_blur",
                "model.name=unet_small",
                f"distill.teacher.run={teacher_run}",
            ],
            "task=image_to_image has image targets .no class",
        ),
        "multilabel task": (
            ["task=multilabel", "data.dataset=synthetic_multilabel", f"distill.teacher.run={teacher_run}"],
            "task=multilabel has multi_hot targets",
        ),
        "off but set": (["distill.temperature=2"], "distillation is off"),
        "run and model": (
            [f"distill.teacher.run={teacher_run}", "distill.teacher.model=small_cnn"],
            "remove distill.teacher.model",
        ),
        "model without weights": (["distill.teacher.model=small_cnn"], "needs its weights"),
        "batch auto": (
            [f"distill.teacher.run={teacher_run}", "data.batch_size=auto"],
            "set data.batch_size to a number",
        ),
        "library without model": (["distill.teacher.weights=torchvision:DEFAULT"], "name the architecture"),
    }[case]
    with pytest.raises(UsageError, match=match) as e:
        build(*over, base=QUIET[:2] if case.endswith("task") else QUIET)  # eval.per_class: classification's
    assert "\n" not in str(e.value) and str(e.value).startswith(("distill", "distill.teacher")), str(e.value)


def test_cli_bad_teacher_exits_2_with_one_line(cli_in_process, tmp_path):
    proc = cli_in_process("train", f"run.dir={tmp_path / 'run'}", f"distill.teacher.run={tmp_path / 'nowhere'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "distill.teacher: run=" in lines[0] and "Traceback" not in proc.stderr, lines
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


# ---------------------------------------------------------------- DDP


@pytest.mark.slow  # 12 s of DDP; one-process distillation stays in the main suite
@pytest.mark.dist
def test_ddp_distillation_matches_one_process(teacher_run, tmp_path, run_cli):
    """2 processes (gloo) with batch B each against one process with batch 2B over the same samples: each rank's
    own teacher gives each sample the logits the one process's does, so the linear student (no BatchNorm) ends
    with the same weights up to float summation order. A teacher in train mode would normalise with per-rank
    batch statistics and move them apart."""
    from test_ddp import max_diff

    common = [
        *QUIET,
        "model.name=linear",
        "run.max_steps=6",
        "checkpoint.every_epochs=null",
        "log.every_steps=2",
        f"distill.teacher.run={teacher_run}",
        "distill.alpha=0.7",
        "distill.temperature=2",
    ]
    ref = tmp_path / "one"
    train(config.load(None, [*common, "data.batch_size=32", f"run.dir={ref}"]), quiet=True)
    proc = run_cli(
        "train", "--nproc-per-node", "2", *common, "data.batch_size=16", f"run.dir={tmp_path / 'ddp'}", timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    diff = max_diff(tmp_path / "ddp" / "last.safetensors", ref / "last.safetensors")
    print(f"distill, DDP vs one process: max |w_ddp - w_single| = {diff:.2e}")
    assert diff < 9e-8  # measured 2.98e-8 (float summation order, as test_ddp.py's linear 2.24e-8); 3x
    decided = json.loads((tmp_path / "ddp" / "decisions.json").read_text())
    assert decided["world_size"] == 2 and decided["distill"]["model"] == "small_cnn"


def test_a_teacher_file_changed_between_pause_and_resume_is_refused(teacher_run, tmp_path):
    """The teacher is not in the checkpoint but read again at resume: a file replaced in between (here: the same
    model with other weights, which loads without complaint) would silently change what the rest of the run learns
    from. The resume is refused, naming the fingerprints; with the file restored it goes on."""
    from safetensors import safe_open
    from test_resume import BASE

    teacher = tmp_path / "teacher.safetensors"
    original = (teacher_run / "best.safetensors").read_bytes()
    teacher.write_bytes(original)
    over = [*BASE, f"distill.teacher.weights={teacher}", f"run.dir={tmp_path / 'run'}"]
    assert train(config.load(None, [*over, "run.stop_after_steps=3"]), quiet=True)["paused"]
    with safe_open(str(teacher), "pt") as f:
        meta = f.metadata()
    state = load_file(str(teacher))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, str(teacher), metadata=meta)
    with pytest.raises(
        UsageError,
        match=r"^distill.teacher: .*teacher.safetensors changed since this run began "
        r"\(sha256 [0-9a-f]{16} then, [0-9a-f]{16} now",
    ):
        train(config.load(None, [*over, "checkpoint.resume=auto"]), quiet=True)
    teacher.write_bytes(original)
    done = train(config.load(None, [*over, "checkpoint.resume=auto"]), quiet=True)
    assert not done["paused"] and done["global_step"] > 3

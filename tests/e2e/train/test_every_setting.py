"""Every config field changes what happens, or is refused: none is accepted and ignored.

The test walks the schema (config.Config and every section) and runs the probe registered for each
field. A probe sets a non-default value and observes its effect against the default (a built object,
a short training, the run folder), or checks that a value which cannot apply here is refused with a
UsageError. A field without a probe fails the walk, so a new setting must come with one.

Probes that only mean something on a GPU are gpu-marked (they run in the GPU session); a probe may also
name the test elsewhere that proves its field, which the walk checks exists.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from torchsprint import config, runtime
from torchsprint.errors import UsageError
from torchsprint.train.build import build_training
from torchsprint.train.run import train

# data.backend=cpu: the probes of the cpu backend's own fields compare against it (the default, auto, picks
# memory for digits; its probe is below and tests/e2e/data/test_backend_auto.py proves what it picks).
BASE = ["model.args={width: 8}", "log.tensorboard=false", "log.progress=false", "run.epochs=1", "data.backend=cpu"]
from paths import TESTS  # noqa: E402


def fields() -> list[str]:
    out = []
    for name, f in config.Config.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, config.Section):
            out += [f"{name}.{k}" for k in ann.model_fields]
        else:
            out.append(name)
    return out


def cfg_of(*over):
    return config.load(None, [*BASE, *over])


def build(*over):
    """(cfg, Built) of the run these overrides describe, on digits; nothing is written."""
    cfg = cfg_of(*over)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        return cfg, build_training(cfg, rt, lambda m: None)
    finally:
        runtime.teardown(rt)
        torch.use_deterministic_algorithms(False)


# The runs several probes compare against (the default run, run.epochs=2, ...), trained once per test process:
# a run is seeded and bit-reproducible, so the cached summary and folder are what a new one would give. Probes
# only read them; a run a probe continues (checkpoint.resume) is trained with fresh=True.
_RUNS: dict[tuple[str, ...], tuple[dict, Path]] = {}


def run(tmp: Path, *over, fresh: bool = False) -> tuple[dict, Path]:
    """A short real training; (summary, run folder)."""
    if not fresh and over in _RUNS:
        summary, d = _RUNS[over]
        return copy.deepcopy(summary), d
    d = tmp / f"run{len(list(tmp.glob('run*')))}"
    summary = train(cfg_of(*over, f"run.dir={d}"), quiet=True)
    if not fresh:
        _RUNS[over] = copy.deepcopy(summary), d
    return summary, d


def refused(*over, match: str, build_it: bool = True):
    with pytest.raises(UsageError, match=match):
        build(*over) if build_it else cfg_of(*over)


def differs(observe, *over, base=()):
    """observe(cfg, built) differs between base and base + over."""
    a = observe(*build(*base))
    b = observe(*build(*base, *over))
    assert a != b, (over, a)
    return a, b


def first_batch(loader):
    loader.set_epoch(0)
    return next(iter(loader))


def group(key):
    return lambda cfg, b: [g.get(key) for g in b.opt.param_groups]


def lrs(steps: int = 12):
    def observe(cfg, b):
        out = []
        for _ in range(steps):
            out.append(round(b.opt.param_groups[0]["lr"], 12))
            b.opt.step()
            b.sched.step()
        return out

    return observe


def n_params(cfg, b):
    return (
        sum(p.numel() for p in b.model.parameters()),
        sum(p.numel() for p in b.model.parameters() if p.requires_grad),
    )


def weights_after_training(tmp, *over):
    from safetensors.torch import load_file

    _, d = run(tmp, *over)
    return load_file(str(d / "last.safetensors"))


def trained_differently(tmp, *over, base=()):
    a = weights_after_training(tmp, *base)
    b = weights_after_training(tmp, *base, *over)
    assert any(not torch.equal(a[k], b[k]) for k in a), over


def elsewhere(test: str):
    """The field is proved by another test: check it exists (file::function)."""
    file, func = test.split("::")
    assert f"def {func}(" in next(TESTS.rglob(file)).read_text(), test


def image_folder(tmp, n=6):
    from conftest import make_image_folder

    return make_image_folder(tmp / "imgs", per_class=n)


IMG = [
    "data.dataset=image_folder",
    "data.train.transforms=[resize: [16, 16]]",
    "data.eval.transforms=[resize: [16, 16]]",
]


def probe_max_file_mb(tmp):
    """A 200x200 noise JPEG (tens of KB) among 1 KB ones: under data.max_file_mb=0.005 (5 KiB) it is left out and
    counted among the skipped files, never read; at the default it is a training image."""
    import numpy as np
    from PIL import Image

    root = image_folder(tmp)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)).save(
        root / "train" / "circle" / "big.jpg", quality=95
    )
    a, b = differs(
        lambda c, b: (len(b.loaders.train.loader.shared.dataset), b.loaders.info.facts.get("skipped")),
        "data.max_file_mb=0.005",
        base=[*IMG, f"data.root={root}"],
    )
    assert b[0] == a[0] - 1 and list(b[1].values())[0]["examples"] == ["big.jpg"], (a, b)


def probe_root(tmp):
    """data.root alone is the user's images (the dataset detected from its folders); digits refuses one it would
    ignore."""
    from conftest import make_image_folder

    refused("data.dataset=digits", f"data.root={tmp}", match="takes no data.root")
    make_image_folder(tmp / "img", classes=("a", "b", "c"), per_class=2)
    differs(lambda c, b: b.loaders.info.classes, f"data.root={tmp / 'img'}", *IMG[1:])


def probe_pretrained(tmp):
    from safetensors.torch import save_file

    cfg, b = build()
    state = {
        k: torch.full_like(v, 0.5).contiguous() if v.is_floating_point() else v for k, v in b.model.state_dict().items()
    }
    save_file(state, str(tmp / "w.safetensors"))
    _, b2 = build(f"model.pretrained={tmp / 'w.safetensors'}")
    assert all(torch.equal(v, state[k]) for k, v in b2.model.state_dict().items())


def probe_strict(tmp):
    from safetensors.torch import save_file

    _, b = build()
    state = {k: v.contiguous() for k, v in b.model.state_dict().items()}  # safetensors stores dense tensors only
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp / "w.safetensors"))
    build(f"model.pretrained={tmp / 'w.safetensors'}")  # loads what matches
    refused(f"model.pretrained={tmp / 'w.safetensors'}", "model.strict=true", match="does not match model exactly")


def probe_bad_sample(tmp):
    root = image_folder(tmp)
    (root / "train" / "circle" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0bad")
    with pytest.raises(UsageError, match="unreadable sample"):
        run(tmp, *IMG, f"data.root={root}")
    summary, d = run(tmp, *IMG, f"data.root={root}", "data.on_bad_sample=skip")
    assert "bad.jpg" in (d / "metrics.jsonl").read_text()


def probe_progress(tmp, monkeypatch):
    from torchsprint.observe.logging import RunLogger

    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    for value, bar in ((True, True), (False, False)):
        logger = RunLogger(None, cfg_of(f"log.progress={value}").log)
        logger.start_epoch(0, 1, 10)
        assert (logger.progress is not None) == bar
        logger.end_epoch()


def probe_compile_backend(tmp):
    import torch._dynamo

    calls = []

    @torch._dynamo.register_backend(name="torchsprint_probe")
    def probe_backend(gm, example_inputs):
        calls.append(len(example_inputs))
        return gm.forward

    cfg, b = build("speed.compile=true", "speed.compile_backend=torchsprint_probe")
    b.model(first_batch(b.loaders.val)[0])
    assert calls, "the configured torch.compile backend never ran"


def probe_fullgraph(tmp):
    import torch._dynamo

    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.fc(x.flatten(1))

    from torchsprint.runtime.parallel import wrap_model
    from torchsprint.train.plan import decide_speed

    for full, fails in ((False, False), (True, True)):
        cfg, net, cpu = (
            cfg_of("speed.compile=true", f"speed.fullgraph={full}", "speed.compile_backend=eager"),
            Breaks(),
            torch.device("cpu"),
        )
        model = wrap_model(
            net, cfg.strategy, runtime.Runtime(cpu), speed=decide_speed(cfg.speed, cfg.strategy, net, cpu)
        )
        torch._dynamo.reset()
        if fails:
            with pytest.raises(Exception, match="graph_break|Graph break|fullgraph"):
                model(torch.zeros(2, 1, 8, 8))
        else:
            model(torch.zeros(2, 1, 8, 8))


def ddp_wrapped(*over):
    """The model wrapped as one rank of DDP (a 1-process gloo group): what the strategy options reach."""
    import os
    import tempfile

    import torch.distributed as dist

    from torchsprint.runtime.parallel import wrap_model

    cfg = cfg_of(*over)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'pg')}", rank=0, world_size=1)
        try:
            rt = runtime.Runtime(
                torch.device("cpu"), world_size=2
            )  # "distributed" for wrap_model; the group has 1 rank
            from torchsprint.models import build_model
            from torchsprint.train.plan import decide_speed

            net = build_model(cfg.model, 10, 1)
            return wrap_model(
                net, cfg.strategy, rt, speed=decide_speed(cfg.speed, cfg.strategy, net, rt.device, rt.world_size)
            )
        finally:
            dist.destroy_process_group()


def probe_deterministic(tmp):
    cfg = cfg_of("run.deterministic=true")
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    rt = runtime.setup(cfg_of().run, cfg.strategy, cfg.speed)  # a later run in the same process: back off
    assert not torch.are_deterministic_algorithms_enabled()
    runtime.teardown(rt)


def probe_channels_last(tmp):
    _, b = build("speed.channels_last=true")
    x = first_batch(b.loaders.train)[0]
    conv = [m for m in b.model.modules() if isinstance(m, nn.Conv2d)][1]  # 8 input channels: the layouts differ
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert x.stride()[1] == 1  # NHWC batch (1 channel: is_contiguous cannot tell the formats apart)
    _, b = build("speed.channels_last=false")
    assert not [m for m in b.model.modules() if isinstance(m, nn.Conv2d)][1].weight.is_contiguous(
        memory_format=torch.channels_last
    )
    # auto (the default): a convolutional model goes NHWC, its batches stay NCHW; a model without convolutions stays
    _, b = build()
    assert [m for m in b.model.modules() if isinstance(m, nn.Conv2d)][1].weight.is_contiguous(
        memory_format=torch.channels_last
    )
    x = first_batch(b.loaders.train)[0]
    assert x.is_contiguous() and (x.shape[1] == 1 or x.stride()[1] != 1)
    from torchsprint.runtime.parallel import channels_last_on

    _, b = build("model.name=linear", "model.args={}")
    assert not channels_last_on("auto", b.model) and channels_last_on(True, b.model)


def probe_imports(tmp, monkeypatch):
    (tmp / "probe_models.py").write_text(
        "from torchsprint.models.core import MODELS\nfrom torchsprint.models.nets import small_cnn\n"
        "MODELS.register('probe_net', override=True)(small_cnn)\n"
    )
    monkeypatch.chdir(tmp)
    refused("model.name=probe_net", match="unknown model 'probe_net'")
    build("model.name=probe_net", "imports=[probe_models]")


def probe_stop_signals():
    """A listed signal sets the stop flag (instead of its default action); an unlisted one is left alone."""
    import signal

    from torchsprint.runtime.preempt import SIGNAL, Stopper

    before = signal.getsignal(signal.SIGUSR2)
    with Stopper(cfg_of("run.stop_signals=[SIGUSR2]").run) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.vote() == SIGNAL and stop.got == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) is before
    with Stopper(cfg_of("run.stop_signals=[]").run):
        assert signal.getsignal(signal.SIGUSR2) is before


def probe_run_name_out_dir_dir(tmp):
    from torchsprint.state.rundir import planned_path

    assert planned_path(cfg_of("run.name=abc").run)[0].parent.name == "abc"
    assert planned_path(cfg_of(f"run.out_dir={tmp}").run)[0].parents[1] == tmp
    assert planned_path(cfg_of(f"run.dir={tmp / 'x'}").run) == (tmp / "x", True)


def probe_train_time(tmp):
    """The run stops at the length fitted to its time (the fitting itself, on a fake clock:
    tests/unit/train/test_time_fit.py); a length fixed otherwise is refused."""
    summary, _ = run(tmp, "run.train_time=3s", "run.epochs=1000")  # epochs: an upper bound
    fit = summary["train_time"]
    assert fit["budget_s"] == 3 and fit["fits"] and summary["global_step"] == fit["fitted_steps"]
    assert run(tmp)[0].get("train_time") is None
    refused("run.train_time=3s", "run.max_steps=5", match="run.train_time", build_it=False)
    elsewhere("test_time_fit.py::test_a_steady_run_is_fitted_to_the_time_and_its_cosine_ends_there")


# The tune section is read by `torchsprint tune` (train keeps it in config.yaml and does nothing with it): each
# field's effect on the search is proved in tests/unit/commands/test_tune_settings.py.
TUNE_PROBES = {
    "tune.space": "test_tune_settings.py::test_tune_space_is_what_is_searched",
    "tune.metric": "test_tune_settings.py::test_tune_metric_is_what_trials_are_scored_by_in_its_direction",
    "tune.sampler": "test_tune_settings.py::test_tune_sampler_and_tune_seed_decide_the_draws",
    "tune.seed": "test_tune_settings.py::test_tune_sampler_and_tune_seed_decide_the_draws",
    "tune.pruner": "test_tune_settings.py::test_tune_pruner_stops_the_trials_that_fall_behind",
}

PROBES = {
    **{field: (lambda t, name=name: elsewhere(name)) for field, name in TUNE_PROBES.items()},
    "imports": probe_imports,
    "task": lambda t: differs(
        lambda c, b: type(b.loss_fn).__name__,
        "task=multilabel",
        "data.dataset=synthetic_multilabel",
        f"data.root={t}",
        "data.options={num_images: 8, val_images: 4, size: 8}",
    ),
    "run.name": probe_run_name_out_dir_dir,
    "run.out_dir": probe_run_name_out_dir_dir,
    "run.dir": probe_run_name_out_dir_dir,
    "run.seed": lambda t: differs(lambda c, b: float(next(b.model.parameters()).sum()), "run.seed=1"),
    "run.epochs": lambda t: run(t, "run.epochs=2")[0]["global_step"] == 2 * run(t)[0]["global_step"] or pytest.fail(),
    "run.max_steps": lambda t: run(t, "run.max_steps=3")[0]["global_step"] == 3 or pytest.fail(),
    "run.stop_after_steps": lambda t: run(t, "run.stop_after_steps=2")[0]["paused"] or pytest.fail(),
    "run.max_time": lambda t: run(t, "run.max_time=0.001s")[0]["stopped"] == "max_time" or pytest.fail(),
    "run.train_time": lambda t: probe_train_time(t),
    "run.stop_signals": lambda t: (
        probe_stop_signals()
    ),  # real signals to a real CLI process: tests/e2e/train/test_preempt.py
    "run.requeue": lambda t: (
        _expect(UsageError, "not a SLURM job", run, t, "run.requeue=true")
        if not os.environ.get("SLURM_JOB_ID")
        else pytest.skip("inside a SLURM job")
    ),  # requeue itself: tests/e2e/train/test_preempt.py
    "run.device": lambda t: (
        refused("run.device=cuda", match="no CUDA device")
        if not torch.cuda.is_available()
        else differs(lambda c, b: str(next(b.model.parameters()).device), "run.device=cuda", base=["run.device=cpu"])
    ),
    "run.deterministic": probe_deterministic,
    "data.dataset": lambda t: differs(
        lambda c, b: b.loaders.info.classes,
        "data.dataset=synthetic_jpeg",
        f"data.root={t}",
        "data.options={num_images: 6, val_images: 3, size: [20, 16], classes: 3}",
        *IMG[1:],
    ),
    "data.root": lambda t: probe_root(t),
    "data.options": lambda t: (
        refused("data.options={x: 1}", match="takes no data.options"),
        differs(
            lambda c, b: len(b.loaders.train) * c.data.batch_size,
            "data.options={num_images: 20, val_images: 4}",
            base=[
                "data.dataset=synthetic_jpeg",
                f"data.root={t}",
                "data.batch_size=2",
                *IMG[1:],
                "data.options={num_images: 10, val_images: 4}",
            ],
        ),
    ),
    "data.val_fraction": lambda t: differs(lambda c, b: len(b.loaders.val), "data.val_fraction=0.5"),
    "data.split_seed": lambda t: differs(lambda c, b: first_batch(b.loaders.val)[1].tolist(), "data.split_seed=1"),
    "data.backend": lambda t: (
        differs(lambda c, b: type(b.loaders.train).__name__, "data.backend=memory"),
        differs(lambda c, b: type(b.loaders.train).__name__, "data.backend=auto"),
    ),
    "data.memory_budget_gib": lambda t: (
        refused("data.backend=memory", "data.memory_budget_gib=0.0001", match="over the 104.9 KiB"),
        elsewhere("test_backend_auto.py::test_data_memory_budget_gib_sets_the_budget"),
    ),
    "data.batch_size": lambda t: (
        differs(lambda c, b: first_batch(b.loaders.train)[0].shape[0], "data.batch_size=16"),
        differs(lambda c, b: first_batch(b.loaders.train)[0].shape[0], "data.batch_size=auto"),
    ),
    "data.effective_batch_size": lambda t: differs(
        lambda c, b: b.cfg.optim.accum_steps, "data.effective_batch_size=256"
    ),
    "data.eval_batch_size": lambda t: differs(
        lambda c, b: first_batch(b.loaders.val)[0].shape[0], "data.eval_batch_size=7"
    ),
    "data.num_workers": lambda t: differs(lambda c, b: b.loaders.train.loader.shared.num_workers, "data.num_workers=1"),
    "data.pin_memory": lambda t: elsewhere("test_every_setting.py::test_cuda_only_settings"),
    "data.persistent_workers": lambda t: differs(
        lambda c, b: b.loaders.train.loader.shared.persistent_workers,
        "data.persistent_workers=false",
        base=["data.num_workers=1"],
    ),
    "data.prefetch_factor": lambda t: (
        refused("data.prefetch_factor=4", match="per worker process"),
        differs(
            lambda c, b: b.loaders.train.loader.shared.prefetch_factor,
            "data.prefetch_factor=4",
            base=["data.num_workers=1"],
        ),
    ),
    "data.drop_last": lambda t: differs(lambda c, b: len(b.loaders.train), "data.drop_last=false"),
    "data.sampler": lambda t: (
        differs(lambda c, b: b.loaders.train.sampler.indices()[:20], "data.sampler=balanced")
        or elsewhere("test_imbalance.py::test_loader_draws_classes_equally_on_every_backend")
    ),
    "data.sampler_from_epoch": lambda t: elsewhere(
        "test_imbalance.py::test_deferred_sampler_switches_at_its_epoch_as_a_function_of_the_epoch"
    ),
    "data.repeated_aug": lambda t: differs(
        lambda c, b: (len(b.loaders.train), b.loaders.train.sampler.indices()[:20]), "data.repeated_aug=3"
    ),
    "data.on_bad_sample": probe_bad_sample,
    "data.max_image_pixels": lambda t: _expect(
        UsageError, "data.max_image_pixels", run, t, *IMG, f"data.root={image_folder(t)}", "data.max_image_pixels=100"
    ),
    "data.max_file_mb": probe_max_file_mb,
    "data.decoder": lambda t: (
        refused("data.decoder=pil", match="already decoded in memory"),
        differs(
            lambda c, b: b.loaders.train.loader.shared.dataset.raws[0].decoder,
            "data.decoder=pil",
            base=[*IMG, f"data.root={image_folder(t)}"],
        ),
    ),
    "data.cache": lambda t: (
        refused("data.cache=on", match="not read as image files"),
        differs(
            lambda c, b: type(b.loaders.train.loader.shared.dataset.raws[0]).__name__,
            "data.cache=off",
            base=[*IMG, f"data.root={image_folder(t)}"],
        ),
    ),
    "data.cache_dir": lambda t: differs(
        lambda c, b: b.loaders.info.facts["cache"]["dir"],
        f"data.cache_dir={t / 'c2'}",
        base=[*IMG, f"data.root={image_folder(t)}"],
    ),
    "data.cache_gib": lambda t: (
        refused(
            *IMG, f"data.root={image_folder(t)}", "data.cache=on", "data.cache_gib=1e-6", match="Raise data.cache_gib"
        ),
        differs(
            lambda c, b: b.loaders.info.facts["cache"]["state"],
            "data.cache_gib=1e-6",
            base=[*IMG, f"data.root={image_folder(t)}"],
        ),
    ),
    "data.cpu_fraction": lambda t: refused("data.cpu_fraction=0.5", match="data.backend=cpu does not use it"),
    "data.fallback": lambda t: (refused("data.fallback=cpu", match="always runs"), _fallback(t)),
    "data.train": lambda t: differs(
        lambda c, b: tuple(first_batch(b.loaders.train)[0].shape),
        "data.train.transforms=[resize: 12]",
        base=["data.eval.transforms=[resize: 12]"],
    ),
    "data.eval": lambda t: differs(
        lambda c, b: tuple(first_batch(b.loaders.val)[0].shape),
        "data.eval.transforms=[resize: 12]",
        base=["data.train.transforms=[resize: 12]"],
    ),
    "data.progressive": lambda t: (
        differs(
            lambda c, b: tuple(first_batch(b.loaders.train)[0].shape),
            "data.progressive={start_size: 4, end_epoch: 2, step: 2}",
            base=["data.train.transforms=[random_resized_crop: {size: 8}]", "run.epochs=2"],
        ),
        elsewhere("test_progressive.py::test_each_epochs_batches_are_the_fixed_size_runs_crops_at_that_size"),
    ),
    "model.name": lambda t: differs(n_params, "model.name=linear", "model.args={}"),
    "model.args": lambda t: differs(n_params, "model.args={width: 4}"),
    "model.pretrained": lambda t: (
        probe_pretrained(t),  # library weights (torchvision:/timm:) from their caches:
        elsewhere("test_recipes_pretrained.py::test_torchvision_weights_from_the_torch_hub_cache"),
        elsewhere("test_recipes_pretrained.py::test_timm_weights_from_the_hugging_face_cache"),
    ),
    "model.strict": probe_strict,
    "model.freeze": lambda t: differs(n_params, "model.freeze=['0.*']"),
    "model.train_only": lambda t: differs(n_params, "model.train_only=['7.*']"),
    "model.freeze_bn_stats": lambda t: differs(
        lambda c, b: len(b.frozen_norms), "model.freeze_bn_stats=false", base=["model.freeze=['0.*']"]
    ),
    "model.bn_momentum": lambda t: (
        differs(
            lambda c, b: sorted(
                {m.momentum for m in b.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
            ),
            "model.bn_momentum=0.3",
        ),
        refused("model.name=linear", "model.args={}", "model.bn_momentum=0.3", match="has no BatchNorm layer"),
        elsewhere("test_registries.py::test_bn_momentum_sets_the_running_statistics_update"),
    ),
    "optim.name": lambda t: differs(lambda c, b: type(b.opt).__name__, "optim.name=adamw"),
    "optim.lr": lambda t: differs(group("lr"), "optim.lr=0.05", base=["sched.name=constant"]),
    "optim.momentum": lambda t: (
        differs(group("momentum"), "optim.momentum=0.5"),
        refused("optim.name=adam", "optim.momentum=0.5", match="does not apply to optimizer adam"),
    ),
    "optim.nesterov": lambda t: (
        differs(group("nesterov"), "optim.nesterov=false"),
        refused("optim.name=adam", "optim.nesterov=false", match="does not apply"),
    ),
    "optim.betas": lambda t: (
        differs(group("betas"), "optim.betas=[0.8, 0.9]", base=["optim.name=adam"]),
        refused("optim.betas=[0.8, 0.9]", match="does not apply to optimizer sgd"),
    ),
    "optim.eps": lambda t: (
        differs(group("eps"), "optim.eps=1e-6", base=["optim.name=adam"]),
        refused("optim.eps=1e-6", match="does not apply to optimizer sgd"),
    ),
    "optim.weight_decay": lambda t: differs(group("weight_decay"), "optim.weight_decay=0.1"),
    "optim.no_decay_norm_bias": lambda t: differs(
        lambda c, b: len(b.opt.param_groups), "optim.no_decay_norm_bias=false"
    ),
    "optim.impl": lambda t: differs(group("foreach"), "optim.impl=foreach"),
    "optim.args": lambda t: differs(group("dampening"), "optim.args={dampening: 0.1}", base=["optim.nesterov=false"]),
    "optim.clip_grad_norm": lambda t: trained_differently(t, "optim.clip_grad_norm=0.01"),
    "optim.accum_steps": lambda t: (
        run(t, "optim.accum_steps=2")[0]["global_step"] * 2 == run(t)[0]["global_step"] or pytest.fail()
    ),
    "optim.param_groups": lambda t: (
        differs(group("lr"), "optim.param_groups=[{pattern: '0.*', lr_scale: 0.1}]"),
        refused("optim.param_groups=[{pattern: 'nope.*'}]", match="'nope.\\*' matches no"),
    ),
    "optim.layer_decay": lambda t: differs(group("lr"), "optim.layer_decay=0.5"),
    "sched.name": lambda t: differs(lrs(), "sched.name=exponential", "sched.interval=step", "sched.gamma=0.5"),
    "sched.interval": lambda t: differs(lrs(), "sched.interval=epoch"),
    "sched.warmup_epochs": lambda t: differs(lrs(), "sched.warmup_epochs=0.5"),
    "sched.warmup_start": lambda t: (
        differs(lrs(), "sched.warmup_start=0.5", base=["sched.warmup_epochs=0.5"]),
        refused("sched.warmup_start=0.5", match="no effect with sched.warmup_epochs=0"),
    ),
    "sched.min_lr_ratio": lambda t: differs(lrs(30), "sched.min_lr_ratio=0.5"),
    "sched.step_size": lambda t: (
        differs(lrs(30), "sched.step_size=0.1", base=["sched.name=step"]),
        refused("sched.step_size=0.1", match="does not apply to sched.name=cosine"),
    ),
    "sched.milestones": lambda t: (
        differs(lrs(30), "sched.milestones=[0.1]", base=["sched.name=multistep"]),
        refused("sched.milestones=[0.1]", match="does not apply"),
    ),
    "sched.gamma": lambda t: (
        differs(lrs(30), "sched.gamma=0.5", base=["sched.name=exponential"]),
        refused("sched.gamma=0.5", match="does not apply"),
    ),
    "sched.pct_start": lambda t: (
        differs(lrs(30), "sched.pct_start=0.5", base=["sched.name=onecycle"]),
        refused("sched.pct_start=0.5", match="does not apply"),
    ),
    "loss.name": lambda t: differs(lambda c, b: type(b.loss_fn).__name__, "loss.name=bce_with_logits"),
    "model.freeze_epochs": lambda t: elsewhere(
        "test_freeze_epochs.py::test_body_frozen_then_trained_and_resume_is_exact_across_the_switch"
    ),
    "model.head": lambda t: refused("model.head=['7.*']", match="set model.freeze_epochs"),
    "loss.class_weights": lambda t: elsewhere("test_imbalance.py::test_class_weights_equal_sklearn_and_reach_the_loss"),
    "loss.logit_adjust": lambda t: elsewhere("test_imbalance.py::test_logit_adjusted_loss_equals_a_hand_computation"),
    "loss.label_smoothing": lambda t: differs(
        lambda c, b: float(b.loss_fn(torch.eye(10) * 5, torch.arange(10))), "loss.label_smoothing=0.2"
    ),
    "loss.args": lambda t: differs(
        lambda c, b: float(
            b.loss_fn(torch.randn(10, 10, generator=torch.Generator().manual_seed(0)), torch.arange(10))
        ),
        "loss.args={weight: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}",
    ),
    "loss.terms": lambda t: differs(
        lambda c, b: type(b.loss_fn).__name__, "loss.terms=[{name: cross_entropy, weight: 0.5}]"
    ),
    # distill: the loss against the formula, the teacher from every source, and refusals in test_distill.py.
    "distill.teacher": lambda t: elsewhere(
        "test_distill.py::test_a_distilled_student_beats_the_same_student_trained_alone"
    ),
    "distill.temperature": lambda t: (
        refused("distill.temperature=2", match="distillation is off"),
        elsewhere("test_distill.py::test_kd_loss_equals_the_formula_in_plain_torch"),
    ),
    "distill.alpha": lambda t: (
        refused("distill.alpha=0.9", match="distillation is off"),
        elsewhere("test_distill.py::test_kd_loss_equals_the_formula_in_plain_torch"),
    ),
    "mix.mixup_alpha": lambda t: differs(
        lambda c, b: tuple(first_batch(b.loaders.train)[1].shape), "mix.mixup_alpha=0.2"
    ),
    "mix.cutmix_alpha": lambda t: differs(
        lambda c, b: tuple(first_batch(b.loaders.train)[1].shape), "mix.cutmix_alpha=1.0"
    ),
    "mix.prob": lambda t: (
        refused("mix.prob=0.5", match="mixing is off"),
        differs(_epoch_images, "mix.prob=0.0", base=["mix.mixup_alpha=0.2"]),
    ),
    "mix.switch_prob": lambda t: (
        refused("mix.cutmix_alpha=1", "mix.switch_prob=0.9", match="only CutMix is on"),
        differs(_epoch_images, "mix.switch_prob=0.9", base=["mix.mixup_alpha=0.2", "mix.cutmix_alpha=1"]),
    ),
    "mix.mode": lambda t: (
        refused("mix.mode=elem", match="mixing is off"),
        differs(lambda c, b: first_batch(b.loaders.train)[1].tolist(), "mix.mode=elem", base=["mix.mixup_alpha=0.2"]),
    ),
    "precision.mode": lambda t: (
        differs(lambda c, b: b.prec.dtype, "precision=amp_bf16"),
        refused("precision=fp16", match="needs a CUDA device") if not torch.cuda.is_available() else None,
    ),
    "precision.on_nonfinite": lambda t: (
        _expect(FloatingPointError, "on_nonfinite=stop", run, t, "optim.lr=1e30"),
        run(t, "optim.lr=1e30", "precision.on_nonfinite=skip")[0]["skipped_steps"] > 0 or pytest.fail(),
    ),
    "strategy.name": lambda t: (
        refused("strategy=ddp", match="one process per device"),
        refused("strategy=dp", match="needs CUDA GPUs") if not torch.cuda.is_available() else None,
    ),
    "strategy.backend": lambda t: (
        runtime.resolve_backend(cfg_of("strategy.backend=gloo").strategy, torch.device("cpu")) == "gloo"
        or pytest.fail(),
        _expect(
            UsageError,
            "needs CUDA devices",
            runtime.resolve_backend,
            cfg_of("strategy.backend=nccl").strategy,
            torch.device("cpu"),
        ),
    ),
    "strategy.sync_bn": lambda t: (
        type(
            next(m for m in ddp_wrapped("strategy.sync_bn=true").modules() if "BatchNorm" in type(m).__name__)
        ).__name__
        == "GlooSyncBatchNorm"
        or pytest.fail()
    ),
    "strategy.find_unused_parameters": lambda t: (
        ddp_wrapped("strategy.find_unused_parameters=true").find_unused_parameters or pytest.fail()
    ),
    "strategy.static_graph": lambda t: ddp_wrapped("strategy.static_graph=true").static_graph or pytest.fail(),
    "strategy.bucket_cap_mb": lambda t: (
        ddp_wrapped("strategy.bucket_cap_mb=1").bucket_bytes_cap == 2**20 or pytest.fail()
    ),
    "strategy.timeout_s": lambda t: elsewhere("test_ddp.py::test_failed_rank_makes_the_other_exit_within_timeout"),
    "strategy.comm_hook": lambda t: (
        ddp_wrapped("strategy.comm_hook=bf16")._comm_hooks[0][0].__name__ == "bf16_compress_hook" or pytest.fail(),
        elsewhere("test_comm_hooks.py::test_comm_hooks_two_processes"),
    ),
    "strategy.powersgd_rank": lambda t: (
        ddp_wrapped("strategy.comm_hook=powersgd", "strategy.powersgd_rank=3")
        ._comm_hooks[0][1]
        .matrix_approximation_rank
        == 3
        or pytest.fail(),
        refused("strategy.powersgd_rank=3", match="applies to strategy.comm_hook=powersgd"),
    ),
    "strategy.powersgd_start_step": lambda t: (
        ddp_wrapped("strategy.comm_hook=powersgd", "strategy.powersgd_start_step=7")
        ._comm_hooks[0][1]
        .start_powerSGD_iter
        == 7
        or pytest.fail(),
        refused("strategy.powersgd_start_step=7", match="applies to strategy.comm_hook"),
    ),
    "speed.channels_last": probe_channels_last,
    "speed.compile": lambda t: differs(lambda c, b: type(b.model).__name__, "speed.compile=true"),
    "speed.compile_mode": lambda t: (
        _expect(UsageError, "compile_mode", cfg_of, "speed.compile_mode=fastest")
        or elsewhere("test_every_setting.py::test_cuda_only_settings")
    ),
    "speed.compile_backend": probe_compile_backend,
    "speed.fullgraph": probe_fullgraph,
    "speed.cudnn_benchmark": lambda t: elsewhere("test_every_setting.py::test_cuda_only_settings"),
    "speed.tf32": lambda t: elsewhere("test_every_setting.py::test_cuda_only_settings"),
    "speed.cuda_graphs": lambda t: (
        refused("speed.cuda_graphs=true", match="needs a CUDA device")
        if not torch.cuda.is_available()
        else elsewhere("test_every_setting.py::test_cuda_only_settings")
    ),
    "checkpoint.every_epochs": lambda t: (
        _history(t, "run.epochs=2", "checkpoint.every_epochs=2") != _history(t, "run.epochs=2") or pytest.fail()
    ),
    "checkpoint.every_steps": lambda t: _history(t, "checkpoint.every_steps=5") != _history(t) or pytest.fail(),
    "checkpoint.keep_last": lambda t: (
        _files(t, "checkpoint.every_steps=5", "checkpoint.keep_last=1", "checkpoint.keep_best=0")
        != _files(t, "checkpoint.every_steps=5", "checkpoint.keep_best=0")
        or pytest.fail()
    ),
    "checkpoint.keep_best": lambda t: (
        _files(t, "run.epochs=3", "checkpoint.keep_last=1", "checkpoint.keep_best=0")
        != _files(t, "run.epochs=3", "checkpoint.keep_last=1", "checkpoint.keep_best=2")
        or pytest.fail()
    ),
    "checkpoint.monitor": lambda t: (
        run(t, "checkpoint.monitor=val/loss", "checkpoint.mode=min")[0]["best_metric"] != run(t)[0]["best_metric"]
        or pytest.fail(),
        _expect(UsageError, "is not a metric", run, t, "checkpoint.monitor=val/nope"),
    ),
    "checkpoint.mode": lambda t: (
        run(t, "run.epochs=3", "checkpoint.mode=min")[0]["best_epoch"] != run(t, "run.epochs=3")[0]["best_epoch"]
        or pytest.fail()
    ),
    "checkpoint.resume": lambda t: _resume(t),
    "ema.enabled": lambda t: (
        (run(t, "ema.enabled=true")[1] / "ema.safetensors").is_file()
        and not (run(t)[1] / "ema.safetensors").exists()
        or pytest.fail()
    ),
    "ema.decay": lambda t: (
        refused("ema.decay=0.5", match="no effect with ema.enabled=false"),
        _ema_differs(t, "ema.decay=0.5"),
    ),
    "ema.warmup": lambda t: _ema_differs(t, "ema.warmup=true"),
    "ema.warmup_gamma": lambda t: (
        refused("ema.enabled=true", "ema.warmup_gamma=5", match="warm-up, which is off"),
        _ema_differs(t, "ema.warmup_gamma=5", base=["ema.warmup=true"]),
    ),
    "ema.warmup_power": lambda t: (
        refused("ema.enabled=true", "ema.warmup_power=0.9", match="warm-up, which is off"),
        _ema_differs(t, "ema.warmup_power=0.9", base=["ema.warmup=true"]),
    ),
    "ema.every_steps": lambda t: _ema_differs(t, "ema.every_steps=3"),
    "ema.buffers": lambda t: _ema_differs(t, "ema.buffers=copy", keys="running_mean"),
    "ema.eval": lambda t: (
        "ema/val/top1" in run(t, "ema.enabled=true")[0]["final"]
        and "ema/val/top1" not in run(t, "ema.enabled=true", "ema.eval=false")[0]["final"]
        or pytest.fail()
    ),
    "ema.device": lambda t: (
        refused("ema.enabled=true", "ema.device=cpu", match="set ema.eval=false"),
        build("ema.enabled=true", "ema.device=cpu", "ema.eval=false"),
        elsewhere("test_recipes_ema.py::test_ema_on_cpu_beside_a_cuda_model"),
    ),
    "swa.enabled": lambda t: (
        (run(t, "swa.enabled=true", "swa.lr=0.01", "swa.start=1")[1] / "swa.safetensors").is_file()
        and not (run(t)[1] / "swa.safetensors").exists()
        or pytest.fail()
    ),
    "swa.start": lambda t: (
        refused("swa.start=1", match="no effect with swa.enabled=false"),
        refused("swa.enabled=true", "swa.lr=0.01", "swa.start=2", match="after the run's last epoch"),
        elsewhere("test_recipes_swa.py::test_swa_start_as_a_fraction_and_early_stop_before_it"),
    ),
    "swa.lr": lambda t: (
        refused("swa.enabled=true", match="needs swa.lr"),
        differs(_swa_lrs, "swa.lr=0.02", base=["swa.enabled=true", "swa.lr=0.01", "swa.start=1"]),
    ),
    "swa.anneal_epochs": lambda t: differs(
        _swa_lrs, "swa.anneal_epochs=3", base=["swa.enabled=true", "swa.lr=0.01", "swa.start=1"]
    ),
    "swa.anneal_strategy": lambda t: differs(
        _swa_lrs,
        "swa.anneal_strategy=linear",
        base=["swa.enabled=true", "swa.lr=0.01", "swa.start=1", "swa.anneal_epochs=3"],
    ),
    "early_stop.patience": lambda t: (
        run(t, "run.epochs=3", "early_stop.patience=1", "early_stop.min_delta=0.99")[0]["global_step"] * 3
        == run(t, "run.epochs=3")[0]["global_step"] * 2
        or pytest.fail()
    ),
    "early_stop.min_delta": lambda t: (
        refused("early_stop.min_delta=0.5", match="no effect without early_stop.patience"),
        elsewhere("test_recipes_early_stop.py::test_early_stop_stops_where_a_plain_loop_does"),
    ),
    "log.every_steps": lambda t: _lines(t, "log.every_steps=5") != _lines(t) or pytest.fail(),
    "log.progress": None,  # needs monkeypatch: see PROBES_WITH_MONKEYPATCH
    "log.tensorboard": lambda t: (
        (run(t, "log.tensorboard=true")[1] / "tb").is_dir() and not (run(t)[1] / "tb").exists() or pytest.fail()
    ),
    "log.csv": lambda t: (
        (run(t, "log.csv=true")[1] / "metrics_eval.csv").is_file()
        and not (run(t)[1] / "metrics_eval.csv").exists()
        or pytest.fail()
    ),
    "log.mlflow": lambda t: (
        pytest.importorskip("mlflow", reason="mlflow-skinny is optional; the dev extra installs it")
        and (run(t, "log.mlflow=true", f"run.out_dir={t}")[1] / "mlflow.json").is_file()
        or pytest.fail()
    ),
    "log.mlflow_uri": lambda t: (
        pytest.importorskip("mlflow", reason="optional; the dev extra installs it")
        and (
            _expect(UsageError, "applies to log.mlflow", run, t, f"log.mlflow_uri={(t / 'm').as_uri()}"),
            run(t, "log.mlflow=true", f"log.mlflow_uri={(t / 'm').as_uri()}"),
            (t / "m").is_dir() or pytest.fail(),
        )
    ),
    "log.wandb": None,  # needs monkeypatch (WANDB_SILENT): PROBES_WITH_MONKEYPATCH
    "log.wandb_mode": lambda t: _expect(UsageError, "applies to log.wandb", run, t, "log.wandb_mode=offline"),
    "log.project": lambda t: (
        pytest.importorskip("mlflow", reason="optional; the dev extra installs it")
        and (
            _expect(UsageError, "applies to log.mlflow and log.wandb", run, t, "log.project=x"),
            json.loads(
                (run(t, "log.mlflow=true", "log.project=probe", f"run.out_dir={t}")[1] / "mlflow.json").read_text()
            )["experiment"]
            == "probe"
            or pytest.fail(),
        )
    ),
    "eval.every_epochs": lambda t: (
        _lines(t, "run.epochs=2", "eval.every_epochs=2", kind="eval") != _lines(t, "run.epochs=2", kind="eval")
        or pytest.fail()
    ),
    "eval.every_steps": lambda t: (
        _lines(t, "eval.every_steps=2", kind="eval") > _lines(t, kind="eval") or pytest.fail()
    ),
    "eval.test_at_end": lambda t: refused("eval.test_at_end=true", match="has no test split"),  # + test_folder_layouts
    "eval.topk": lambda t: "val/top3" in run(t, "eval.topk=3")[0]["final"] or pytest.fail(),
    "eval.per_class": lambda t: (
        (run(t)[1] / "confusion_matrix.csv").exists()
        and not (run(t, "eval.per_class=false")[1] / "confusion_matrix.csv").exists()
        or pytest.fail()
    ),
    "eval.threshold": lambda t: refused("eval.threshold=0.7", match="task=classification does not use it"),
    "eval.tta": lambda t: (
        elsewhere("test_tta.py::test_validation_during_training_uses_tta_and_tta_changes_the_figures")
        or refused("eval.tta=five_crop", match="must end with center_crop")
    ),
    # `torchsprint serve`'s settings act on a real server: each is proved by a test of tests/e2e/serve/test_serve.py.
    **{
        f"serve.{field}": lambda t, test=test: elsewhere(f"test_serve.py::{test}")
        for field, test in {
            "host": "test_settings_come_from_the_run_a_file_overrides_and_flags",
            "port": "test_bad_settings_are_one_line_errors",
            "max_batch": "test_concurrent_answers_equal_predict_however_batched",
            "max_wait_ms": "test_max_wait_ms_holds_an_image_for_one_on_its_way_and_no_longer",
            "queue_limit": "test_full_queue_answers_503_with_retry_after_then_recovers",
            "timeout_s": "test_timeout_answers_503_and_drops_the_queued_image",
            "workers": "test_workers_share_the_port_and_metrics_add_up",
            "runtime": "test_onnxruntime_answers_equal_predict_on_onnx",
            "device": "test_bad_settings_are_one_line_errors",
            "token": "test_token_is_required_where_it_guards_and_the_api_is_described",
            "max_body_mb": "test_bad_input_gets_one_line_4xx_and_batch_mates_are_unaffected",
            "max_pixels": "test_bad_input_gets_one_line_4xx_and_batch_mates_are_unaffected",
            "topk": "test_token_is_required_where_it_guards_and_the_api_is_described",
            "buckets": "test_concurrent_answers_equal_predict_however_batched",
        }.items()
    },
    "serve.precision": lambda t: elsewhere(
        "test_inference_precision.py::test_serve_in_bf16_answers_as_predict_does_however_batched"
    ),
    "serve.max_model_pixels": lambda t: elsewhere(
        "test_serve_limits.py::test_a_batch_never_holds_more_pixels_than_the_limit_and_larger_images_are_refused"
    ),
}


def probe_wandb(tmp, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional; the dev extra installs it")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert not list(run(tmp)[1].glob("wandb/*"))
    assert list(run(tmp, "log.wandb=true", "log.wandb_mode=offline")[1].glob("wandb/offline-run-*"))


PROBES_WITH_MONKEYPATCH = {"log.progress": probe_progress, "imports": probe_imports, "log.wandb": probe_wandb}


def _expect(exc, match, fn, *args):
    with pytest.raises(exc, match=match):
        fn(*args)
    return True


def _fallback(t):
    """Without CUDA the gpu backend is refused, and with data.fallback=cpu the cpu backend runs instead."""
    if torch.cuda.is_available():
        return elsewhere("test_data_backends.py::test_gpu_backends_without_cuda_fail_clearly_or_fall_back")
    base = [*IMG, f"data.root={image_folder(t)}", "data.backend=gpu"]
    refused(*base, match="needs a CUDA GPU")
    with pytest.warns(UserWarning, match="using data.fallback=cpu"):
        _, b = build(*base, "data.fallback=cpu")
    assert type(b.loaders.train).__name__ == "DeviceLoader"


def _ema_differs(t, *over, base=(), keys=""):
    """The EMA weights after a short run differ with `over` (on the entries whose names contain `keys`)."""
    from safetensors.torch import load_file

    a, b = (
        load_file(str(run(t, "ema.enabled=true", "ema.decay=0.9", *base, *o)[1] / "ema.safetensors"))
        for o in ((), over)
    )
    assert any(not torch.equal(a[k], b[k]) for k in a if keys in k), over


def _swa_lrs(cfg, b):
    """The learning rate after each of 4 epoch ends with SWA on (SWALR's steps)."""
    out = []
    for epoch in range(4):
        b.swa.end_epoch(epoch, True)
        out.append(round(b.opt.param_groups[0]["lr"], 12))
    return out


def _epoch_images(cfg, b):
    """A checksum per training batch of epoch 0 (what mixing did to each)."""
    b.loaders.train.set_epoch(0)
    return [round(float(x.double().sum()), 6) for x, _ in b.loaders.train]


def _history(t, *over):
    _, d = run(t, *over)
    return [e["step"] for e in json.loads((d / "checkpoints" / "status.json").read_text())["history"]]


def _files(t, *over):
    _, d = run(t, *over)
    return sorted(p.name for p in (d / "checkpoints").glob("ckpt-*.pt"))


def _lines(t, *over, kind="train"):
    _, d = run(t, *over)
    return sum(json.loads(x)["kind"] == kind for x in (d / "metrics.jsonl").read_text().splitlines())


def _resume(t):
    summary, d = run(t, "run.epochs=2", "run.stop_after_steps=3", fresh=True)  # continued below
    assert summary["paused"]
    resumed = train(cfg_of("run.epochs=2", f"run.dir={d}", "checkpoint.resume=auto"), quiet=True)
    fresh, _ = run(t, "run.epochs=2")
    assert resumed["global_step"] == fresh["global_step"] and resumed["final"] == fresh["final"]


def test_every_field_has_a_probe():
    missing = [f for f in fields() if f not in PROBES]
    assert not missing, f"add a probe to tests/e2e/train/test_every_setting.py PROBES for {missing}"


@pytest.mark.parametrize("field", fields())
def test_field_changes_behaviour_or_is_refused(field, tmp_path, monkeypatch):
    probe = PROBES_WITH_MONKEYPATCH.get(field)
    if probe is not None:
        probe(tmp_path, monkeypatch)
        return
    assert PROBES.get(field) is not None, f"no probe for {field}"
    PROBES[field](tmp_path)


@pytest.mark.gpu
def test_cuda_only_settings(tmp_path):
    """data.pin_memory, speed.cudnn_benchmark, speed.tf32, speed.compile_mode and speed.cuda_graphs act on CUDA."""
    _, b = build("run.device=cuda", "data.num_workers=1")
    assert b.loaders.train.loader.shared.pin_memory
    _, b = build("run.device=cuda", "data.num_workers=1", "data.pin_memory=false")
    assert not b.loaders.train.loader.shared.pin_memory
    for flag in (True, False):
        build("run.device=cuda", f"speed.cudnn_benchmark={flag}")
        assert torch.backends.cudnn.benchmark is flag
        build("run.device=cuda", f"speed.tf32={flag}")
        assert torch.backends.cuda.matmul.allow_tf32 is flag and torch.backends.cudnn.allow_tf32 is flag
    _, b = build("run.device=cuda", "speed.cuda_graphs=true")
    assert type(b.model).__name__ == "CudaGraphed"
    _, b = build("run.device=cuda", "speed.compile=true", "speed.compile_mode=reduce-overhead")
    assert type(b.model).__name__ == "OptimizedModule"


# ---------------------------------------------------------------- transform steps
# Every registered preprocessing step changes images on the cpu backend, and on the batched backends
# (memory, gpu) either changes them the same way or is refused naming data.backend=cpu. Arguments for
# steps that need them (or whose defaults do nothing, like color_jitter's zeros):
STEP_ARGS = {
    "resize": 12,
    "center_crop": 12,
    "random_crop": {"size": 16, "padding": 2},
    "random_resized_crop": 16,
    "random_rotation": 30,
    "random_affine": {"degrees": 30},
    "color_jitter": {"brightness": 0.5},
}


def _step_names():
    from torchsprint.data.preprocess.transforms import TRANSFORMS

    # normalize: the data.train/data.eval probes; clip steps (data/sources/video.py): tests/e2e/tasks/test_task_video.py
    return [
        n
        for n in TRANSFORMS.names()
        if n != "normalize" and TRANSFORMS.get(n).__module__ == "torchsprint.data.preprocess.transforms"
    ]


@pytest.mark.parametrize("name", _step_names())
def test_every_transform_step_changes_images_or_is_refused(name):
    from torchsprint.data.core import sample_seeds
    from torchsprint.data.preprocess.augment import compile_batch_spec
    from torchsprint.data.preprocess.batch_ops import BATCH_OPS
    from torchsprint.data.preprocess.transforms import compile_spec

    step = {name: STEP_ARGS[name]} if name in STEP_ARGS else name
    x = torch.randint(0, 256, (50, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    cpu = compile_spec([step]).cpu
    outs = []
    for i in range(len(x)):
        torch.manual_seed(i)
        outs.append(cpu(x[i]))
    assert any(o.shape != x[i].shape or not torch.equal(o, x[i]) for i, o in enumerate(outs)), name
    if name not in BATCH_OPS:
        with pytest.raises(UsageError, match=f"'{name}' is not supported by data.backend=memory.*data.backend=cpu"):
            compile_batch_spec([step], "data.train.transforms", 3, "memory")
        return
    got = compile_batch_spec([step], "data.train.transforms", 3, "memory")(x, sample_seeds(0, 0, torch.arange(len(x))))
    assert got.shape != x.shape or not torch.equal(got, x), name

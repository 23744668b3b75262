"""Weight averaging: swa (AveragedModel, SWALR, update_bn) during training, and `torchsprint average` afterwards.

References are independent of the code under test: the mean of the saved per-epoch weights in float64, the
BatchNorm statistics measured by forward hooks over the same training batches, torch's own SWALR stepped by the
torch.optim.swa_utils recipe, an uninterrupted run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from paths import WORKERS
from torchsprint import cli, config, runtime
from torchsprint.config.saved import load_run_config
from torchsprint.errors import UsageError
from torchsprint.train.build import build_training
from torchsprint.train.run import train

BASE = [
    "model.args={width: 8}",
    "data.batch_size=128",
    "data.val_fraction=0.5",
    "optim.lr=0.05",
    "eval.per_class=false",
    "data.train.transforms=[random_crop: {size: 8, padding: 1}, hflip]",
    "log.tensorboard=false",
    "log.progress=false",
    "run.device=cpu",
]
SWA = ["swa.enabled=true", "swa.lr=0.02", "swa.start=2", "swa.anneal_epochs=1"]


def run(d: Path, *over: str) -> dict:
    return train(config.load(None, [*BASE, f"run.dir={d}", *over]), quiet=True)


def train_loader(run_dir: Path):
    """The run's own training loader, rebuilt from its folder (config.yaml), its config and its data's DataInfo."""
    cfg = load_run_config(run_dir)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        loaders = build_training(cfg, rt, lambda *_: None).loaders
        return loaders.train, cfg, loaders.info
    finally:
        runtime.teardown(rt)
        torch.use_deterministic_algorithms(False)


def bn_reference(state: dict, run_dir: Path) -> dict:
    """Per BatchNorm layer, what update_bn should find: the mean over training batches of each batch's per-channel
    mean and unbiased variance of the layer's input, measured by forward pre-hooks (train mode, float64)."""
    from torchsprint.models import build_model

    loader, cfg, info = train_loader(run_dir)
    epoch = cfg.run.epochs  # the pass swa and average make: the loader's epoch run.epochs
    model = build_model(cfg.model, info.num_classes, info.in_channels)
    model.load_state_dict(state)
    seen: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            seen[name] = []
            m.register_forward_pre_hook(
                lambda mod, inp, name=name: seen[name].append(
                    (inp[0].double().mean((0, 2, 3)), inp[0].double().var((0, 2, 3), unbiased=True))
                )
            )
    model.train()  # batch statistics: the running ones do not change what a layer passes on
    loader.set_epoch(epoch)
    with torch.no_grad():
        for x, _ in loader:
            model(x)
    assert seen and all(len(v) == len(loader) for v in seen.values())
    return {f"{n}.running_mean": torch.stack([m for m, _ in v]).mean(0) for n, v in seen.items()} | {
        f"{n}.running_var": torch.stack([s for _, s in v]).mean(0) for n, v in seen.items()
    }


def max_diff(a: dict, b: dict, keys) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)


def is_param(key: str) -> bool:
    return not key.endswith(("running_mean", "running_var", "num_batches_tracked"))


@pytest.fixture(scope="module")
def swa_run(tmp_path_factory):
    """4 epochs, SWA from epoch 2, every end-of-epoch checkpoint kept."""
    d = tmp_path_factory.mktemp("swa") / "run"
    summary = run(d, "run.epochs=4", *SWA, "checkpoint.keep_last=10")
    return d, summary


def test_swa_is_the_mean_of_the_epoch_weights_with_recomputed_bn(swa_run):
    """swa.safetensors: its weights the plain mean of the model at the end of epochs 2-4 (the checkpoints), its
    BatchNorm statistics those of one pass over the run's training data; evaluated and recorded."""
    d, summary = swa_run
    swa = load_file(str(d / "swa.safetensors"))
    epochs = [
        torch.load(next((d / "checkpoints").glob(f"ckpt-e00{e}-*.pt")), weights_only=True)["model"] for e in (2, 3, 4)
    ]
    mean = {k: sum(s[k].double() for s in epochs) / 3 for k in swa}
    params = [k for k in swa if is_param(k)]
    diff = max_diff(swa, mean, params)
    # Measured 7.9e-8 (AveragedModel's float32 running mean against the float64 mean of three); 3x.
    assert diff < 2.4e-7, diff
    assert max_diff(swa, epochs[-1], params) > 1e-3  # the average is not the last weights
    ref = bn_reference(swa, d)
    bn_diff = max_diff(swa, ref, ref)
    # Measured 1.1e-6 (update_bn's cumulative float32 average against the float64 mean of per-batch statistics,
    # on running variances of order 10); 3x.
    assert bn_diff < 3.3e-6, bn_diff
    stale = epochs[-1]  # what the average's BatchNorm buffers would hold without update_bn: the model's
    assert max_diff(swa, stale, ref) > 1e-2
    with safe_open(str(d / "swa.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["weights"] == "swa" and meta["swa_epochs"] == "2-4" and meta["swa_averaged"] == "3"
    assert summary["swa"] == {
        "start_epoch": 2,
        "averaged_epochs": 3,
        "lr": 0.02,
        "anneal_epochs": 1,
        "anneal_strategy": "cos",
        "file": "swa.safetensors",
    }
    saved = json.loads((d / "summary.json").read_text())
    assert saved["final"]["swa/val/top1"] == summary["final"]["swa/val/top1"]
    from torchsprint.train.evaluation import evaluate_run

    again = evaluate_run(d, "swa")  # the file holds what was evaluated
    # Measured: equal (the same weights over the same batches in the same order).
    assert again["top1"] == summary["final"]["swa/val/top1"] and again["loss"] == summary["final"]["swa/val/loss"]


@pytest.mark.parametrize(
    "sched",
    [
        ["sched.name=step", "sched.interval=epoch", "sched.step_size=1", "sched.gamma=0.5"],
        ["sched.name=exponential", "sched.interval=step", "sched.gamma=0.5"],
    ],
)
def test_swa_lr_follows_torch_swalr(tmp_path, sched):
    """The learning rate of every step equals the torch.optim.swa_utils recipe's: the run's schedule until epoch
    swa.start, then SWALR (built up front, stepped at each averaged epoch's end) on the same optimizer."""
    over = [
        "run.epochs=5",
        "swa.enabled=true",
        "swa.lr=0.004",
        "swa.start=3",
        "swa.anneal_epochs=2",
        "swa.anneal_strategy=linear",
        "log.every_steps=1",
        "optim.lr=0.05",
        *sched,
    ]
    run(tmp_path / "r", *over)
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    got = [x["train/lr"] for x in lines if x["kind"] == "train"]
    steps = len(got) // 5
    per_step = "sched.interval=step" in sched
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
    main = (
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s / steps))
        if per_step
        else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    )
    swalr = torch.optim.swa_utils.SWALR(opt, swa_lr=0.004, anneal_epochs=2, anneal_strategy="linear")
    want = []
    for epoch in range(5):
        for _ in range(steps):
            opt.step()
            if per_step and epoch < 2:
                main.step()
            want.append(opt.param_groups[0]["lr"])  # the log line's lr: after the step's scheduler step
        if epoch >= 2:  # epoch 3 (1-based) on: averaged, SWALR steps
            swalr.step()
        elif not per_step:
            main.step()
    assert len(got) == len(want)
    assert got == want  # measured: equal (the same float operations in the same order)
    assert got[-1] == pytest.approx(0.004) and got[2 * steps] != got[3 * steps]


def test_swa_resumes_bit_exactly(tmp_path):
    """Paused in epoch 4 (two epochs averaged, SWALR two steps into its three-epoch anneal) and resumed ==
    uninterrupted, bit for bit."""
    over = ["run.epochs=5", *SWA, "swa.anneal_epochs=3", "checkpoint.every_steps=3", "log.every_steps=1"]
    full = run(tmp_path / "full", *over)
    paused = run(tmp_path / "resumed", *over, "run.stop_after_steps=23")
    assert paused["paused"] and "swa" not in paused
    ckpt = torch.load(sorted((tmp_path / "resumed" / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert int(ckpt["swa"]["averaged"]["n_averaged"]) == 2 and ckpt["swa"]["swalr"]["_step_count"] == 3
    resumed = run(tmp_path / "resumed", *over, "checkpoint.resume=auto")
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, full["global_step"] + 1))  # resumed
    for name in ("swa", "last"):
        a, b = (load_file(str(tmp_path / r / f"{name}.safetensors")) for r in ("full", "resumed"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert full["final"] == resumed["final"] and "swa/val/top1" in full["final"]
    assert full["swa"] == resumed["swa"]


def test_swa_refusals(tmp_path):
    def refused(match, *over, d="x"):
        with pytest.raises(UsageError, match=match):
            run(tmp_path / d, *over)

    refused("needs swa.lr", "swa.enabled=true")
    refused("after the run's last epoch", "run.epochs=2", "swa.enabled=true", "swa.lr=0.01", "swa.start=3")
    refused("give an epoch number", "run.epochs=4", "swa.enabled=true", "swa.lr=0.01", "swa.start=2.5")
    refused("no effect with swa.enabled=false", "swa.lr=0.01")
    refused("no effect with swa.enabled=false", "swa.start=2")
    refused(
        "evaluated once, after the last epoch",
        "swa.enabled=true",
        "swa.lr=0.01",
        "swa.start=1",
        "checkpoint.monitor=swa/val/top1",
    )
    with pytest.raises(UsageError):  # a validation error: a start of 0 epochs
        config.load(None, ["swa.start=0"])
    # A run without SWA resumed with an average that should already hold its finished epochs: refused.
    run(tmp_path / "plain", "run.epochs=3", "run.stop_after_steps=15")
    refused(
        "no average of the epochs since",
        "run.epochs=3",
        "swa.enabled=true",
        "swa.lr=0.01",
        "swa.start=1",
        "checkpoint.resume=auto",
        d="plain",
    )
    run(tmp_path / "sw", "run.epochs=3", "swa.enabled=true", "swa.lr=0.01", "swa.start=1", "run.stop_after_steps=10")
    refused(
        "resume with the same swa.start",
        "run.epochs=3",
        "swa.enabled=true",
        "swa.lr=0.01",
        "swa.start=2",
        "checkpoint.resume=auto",
        d="sw",
    )


def test_swa_start_as_a_fraction_and_early_stop_before_it(tmp_path):
    """swa.start=0.5 of 4 epochs averages epochs 3-4; a run that stops before its first averaged epoch says so."""
    from torchsprint.state.swa import start_index

    assert start_index(config.load(None, ["swa.start=0.75"]).swa, 20) == 15  # epochs 16-20, as the schema says
    s = run(tmp_path / "frac", "run.epochs=4", "swa.enabled=true", "swa.lr=0.02", "swa.start=0.5")
    assert s["swa"]["start_epoch"] == 3 and s["swa"]["averaged_epochs"] == 2
    s = run(tmp_path / "short", "run.epochs=4", "run.max_steps=10", "swa.enabled=true", "swa.lr=0.02", "swa.start=3")
    assert s["swa"]["averaged_epochs"] == 0 and s["swa"]["file"] is None
    assert not (tmp_path / "short" / "swa.safetensors").exists() and "swa/val/top1" not in s["final"]


# ---------------------------------------------------------------- torchsprint average


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("avg")
    for seed in (1, 2):
        run(root / f"s{seed}", "run.epochs=2", f"run.seed={seed}", "checkpoint.keep_last=3")
    return root


def test_average_of_runs_is_their_mean_with_recomputed_bn_and_eval_takes_it(two_runs, capsys):
    """The file's weights are the plain mean of the runs' last weights, its BatchNorm statistics one pass over the
    first run's training data; `torchsprint eval --weights FILE` reproduces the printed figure."""
    out = two_runs / "avg.safetensors"
    code, r = (
        cli.main(["average", str(two_runs / "s1"), str(two_runs / "s2"), "-o", str(out), "--json"]),
        capsys.readouterr(),
    )
    assert code == 0, r.err
    res = json.loads(r.out.strip().splitlines()[-1])
    assert [x["input"] for x in res["inputs"]] == [str(two_runs / "s1"), str(two_runs / "s2")]
    avg = load_file(str(out))
    inputs = [load_file(str(two_runs / s / "last.safetensors")) for s in ("s1", "s2")]
    params = [k for k in avg if is_param(k)]
    diff = max_diff(avg, {k: (inputs[0][k].double() + inputs[1][k].double()) / 2 for k in avg}, params)
    assert diff < 1.8e-7, diff  # float32 rounding of the float64 mean (measured 6.0e-8: half an ulp near 1); 3x
    ref = bn_reference(avg, two_runs / "s1")
    bn_diff = max_diff(avg, ref, ref)
    assert bn_diff < 1.5e-7, bn_diff  # measured 4.8e-8 (as in the SWA test, on smaller statistics); 3x
    assert max_diff(avg, inputs[0], ref) > 1e-2  # not the input's statistics
    code, r = cli.main(["eval", "-r", str(two_runs / "s1"), "--weights", str(out), "--json"]), capsys.readouterr()
    assert code == 0, r.err
    ev = json.loads(r.out.strip().splitlines()[-1])
    assert ev["top1"] == res["average"]["top1"] and ev["weights"] == str(out)


def test_average_of_a_runs_checkpoints(two_runs):
    """--checkpoints 2: the model weights of the run's two newest checkpoints (epochs 1 and 2), averaged."""
    from torchsprint.commands.average import average

    out = two_runs / "ck.safetensors"
    res = average([str(two_runs / "s1")], out, checkpoints=2, log=lambda *_: None)
    files = sorted((two_runs / "s1" / "checkpoints").glob("ckpt-*.pt"))
    assert [x["input"] for x in res["inputs"]] == [p.name for p in files]
    states = [torch.load(p, weights_only=True)["model"] for p in files]
    avg = load_file(str(out))
    diff = max_diff(
        avg, {k: (states[0][k].double() + states[1][k].double()) / 2 for k in avg}, [k for k in avg if is_param(k)]
    )
    assert diff < 1.8e-7, diff  # measured 6.0e-8, as for the runs; 3x
    from torchsprint.commands.trained import load_weights_file

    assert load_weights_file(out).classes == [str(i) for i in range(10)]  # what predict -r FILE reads


def test_average_refuses_other_models_one_line(two_runs, cli_in_process, tmp_path):
    run(tmp_path / "wide", "run.epochs=1", "model.args={width: 16}")
    r = cli_in_process("average", str(two_runs / "s1"), str(tmp_path / "wide"), "-o", str(tmp_path / "x.safetensors"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has shape" in lines[0] and "same architecture" in lines[0], r.stderr
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize(
    "runs,kw,says",
    [
        (["s1"], {}, "at least 2 inputs"),
        (["s1", "s2"], {"checkpoints": 2}, "averages the checkpoints of one run"),
        (["s1"], {"checkpoints": 5}, "holds 2 checkpoint(s)"),
        (["s1", "s2"], {"weights": "ema"}, "that run has no ema weights"),
        (["s1", "s2"], {"out": "x.pt"}, "name the file *.safetensors"),
        (["s1", "nowhere"], {}, "no such run folder"),
    ],
)
def test_average_bad_input_is_refused(two_runs, runs, kw, says):
    """In process (the CLI's exit 2 and one line: test_average_refuses_other_models_one_line)."""
    from torchsprint.commands.average import average

    out = two_runs / kw.pop("out", "x.safetensors")
    with pytest.raises(UsageError, match=re.escape(says)):
        average([str(two_runs / r) for r in runs], out, log=lambda *_: None, **kw)
    assert not out.exists()


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
@pytest.mark.dist
def test_swa_under_ddp_is_the_same_on_every_rank(tmp_path):
    """Two gloo ranks: each rank's average (weights and recomputed BatchNorm statistics, which start from each
    rank's own shard of the training data) is the same, and is what swa.safetensors holds."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(WORKERS / "swa_ddp_worker.py"),
            str(out),
            str(tmp_path / "run"),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    saved = load_file(str(tmp_path / "run" / "swa.safetensors"))
    assert r0.keys() == r1.keys() == saved.keys()
    assert all(torch.equal(r0[k], r1[k]) and torch.equal(r0[k], saved[k]) for k in r0)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["swa"]["averaged_epochs"] == 2 and "swa/val/top1" in summary["final"]

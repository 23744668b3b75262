"""speed.cuda_graphs=auto: one decision (parallel.decide_cuda_graphs) that the capture, Precision,
decisions.json and the start-up summary all read; on for one CUDA process where it is safe, off and explained
elsewhere; nothing changes on CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.runtime import parallel
from torchsprint.runtime.core import Runtime
from torchsprint.runtime.parallel import GraphsDecision, check_speed, decide_cuda_graphs, wrap_model
from torchsprint.train import build
from torchsprint.train.plan import NO_SPEED, decide_speed, describe_decisions
from torchsprint.train.run import train

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU: the decision only reads .type
TINY = [
    "log.tensorboard=false",
    "run.max_steps=3",
    "checkpoint.every_epochs=null",
    "eval.per_class=false",
    "log.progress=false",
    "model.args={width: 4}",
]


def decide(*over, device=CUDA, world_size=1):
    cfg = config.load(None, list(over))
    return decide_cuda_graphs(cfg.speed, cfg.strategy, device, world_size, cfg.data.drop_last, cfg.model.freeze_epochs)


# (overrides, device, world size) -> (on, a phrase of the reason)
TABLE = [
    ([], CUDA, 1, True, "auto: on"),
    (["data.drop_last=false"], CUDA, 1, True, "last partial batch of an epoch runs eagerly"),
    (["optim.accum_steps=4"], CUDA, 1, True, "auto: on"),  # accumulation is exact through the graph (H200: 0.0)
    (["precision=amp_fp16"], CUDA, 1, True, "auto: on"),  # scaler, loss and optimizer stay eager
    (["ema.enabled=true"], CUDA, 1, True, "auto: on"),  # the EMA update runs after the eager optimizer step
    ([], CPU, 1, False, "needs a CUDA device (this run is on cpu)"),
    (["speed.compile=true"], CUDA, 1, False, "no torch.compile"),
    (["speed.compile=true", "speed.compile_mode=reduce-overhead"], CUDA, 1, False, "reduce-overhead adds CUDA graphs"),
    (["strategy.name=dp"], CUDA, 1, False, "no DataParallel"),
    (["strategy.sync_bn=true"], CUDA, 1, False, "no SyncBatchNorm"),
    ([], CUDA, 2, False, "one process"),
    (["model.freeze_epochs=2"], CUDA, 1, False, "no model.freeze_epochs"),  # auto must not refuse freeze_epochs
    (["speed.cuda_graphs=false"], CUDA, 1, False, "speed.cuda_graphs=false"),
    (["speed.cuda_graphs=true"], CUDA, 1, True, "speed.cuda_graphs=true"),
    (["speed.cuda_graphs=true"], CUDA, 2, True, "speed.cuda_graphs=true"),  # as set: DDP capture is the user's call
]


@pytest.mark.parametrize(
    "over,device,world,on,why", TABLE, ids=[f"{' '.join(t[0]) or 'defaults'}-{t[1].type}-x{t[2]}" for t in TABLE]
)
def test_the_decision_truth_table(over, device, world, on, why):
    d = decide(*over, device=device, world_size=world)
    assert d.on is on and why in d.why, d


def test_auto_is_on_exactly_where_true_would_be_accepted():
    """Every auto-off case on one process is one that check_speed refuses for speed.cuda_graphs=true, and every
    auto-on case is accepted: auto never turns on what `true` would refuse."""
    for over, device, world, on, _ in TABLE:
        if any(o.startswith("speed.cuda_graphs=") or o.startswith("model.freeze_epochs=") for o in over) or world > 1:
            # freeze_epochs with graphs=true is refused by build_training (train/run.py), which check_speed cannot see
            continue
        cfg = config.load(None, [*over, "speed.cuda_graphs=true", "speed.compile_backend=aot_eager"])
        try:
            check_speed(cfg.speed, cfg.strategy, device, cfg.optim.accum_steps)
            accepted = True
        except UsageError:
            accepted = False
        assert accepted is on, over


def test_auto_never_refuses_what_true_refuses():
    """The switches that refuse speed.cuda_graphs=true leave auto alone (it is the default: a run with compile,
    dp or sync_bn must not fail because of a setting it never made)."""
    for over in (["speed.compile=true", "speed.compile_backend=aot_eager"], ["strategy.sync_bn=true"]):
        cfg = config.load(None, over)
        check_speed(cfg.speed, cfg.strategy, CUDA)
        check_speed(cfg.speed, cfg.strategy, CPU)


def test_build_training_reads_one_decision(tmp_path, monkeypatch):
    """Whatever decide_cuda_graphs returns is what the capture, Precision (autocast cache off) and decisions.json
    see: a decision of 'on' on this CPU machine (the capture replaced by a recorder) reaches all three."""
    captured = []

    def fake_capture(model, example, prec, frozen_norms=None, chosen_by_auto=False):
        captured.append((example().shape, prec.graph_safe, chosen_by_auto))
        return model

    said = GraphsDecision(True, "pretend: decided on by the test")
    monkeypatch.setattr(build, "decide_cuda_graphs", lambda *a, **k: said)  # where build_training's start reads it
    monkeypatch.setattr(parallel, "capture_cuda_graphs", fake_capture)
    train(config.load(None, [*TINY, f"run.dir={tmp_path / 'r'}"]), quiet=True)
    assert captured == [(torch.Size([64, 1, 8, 8]), True, True)]  # one capture, of a training batch, graph-safe
    d = json.loads((tmp_path / "r" / "decisions.json").read_text())
    assert (d["cuda_graphs"], d["cuda_graphs_why"]) == (True, said.why)


@pytest.mark.parametrize(
    "over, by_auto", [(["speed.channels_last=false"], True), (["speed.cuda_graphs=true"], False), ([], True)]
)
def test_graphs_by_auto_reads_the_cuda_graphs_setting(over, by_auto):
    """graphs_by_auto (a failed capture becomes one line naming speed.cuda_graphs) follows speed.cuda_graphs, not
    another setting: it once read speed.channels_last's, so cuda_graphs=true with channels_last=auto said auto chose it,
    and auto's own failures under channels_last=false were raised as CUDA tracebacks."""
    cfg = config.load(None, over)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    assert decide_speed(cfg.speed, cfg.strategy, net, CUDA).graphs_by_auto is by_auto  # CUDA: only .type is read


def test_wrap_model_follows_the_decision_it_is_given(monkeypatch):
    """wrap_model captures exactly when the speed plan's decision says so, whatever the config held (no second
    decision inside wrap_model)."""
    calls = []
    monkeypatch.setattr(parallel, "capture_cuda_graphs", lambda m, *a, **k: calls.append(k) or m)
    wrap_model(
        torch.nn.Linear(2, 2),
        config.load(None, ["speed.cuda_graphs=false"]).strategy,
        Runtime(device=CPU),
        speed=dataclasses.replace(NO_SPEED, cuda_graphs=GraphsDecision(True, "x")),
        example=lambda: torch.zeros(1, 2),
    )
    assert len(calls) == 1
    cfg = config.load(None, [])
    wrap_model(
        torch.nn.Linear(2, 2),
        cfg.strategy,
        Runtime(device=CPU),
        speed=dataclasses.replace(NO_SPEED, cuda_graphs=GraphsDecision(False, "x")),
    )
    assert len(calls) == 1
    net = torch.nn.Linear(2, 2)
    wrap_model(
        net, cfg.strategy, Runtime(device=CPU), speed=decide_speed(cfg.speed, cfg.strategy, net, CPU)
    )  # cpu: off
    assert len(calls) == 1


def test_a_model_auto_cannot_capture_stops_with_one_line(monkeypatch):
    """Under auto a failed capture is a UsageError naming speed.cuda_graphs=false (not a CUDA traceback); under
    true the error is torch's own."""

    def fails(*a, **k):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(parallel, "CudaGraphed", fails)
    monkeypatch.setattr(torch.random, "fork_rng", lambda **k: contextlib.nullcontext())  # its CUDA RNG needs a GPU
    net = torch.nn.Linear(2, 2)
    with pytest.raises(
        UsageError, match=r"speed.cuda_graphs=auto .* operation not permitted .*speed.cuda_graphs=false"
    ):
        parallel.capture_cuda_graphs(net, lambda: torch.zeros(1, 2), None, chosen_by_auto=True)
    with pytest.raises(RuntimeError, match="operation not permitted"):
        parallel.capture_cuda_graphs(net, lambda: torch.zeros(1, 2), None)


def test_cpu_run_says_off_and_why_and_trains_as_before(tmp_path, capsys):
    """On CPU the default (auto) decides off, says so at start-up and in decisions.json, and the run is bit-identical
    to speed.cuda_graphs=false (the default run's figures unchanged)."""
    train(config.load(None, [*TINY, f"run.dir={tmp_path / 'auto'}"]))
    out = capsys.readouterr().out
    assert "CUDA graphs off (speed.cuda_graphs=auto: off, needs a CUDA device (this run is on cpu))" in out
    assert "optimizer update " in out
    d = json.loads((tmp_path / "auto" / "decisions.json").read_text())
    assert d["cuda_graphs"] is False and "needs a CUDA device" in d["cuda_graphs_why"]
    assert d["optimizer_impl"] in ("foreach", "for_loop", "default") and d["optimizer_impl_why"].startswith(
        "optim.impl=auto"
    )
    train(config.load(None, [*TINY, "speed.cuda_graphs=false", f"run.dir={tmp_path / 'off'}"]), quiet=True)
    a, b = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("auto", "off"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_summary_line_reports_an_on_decision_and_the_fused_optimizer():
    d = {
        "dataset": "digits",
        "root": None,
        "backend": "memory",
        "backend_why": "w",
        "device": "cuda:0",
        "world_size": 1,
        "precision": "fp32",
        "channels_last": True,
        "channels_last_why": "c",
        "batch_size": 64,
        "accum_steps": 1,
        "effective_batch_size": 64,
        "steps_per_epoch": 22,
        "epochs": 10,
        "cuda_graphs": True,
        "cuda_graphs_why": "speed.cuda_graphs=auto: on (...)",
        "optimizer_impl": "fused",
        "optimizer_impl_why": "optim.impl=auto: fused kernels for sgd/adam/adamw on CUDA",
    }
    assert (
        "CUDA graphs on (speed.cuda_graphs=auto: on (...)); optimizer update fused (optim.impl=auto: fused kernels "
        "for sgd/adam/adamw on CUDA)"
    ) in describe_decisions(d)


def test_impl_in_use_reads_the_built_optimizer():
    """What decisions.json reports is read off the optimizer object: fused where the CUDA path would pass fused=True."""
    from torchsprint.optim.optimizers import impl_in_use

    cfg = config.load(None, []).optim
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert impl_in_use(torch.optim.SGD(p, lr=0.1, fused=True), cfg)[0] == "fused"
    assert impl_in_use(torch.optim.SGD(p, lr=0.1, foreach=True), cfg)[0] == "foreach"
    assert impl_in_use(torch.optim.SGD(p, lr=0.1, foreach=False), cfg)[0] == "for_loop"
    assert impl_in_use(torch.optim.SGD(p, lr=0.1), cfg) == (
        "default",
        "optim.impl=auto: PyTorch's choice (fused is used for sgd/adam/adamw on CUDA only)",
    )
    args = config.load(None, ["optim.args={foreach: true}"]).optim
    assert impl_in_use(torch.optim.SGD(p, lr=0.1, foreach=True), args) == ("foreach", "optim.args.foreach=True")


def test_resolve_impl_picks_fused_on_cuda_parameters(monkeypatch):
    """optim.impl=auto resolves to fused when every parameter is on CUDA (the default run on a GPU: bench's '+ foreach
    optimizer' row is against the seeds' for_loop baseline, not against this). is_cuda is faked per parameter."""
    from torchsprint.optim.optimizers import resolve_impl

    class OnCuda(torch.Tensor):
        is_cuda = True

    cfg = config.load(None, []).optim
    assert resolve_impl(cfg, [{"params": [torch.zeros(2).as_subclass(OnCuda)]}]).impl == "fused"
    assert resolve_impl(cfg, [{"params": [torch.zeros(2)]}]).impl == "auto"

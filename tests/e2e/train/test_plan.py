"""The run plan: every run-time decision made once, in plan.RunPlan; decisions.json and the start-up
summary are written from it, and what ran (the model's and the batches' memory format, CUDA graphs, precision, the
batch, the optimizer steps of an epoch, the logged steps) is what it says. Real training runs on CPU, no mocks: a
spy around run.build_training only keeps the objects the run trains with, and hooks count what they do."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from torchsprint import config
from torchsprint.observe.logging import RunLogger
from torchsprint.runtime.core import Runtime
from torchsprint.runtime.parallel import CudaGraphed, unwrap
from torchsprint.state.checkpoint import TrainState
from torchsprint.train import run
from torchsprint.train.context import RunContext
from torchsprint.train.engine import set_train_mode, train_one_epoch
from torchsprint.train.plan import decisions, describe_decisions

# 40 training JPEGs of 12x12 RGB (3 channels: an NCHW and an NHWC batch differ in their strides), batch 8,
# 2 micro-batches per step: 5 batches -> 3 optimizer steps per epoch (the last of one micro-batch).
SMALL = [
    "data.dataset=synthetic_jpeg",
    "data.options={num_images: 40, val_images: 8, size: [12, 12], classes: 2}",
    "data.batch_size=8",
    "data.drop_last=false",
    "optim.accum_steps=2",
    "run.epochs=2",
    "log.every_steps=1",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "checkpoint.every_epochs=null",
    "model.args={width: 4}",
]


def nhwc(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor is laid out channels_last and not also NCHW (true for C > 1 and H*W > 1 only)."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def spy_on_build(monkeypatch) -> dict:
    """Keep the Built of the next run.train, with what its model sees: the training batches, and the order of
    optimizer steps ("S") and evaluation forwards ("E", which end each epoch here)."""
    seen = {"built": None, "batches": [], "events": []}
    real = run.build_training

    def pre_forward(module, args):
        if module.training:
            seen["batches"].append(args[0])
        else:
            seen["events"].append("E")

    def build(*a, **k):
        b = real(*a, **k)
        seen["built"] = b
        unwrap(b.model).register_forward_pre_hook(pre_forward)
        b.opt.register_step_post_hook(lambda *_: seen["events"].append("S"))
        return b

    monkeypatch.setattr(run, "build_training", build)
    return seen


@pytest.mark.parametrize(
    "setting, model_nhwc, inputs_nhwc", [("auto", True, False), ("true", True, True), ("false", False, False)]
)
def test_decisions_and_summary_are_the_plan_and_say_what_ran(
    tmp_path, monkeypatch, capsys, setting, model_nhwc, inputs_nhwc
):
    seen = spy_on_build(monkeypatch)
    cfg = config.load(
        None, [*SMALL, f"data.root={tmp_path / 'data'}", f"speed.channels_last={setting}", f"run.dir={tmp_path / 'r'}"]
    )
    summary = run.train(cfg)
    out = capsys.readouterr().out
    b, d = seen["built"], json.loads((tmp_path / "r" / "decisions.json").read_text())
    plan = b.plan
    # Written from the plan (and the data's facts), nothing else: the file and the summary lines.
    assert d == json.loads(json.dumps(decisions(plan, b.loaders.info.facts)))
    for line in describe_decisions(d):
        assert line in out
    # The plan says what ran. Memory formats: the model's 4-D weights with more than one input channel, and every
    # training batch the model was given.
    weights = [p for p in unwrap(b.model).parameters() if p.ndim == 4 and p.shape[1] > 1]
    assert weights and {nhwc(p) for p in weights} == {model_nhwc}
    assert d["channels_last"] is plan.channels_last is model_nhwc
    assert seen["batches"] and {nhwc(x) for x in seen["batches"]} == {inputs_nhwc} == {plan.channels_last_inputs}
    # CUDA graphs (off on CPU) and precision: the objects that ran.
    graphed = any(isinstance(m, CudaGraphed) for m in b.model.modules())
    assert d["cuda_graphs"] is plan.cuda_graphs.on is graphed is False
    assert d["precision"] == plan.precision == b.prec.mode == "fp32"
    # The batch, the accumulation and the steps: batch sizes the model saw, optimizer steps taken per epoch.
    assert d["batch_size"] == plan.batch_size == max(x.shape[0] for x in seen["batches"]) == 8
    assert d["accum_steps"] == plan.accum_steps == 2
    assert d["effective_batch_size"] == plan.effective_batch_size == 16
    first_epoch = "".join(seen["events"]).split("E")[0]  # the optimizer steps before the first evaluation
    assert d["steps_per_epoch"] == plan.steps_per_epoch == len(first_epoch) == 3
    assert d["epochs"] == plan.epochs == 2 and summary["global_step"] == seen["events"].count("S") == 6
    # The log steps follow the plan's interval (every step here).
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(
        range(plan.log_every_steps, 7, plan.log_every_steps)
    )


def test_the_engine_follows_the_plan_not_the_config(tmp_path):
    """train_one_epoch steps, logs and stops as the plan says, when the config it was built from says otherwise."""
    cfg = config.load(None, [*SMALL, f"data.root={tmp_path / 'data'}", f"run.dir={tmp_path / 'r'}"])
    rt = Runtime(torch.device("cpu"))
    b = run.build_training(cfg, rt, lambda *_: None)
    plan = dataclasses.replace(b.plan, log_every_steps=2, accum_steps=1, max_steps=4)  # the config: 1, 2, none
    (tmp_path / "log").mkdir()
    logger = RunLogger(tmp_path / "log", b.cfg.log, console=False)
    steps = []
    b.opt.register_step_post_hook(lambda *_: steps.append(1))
    set_train_mode(b.model, b.frozen_norms)
    ep = train_one_epoch(b, TrainState(), plan, RunContext(rt, tmp_path, logger))
    logger.close()
    assert len(steps) == 4 and ep["images"] == 32 and not ep["finished_epoch"]  # one batch per step, stopped at 4
    rows = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4]


def test_the_plan_is_frozen(tmp_path):
    cfg = config.load(None, [*SMALL, f"data.root={tmp_path / 'data'}"])
    b = run.build_training(cfg, Runtime(torch.device("cpu")), lambda *_: None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.plan.steps_per_epoch = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.plan.speed.channels_last = True

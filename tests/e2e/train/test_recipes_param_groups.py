"""Per-parameter-group lr / weight decay and layer-wise lr decay: each parameter's optimizer group has the expected
rate."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torchvision

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.optim import build_optimizer, build_scheduler

timm = pytest.importorskip("timm")


def optim_cfg(*over):
    return config.load(None, [*over]).optim


def per_param(opt) -> dict[int, tuple[float, float]]:
    """id(parameter) -> (lr, weight_decay) of the group that holds it."""
    return {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}


def test_pattern_groups_on_torchvision_resnet18():
    model = torchvision.models.resnet18(num_classes=3)
    opt = build_optimizer(
        optim_cfg(
            "optim.lr=0.2",
            "optim.weight_decay=1e-4",
            "optim.param_groups=[{pattern: 'layer4.*', lr_scale: 0.1, weight_decay: 0.01}, "
            "{pattern: 're:^(layer4|fc)\\.', lr_scale: 5}]",
        ),
        model,
    )
    got = per_param(opt)
    assert len(got) == len(list(model.parameters()))  # every trainable parameter exactly once
    for name, p in model.named_parameters():
        no_decay = p.ndim <= 1  # resnet's 1-d parameters are the BatchNorm weights/biases and fc.bias
        if name.startswith("layer4."):  # the first matching rule wins (the regex matches layer4 too)
            want = (0.2 * 0.1, 0.0 if no_decay else 0.01)
        elif name.startswith("fc."):
            want = (0.2 * 5, 0.0 if no_decay else 1e-4)
        else:
            want = (0.2, 0.0 if no_decay else 1e-4)
        assert got[id(p)] == pytest.approx(want, rel=1e-12), name
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)  # groups by decreasing rate: group 0 is the largest


def test_schedulers_scale_each_groups_own_rate():
    model = torchvision.models.resnet18(num_classes=3)
    opt = build_optimizer(optim_cfg("optim.lr=0.2", "optim.param_groups=[{pattern: 'layer*', lr_scale: 0.1}]"), model)
    sched = build_scheduler(config.load(None, ["sched.warmup_epochs=1"]).sched, opt, epochs=4, steps_per_epoch=5)
    assert sorted({round(g["initial_lr"], 12) for g in opt.param_groups}) == [0.02, 0.2]  # each group's own base
    for _ in range(7):
        opt.step()
        sched.step()
    factors = [g["lr"] / g["initial_lr"] for g in opt.param_groups]
    # Step 7 of 20 with 5 warm-up steps: cosine (to 0) 0.4 epochs into its 3, the same for every group.
    want = 0.5 * (1 + math.cos(math.pi * (7 / 5 - 1) / 3))  # 0.9568
    worst = max(abs(f - want) for f in factors)
    print(f"max |factor - cosine| = {worst:.1e}")
    assert worst < 6e-16, (factors, want)  # measured 0.0 (2e-16 in an earlier measurement: one rounding)


def test_layer_decay_on_torchvision_resnet18_matches_timm_on_its_resnet18():
    """torchvision's and timm's resnet18 share parameter names; block_layer_ids must give timm's layer scales."""
    from timm.optim._param_groups import param_groups_layer_decay

    tv = torchvision.models.resnet18(num_classes=3)
    opt = build_optimizer(optim_cfg("optim.lr=1.0", "optim.layer_decay=0.75"), tv)
    ours = {n: per_param(opt)[id(p)][0] for n, p in tv.named_parameters()}
    ref = {}
    for g in param_groups_layer_decay(timm.create_model("resnet18", num_classes=3), layer_decay=0.75):
        ref.update(dict.fromkeys(g["param_names"] if "param_names" in g else [], g["lr_scale"]))
    if not ref:  # this timm version does not name the parameters in its groups: map them through the model
        tm = timm.create_model("resnet18", num_classes=3)
        names = {id(p): n for n, p in tm.named_parameters()}
        for g in param_groups_layer_decay(tm, layer_decay=0.75):
            ref.update({names[id(p)]: g["lr_scale"] for p in g["params"]})
    assert ours.keys() == ref.keys()
    assert all(ours[n] == pytest.approx(ref[n], rel=1e-12) for n in ours), {
        n: (ours[n], ref[n]) for n in ours if ours[n] != ref[n]
    }
    assert ours["conv1.weight"] == pytest.approx(0.75**9) and ours["layer1.0.conv1.weight"] == pytest.approx(0.75**8)
    assert ours["fc.weight"] == 1.0


def test_layer_decay_on_a_timm_vit_uses_its_group_matcher():
    from timm.optim._param_groups import param_groups_layer_decay

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    opt = build_optimizer(
        optim_cfg(
            "optim.lr=1.0",
            "optim.layer_decay=0.8",
            "optim.name=adamw",
            "optim.weight_decay=0.05",
            "optim.param_groups=[{pattern: 'head.*', lr_scale: 2}]",
        ),
        model,
    )
    ours = {n: per_param(opt)[id(p)][0] for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    ref = {names[id(p)]: g["lr_scale"] for g in param_groups_layer_decay(model, layer_decay=0.8) for p in g["params"]}
    for n in ours:  # the head's rule multiplies its layer scale
        assert ours[n] == pytest.approx(ref[n] * (2 if n.startswith("head.") else 1), rel=1e-12), n
    assert ours["cls_token"] == pytest.approx(0.8**13) and ours["blocks.11.mlp.fc1.weight"] == pytest.approx(0.8)


def test_frozen_parameters_stay_out_and_unmatched_patterns_are_named():
    model = torchvision.models.resnet18(num_classes=3)
    with pytest.raises(UsageError, match="pattern 'backbone.\\*' matches no trainable parameter"):
        build_optimizer(optim_cfg("optim.param_groups=[{pattern: 'backbone.*', lr_scale: 0.1}]"), model)
    for p in model.layer1.parameters():
        p.requires_grad_(False)
    with pytest.raises(UsageError, match="pattern 'layer1.\\*'"):  # only frozen parameters match: nothing to set
        build_optimizer(optim_cfg("optim.param_groups=[{pattern: 'layer1.*', lr_scale: 0.1}]"), model)
    opt = build_optimizer(optim_cfg("optim.layer_decay=0.5"), model)
    assert sum(len(g["params"]) for g in opt.param_groups) == sum(p.requires_grad for p in model.parameters())


def test_a_run_trains_with_groups_and_resumes(tmp_path):
    """Through the CLI flow: the groups' rates are logged by the schedule and a checkpoint round-trips them."""
    from torchsprint.train.run import train

    over = [
        "model.args={width: 8}",
        "log.tensorboard=false",
        "log.progress=false",
        "run.epochs=2",
        "eval.per_class=false",
        "optim.layer_decay=0.7",
        "optim.param_groups=[{pattern: '0.*', lr_scale: 0.5, weight_decay: 0}]",
        "log.every_steps=1",
        "optim.no_decay_norm_bias=false",
    ]  # so that only the pattern's rule can give a group weight decay 0
    full = train(config.load(None, [*over, f"run.dir={tmp_path / 'a'}"]), quiet=True)
    train(config.load(None, [*over, f"run.dir={tmp_path / 'b'}", "run.stop_after_steps=30"]), quiet=True)
    resumed = train(config.load(None, [*over, f"run.dir={tmp_path / 'b'}", "checkpoint.resume=auto"]), quiet=True)
    assert resumed["final"] == full["final"]
    lines = [json.loads(x) for x in ((tmp_path / "b") / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(
        range(1, full["global_step"] + 1)
    )  # resumed, not started over
    ck = torch.load(sorted((tmp_path / "b" / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert len({g["lr_scale"] for g in ck["optimizer"]["param_groups"]}) > 2
    # the pattern's weight_decay: 0 reached the optimizer the run stepped, beside the default decay of the rest
    decays = {g["weight_decay"] for g in ck["optimizer"]["param_groups"]}
    assert decays == {0, config.load(None, []).optim.weight_decay}

"""Registries, driven by their names: every optimizer and scheduler builds and steps, every built-in model trains."""

import math

import pytest
import torch
from torch import nn

from torchsprint import config
from torchsprint.data import DATASETS, LOADERS
from torchsprint.data.preprocess.transforms import TRANSFORMS
from torchsprint.errors import UsageError
from torchsprint.models import MODELS, build_model
from torchsprint.models.nets import small_cnn
from torchsprint.optim import LOSSES, OPTIMIZERS, SCHEDULERS, build_loss, build_optimizer, build_scheduler

BUILTIN_MODELS = ["small_cnn", "cifar_resnet18", "linear"]


def cfg_with(*overrides):
    return config.load(None, list(overrides))


@pytest.mark.parametrize("name", OPTIMIZERS.names())
def test_every_optimizer_builds_and_steps(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    cfg = cfg_with(f"optim.name={name}", "optim.lr=0.01")
    opt = build_optimizer(cfg.optim, model)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # two steps: ADOPT (timm/adopt) only initialises its second moment on the first
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 3, (16,)))
        loss.backward()
        opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), f"{name} did not update"


def test_unknown_optimizer_suggests():
    with pytest.raises(UsageError, match="Did you mean: adamw"):
        build_optimizer(cfg_with("optim.name=adamww").optim, nn.Linear(2, 2))


def test_no_decay_for_norm_and_bias():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 5, 5))
    opt = build_optimizer(cfg_with("optim.weight_decay=0.1").optim, model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {4, 2}
    assert all(p.ndim == 1 for p in no_decay["params"])
    opt = build_optimizer(cfg_with("optim.weight_decay=0.1", "optim.no_decay_norm_bias=false").optim, model)
    assert len(opt.param_groups) == 1


def test_frozen_parameters_are_not_optimised():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    opt = build_optimizer(cfg_with().optim, model)
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model[0].weight) not in ids and id(model[1].weight) in ids


@pytest.mark.parametrize("name", SCHEDULERS.names())
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_every_scheduler_builds_and_steps(name, interval):
    model = nn.Linear(2, 2)
    own = {
        "step": ["sched.step_size=2", "sched.gamma=0.5"],
        "multistep": ["sched.milestones=[2, 3]", "sched.gamma=0.5"],
        "exponential": ["sched.gamma=0.5"],
    }.get(name, [])  # each schedule's own fields (others are refused)
    cfg = cfg_with(f"sched.name={name}", f"sched.interval={interval}", "sched.warmup_epochs=1", *own)
    opt = build_optimizer(cfg.optim, model)
    sched = build_scheduler(cfg.sched, opt, epochs=4, steps_per_epoch=5)
    lrs = []
    for _ in range(20 if interval == "step" else 4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert all(math.isfinite(x) and x >= 0 for x in lrs)
    assert lrs[0] < 0.1 * 0.2 + 1e-9 or name == "onecycle"  # warm-up starts at warmup_start x lr
    assert max(lrs) <= 0.1 + 1e-9


def test_cosine_reaches_min_and_warmup_is_linear():
    model = nn.Linear(2, 2)
    cfg = cfg_with("sched.warmup_epochs=1", "sched.min_lr_ratio=0.1", "sched.warmup_start=0.0")
    opt = build_optimizer(cfg.optim, model)
    sched = build_scheduler(cfg.sched, opt, epochs=3, steps_per_epoch=10)
    lrs = []
    for _ in range(30):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and abs(lrs[5] - 0.05) < 1e-9 and abs(lrs[10] - 0.1) < 1e-9
    assert abs(opt.param_groups[0]["lr"] - 0.01) < 1e-9


def test_multistep_decays_at_milestones():
    opt = build_optimizer(cfg_with().optim, nn.Linear(2, 2))
    cfg = cfg_with("sched.name=multistep", "sched.milestones=[1, 2]", "sched.interval=epoch")
    sched = build_scheduler(cfg.sched, opt, epochs=3, steps_per_epoch=1)
    seen = []
    for _ in range(3):
        seen.append(round(opt.param_groups[0]["lr"], 10))
        opt.step()
        sched.step()
    assert seen == [0.1, 0.01, 0.001]


@pytest.mark.parametrize("name", LOSSES.names())
def test_every_loss(name):
    logits = torch.randn(6, 4, requires_grad=True)
    target = torch.randint(0, 4, (6,)) if name in ("cross_entropy", "bce_with_logits") else torch.randn(6, 4)
    loss = build_loss(cfg_with(f"loss.name={name}").loss)(logits, target)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss) and logits.grad is not None


def test_label_smoothing_and_weighted_sum():
    logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
    ls = build_loss(cfg_with("loss.label_smoothing=0.1").loss)(logits, target)
    assert torch.allclose(ls, nn.functional.cross_entropy(logits, target, label_smoothing=0.1))
    cfg = cfg_with("loss.terms=[{name: cross_entropy, weight: 0.5}, {name: bce_with_logits, weight: 2.0}]")
    got = build_loss(cfg.loss)(logits, target)
    want = 0.5 * nn.functional.cross_entropy(logits, target) + 2.0 * nn.functional.binary_cross_entropy_with_logits(
        logits, nn.functional.one_hot(target, 5).float()
    )
    assert torch.allclose(got, want)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
@pytest.mark.parametrize("in_channels", [1, 3])
def test_builtin_models_forward_backward(name, in_channels):
    args = {"width": 8} if name != "linear" else {}
    model = build_model(
        cfg_with(f"model.name={name}", f"model.args={args}").model, num_classes=7, in_channels=in_channels
    )
    x = torch.randn(2, in_channels, 16, 16)
    out = model(x)
    assert out.shape == (2, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        "mobilenet_v3_small",
        "efficientnet_b0",
        "convnext_tiny",
        "vit_b_16",
        "densenet121",
        "regnet_y_400mf",
        "shufflenet_v2_x0_5",
        "squeezenet1_0",
    ],
)
def test_torchvision_models_take_data_classes_and_channels(name):
    model = build_model(cfg_with(f"model.name={name}").model, num_classes=5, in_channels=1)
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(1, 1, 224, 224))
    assert out.shape == (1, 5)


def test_every_torchvision_classification_model_is_registered():
    import torchvision

    names = set(MODELS.names())
    assert set(torchvision.models.list_models(module=torchvision.models)) <= names
    assert set(BUILTIN_MODELS) <= names


def test_unknown_model_lists_closest():
    with pytest.raises(UsageError) as e:
        MODELS.get("resnet19")
    assert "resnet18" in str(e.value) and "torchsprint list models" in str(e.value)


@pytest.mark.parametrize(
    "registry,bad,good",
    [
        (DATASETS, "digit", "digits"),
        (LOADERS, "cpuu", "cpu"),
        (SCHEDULERS, "cosin", "cosine"),
        (LOSSES, "crossentropy", "cross_entropy"),
        (TRANSFORMS, "hflp", "hflip"),
    ],
)
def test_unknown_names_suggest(registry, bad, good):
    with pytest.raises(UsageError, match=good):
        registry.get(bad)


def test_user_registration_via_decorator():
    @MODELS.register("test_tiny_user_net")
    def tiny(num_classes, in_channels=3):
        return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))

    assert "test_tiny_user_net" in MODELS.names()
    with pytest.raises(ValueError, match="twice"):
        MODELS.register("test_tiny_user_net")(small_cnn)


def test_timm_models_when_timm_is_installed():
    pytest.importorskip("timm", reason="timm is optional; the dev extra installs it")
    model = build_model(cfg_with("model.name=timm/resnet18").model, num_classes=5, in_channels=1)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 5)
    with pytest.raises(UsageError, match="timm/resnet18"):
        MODELS.get("timm/resnet19")


def test_a_torchvision_name_does_not_load_later_providers():
    from torchsprint.registry import Registry

    calls = []
    reg = Registry("thing")
    reg.add_provider(lambda: calls.append("a") or {"x": 1})
    reg.add_provider(lambda: calls.append("b") or {"y": 2})
    assert reg.get("x") == 1 and calls == ["a"]  # the second (e.g. timm, seconds to import) stays unloaded
    assert reg.get("y") == 2 and calls == ["a", "b"]


def test_bn_momentum_sets_the_running_statistics_update():
    """model.bn_momentum on torchvision's MobileNetV3 (built with BatchNorm momentum 0.01): every BatchNorm layer
    takes the value, and one training-mode forward moves the first layer's running mean by that share of the
    batch's mean (PyTorch's convention, worked by hand from the layer's input), as timm's --bn-momentum does."""
    from torchsprint import config
    from torchsprint.models import build_model

    torch.manual_seed(0)
    for value, expected in ((None, {0.01}), (0.1, {0.1})):
        cfg = config.load(
            None, ["model.name=mobilenet_v3_small"] + ([] if value is None else [f"model.bn_momentum={value}"])
        )
        model = build_model(cfg.model, num_classes=4, in_channels=3)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert {m.momentum for m in norms} == expected
    seen = {}
    # its input as it enters (a pre-hook: after the layer the same storage holds something else on the CPU)
    norms[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    before = norms[0].running_mean.clone()
    model.train()
    model(torch.randn(8, 3, 64, 64))
    by_hand = 0.9 * before + 0.1 * seen["x"].mean(dim=(0, 2, 3))
    torch.testing.assert_close(norms[0].running_mean, by_hand, rtol=0, atol=1e-9)  # 1.5e-10 measured (float32 sums)

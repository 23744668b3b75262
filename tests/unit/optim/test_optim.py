"""optim/ against torch's own classes (independent references): parameter groups, optimizers, every
schedule with and without warm-up, losses; and the refusals of settings an optimizer or schedule ignores."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.optim import FixedLR, build_loss, build_optimizer, build_scheduler, param_groups


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 3), nn.LayerNorm(3))


def test_param_groups_put_biases_and_norms_out_of_decay_and_frozen_out_of_both():
    m = net()
    m[0].bias.requires_grad_(False)
    decay, no_decay = param_groups(m, 0.05, True)
    assert decay["params"] == [m[0].weight, m[3].weight] and decay["weight_decay"] == 0.05
    assert no_decay["params"] == [m[1].weight, m[1].bias, m[3].bias, m[4].weight, m[4].bias]
    assert no_decay["weight_decay"] == 0.0
    (one,) = param_groups(m, 0.05, False)
    assert len(one["params"]) == 7 and one["weight_decay"] == 0.05
    (one,) = param_groups(m, 0.0, True)  # nothing to split without decay
    assert len(one["params"]) == 7 and one["weight_decay"] == 0.0


def optim_cfg(*over):
    return config.load(None, list(over)).optim


@pytest.mark.parametrize(
    "over,cls,want",
    [
        (
            ["optim.name=sgd", "optim.lr=0.3", "optim.momentum=0.8", "optim.nesterov=true", "optim.impl=foreach"],
            torch.optim.SGD,
            {"lr": 0.3, "momentum": 0.8, "nesterov": True, "foreach": True},
        ),
        (
            ["optim.name=sgd", "optim.momentum=0", "optim.nesterov=true", "optim.impl=for_loop"],
            torch.optim.SGD,
            {"momentum": 0, "nesterov": False, "foreach": False},
        ),  # nesterov needs momentum
        (
            ["optim.name=adam", "optim.lr=0.01", "optim.betas=[0.8, 0.9]", "optim.eps=1e-6"],
            torch.optim.Adam,
            {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6, "foreach": None, "fused": None},
        ),
        (
            ["optim.name=adamw", "optim.betas=[0.7, 0.95]", "optim.eps=1e-7", "optim.weight_decay=0.1"],
            torch.optim.AdamW,
            {"betas": (0.7, 0.95), "eps": 1e-7},
        ),
        (
            ["optim.name=rmsprop", "optim.momentum=0.5", "optim.eps=1e-5"],
            torch.optim.RMSprop,
            {"momentum": 0.5, "eps": 1e-5},
        ),
        (
            ["optim.name=Adagrad", "optim.lr=0.2", "optim.args={lr_decay: 0.1}"],
            torch.optim.Adagrad,
            {"lr": 0.2, "lr_decay": 0.1},
        ),
    ],
)
def test_build_optimizer_passes_each_setting(over, cls, want):
    opt = build_optimizer(optim_cfg(*over), net())
    assert type(opt) is cls
    for k, v in want.items():
        assert opt.defaults[k] == v, (k, opt.defaults[k])
    decays = [g["weight_decay"] for g in opt.param_groups]
    assert len(decays) == 2 and decays[1] == 0.0 and decays[0] == optim_cfg(*over).weight_decay > 0


def test_build_optimizer_refusals():
    with pytest.raises(
        UsageError, match=r"^optim.impl=fused: RMSprop has no fused implementation. Use foreach or auto.$"
    ):
        build_optimizer(optim_cfg("optim.name=rmsprop", "optim.impl=fused"), net())
    assert build_optimizer(optim_cfg("optim.name=sgd", "optim.impl=fused"), net()).defaults["fused"] is True
    with pytest.raises(
        UsageError,
        match=r"^optim.betas=\(0.8, 0.9\) does not apply to optimizer sgd \(it reads "
        r"optim.momentum, optim.nesterov\); remove it, or pass sgd's own arguments in optim.args.$",
    ):
        build_optimizer(optim_cfg("optim.name=sgd", "optim.betas=[0.8, 0.9]"), net())
    with pytest.raises(
        UsageError, match=r"optim.momentum=0.5 does not apply to optimizer adagrad \(it reads only optim.lr\)"
    ):
        build_optimizer(optim_cfg("optim.name=adagrad", "optim.momentum=0.5"), net())
    frozen = net().requires_grad_(False)
    with pytest.raises(UsageError, match="^no trainable parameters"):
        build_optimizer(optim_cfg(), frozen)
    with pytest.raises(UsageError, match=r"^optimizer 'sgd': bad arguments \(optim.args=\{'bogus': 1\}\)"):
        build_optimizer(optim_cfg("optim.args={bogus: 1}"), net())


def lrs(sched, steps):
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    return out


def new_opt(lr=1.0):
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize(
    "over,ref",
    [
        (
            ["sched.name=cosine", "sched.min_lr_ratio=0.1"],
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10, eta_min=0.1),
        ),
        (
            ["sched.name=step", "sched.step_size=3", "sched.gamma=0.5"],
            lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5),
        ),
        (
            ["sched.name=multistep", "sched.milestones=[6, 2]", "sched.gamma=0.3"],
            lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 6], 0.3),
        ),
        (["sched.name=exponential", "sched.gamma=0.8"], lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8)),
    ],
)
def test_epoch_schedules_equal_torchs(over, ref):
    c = config.load(None, [*over, "sched.interval=epoch", "sched.warmup_epochs=0"]).sched
    got = lrs(build_scheduler(c, new_opt(), epochs=10, steps_per_epoch=7), 10)
    want = lrs(ref(new_opt()), 10)
    assert got == pytest.approx(want, abs=1e-12)


def test_per_step_cosine_with_warmup_follows_the_formula():
    c = config.load(
        None,
        [
            "sched.name=cosine",
            "sched.interval=step",
            "sched.warmup_epochs=1",
            "sched.warmup_start=0.1",
            "sched.min_lr_ratio=0",
        ],
    ).sched
    got = lrs(build_scheduler(c, new_opt(2.0), epochs=3, steps_per_epoch=4), 12)
    want = []
    for i in range(12):
        e = i / 4
        warm = 0.1 + 0.9 * min(e / 1, 1.0)
        want.append(2.0 * warm * 0.5 * (1 + math.cos(math.pi * min(max(e - 1, 0) / 2, 1.0))))
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == pytest.approx(0.2) and got[4] == pytest.approx(2.0)


def test_onecycle_rises_from_lr_over_25_to_lr_then_falls_to_lr_over_25e4():
    c = config.load(
        None, ["sched.name=onecycle", "sched.interval=step", "sched.pct_start=0.25", "sched.warmup_epochs=0"]
    ).sched
    got = lrs(build_scheduler(c, new_opt(1.0), epochs=4, steps_per_epoch=10), 41)
    assert got[0] == pytest.approx(1 / 25) and got[10] == pytest.approx(1.0) and got[40] == pytest.approx(1 / 25 / 1e4)
    assert got[5] == pytest.approx(1 / 25 + (1 - 1 / 25) * 0.5)  # half-way up (cosine)
    end = 1 / 25 / 1e4
    assert got[25] == pytest.approx(end + (1 - end) * 0.5)  # half-way down
    assert all(a < b for a, b in zip(got[:10], got[1:11])) and all(a > b for a, b in zip(got[10:40], got[11:41]))


def test_constant_is_free_unless_it_warms_up():
    c = config.load(None, ["sched.name=constant", "sched.warmup_epochs=0"]).sched
    s = build_scheduler(c, new_opt(0.5), epochs=3, steps_per_epoch=4)
    assert isinstance(s, FixedLR) and lrs(s, 3) == [0.5] * 3 and s.state_dict() == {}
    s.load_state_dict({"anything": 1})
    c = config.load(
        None, ["sched.name=constant", "sched.warmup_epochs=1", "sched.warmup_start=0.5", "sched.interval=step"]
    ).sched
    assert lrs(build_scheduler(c, new_opt(1.0), epochs=3, steps_per_epoch=2), 4) == pytest.approx([0.5, 0.75, 1.0, 1.0])


def test_schedule_settings_the_schedule_ignores_are_refused():
    with pytest.raises(
        UsageError,
        match=r"^sched.gamma=0.5 does not apply to sched.name=cosine \(it reads sched.min_lr_ratio\); "
        r"remove it or pick the schedule it belongs to.$",
    ):
        build_scheduler(
            config.load(None, ["sched.name=cosine", "sched.gamma=0.5"]).sched, new_opt(), epochs=2, steps_per_epoch=1
        )
    with pytest.raises(UsageError, match=r"it reads no schedule-specific field"):
        build_scheduler(
            config.load(None, ["sched.name=constant", "sched.step_size=4"]).sched,
            new_opt(),
            epochs=2,
            steps_per_epoch=1,
        )
    with pytest.raises(UsageError, match=r"^sched.warmup_start=0.3 has no effect with sched.warmup_epochs=0"):
        build_scheduler(
            config.load(None, ["sched.warmup_epochs=0", "sched.warmup_start=0.3"]).sched,
            new_opt(),
            epochs=2,
            steps_per_epoch=1,
        )


def loss_cfg(*over):
    return config.load(None, list(over)).loss


def test_losses_equal_torchs():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g)
    f = build_loss(loss_cfg("loss.name=cross_entropy", "loss.label_smoothing=0.1"), "class_index")
    assert torch.equal(f(logits, y), nn.functional.cross_entropy(logits, y, label_smoothing=0.1))
    f = build_loss(loss_cfg("loss.name=bce_with_logits", "loss.label_smoothing=0.2"), "class_index")
    hot = nn.functional.one_hot(y, 4).float()
    assert torch.allclose(f(logits, y), nn.functional.binary_cross_entropy_with_logits(logits, hot * 0.8 + 0.1))
    assert torch.allclose(f(logits, hot), f(logits, y))  # multi-hot targets as they are
    for name, ref in (
        ("mse", nn.functional.mse_loss),
        ("l1", nn.functional.l1_loss),
        ("smooth_l1", nn.functional.smooth_l1_loss),
    ):
        assert torch.equal(build_loss(loss_cfg(f"loss.name={name}"), "image")(logits, hot), ref(logits, hot))
    w = build_loss(
        loss_cfg("loss.name=cross_entropy", "loss.args={weight: [1, 2, 3, 4]}"), "class_index", num_classes=4
    )
    assert torch.allclose(w(logits, y), nn.functional.cross_entropy(logits, y, weight=torch.tensor([1.0, 2, 3, 4])))
    both = build_loss(loss_cfg("loss.terms=[{name: mse, weight: 2.0}, {name: l1, weight: 0.5}]"), "image")
    assert torch.allclose(
        both(logits, hot), 2 * nn.functional.mse_loss(logits, hot) + 0.5 * nn.functional.l1_loss(logits, hot)
    )


def test_loss_refusals_name_the_setting():
    with pytest.raises(
        UsageError,
        match=r"^loss: loss mse compares outputs with image targets, but this task's targets are "
        r"class_index. Use cross_entropy \(or bce_with_logits\).$",
    ):
        build_loss(loss_cfg("loss.name=mse"), "class_index")
    with pytest.raises(UsageError, match=r"^loss.label_smoothing=0.1: loss l1 has no class labels to smooth"):
        build_loss(loss_cfg("loss.name=l1", "loss.label_smoothing=0.1"), "image")
    with pytest.raises(UsageError, match=r"^loss.args.weight: 3 values for 4 classes; give one per class"):
        build_loss(loss_cfg("loss.args={weight: [1, 2, 3]}"), "class_index", num_classes=4)
    with pytest.raises(UsageError, match=r"^loss.args.weight: expected a list of numbers, got 'heavy'.$"):
        build_loss(loss_cfg("loss.args={weight: heavy}"), "class_index")
    with pytest.raises(
        UsageError, match=r"^loss.terms\[1\]: loss cross_entropy compares outputs with class_index targets"
    ):
        build_loss(loss_cfg("loss.terms=[{name: mse}, {name: cross_entropy}]"), "image")
    with pytest.raises(UsageError, match=r"^loss: bad arguments \{'bogus': 1\}"):
        build_loss(loss_cfg("loss.args={bogus: 1}"), "class_index")


def test_every_other_torch_optimizer_by_lower_case_name_except_those_a_plain_loop_cannot_drive():
    from torchsprint.optim.optimizers import _torch_optim_provider

    provided = _torch_optim_provider()  # called directly: the registry calls it once per process
    want = {
        n.lower()
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    } - {"lbfgs", "muon", "sparseadam"}
    assert set(provided) == want and {"adagrad", "nadam", "radam"} <= want
    c = optim_cfg("optim.name=adagrad", "optim.lr=0.2", "optim.impl=foreach", "optim.args={lr_decay: 0.1}")
    opt = provided["adagrad"](param_groups(net(), 0.0, True), c)
    assert type(opt) is torch.optim.Adagrad and opt.defaults["lr"] == 0.2 and opt.defaults["foreach"] is True
    assert opt.defaults["lr_decay"] == 0.1 and len(opt.param_groups[0]["params"]) == 8
    assert provided["adagrad"].__doc__ == "torch.optim.Adagrad(lr=optim.lr, **optim.args)"


def test_wrong_target_hints_and_user_losses_that_smooth_or_not():
    from torchsprint.optim import LOSSES

    with pytest.raises(
        UsageError,
        match=r"^loss: loss mse compares outputs with image targets, but this task's targets are "
        r"multi_hot. Use bce_with_logits.$",
    ):
        build_loss(loss_cfg("loss.name=mse"), "multi_hot")
    with pytest.raises(
        UsageError,
        match=r"^loss: loss cross_entropy compares outputs with class_index targets, but this "
        r"task's targets are image. Use mse, l1 or smooth_l1.$",
    ):
        build_loss(loss_cfg("loss.name=cross_entropy"), "image")
    with pytest.raises(
        UsageError,
        match=r"^loss: loss bce_with_logits compares outputs with class_index or multi_hot "
        r"targets, but this task's targets are boxes. Use another loss.$",
    ):
        build_loss(loss_cfg("loss.name=bce_with_logits"), "boxes")
    with pytest.raises(UsageError) as e:
        build_loss(loss_cfg("loss.name=mse", "loss.label_smoothing=0.1"), "image")
    assert str(e.value).endswith("(it applies to cross_entropy and bce_with_logits). Set loss.label_smoothing=0.")
    with pytest.raises(UsageError) as e:
        build_loss(loss_cfg("loss.args={weight: [1, 2]}"), "class_index", num_classes=3)
    assert str(e.value).endswith("give one per class (in the order of the dataset's classes).")

    LOSSES.register("test_smoothing_loss", override=True)(
        lambda label_smoothing=0.0: nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    )
    LOSSES.register("test_plain_loss", override=True)(lambda: nn.MSELoss())
    smooth = build_loss(loss_cfg("loss.name=test_smoothing_loss", "loss.label_smoothing=0.2"), "class_index")
    assert smooth.label_smoothing == 0.2  # a user's loss that takes label_smoothing gets it
    with pytest.raises(UsageError, match="^loss.label_smoothing=0.2: loss test_plain_loss has no class labels"):
        build_loss(loss_cfg("loss.name=test_plain_loss", "loss.label_smoothing=0.2"), "class_index")
    assert isinstance(build_loss(loss_cfg("loss.name=test_plain_loss"), "class_index"), nn.MSELoss)


def test_timm_optimizers_by_name_step_like_timm():
    """optim.name=timm/lamb builds timm's own Lamb: one step equals timm.optim.Lamb's on the same weights."""
    timm_optim = pytest.importorskip("timm.optim")
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    cfg = config.load(
        None, ["optim.name=timm/lamb", "optim.lr=0.008", "optim.weight_decay=0.02", "optim.no_decay_norm_bias=false"]
    ).optim
    ours = build_optimizer(cfg, a)
    ref = timm_optim.Lamb(b.parameters(), lr=0.008, weight_decay=0.02)
    assert type(ours) is timm_optim.Lamb
    x, before = torch.randn(8, 4), a.weight.detach().clone()
    for m, o in ((a, ours), (b, ref)):
        m(x).square().mean().backward()
        o.step()
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, before)

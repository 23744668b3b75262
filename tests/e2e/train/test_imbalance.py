"""Imbalanced classes: data.sampler=balanced (class frequencies, exact resume, DDP shards) and
loss.class_weights=auto (against scikit-learn's inverse frequency, and in the loss the run trains with)."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from scipy.stats import chisquare

from conftest import make_image_folder
from torchsprint import config, runtime
from torchsprint.data import build_loaders
from torchsprint.data.core import EpochSampler, balanced_weights
from torchsprint.errors import UsageError
from torchsprint.train.build import build_training
from torchsprint.train.run import train

QUIET = [
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "model.args={width: 8}",
    "run.device=cpu",
]


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """A real JPEG folder with 24 'circle' and 6 'square' training images (4:1)."""
    root = make_image_folder(tmp_path_factory.mktemp("skew") / "img", per_class=24)
    for p in sorted((root / "train" / "square").glob("*.jpg"))[6:]:
        p.unlink()
    return root


def test_sampler_class_frequencies_are_balanced():
    """Over an epoch, each of 3 classes (counts 600/300/100) is drawn about n/3 times: a chi-square test against
    equal frequencies passes, and fails for the plain shuffle (which keeps 6:3:1)."""
    labels = torch.tensor([0] * 600 + [1] * 300 + [2] * 100)
    for epoch in range(5):
        s = EpochSampler(1000, seed=3, shuffle=True, weights=balanced_weights(labels, 3))
        s.set_epoch(epoch)
        counts = np.bincount(labels[s.indices()].numpy(), minlength=3)
        # p > 0.001 for a fair draw (1 false alarm in 1000 per epoch; the seeds are fixed so it never flips);
        # the 6:3:1 shuffle gives chi2 ~ 560, p ~ 1e-120.
        assert chisquare(counts).pvalue > 1e-3, counts
    plain = EpochSampler(1000, seed=3, shuffle=True)
    assert chisquare(np.bincount(labels[plain.indices()].numpy())).pvalue < 1e-50  # the test can tell


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_loader_draws_classes_equally_on_every_backend(skewed, backend):
    """Labels the real loader delivers over 10 epochs of 30 draws: about 150 of each class, not 240:60."""
    cfg = config.load(
        None,
        QUIET
        + [
            "data.dataset=image_folder",
            f"data.root={skewed}",
            f"data.backend={backend}",
            "data.sampler=balanced",
            "data.batch_size=5",
        ],
    )
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    loaders = build_loaders(cfg.data, rt, seed=0)
    seen = Counter()
    for epoch in range(10):
        loaders.train.set_epoch(epoch)
        for _, y in loaders.train:
            seen.update(y.tolist())
    assert sum(seen.values()) == 300
    # Binomial(300, 1/2): sd 8.7; 4 sd = 35 (the unbalanced draw sits at 240, 10 sd away).
    assert abs(seen[0] - 150) < 35, seen


def test_ddp_shards_are_disjoint_equal_and_one_global_draw():
    labels = torch.tensor([0] * 70 + [1] * 31)  # 101 samples: 3 ranks need padding
    w = balanced_weights(labels, 2)
    full = EpochSampler(101, seed=5, shuffle=True, weights=w)
    full.set_epoch(2)
    draw = full.indices()
    shards = []
    for rank in range(3):
        s = EpochSampler(101, seed=5, shuffle=True, rank=rank, world_size=3, weights=w)
        s.set_epoch(2)
        shards.append(s.keyed_indices())
    assert len({len(ix) for ix, _ in shards}) == 1  # equal step counts on every rank
    keys = sorted(k for _, ks in shards for k in ks)
    assert keys == sorted([*range(101), 0])  # each draw position on one rank only, plus one pad wrapped to the start
    padded = draw + draw[:1]
    for rank, (ix, _) in enumerate(shards):
        assert ix == padded[rank::3]  # rank r holds every 3rd element of the same global draw
    one = EpochSampler(101, seed=5, shuffle=True, rank=0, world_size=3, weights=w)
    one.set_epoch(2, start_sample=7)
    idx, seeds = one.keys()
    one.set_epoch(2)
    assert list(zip(idx, seeds)) == list(one)[7:]  # mid-epoch resume skips exactly


@pytest.mark.parametrize(
    "sampler,stop",
    [
        (["data.sampler=balanced"], 5),  # stopped mid-epoch 1 (7 steps an epoch)
        # deferred: epoch 1 shuffles, epoch 2 draws by sqrt frequency; stopped mid-epoch 2, after the switch
        (["data.sampler=sqrt", "data.sampler_from_epoch=2"], 10),
    ],
)
def test_balanced_run_resumes_exactly_and_changes_training(skewed, tmp_path, sampler, stop):
    """A run stopped mid-epoch and resumed ends with the uninterrupted run's weights (the draw is a function of the
    epoch); the weighted draw changes the weights (the setting is honoured) and keeps the epoch's length."""
    over = QUIET + [
        "data.dataset=image_folder",
        f"data.root={skewed}",
        "data.backend=memory",
        *sampler,
        "data.batch_size=4",
        "run.epochs=2",
        "data.train.transforms=[hflip]",
        "log.every_steps=1",
    ]
    full = train(config.load(None, [*over, f"run.dir={tmp_path / 'a'}"]), quiet=True)
    train(config.load(None, [*over, f"run.dir={tmp_path / 'b'}", f"run.stop_after_steps={stop}"]), quiet=True)
    resumed = train(config.load(None, [*over, f"run.dir={tmp_path / 'b'}", "checkpoint.resume=auto"]), quiet=True)
    a, b = load_file(str(tmp_path / "a" / "last.safetensors")), load_file(str(tmp_path / "b" / "last.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) and full["final"] == resumed["final"]
    plain = [o for o in over if not o.startswith("data.sampler")] + ["data.sampler=shuffle"]
    shuffled = train(config.load(None, [*plain, f"run.dir={tmp_path / 'c'}"]), quiet=True)
    c = load_file(str(tmp_path / "c" / "last.safetensors"))
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the setting is honoured: another sample order
    assert shuffled["global_step"] == full["global_step"]  # the same epoch length (30 draws)


def test_class_weights_equal_sklearn_and_reach_the_loss(skewed):
    from sklearn.utils.class_weight import compute_class_weight

    cfg = config.load(
        None,
        QUIET
        + [
            "data.dataset=image_folder",
            f"data.root={skewed}",
            "data.backend=memory",
            "loss.class_weights=auto",
            "data.batch_size=30",
            "data.drop_last=false",
        ],
    )
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    b = build_training(cfg, rt, log=lambda *_: None)
    labels = np.array([0] * 24 + [1] * 6)
    ref = compute_class_weight("balanced", classes=np.array([0, 1]), y=labels)
    ref = ref / ref.mean()  # sklearn's n / (k * n_c) rescaled to mean 1: [0.4, 1.6]
    np.testing.assert_allclose(b.loss_fn.weight.double().numpy(), ref, rtol=1e-6)  # float32 storage
    b.loaders.train.set_epoch(0)
    images, y = next(iter(b.loaders.train))
    logits = b.model(images)
    expected = F.cross_entropy(logits, y, weight=torch.tensor(ref, dtype=torch.float32))
    assert torch.equal(b.loss_fn(logits, y), expected)
    assert not torch.allclose(F.cross_entropy(logits, y), expected)  # the weights change the loss here


@pytest.mark.parametrize(
    "over,says",
    [
        (
            ["task=multilabel", "data.dataset=synthetic_multilabel", "data.sampler=balanced", "data.root=ROOT"],
            "data.sampler=balanced balance classes, but task=multilabel",
        ),
        (
            [
                "task=image_to_image",
                "data.dataset=synthetic_blur",
                "model.name=unet_small",
                "loss.class_weights=auto",
                "data.root=ROOT",
            ],
            "loss.class_weights=auto balance classes, but task=image_to_image",
        ),
        (["loss.class_weights=auto", "loss.name=bce_with_logits"], "use loss.name=cross_entropy"),
        (["loss.class_weights=auto", "loss.args={weight: [1,1,1,1,1,1,1,1,1,1]}"], "keep one"),
        (["data.sampler=balanced", "data.repeated_aug=2"], "use one of them"),
    ],
)
def test_bad_settings_are_refused(tmp_path, over, says):
    quiet = [o for o in QUIET if not o.startswith("eval.per_class")]  # refused for multilabel itself
    cfg = config.load(
        None, quiet + [o.replace("ROOT", str(tmp_path / "d")) for o in over] + [f"run.dir={tmp_path / 'r'}"]
    )
    with pytest.raises(UsageError, match=re.escape(says)):
        train(cfg, quiet=True, dry_run=True)
    assert not (tmp_path / "r").exists()


def test_refusal_is_one_line_exit_2(cli_in_process, tmp_path):
    r = cli_in_process(
        "train",
        "--dry-run",
        "task=multilabel",
        "data.dataset=synthetic_multilabel",
        "data.sampler=balanced",
        f"data.root={tmp_path / 'd'}",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.sampler=balanced") and "task=multilabel" in lines[0], (
        r.stderr
    )


# ---------------------------------------------------------------- sqrt, deferred, logit adjustment, default


def test_sqrt_sampler_class_shares_follow_the_formula():
    """data.sampler=sqrt: class c's share of the draws is sqrt(n_c) / sum_k sqrt(n_k) (0.5, 1/3, 1/6 for 900/400/100),
    within 4 binomial standard errors over 30,000 draws. Catches a power of 1 (balanced: 1/3 each) or 0 (shuffle: 0.64,
    0.29, 0.07), or weights applied per class instead of per sample (n_c ** 0.5 each: shares n_c ** 1.5)."""
    from torchsprint.data.core import ClassDraw

    labels = torch.tensor([0] * 900 + [1] * 400 + [2] * 100)
    draws = []
    for epoch in range(21):
        s = EpochSampler(1400, seed=7, shuffle=True, weights=ClassDraw(0.5).weights(labels, 3))
        s.set_epoch(epoch)
        draws += s.indices()
    n = len(draws)
    shares = np.bincount(labels[draws].numpy(), minlength=3) / n
    expected = np.sqrt([900, 400, 100]) / np.sqrt([900, 400, 100]).sum()
    se = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(shares - expected) < 4 * se), (shares, expected)
    assert np.all(np.abs(np.array([900, 400, 100]) / 1400 - expected) > 10 * se)  # the shuffle's shares are far off


def test_deferred_sampler_switches_at_its_epoch_as_a_function_of_the_epoch():
    """data.sampler_from_epoch=3 (weights_from=2): epochs 0-1 are the plain shuffle's permutations, epochs 2+ the
    weighted draw, identical to a sampler weighted from the start at that epoch. Catches a switch one epoch early or
    late, and a switch that depends on the sampler's history (a resumed run would draw other samples)."""
    labels = torch.tensor([0] * 90 + [1] * 10)
    w = balanced_weights(labels, 2)
    deferred = EpochSampler(100, seed=4, shuffle=True, weights=w, weights_from=2)
    plain, weighted = EpochSampler(100, seed=4, shuffle=True), EpochSampler(100, seed=4, shuffle=True, weights=w)
    for epoch in (3, 0, 2, 1, 4):  # out of order: nothing carries over from the epoch before
        for s in (deferred, plain, weighted):
            s.set_epoch(epoch)
        assert list(deferred) == list(plain if epoch < 2 else weighted), epoch
    deferred.set_epoch(1)
    assert sorted(deferred.indices()) == list(range(100))  # a permutation: every sample once
    deferred.set_epoch(2)
    assert np.bincount(labels[deferred.indices()].numpy())[1] > 30  # the minority drawn ~50 times, not 10


def test_logit_adjusted_loss_equals_a_hand_computation(skewed):
    """loss.logit_adjust=tau: the run's loss is -log softmax(z + tau * log(prior))[y], prior = training counts / total
    (24 and 6 of 30 here), computed by hand in float64. Catches the shift's sign, a missing tau, a prior from the
    validation split, and the shift leaking into predictions (the model's logits are unchanged)."""
    cfg = config.load(
        None,
        QUIET
        + [
            "data.dataset=image_folder",
            f"data.root={skewed}",
            "data.backend=memory",
            "loss.logit_adjust=1.5",
            "data.batch_size=30",
            "data.drop_last=false",
        ],
    )
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    b = build_training(cfg, rt, log=lambda *_: None)
    b.loaders.train.set_epoch(0)
    images, y = next(iter(b.loaders.train))
    z = b.model(images).double()
    shifted = z + 1.5 * torch.log(torch.tensor([24 / 30, 6 / 30], dtype=torch.float64))
    by_hand = (torch.log(torch.exp(shifted).sum(1)) - shifted[torch.arange(len(y)), y]).mean()
    torch.testing.assert_close(b.loss_fn(z.float(), y).double(), by_hand, rtol=1e-5, atol=1e-6)
    assert abs(F.cross_entropy(z, y) - by_hand) > 1e-3  # the adjustment changes the loss here
    assert b.cfg.loss.logit_adjust == 1.5 and not b.cfg.chosen()  # set by the user: no default on top


@pytest.mark.parametrize(
    "over,says",
    [
        (["data.sampler=shuffle", "data.sampler_from_epoch=2"], "but data.sampler=shuffle;"),
        (["data.sampler_from_epoch=2"], "but data.sampler=auto (the training classes are 1.1x imbalanced"),  # digits
        (["data.sampler=sqrt", "data.sampler_from_epoch=3", "run.epochs=2"], "after the run's last epoch"),
        (["loss.logit_adjust=1", "loss.name=bce_with_logits"], "use loss.name=cross_entropy"),
        (
            ["task=multilabel", "data.dataset=synthetic_multilabel", "loss.logit_adjust=1", "data.root=ROOT"],
            "loss.logit_adjust=1 balance classes, but task=multilabel",
        ),
    ],
)
def test_new_settings_are_refused_where_they_would_be_ignored(tmp_path, over, says):
    quiet = [o for o in QUIET if not o.startswith("eval.per_class")]
    cfg = config.load(
        None, quiet + [o.replace("ROOT", str(tmp_path / "d")) for o in over] + [f"run.dir={tmp_path / 'r'}"]
    )
    with pytest.raises(UsageError, match=re.escape(says)):
        train(cfg, quiet=True, dry_run=True)


def test_auto_sampler_threshold_and_empty_classes():
    """data.sampler=auto from the labels: sqrt at exactly AUTO_SAMPLER_RATIO and above, shuffle just under it and
    without labels; an empty class is left out of the ratio (it has nothing to draw). Catches `>` for `>=` and a
    ratio taken over an empty class (infinite: always on)."""
    from torchsprint.data.core import AUTO_SAMPLER, AUTO_SAMPLER_RATIO, auto_sampler

    big = int(10 * AUTO_SAMPLER_RATIO)
    at, why = auto_sampler(torch.tensor([0] * big + [1] * 10), ["a", "b"])
    assert at == AUTO_SAMPLER and f"{AUTO_SAMPLER_RATIO:.1f}x imbalanced (a {big}" in why
    assert auto_sampler(torch.tensor([0] * (big - 1) + [1] * 10), ["a", "b"])[0] == "shuffle"
    assert auto_sampler(torch.tensor([0] * 12 + [1] * 10), ["a", "b", "empty"])[0] == "shuffle"
    assert auto_sampler(None, ["a", "b"])[0] == "shuffle"


def test_auto_stands_down_where_the_user_chose_and_records_what_it_did():
    """before_data: auto becomes shuffle where a loss counter-measure is on or the task has no classes, and stays
    otherwise; after_data: auto becomes the sampler build_loaders resolved, with the balanced-accuracy monitor and
    both recorded (why, how to override), nothing recorded for shuffle, a monitor the user set kept, a sampler the
    user set untouched. Catches a default stacked on the user's own counter-measure, a monitor overridden against
    the user's setting, and a choice applied but not recorded."""
    from types import SimpleNamespace

    from torchsprint.train.imbalance import MONITOR, after_data, before_data

    cfg = config.load(None, [])
    assert cfg.data.sampler == "auto" and before_data(cfg, "class_index").data.sampler == "auto"
    assert before_data(cfg, "multi_hot").data.sampler == "shuffle"
    for on in ("loss.class_weights=auto", "loss.logit_adjust=1"):
        assert before_data(config.load(None, [on]), "class_index").data.sampler == "shuffle", on
    assert before_data(config.load(None, ["loss.logit_adjust=0"]), "class_index").data.sampler == "auto"

    sqrt = SimpleNamespace(sampler="sqrt", sampler_why="the training classes are 10.0x imbalanced")
    out = after_data(cfg, sqrt)
    assert out.data.sampler == "sqrt" and out.checkpoint.monitor == MONITOR and out.checkpoint.mode == "max"
    assert [c["setting"] for c in out.chosen()] == ["data.sampler", "checkpoint.monitor"]
    assert "10.0x imbalanced" in out.chosen()[0]["why"] and "data.sampler=shuffle" in out.chosen()[0]["override"]
    assert cfg.data.sampler == "auto" and cfg.checkpoint.monitor == "val/top1"  # the input is not mutated
    plain = after_data(cfg, SimpleNamespace(sampler="shuffle", sampler_why="under the threshold"))
    assert plain.data.sampler == "shuffle" and plain.checkpoint.monitor == "val/top1" and plain.chosen() == []
    kept = after_data(config.load(None, ["checkpoint.monitor=val/top1"]), sqrt)
    assert kept.data.sampler == "sqrt" and kept.checkpoint.monitor == "val/top1"
    assert [c["setting"] for c in kept.chosen()] == ["data.sampler"]
    mine = config.load(None, ["data.sampler=shuffle"])
    assert after_data(mine, sqrt) is mine


@pytest.fixture(scope="module")
def tenfold(tmp_path_factory):
    """A real JPEG folder, 40 'circle' and 4 'square' training images (10x), 10 and 3 to validate."""
    root = make_image_folder(tmp_path_factory.mktemp("tenfold") / "img", per_class=40)
    for p in sorted((root / "train" / "square").glob("*.jpg"))[4:]:
        p.unlink()
    for c, keep in (("circle", 10), ("square", 3)):
        for p in sorted((root / "val" / c).glob("*.jpg"))[keep:]:
            p.unlink()
    return root


def test_default_through_the_cli_is_printed_recorded_and_overridable(cli_in_process, tenfold, skewed, tmp_path):
    """`torchsprint train data.root=DIR` on a 10x-imbalanced folder: the start-up summary names the sampler auto chose
    and the monitor, with why and how to override; decisions.json lists both, config.yaml holds the resolved values
    (eval and resume read them), best.safetensors is chosen by val/balanced_acc. With data.sampler=shuffle set: none
    of it, config.yaml says shuffle. On the 4:1 folder: what the threshold says (applied from AUTO_SAMPLER_RATIO)."""
    from torchsprint.data.core import AUTO_SAMPLER, AUTO_SAMPLER_RATIO
    from torchsprint.train.imbalance import MONITOR

    common = [
        "train",
        "model.name=small_cnn",
        "run.epochs=1",
        "log.progress=false",
        "log.tensorboard=false",
        "data.batch_size=8",
        "run.device=cpu",
    ]
    r = cli_in_process(*common, f"data.root={tenfold}", f"run.dir={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert f"data.sampler: {AUTO_SAMPLER} (data.sampler=auto: the training classes are 10.0x imbalanced" in out, out[
        -3000:
    ]
    assert f"checkpoint.monitor: {MONITOR} (" in out and "to choose otherwise: set checkpoint.monitor=val/top1" in out
    decided = json.loads((tmp_path / "a" / "decisions.json").read_text())
    assert [c["setting"] for c in decided["chosen"] if c["setting"] in ("data.sampler", "checkpoint.monitor")] == [
        "data.sampler",
        "checkpoint.monitor",
    ]
    saved = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert saved["data"]["sampler"] == AUTO_SAMPLER and saved["checkpoint"]["monitor"] == MONITOR
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    # the best weights' metric is the balanced accuracy (10:3 validation: top-1 differs unless every recall is equal)
    assert summary["best_metric"] == summary["final"]["val/balanced_acc"], summary
    for over, root in (
        (["data.sampler=shuffle"], tenfold),
        ([], skewed),
    ):  # set by the user; 4:1, under or at the ratio
        run_dir = tmp_path / f"r{len(over)}"
        r = cli_in_process(*common, *over, f"data.root={root}", f"run.dir={run_dir}")
        assert r.returncode == 0, r.stderr[-2000:]
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        chosen = [c["setting"] for c in json.loads((run_dir / "decisions.json").read_text())["chosen"]]
        applies = not over and 4.0 >= AUTO_SAMPLER_RATIO
        assert (saved["data"]["sampler"], "data.sampler" in chosen) == (
            (AUTO_SAMPLER, True) if applies else ("shuffle", False)
        ), (over, saved["data"], chosen)
        assert saved["checkpoint"]["monitor"] == (MONITOR if applies else "val/top1")

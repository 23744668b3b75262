"""Mixup and CutMix (data/preprocess/mix.py) against torchvision v2 MixUp/CutMix and timm's targets, their
distributions, exact resume, DDP, bf16 and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy import stats
from torchvision.transforms import v2

from torchsprint import config
from torchsprint.data.preprocess.mix import Mixer, MixParams, cutmix_box
from torchsprint.errors import UsageError
from torchsprint.train.run import train

C = 5


def batch(b=8, h=10, w=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, h, w, generator=g), torch.randint(0, C, (b,), generator=g)


def params(b, *, cut, lam, box=(0, 0, 0, 0), use=True):
    return MixParams(
        torch.full((b,), use),
        torch.full((b,), cut),
        torch.full((b,), float(lam), dtype=torch.float64),
        torch.tensor([box] * b, dtype=torch.int64),
    )


class InjectedMixUp(v2.MixUp):
    """torchvision's MixUp with a given lam instead of its own draw (the transform itself unchanged)."""

    def __init__(self, lam, **kw):
        super().__init__(**kw)
        self.lam = lam

    def make_params(self, flat_inputs):
        return {"lam": self.lam}


class InjectedCutMix(v2.CutMix):
    """torchvision's CutMix with given (box, lam_adjusted) parameters."""

    def __init__(self, params, **kw):
        super().__init__(**kw)
        self.params = params

    def make_params(self, flat_inputs):
        return self.params


@pytest.mark.parametrize("lam", [0.0, 0.137, 0.5, 0.93])
def test_mixup_equals_torchvision_given_lam(lam):
    x, y = batch()
    ref_x, ref_y = InjectedMixUp(lam, num_classes=C)(x, y)
    got_x, got_y = Mixer(0.2, 0, 1, 0.5, "batch", C).apply(x, y, params(8, cut=False, lam=lam))
    assert torch.equal(got_x, ref_x) and torch.equal(got_y, ref_y)  # bit-identical: same operations, same order


def test_cutmix_box_and_batch_equal_torchvision():
    """torchvision's CutMix draws (lam, box) with the global RNG; the same draws give the same box, and
    its box applied by Mixer gives its images and targets exactly."""
    x, y = batch(h=17, w=23)
    cm = v2.CutMix(alpha=1.0, num_classes=C)
    for seed in range(40):
        torch.manual_seed(seed)
        ref_params = cm.make_params([x])
        torch.manual_seed(seed)  # replay torchvision's draws: lam, then r_x, then r_y
        lam = float(cm._dist.sample(()))
        rx, ry = int(torch.randint(23, size=(1,))), int(torch.randint(17, size=(1,)))
        box, lam_adj = cutmix_box(np.array([lam]), np.array([ry]), np.array([rx]), 17, 23)
        assert tuple(box[0].tolist()) == ref_params["box"] and lam_adj[0] == ref_params["lam_adjusted"]
        ref_x, ref_y = InjectedCutMix(ref_params, alpha=1.0, num_classes=C)(x, y)
        got_x, got_y = Mixer(0, 1.0, 1, 0.5, "batch", C).apply(
            x, y, params(8, cut=True, lam=lam_adj[0], box=box[0].tolist())
        )
        assert torch.equal(got_x, ref_x) and torch.equal(got_y, ref_y), seed


def test_unmixed_samples_are_untouched_and_video_is_mixed_per_frame():
    x, y = batch()
    got_x, got_y = Mixer(0.2, 0, 1, 0.5, "batch", C).apply(x, y, params(8, cut=False, lam=0.3, use=False))
    assert torch.equal(got_x, x) and torch.equal(got_y, torch.nn.functional.one_hot(y, C).float())
    clip = torch.randn(4, 3, 2, 6, 7)  # (B, C, T, H, W): one box for every frame of a clip
    out, _ = Mixer(0, 1.0, 1, 0.5, "batch", C).apply(clip, y[:4], params(4, cut=True, lam=0.5, box=(1, 2, 4, 5)))
    assert torch.equal(out[:, :, :, 2:5, 1:4], clip.roll(1, 0)[:, :, :, 2:5, 1:4])
    assert torch.equal(out[:, :, :, :2], clip[:, :, :, :2])


def test_soft_targets_with_label_smoothing_equal_timms_mixup_target_and_soft_ce():
    """nn.CrossEntropyLoss(label_smoothing) on Mixer's targets == timm's SoftTargetCrossEntropy on timm's
    mixup_target (smooth, then mix). B=2, where timm's flip(0) pairing and torchvision's roll(1, 0) coincide."""
    from timm.data.mixup import mixup_target
    from timm.loss import SoftTargetCrossEntropy

    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for eps in (0.0, 0.1, 0.3):
        for lam in (0.2, 0.5, 0.77):
            logits, y = torch.randn(2, C, generator=g), torch.randint(0, C, (2,), generator=g)
            _, soft = Mixer(0.2, 0, 1, 0.5, "batch", C).apply(torch.zeros(2, 1, 2, 2), y, params(2, cut=False, lam=lam))
            ours = torch.nn.CrossEntropyLoss(label_smoothing=eps)(logits, soft)
            ref = SoftTargetCrossEntropy()(logits, mixup_target(y, C, lam=lam, smoothing=eps))
            worst = max(worst, abs(float(ours - ref)))
    assert worst < 7e-7  # float32 summation order; measured 2.4e-7


def draws(mixer, n_batches=3000, b=1, h=32, w=32):
    ps = [mixer.draw(s, b, h, w) for s in range(n_batches)]
    return (torch.cat([getattr(p, k) for p in ps]) for k in ("use", "cut", "lam"))


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_mixup_lambda_is_beta_distributed(alpha):
    use, cut, lam = draws(Mixer(alpha, 0, 1, 0.5, "batch", C))
    assert bool(use.all()) and not bool(cut.any())
    ks = stats.kstest(lam.numpy(), stats.beta(alpha, alpha).cdf)
    assert ks.statistic < 1.95 / np.sqrt(len(lam))  # the KS critical value at alpha=0.001 (n=3000: 0.036)


def test_cutmix_lambda_matches_torchvisions_distribution():
    """The box-corrected lam of 3,000 batches vs 3,000 of torchvision's CutMix.make_params (two-sample KS)."""
    _, cut, lam = draws(Mixer(0, 1.0, 1, 0.5, "batch", C), h=17, w=23)
    assert bool(cut.all())
    cm = v2.CutMix(alpha=1.0, num_classes=C)
    torch.manual_seed(0)
    ref = [cm.make_params([torch.zeros(1, 3, 17, 23)])["lam_adjusted"] for _ in range(3000)]
    ks = stats.ks_2samp(lam.numpy(), np.array(ref))
    assert ks.pvalue > 1e-3, ks


def test_switch_and_prob_frequencies_and_elem_mode():
    use, cut, _ = draws(Mixer(0.2, 1.0, 0.7, 0.3, "batch", C), n_batches=4000)
    n = len(use)
    # Binomial frequencies within 4 standard deviations.
    assert abs(float(use.double().mean()) - 0.7) < 4 * (0.7 * 0.3 / n) ** 0.5
    assert abs(float(cut.double().mean()) - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5
    # elem: one draw per sample, so a batch holds both kinds and different weights; batch: one for all.
    pe, pb = Mixer(0.2, 1.0, 1, 0.5, "elem", C).draw(3, 64, 8, 8), Mixer(0.2, 1.0, 1, 0.5, "batch", C).draw(3, 64, 8, 8)
    assert 0 < int(pe.cut.sum()) < 64 and len(set(pe.lam.tolist())) > 32
    assert len(set(pb.lam.tolist())) == 1 and len(set(pb.cut.tolist())) == 1


def test_elem_mode_equals_a_per_sample_loop():
    x, y = batch(b=16)
    m = Mixer(0.4, 1.0, 0.8, 0.5, "elem", C)
    p = m.draw(11, 16, 10, 12)
    got_x, got_y = m.apply(x, y, p)
    partner, partner_y = x.roll(1, 0), y.roll(1, 0)
    worst = 0.0
    for i in range(16):
        lam = 1.0  # the sample's own share of its target
        if not p.use[i]:
            ref = x[i]
        elif p.cut[i]:
            x1, y1, x2, y2 = p.box[i].tolist()
            ref = x[i].clone()
            ref[:, y1:y2, x1:x2] = partner[i, :, y1:y2, x1:x2]
            lam = 1.0 - (x2 - x1) * (y2 - y1) / (10 * 12)  # the share of its pixels it keeps
            assert float(p.lam[i]) == pytest.approx(lam, abs=1e-12), i
        else:
            lam = float(p.lam[i])
            ref = partner[i] * (1.0 - lam) + x[i] * lam
        assert torch.equal(got_x[i], ref), i
        ref_y = torch.zeros(C, dtype=torch.float64)
        ref_y[y[i]] += lam
        ref_y[partner_y[i]] += 1.0 - lam
        worst = max(worst, float((got_y[i].double() - ref_y).abs().max()))
    assert p.use.any() and (p.use & p.cut).any() and (p.use & ~p.cut).any()  # all three kinds of sample occur
    print(f"max |target - per-sample target| = {worst:.2e}")
    assert worst < 8e-8, worst  # float32 rounding of lam and 1 - lam: measured 2.8e-08


# ---------------------------------------------------------------- in training

BASE = [
    "model.args={width: 8, dropout: 0.2}",
    "run.epochs=2",
    "data.batch_size=128",
    "data.val_fraction=0.5",
    "data.train.transforms=[random_crop: {size: 8, padding: 1}, hflip]",
    "optim.lr=0.05",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "checkpoint.every_steps=3",
    "loss.label_smoothing=0.1",
    "mix.mixup_alpha=0.2",
    "mix.cutmix_alpha=1.0",
]


def run(d: Path, *extra):
    return train(config.load(None, [*BASE, f"run.dir={d}", *extra]), quiet=True)


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_pause_and_resume_with_mixing_is_bit_identical(tmp_path, backend):
    ref = run(tmp_path / "ref", f"data.backend={backend}")
    first = run(tmp_path / "b", f"data.backend={backend}", "run.stop_after_steps=5", "log.every_steps=1")
    assert first["paused"]
    done = run(tmp_path / "b", f"data.backend={backend}", "checkpoint.resume=auto", "log.every_steps=1")
    lines = [json.loads(x) for x in ((tmp_path / "b") / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(
        range(1, ref["global_step"] + 1)
    )  # resumed, not started over
    a, b = load_file(str(tmp_path / "ref" / "last.safetensors")), load_file(str(tmp_path / "b" / "last.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert done["final"] == ref["final"]
    # and mixing changed the run (the same config without it trains other weights)
    plain = run(tmp_path / "plain", f"data.backend={backend}", "mix.mixup_alpha=0", "mix.cutmix_alpha=0")
    c = load_file(str(tmp_path / "plain" / "last.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a) and plain["final"] != ref["final"]


def test_amp_bf16_trains_with_mixing(tmp_path):
    s = run(
        tmp_path / "bf16",
        "precision=amp_bf16",
        "mix.mode=elem",
        "model.args={width: 8}",
        "data.batch_size=32",
        "run.epochs=1",
        "optim.lr=0.1",
    )
    # 28 steps: above chance (0.1) already; measured 0.266 (fp32: 0.268), val loss 2.198 (fp32: 2.198)
    assert s["global_step"] == 28 and np.isfinite(s["final"]["val/loss"]) and s["final"]["val/top1"] > 0.18
    # both switches acted: the same run in fp32, and in bf16 without mixing, end with other weights
    same = ["model.args={width: 8}", "data.batch_size=32", "run.epochs=1", "optim.lr=0.1"]
    run(tmp_path / "fp32", "mix.mode=elem", *same)
    run(tmp_path / "nomix", "precision=amp_bf16", *same, "mix.mixup_alpha=0", "mix.cutmix_alpha=0")
    w = {n: load_file(str(tmp_path / n / "last.safetensors")) for n in ("bf16", "fp32", "nomix")}
    for other in ("fp32", "nomix"):
        assert any(not torch.equal(w["bf16"][k], w[other][k]) for k in w["bf16"]), other


def test_bce_loss_takes_the_soft_targets(tmp_path):
    """The run's own loss on the run's own mixed batch equals BCE written out on the smoothed soft targets
    (Keras' binary smoothing t(1 - eps) + eps / 2), then a run finishes."""
    from torchsprint import runtime
    from torchsprint.train.build import build_training

    cfg = config.load(None, [*BASE, "loss.name=bce_with_logits", f"run.dir={tmp_path / 'b'}"])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        b = build_training(cfg, rt, lambda m: None)
        b.loaders.train.set_epoch(0)
        x, soft = next(iter(b.loaders.train))
        logits = torch.randn(len(x), 10, generator=torch.Generator().manual_seed(0))
        got = float(b.loss_fn(logits, soft))
    finally:
        runtime.teardown(rt)
    assert soft.shape == (len(x), 10) and (soft.max(1).values < 1).any()  # mixed: some targets are not one-hot
    t = soft.double() * 0.9 + 0.05
    z = logits.double()
    want = float(-(t * torch.nn.functional.logsigmoid(z) + (1 - t) * torch.nn.functional.logsigmoid(-z)).mean())
    print(f"|bce - written-out bce| = {abs(got - want):.2e}")
    assert abs(got - want) < 1.2e-7, (got, want)  # float32 loss vs float64: measured 4.0e-08
    s = run(tmp_path / "bce", "loss.name=bce_with_logits", "run.epochs=1")
    assert np.isfinite(s["final"]["val/loss"])


@pytest.mark.slow  # 11 s of DDP; one-process mixing stays in the main suite
@pytest.mark.dist
def test_ddp_two_processes_with_mixing(tmp_path, run_cli):
    """`torchsprint train --nproc-per-node 2` with Mixup/CutMix: each rank mixes its own batches with its
    own seed (rank in the seed), the run finishes and learns."""
    d = tmp_path / "ddp"
    proc = run_cli(
        "train",
        "--nproc-per-node",
        "2",
        *BASE,
        "data.batch_size=16",
        "run.epochs=1",
        "model.args={width: 8}",
        "optim.lr=0.1",
        "data.backend=cpu",
        f"run.dir={d}",
        timeout=240,
    )  # the backend the bound was measured on
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((d / "summary.json").read_text())
    # 28 steps of global batch 32: above chance (0.1); measured top-1 0.279 (one process, batch 32: 0.266)
    assert summary["global_step"] == 28 and summary["final"]["val/top1"] > 0.18
    from torchsprint.data.preprocess.mix import MixLoader

    r0, r1 = MixLoader([], None, 0, 0, 2), MixLoader([], None, 0, 1, 2)
    assert len({r0.batch_seed(0), r1.batch_seed(0), r0.batch_seed(1)}) == 3


@pytest.mark.parametrize(
    "over, match",
    [
        (["mix.prob=0.5"], "mixing is off"),
        (["mix.mode=elem"], "mixing is off"),
        (["mix.mixup_alpha=0.2", "mix.switch_prob=0.2"], "only Mixup is on"),
        (["mix.mixup_alpha=0.2", "loss.args={ignore_index: 0}"], "ignore_index"),
        (["mix.cutmix_alpha=1", "task=image_to_image", "data.dataset=synthetic_blur"], "task=image_to_image"),
        (["mix.cutmix_alpha=1", "task=multilabel", "data.dataset=synthetic_multilabel"], "task=multilabel"),
    ],
)
def test_refusals(over, match):
    from torchsprint import runtime
    from torchsprint.train.build import build_training

    cfg = config.load(None, ["log.tensorboard=false", *over])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        with pytest.raises(UsageError, match=match):
            build_training(cfg, rt, lambda m: None)
    finally:
        runtime.teardown(rt)

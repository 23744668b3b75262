"""train/engine.py and train/validation.py function by function, fast: real tiny models, real in-memory loaders,
optimizers, RunLogger and Saver.

Every reference is an independent plain PyTorch computation over the same batches (the loader's own
batches, read before the engine runs: the engine's job is the loop, not the data). Each test takes well
under a second, so benchmarks/tools/mutation.sh can run them for each of train/engine.py's and train/validation.py's
mutants.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fault_env import faults
from torchsprint import config, runtime
from torchsprint.data.build import build_loaders
from torchsprint.data.core import Splits, TensorImages
from torchsprint.errors import Diverged, UsageError
from torchsprint.models.init import NO_HEAD_ONLY
from torchsprint.observe.logging import RunLogger
from torchsprint.runtime.preempt import Stopper
from torchsprint.state.checkpoint import Saver, TrainState, data_geometry
from torchsprint.state.ema import build_ema
from torchsprint.state.precision import Precision
from torchsprint.tasks.core import get_task
from torchsprint.train.context import RunContext, Trainable
from torchsprint.train.engine import (
    NO_EMA,
    NO_SWA,
    EpochTotals,
    check_finite,
    epoch_means,
    fit,
    hits_sum,
    report_epoch,
    train_one_epoch,
    train_step,
)
from torchsprint.train.plan import NO_SPEED, build_plan
from torchsprint.train.validation import early_stop_check, evaluate, is_better, set_train_mode

CPU = torch.device("cpu")
N_TRAIN, N_VAL, C, H, W, K = 40, 24, 1, 4, 4, 3  # 40 images of 1x4x4, 3 classes
FAST = [
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "data.backend=memory",
    "data.batch_size=8",
    "sched.name=constant",
    "optim.momentum=0",
    "optim.weight_decay=0",
]


def dataset(seed: int = 0) -> Splits:
    """Three classes whose mean brightness differs: learnable by a linear model in a few steps."""
    g = torch.Generator().manual_seed(seed)

    def split(n):
        y = torch.arange(n) % K
        x = (y.view(-1, 1, 1, 1) * 80 + torch.randint(0, 90, (n, C, H, W), generator=g)).clamp(0, 255).to(torch.uint8)
        return TensorImages(x, y)

    return Splits(split(N_TRAIN), split(N_VAL), [f"c{i}" for i in range(K)], C)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(C * H * W, K))


class Run(SimpleNamespace):
    def rows(self, kind: str | None = None) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        self.logger.jsonl.flush()
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return [r for r in rows if kind is None or r["kind"] == kind]


def setup(
    tmp_path: Path,
    *overrides: str,
    lr: float = 0.1,
    sched=None,
    ema: bool = False,
    prec: str = "fp32",
    on_nonfinite: str = "skip",
    model: nn.Module | None = None,
) -> Run:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = config.load(None, [*FAST, f"optim.lr={lr}", f"run.dir={tmp_path}", *overrides])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    loaders = build_loaders(cfg.data, rt, seed=cfg.run.seed, splits=dataset())
    model = model if model is not None else tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = sched(opt) if sched else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    run_ema = build_ema(cfg.ema, model, CPU) if ema else None
    if run_ema is not None:
        run_ema.attach(model)
    logger = RunLogger(tmp_path, cfg.log, console=True)
    saver = Saver(
        tmp_path,
        cfg.checkpoint,
        rt,
        {"classes": loaders.info.classes},
        geometry=data_geometry(cfg, 1),
        log=logger.info,
        ema=run_ema,
    )
    return Run(
        cfg=cfg,
        rt=rt,
        loaders=loaders,
        model=model,
        opt=opt,
        sched=sched,
        logger=logger,
        saver=saver,
        prec=Precision(prec, CPU, on_nonfinite=on_nonfinite),
        loss_fn=nn.CrossEntropyLoss(),
        dir=tmp_path,
        ema=run_ema,
        state=TrainState(),
    )


def batches(loader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def plain_steps(
    model: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], lr: float, clip: float | None = None
) -> list[float]:
    """SGD over groups of micro-batches (gradients averaged over the group), written without torchsprint.
    Returns each step's mean micro-batch loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    crit = nn.CrossEntropyLoss()
    out = []
    for group in steps:
        opt.zero_grad()
        losses = []
        for x, y in group:
            loss = crit(model(x), y)
            (loss / len(group) if len(group) > 1 else loss).backward()
            losses.append(loss.item())
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append(sum(losses) / len(losses))
    return out


def group(bs: list, accum: int) -> list[list]:
    return [bs[i : i + accum] for i in range(0, len(bs), accum)]


def plan_of(r: Run):
    """The RunPlan of r's config and objects, built as build_training builds it (no speed switches on this model)."""
    return build_plan(r.cfg, r.rt, info=r.loaders.info, train_batches=len(r.loaders.train), speed=NO_SPEED, opt=r.opt)


def one_epoch(r: Run, stop=None, ema=NO_EMA) -> dict:
    b = SimpleNamespace(
        model=r.model, loaders=r.loaders, loss_fn=r.loss_fn, opt=r.opt, sched=r.sched, prec=r.prec, ema=ema
    )
    return train_one_epoch(b, r.state, plan_of(r), RunContext(r.rt, r.dir, r.logger, r.saver, stop))


def run_fit(r: Run, pass_task: bool = True, **kw) -> dict:
    """fit as run.train calls it; pass_task=False leaves `task` to fit's default (classification)."""
    task = get_task("classification")
    built = SimpleNamespace(
        model=r.model,
        loaders=r.loaders,
        loss_fn=r.loss_fn,
        opt=r.opt,
        sched=r.sched,
        prec=r.prec,
        ema=r.ema if r.ema is not None else NO_EMA,
        frozen_norms=[],
        head_only=NO_HEAD_ONLY,
        swa=NO_SWA,  # every field fit reads (build.Built's): no default behind a getattr
    )
    stop = kw.pop("stop", None) or Stopper(r.cfg.run, r.state.global_step)
    ctx = RunContext(
        r.rt,
        r.dir,
        r.logger,
        r.saver,
        stop,
        weights_meta={"model": "tiny"},
        task=task if pass_task else None,
        make_metrics=lambda: task.make_metrics(r.loaders.info, r.cfg.eval, CPU),
    )
    return fit(plan_of(r), built, r.state, ctx)


def plain_top1(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in data)
    return hits / sum(len(y) for _, y in data)


# ---------------------------------------------------------------- train_step


def test_train_step_one_micro_batch_is_one_plain_sgd_step():
    ((x, y),) = [(torch.randn(6, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2]))]
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    correct: list = []
    loss = train_step(Trainable(model, nn.CrossEntropyLoss(), opt, Precision("fp32", CPU)), [(x, y)], correct=correct)
    want = plain_steps(ref, [[(x, y)]], 0.5)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)  # the same operations in the same order: bit-identical
        assert a.grad is None  # zero_grad(set_to_none=True)
    assert loss.item() == want[0] and not loss.requires_grad
    ((pred, tgt),) = correct
    assert torch.equal(pred, ref_logits_argmax(x)) and tgt is y


def ref_logits_argmax(x):
    with torch.no_grad():
        return tiny_model()(x).argmax(1)


@pytest.mark.parametrize("n", [2, 3])
def test_train_step_accumulates_micro_batches_like_a_plain_loop(n):
    g = torch.Generator().manual_seed(2)
    micro = [(torch.randn(5, 16, generator=g), torch.randint(0, K, (5,), generator=g)) for _ in range(n)]
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    correct: list = []
    loss = train_step(Trainable(model, nn.CrossEntropyLoss(), opt, Precision("fp32", CPU)), micro, correct=correct)
    want = plain_steps(ref, [micro], 0.5)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)  # loss / n before each backward, as the reference: measured difference 0
    # float32 mean on the device vs Python's mean of the same float32 losses: measured 3.4e-8 relative (n=3)
    assert loss.dtype == torch.float32 and math.isclose(loss.item(), want[0], rel_tol=1e-7)
    assert len(correct) == n and all(t is y for (_, t), (_, y) in zip(correct, micro, strict=True))


def test_train_step_all_reduces_only_the_last_micro_batch_under_ddp(tmp_path):
    """Accumulation under DDP: the micro-batches before the last run under no_sync (no all-reduce). One process
    with gloo; a DDP communication hook counts the all-reduces (with one process they change nothing)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(tiny_model())
        calls = []

        def count(_, bucket):
            calls.append(bucket.index())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, count)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(4)
        for n in (1, 2, 3):
            calls.clear()
            micro = [(torch.randn(4, 16, generator=g), torch.randint(0, K, (4,), generator=g)) for _ in range(n)]
            train_step(Trainable(model, nn.CrossEntropyLoss(), opt, Precision("fp32", CPU)), micro)
            assert calls == [0], n  # one bucket (51 parameters), all-reduced once per optimizer step
    finally:
        dist.destroy_process_group()


def test_train_step_clips_the_gradient_norm_like_a_plain_loop():
    g = torch.Generator().manual_seed(3)
    micro = [(torch.randn(8, 16, generator=g) * 10, torch.randint(0, K, (8,), generator=g))]
    model, ref, unclipped = tiny_model(), tiny_model(), tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(Trainable(model, nn.CrossEntropyLoss(), opt, Precision("fp32", CPU)), micro, clip_grad_norm=0.01)
    plain_steps(ref, [micro], 1.0, clip=0.01)
    plain_steps(unclipped, [micro], 1.0)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    moved = torch.sqrt(
        sum(((a - b) ** 2).sum() for a, b in zip(model.parameters(), tiny_model().parameters(), strict=True))
    )
    assert moved <= 0.01 * (1 + 1e-5)  # lr 1 x clipped norm 0.01
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), unclipped.parameters(), strict=True))


def test_train_step_clips_the_unscaled_gradients_under_a_loss_scaler():
    """amp_fp16's path on the CPU (as tests/e2e/train/test_precision.py does): a real GradScaler in the Precision.
    Clipping must see the true gradients, not the gradients times the loss scale."""
    g = torch.Generator().manual_seed(3)
    micro = [(torch.randn(8, 16, generator=g) * 10, torch.randint(0, K, (8,), generator=g))]
    model, ref = tiny_model(), tiny_model()
    prec = Precision("fp32", CPU)
    prec.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), micro, clip_grad_norm=0.01)
    plain_steps(ref, [micro], 1.0, clip=0.01)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)  # scaled by 2**10 and back (exact in binary): measured difference 0


def test_set_train_mode_keeps_frozen_norms_in_eval():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.BatchNorm1d(2))
    model.eval()
    set_train_mode(model, [model[1]])
    assert model.training and model[0].training and not model[1].training and model[2].training


# ---------------------------------------------------------------- EpochTotals, hits_sum, epoch_means


def test_hits_sum_counts_top1_hits_for_index_and_soft_targets():
    pred = torch.tensor([0, 1, 2, 2])
    assert hits_sum([(pred, torch.tensor([0, 1, 1, 2]))]).item() == 3.0
    soft = torch.tensor([[0.9, 0.1, 0.0], [0.3, 0.7, 0.0], [0.6, 0.0, 0.4], [0.0, 0.2, 0.8]])  # argmax 0, 1, 0, 2
    assert hits_sum([(pred, soft)]).item() == 3.0
    both = hits_sum([(pred, soft), (torch.tensor([1, 1]), torch.tensor([1, 0]))])
    assert both.item() == 4.0 and both.dtype == torch.float64
    assert hits_sum([(pred[:2], soft[:2]), (pred[2:], soft[2:])]).item() == 3.0


def test_epoch_totals_fold_adds_sums_and_clears():
    state = TrainState(epoch_loss_sum=1.5, epoch_steps=2, epoch_correct=3, epoch_samples=10)
    t = EpochTotals(accuracy=True)
    t.fold(state)  # nothing to add: unchanged
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples) == (1.5, 2, 3, 10)
    t.losses += [torch.tensor(0.25), torch.tensor(0.5)]
    t.hits += [(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1])), (torch.tensor([2]), torch.tensor([2]))]
    t.samples = 4
    t.fold(state)
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples) == (2.25, 4, 6, 14)
    assert t.losses == [] and t.hits == [] and t.samples == 0
    t.fold(state)  # cleared: a second fold adds nothing
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples) == (2.25, 4, 6, 14)
    t.losses.append(torch.tensor(1.0))
    t.samples = 3
    t.fold(state)  # losses without predictions (hits empty): 0 more hits, but the samples count
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples) == (3.25, 5, 6, 17)
    t.samples = 2  # samples without losses still fold
    t.fold(state)
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_samples, t.samples) == (3.25, 5, 19, 0)


def test_epoch_totals_without_accuracy_count_no_samples():
    state = TrainState()
    t = EpochTotals(accuracy=False)
    assert t.hits is None
    t.losses += [torch.tensor(2.0)]
    t.samples = 8
    t.fold(state)
    assert (state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples) == (2.0, 1, 0, 0)
    assert t.samples == 0 and t.losses == []
    assert epoch_means(state) == {"train/epoch_loss": 2.0}


def test_epoch_totals_count_samples_exactly_past_float32s_integers():
    state = TrainState()
    t = EpochTotals(accuracy=True)
    t.samples = 2**24 + 1  # float32 would round it to 2**24
    t.fold(state)
    assert state.epoch_samples == 2**24 + 1


def test_epoch_totals_sum_in_float64():
    state = TrainState()
    t = EpochTotals(accuracy=False)
    t.losses += [torch.tensor(1e8), torch.tensor(1.0)]  # float32 would give 1e8 exactly; float64 keeps the 1
    t.fold(state)
    assert state.epoch_loss_sum == 1e8 + 1


def test_epoch_means():
    assert epoch_means(TrainState()) == {}
    assert epoch_means(TrainState(epoch_loss_sum=3.0, epoch_steps=4, epoch_correct=3, epoch_samples=12)) == {
        "train/epoch_loss": 0.75,
        "train/epoch_top1": 0.25,
    }
    assert epoch_means(TrainState(epoch_correct=1, epoch_samples=2)) == {"train/epoch_top1": 0.5}


# ---------------------------------------------------------------- check_finite


def test_check_finite_counts_skipped_steps_and_names_the_bad_step():
    state = TrainState(global_step=10, skipped_steps=1)
    opt = torch.optim.SGD(tiny_model().parameters(), lr=0.125)
    prec = Precision("fp32", CPU, on_nonfinite="skip")
    check_finite(prec, state, [torch.tensor(1.0)], opt)
    check_finite(prec, state, [], opt)
    assert state.skipped_steps == 1
    prec._skipped += 2  # what Precision.step counts on the device for two steps with inf gradients
    check_finite(prec, state, [torch.tensor(1.0), torch.tensor(2.0)], opt)
    assert state.skipped_steps == 3 and prec._skipped.item() == 0
    stop = Precision("fp32", CPU, on_nonfinite="stop")
    check_finite(stop, state, [torch.tensor(1.0), torch.tensor(2.0)], opt)  # finite: nothing raised
    window = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(float("nan")), torch.tensor(float("inf"))]
    with pytest.raises(Diverged, match=r"the loss became non-finite \(inf/NaN\) at step 9, .*optim.lr \(now 0.125\)"):
        check_finite(stop, state, window, opt)  # steps 7..10: the NaN is step 9
    with pytest.raises(Diverged, match="at step 10,"):
        check_finite(stop, state, [torch.tensor(1.0), torch.tensor(float("inf"))], opt)
    with pytest.raises(Diverged, match="at step 8,"):  # the caller's verdict is used as is
        check_finite(stop, state, [torch.tensor(float("nan")), torch.tensor(1.0), torch.tensor(2.0)], opt, False)
    check_finite(stop, state, [torch.tensor(float("nan"))], opt, True)  # the caller said finite: trusted
    stop._skipped += 1  # finite losses, but a step skipped for non-finite gradients: no step to name
    with pytest.raises(Diverged, match=r"the gradients became non-finite \(inf/NaN\) by step 10, with precision=fp32"):
        check_finite(stop, state, [torch.tensor(1.0)], opt)


# ---------------------------------------------------------------- early stopping


@pytest.mark.parametrize(
    ("value", "best", "mode", "delta", "want"),
    [
        (1.0, None, "max", 0.0, True),
        (1.0, None, "min", 5.0, True),
        (0.6, 0.5, "max", 0.0, True),
        (0.5, 0.5, "max", 0.0, False),
        (0.4, 0.5, "max", 0.0, False),
        (0.6, 0.5, "max", 0.1, False),
        (0.61, 0.5, "max", 0.1, True),
        (0.55, 0.5, "max", 0.1, False),
        (0.4, 0.5, "min", 0.0, True),
        (0.5, 0.5, "min", 0.0, False),
        (0.6, 0.5, "min", 0.0, False),
        (0.4, 0.5, "min", 0.1, False),
        (0.39, 0.5, "min", 0.1, True),
        (0.45, 0.5, "min", 0.1, False),
    ],
)
def test_is_better(value, best, mode, delta, want):
    assert is_better(value, best, mode, delta) is want


def plain_early_stop(values, patience, min_delta, mode):
    sign = 1 if mode == "max" else -1
    best, wait, out = None, 0, []
    for v in values:
        if best is None or sign * (v - best) > min_delta:
            best, wait = v, 0
        else:
            wait += 1
        out.append((best, wait, wait >= patience))
    return out


@pytest.mark.parametrize("mode", ["max", "min"])
def test_early_stop_check_follows_a_plain_counter(mode):
    values = [0.5, 0.6, 0.62, 0.7, 0.69, 0.75, 0.74, 0.73, 0.76, 0.9]
    values = values if mode == "max" else [1 - v for v in values]
    state = TrainState()
    got = []
    for v in values:
        stop = early_stop_check(state, v, 3, 0.03, mode)
        got.append((state.stop_best, state.stop_wait, stop))
    assert got == plain_early_stop(values, 3, 0.03, mode)
    assert any(s for *_, s in got) and not got[0][2]
    state = TrainState()
    assert not any(early_stop_check(state, v, None, 0.0, mode) for v in values)
    assert state.stop_best is None and state.stop_wait == 0


# ---------------------------------------------------------------- train_one_epoch


def plain_epoch(model, bs, lrs, accum):
    """plain_steps with a per-step learning rate; also the top-1 hits of each forward (before its step)."""
    crit = nn.CrossEntropyLoss()
    losses, hits = [], 0
    for group_, lr in zip(group(bs, accum), lrs, strict=False):
        model.zero_grad()
        step = []
        for x, y in group_:
            logits = model(x)
            loss = crit(logits, y)
            (loss / len(group_) if len(group_) > 1 else loss).backward()
            step.append(loss.detach())
            hits += int((logits.argmax(1) == y).sum())
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(torch.stack(step).float().mean().item())
    return losses, hits


def test_train_one_epoch_matches_a_plain_loop_logs_each_window_and_sums_the_epoch(tmp_path, capsys):
    # 5 batches of 8, 2 per step: steps of 2, 2 and 1 micro-batches; the lr falls every step (interval=step)
    r = setup(
        tmp_path,
        "optim.accum_steps=2",
        "log.every_steps=2",
        "sched.interval=step",
        "run.epochs=3",
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
    )
    bs = batches(r.loaders.train, 0)
    ref = tiny_model()
    want, hits = plain_epoch(ref, bs, [0.1, 0.1 / 2, 0.1 / 3], accum=2)
    t0 = time.perf_counter()
    ep = one_epoch(r)
    wall = time.perf_counter() - t0
    for a, b in zip(r.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=4.5e-8)  # measured 1.5e-8 (p -= lr * g vs SGD's add_)
    assert ep["images"] == 40 and ep["finished_epoch"] is True
    assert 0 <= ep["data_wait"] < ep["seconds"] <= wall
    assert (r.state.epoch, r.state.step_in_epoch, r.state.global_step) == (0, 3, 3)
    (row,) = r.rows("train")  # log steps: 2 only (every 2 steps, 3 steps)
    assert row["step"] == 2 and row["epoch"] == 1 and row["train/skipped_steps"] == 0
    assert row["train/loss"] == (want[0] + want[1]) / 2  # the same float32 losses: measured difference 0
    assert row["train/lr"] == pytest.approx(0.1 / 3)
    # 32 images in two steps of a 16x3 linear model: far above 64 img/s (the window took less than 0.5 s)
    assert row["train/images_per_s"] > 64
    out = capsys.readouterr().out
    assert out == f"loss {row['train/loss']:.4f}  lr 0.0333  {row['train/images_per_s']:.0f} img/s\n"
    assert math.isclose(r.state.epoch_loss_sum, sum(want), rel_tol=1e-15)  # float64 sums: measured 0
    assert (r.state.epoch_steps, r.state.epoch_correct, r.state.epoch_samples) == (3, hits, 40)
    assert r.opt.param_groups[0]["lr"] == pytest.approx(0.1 / 4)  # three sched.step() calls


def test_train_one_epoch_resumes_mid_epoch_at_the_next_step(tmp_path):
    r = setup(
        tmp_path,
        "optim.accum_steps=2",
        "log.every_steps=1",
        "sched.interval=epoch",
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
    )
    r.state = TrainState(epoch=1, step_in_epoch=1, global_step=4, epoch_loss_sum=2.0, epoch_steps=1)
    bs = batches(r.loaders.train, 1)[2:]  # step 1 of epoch 1 (batches 0-1) is done
    ref = tiny_model()
    want, hits = plain_epoch(ref, bs, [0.1, 0.1], accum=2)
    ep = one_epoch(r)
    for a, b in zip(r.model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=4.5e-8)  # measured 1.5e-8
    assert ep["images"] == 24 and ep["finished_epoch"] is True
    assert (r.state.epoch, r.state.step_in_epoch, r.state.global_step) == (1, 3, 6)
    assert [x["step"] for x in r.rows("train")] == [5, 6] and {x["epoch"] for x in r.rows("train")} == {2}
    assert [x["train/loss"] for x in r.rows("train")] == want  # measured difference 0
    assert r.state.epoch_steps == 3 and math.isclose(r.state.epoch_loss_sum, 2.0 + sum(want), rel_tol=1e-15)
    assert r.state.epoch_samples == 24 and r.state.epoch_correct == hits
    assert r.opt.param_groups[0]["lr"] == 0.1  # interval=epoch: the engine's epoch loop steps it, not train_one_epoch


def test_train_one_epoch_draws_the_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    """log.progress on an interactive terminal (a real pseudo-terminal here): the bar names the epoch and counts
    the epoch's steps, starting from the steps a resumed epoch already did."""
    import os
    import re
    import select
    import sys

    master, slave = os.openpty()
    with os.fdopen(slave, "w") as term:
        monkeypatch.setattr(sys, "stdout", term)
        r = setup(tmp_path, "optim.accum_steps=2", "log.every_steps=100", "log.progress=true", "run.epochs=4")
        r.state = TrainState(epoch=1, step_in_epoch=1, global_step=4)  # 1 of epoch 2's 3 steps done
        one_epoch(r)
        term.flush()
    out = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
    assert re.search(r"epoch 2/4 .*3/3", text), text[-500:]


@pytest.mark.parametrize("how", ["max_steps", "stop_at"])
def test_train_one_epoch_stops_at_max_steps_or_stop_at(tmp_path, how):
    # 5 batches, 2 per step: 3 steps per epoch (the last of one batch); stopped after 2 of them
    r = setup(
        tmp_path, "log.every_steps=100", "optim.accum_steps=2", *(["run.max_steps=2"] if how == "max_steps" else [])
    )
    r.state.global_step = 10 if how == "stop_at" else 0
    r.loaders.train.set_epoch(0, start_batch=4)  # where a previous, resumed epoch left the loader: 1 batch to go
    stop = Stopper(r.cfg.run.model_copy(update={"stop_after_steps": 2}), start_step=10)  # a pause at global step 12
    ep = one_epoch(r, **({"stop": stop} if how == "stop_at" else {}))
    assert ep["images"] == 32 and ep["finished_epoch"] is False  # the epoch's length counts from its start
    assert r.state.step_in_epoch == 2 and r.state.epoch_steps == 2 and r.state.epoch_samples == 32
    assert r.rows("train") == []


def test_train_one_epoch_times_the_data_wait_and_the_log_window(tmp_path):
    r = setup(tmp_path, "log.every_steps=5")  # one log window: the whole epoch of 5 steps
    r.loaders.train = WrappedLoader(r.loaders.train, sleep_s=0.01)
    ep = one_epoch(r)
    assert 5 * 0.01 <= ep["data_wait"] <= ep["seconds"]  # every batch's wait is added, not the last one's
    (row,) = r.rows("train")
    # The window is the epoch minus its closing checks, with the same 40 images: never slower than the epoch.
    assert row["train/images_per_s"] >= ep["images"] / ep["seconds"]


def test_train_one_epoch_checkpoints_every_n_steps_with_the_epoch_sums_so_far(tmp_path):
    r = setup(tmp_path, "log.every_steps=100", "checkpoint.every_steps=2", "checkpoint.keep_last=5")
    bs = batches(r.loaders.train, 0)
    want, _ = plain_epoch(tiny_model(), bs, [0.1] * 5, accum=1)
    one_epoch(r)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert names == ["ckpt-e001-s0000002.pt", "ckpt-e001-s0000004.pt"]
    for name, steps in zip(names, (2, 4), strict=True):
        ts = torch.load(tmp_path / "checkpoints" / name, weights_only=False)["train_state"]
        assert (ts["global_step"], ts["epoch_steps"], ts["epoch_samples"]) == (steps, steps, 8 * steps)
        assert math.isclose(ts["epoch_loss_sum"], sum(want[:steps]), rel_tol=1e-15)  # float64 sums


def test_the_kill_fault_lands_after_the_step_and_its_checkpoint(tmp_path):
    """The elastic and resume tests' fault (tests/faults/sitecustomize.py kill_after, FAULT_KILL_AT=RANK:STEP) kills
    the process right after step STEP and its checkpoint: run in a forked child, which must die by SIGKILL with the
    checkpoints of steps 1-3 only (a kill before the save, or at another step, would test another moment)."""
    import multiprocessing
    import os
    import signal

    def child():
        os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
        os.environ.pop("RANK", None)
        faults().kill_after("0:3")  # in the forked child only
        one_epoch(setup(tmp_path, "checkpoint.every_steps=1", "checkpoint.keep_last=10", "log.every_steps=100"))

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(30)
    if p.is_alive():  # a hang (a broken loop): never leave the child running
        p.kill()
        p.join()
    assert p.exitcode == -signal.SIGKILL
    assert sorted(x.name for x in (tmp_path / "checkpoints").glob("*.pt")) == [
        f"ckpt-e001-s000000{i}.pt" for i in (1, 2, 3)
    ]
    # Without the fault (here, in this process; mutmut also sees which engine functions the test calls):
    r = setup(tmp_path / "plain", "log.every_steps=100")
    assert one_epoch(r)["finished_epoch"] and r.state.global_step == 5


# Every step is skipped, so the per-step scheduler steps without an optimizer step: torch warns, as expected here.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_train_one_epoch_counts_skipped_non_finite_steps(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model[1].bias[0] = float("nan")  # every loss and gradient is NaN: every step is skipped
    r = setup(tmp_path, "log.every_steps=2", model=model)
    one_epoch(r)
    assert [x["train/skipped_steps"] for x in r.rows("train")] == [2, 4]  # logged at steps 2 and 4
    assert all(math.isnan(x["train/loss"]) for x in r.rows("train"))
    assert r.state.skipped_steps == 5  # step 5, after the last log step, is counted at the epoch end
    assert torch.equal(model[1].weight, tiny_model()[1].weight)  # never updated


def test_train_one_epoch_stops_on_a_non_finite_loss_naming_its_step(tmp_path):
    # The lr becomes inf at the 2nd step: its loss is still finite, the 3rd step's is not.
    r = setup(
        tmp_path,
        "log.every_steps=3",
        "sched.interval=step",
        on_nonfinite="stop",
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 1 else float("inf")),
    )
    with pytest.raises(Diverged, match="loss became non-finite .* at step 3, with precision=fp32"):
        one_epoch(r)


def test_train_one_epoch_at_epoch_end_checks_the_steps_after_the_last_log_step(tmp_path):
    r = setup(
        tmp_path,
        "log.every_steps=4",
        "sched.interval=step",
        on_nonfinite="stop",
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 3 else float("inf")),
    )
    with pytest.raises(Diverged, match="at step 5,"):  # steps 1-4 finite and logged; step 5 diverges
        one_epoch(r)
    assert r.state.global_step == 5


def test_train_one_epoch_updates_the_ema_after_every_step(tmp_path):
    r = setup(tmp_path, "ema.enabled=true", "ema.decay=0.5", "log.every_steps=100", ema=True)
    bs = batches(r.loaders.train, 0)
    ref, avg = tiny_model(), tiny_model()
    for i, b in enumerate(bs):
        plain_epoch(ref, [b], [0.1], accum=1)
        with torch.no_grad():
            for e, p in zip(avg.parameters(), ref.parameters(), strict=True):
                e.mul_(0.5 if i else 0.0).add_(p, alpha=0.5 if i else 1.0)  # the first update copies (timm)
    one_epoch(r, ema=r.ema)
    for a, b in zip(r.ema.module.parameters(), avg.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=9e-8)  # lerp vs mul+add: measured 3.0e-8


# ---------------------------------------------------------------- evaluate


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_matches_a_plain_eval_loop_and_restores_the_mode(tmp_path, training):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(C * H * W, K))
    r = setup(tmp_path, model=model)
    model.train(training)
    task = get_task("classification")
    got = evaluate(model, r.loaders.val, r.loss_fn, r.prec, task.make_metrics(r.loaders.info, r.cfg.eval, CPU))
    assert model.training is training
    val = batches(r.loaders.val, 0)
    model.eval()
    with torch.no_grad():
        x, y = torch.cat([b[0] for b in val]), torch.cat([b[1] for b in val])
        logits = model(x)
    assert got["count"] == N_VAL
    assert got["top1"] == (logits.argmax(1) == y).sum().item() / len(y)  # a count over a count: exact
    # per-batch sums vs one mean over all samples: measured 7.0e-8 relative
    assert got["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=2.1e-7)


# ---------------------------------------------------------------- report_epoch


def test_report_epoch_logs_means_throughput_and_flags_input_bound_runs(tmp_path, capsys):
    r = setup(tmp_path)
    state = TrainState(epoch=2, global_step=7, epoch_loss_sum=3.0, epoch_steps=4, epoch_correct=3, epoch_samples=12)
    report_epoch(r.logger, state, {"data_wait": 0.5, "seconds": 2.0, "images": 400}, r.loaders.train, "memory")
    out = capsys.readouterr().out
    assert out == (
        "epoch 3: train loss 0.7500, top1 0.2500, 200 img/s, data wait 25% - input-bound: the loader (memory) "
        "is the bottleneck; try more data.num_workers or another data.backend (memory for small datasets, gpu "
        "for JPEGs on CUDA); `torchsprint bench` measures which pays off\n"
    )
    (row,) = r.rows("epoch")
    assert row == row | {
        "step": 7,
        "epoch": 3,
        "train/epoch_loss": 0.75,
        "train/epoch_top1": 0.25,
        "train/epoch_images_per_s": 200.0,
        "train/data_wait_share": 0.25,
    }
    report_epoch(r.logger, state, {"data_wait": 0.2, "seconds": 1.0, "images": 10}, r.loaders.train, "memory")
    out = capsys.readouterr().out
    assert "data wait 20%" in out and "input-bound" not in out  # 0.20 is not above the threshold
    assert r.rows("data") == []
    # zero seconds (a resumed epoch with nothing left): divided by 1e-9, not by zero
    report_epoch(r.logger, state, {"data_wait": 0.0, "seconds": 0.0, "images": 3}, object(), "memory")  # no .skipped
    assert "3000000000 img/s, data wait 0%" in capsys.readouterr().out
    assert r.rows("epoch")[-1]["train/epoch_images_per_s"] == 3e9
    report_epoch(r.logger, state, {"data_wait": 2e-9, "seconds": 0.0, "images": 0}, object(), "memory")
    assert r.rows("epoch")[-1]["train/data_wait_share"] == 2.0
    r.loaders.train.skipped.extend(f"bad{i}.jpg" for i in range(105))
    report_epoch(
        r.logger, TrainState(global_step=12), {"data_wait": 0.0, "seconds": 1.0, "images": 0}, r.loaders.train, "cpu"
    )
    out = capsys.readouterr().out
    assert "105 unreadable sample(s) skipped this epoch, e.g. ['bad0.jpg', 'bad1.jpg', 'bad2.jpg']" in out
    assert "epoch 1: train 0 img/s, data wait 0%" in out
    (row,) = r.rows("data")
    assert row["step"] == 12 and row["data/skipped"] == 105
    assert row["data/skipped_paths"] == [f"bad{i}.jpg" for i in range(100)]  # the first 100
    assert r.loaders.train.skipped == []


# ---------------------------------------------------------------- fit


def test_fit_trains_evaluates_every_n_epochs_and_saves_the_best_and_last_weights(tmp_path, capsys):
    # 3 epochs of 5 steps; lr halves every epoch (interval=epoch); evaluations after epochs 2 and 3 (the last)
    r = setup(
        tmp_path,
        "run.epochs=3",
        "eval.every_epochs=2",
        "log.every_steps=1",
        "sched.interval=epoch",
        "eval.per_class=true",
        lr=0.5,
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e),
    )
    ref = tiny_model()
    val = batches(r.loaders.val, 0)
    top1 = {}
    for e in range(3):
        plain_epoch(ref, batches(r.loaders.train, e), [0.5 * 0.5**e] * 5, accum=1)
        top1[e + 1] = plain_top1(ref, val)
    t0 = time.perf_counter()
    summary = run_fit(r)
    wall = time.perf_counter() - t0
    for a, b in zip(r.model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)  # measured difference 0
    evals = r.rows("eval")
    assert [x["epoch"] for x in evals] == [2, 3] and [x["step"] for x in evals] == [10, 15]
    # float32 k/24 vs the float64 ratio: measured 2e-8
    assert [x["val/top1"] for x in evals] == pytest.approx([top1[2], top1[3]], abs=6e-8)
    epochs = r.rows("epoch")
    assert [x["epoch"] for x in epochs] == [1, 2, 3]
    steps = r.rows("train")
    for x in epochs:  # the epoch means are per epoch (sums reset between epochs)
        losses = [s["train/loss"] for s in steps if s["epoch"] == x["epoch"]]
        assert len(losses) == 5 and math.isclose(x["train/epoch_loss"], sum(losses) / 5, rel_tol=1e-9)
    assert [s["train/lr"] for s in steps] == pytest.approx([0.5] * 5 + [0.25] * 5 + [0.125] * 5)
    best_epoch = 3 if top1[3] > top1[2] else 2  # a tie keeps the earlier epoch
    assert summary["best_epoch"] == best_epoch and summary["best_metric"] == pytest.approx(top1[best_epoch], abs=6e-8)
    assert summary["final"] == {k: v for k, v in evals[-1].items() if k.startswith("val/")}  # lists left out
    assert "val/confusion" not in evals[-1]
    assert summary["global_step"] == 15 and summary["skipped_steps"] == 0 and summary["paused"] is False
    assert summary["early_stop"] is None
    # Totals over the epochs, recomputed from each epoch's row (seconds = images / images_per_s): float rounding only
    secs = [40 / x["train/epoch_images_per_s"] for x in epochs]
    assert math.isclose(summary["train_images_per_s"], 120 / sum(secs), rel_tol=1e-12)
    assert math.isclose(
        summary["data_wait_share"],
        sum(x["train/data_wait_share"] * t for x, t in zip(epochs, secs, strict=True)) / sum(secs),
        rel_tol=1e-12,
    )
    assert sum(secs) <= summary["seconds"] <= wall  # fit's own time, within the time around the call
    assert (r.state.epoch, r.state.step_in_epoch, r.state.epoch_steps, r.state.epoch_samples) == (3, 0, 0, 0)
    assert (r.state.epoch_loss_sum, r.state.epoch_correct) == (0.0, 0)
    last = load_file(str(tmp_path / "last.safetensors"))
    assert torch.equal(last["1.weight"], r.model[1].weight) and torch.equal(last["1.bias"], r.model[1].bias)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "last.safetensors"), "pt") as f:
        assert f.metadata() == {"model": "tiny", "epoch": "3", "step": "15"}
    with safe_open(str(tmp_path / "best.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta == {
        "model": "tiny",
        "epoch": str(best_epoch),
        "step": str(5 * best_epoch),
        "val/top1": meta["val/top1"],
        "weights": "model",
    }
    assert float(meta["val/top1"]) == summary["best_metric"]
    assert not (tmp_path / "ema.safetensors").exists()
    assert (tmp_path / "confusion_matrix.csv").is_file()  # the task's artifacts go with the best weights
    assert (tmp_path / "confusion_matrix_last.csv").is_file()  # and with the last ones
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert "ckpt-e003-s0000015.pt" in ckpts and "ckpt-e002-s0000010.pt" in ckpts  # keep_last=2 (+ best)
    for name, ev in (("ckpt-e002-s0000010.pt", evals[0]), ("ckpt-e003-s0000015.pt", evals[1])):  # saved with its metric
        assert torch.load(tmp_path / "checkpoints" / name, weights_only=False)["metric"] == ev["val/top1"]
    out = capsys.readouterr().out
    task = get_task("classification")
    assert f"epoch 2/3  {task.summary(evals[0])}\n" in out and f"epoch 3/3  {task.summary(evals[1])}\n" in out
    assert "epoch 1/3  " not in out and "EMA" not in out


def test_fit_checkpoints_every_n_epochs(tmp_path):
    r = setup(
        tmp_path,
        "run.epochs=3",
        "checkpoint.every_epochs=2",
        "checkpoint.keep_last=5",
        "checkpoint.keep_best=0",
        "eval.every_epochs=5",
    )
    run_fit(r)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == [
        "ckpt-e002-s0000010.pt",
        "ckpt-e003-s0000015.pt",
    ]  # epoch 2, and the last
    assert [x["epoch"] for x in r.rows("eval")] == [3]


def test_fit_best_weights_follow_the_monitor_in_min_mode(tmp_path):
    r = setup(tmp_path, "run.epochs=3", "checkpoint.monitor=val/loss", "checkpoint.mode=min")
    summary = run_fit(r)
    losses = [x["val/loss"] for x in r.rows("eval")]
    assert len(losses) == 3 and summary["best_metric"] == min(losses)
    assert summary["best_epoch"] == 1 + losses.index(min(losses))


def test_fit_refuses_a_monitor_that_is_not_a_metric(tmp_path):
    r = setup(tmp_path, "run.epochs=1", "checkpoint.monitor=val/nope")
    with pytest.raises(
        UsageError,
        match=r"checkpoint.monitor=val/nope is not a metric; available: \['val/balanced_acc', "
        r"'val/class_imbalance', 'val/count', 'val/f1_macro', 'val/loss', 'val/min_recall', "
        r"'val/top1'\]",
    ):
        run_fit(r)
    r = setup(
        tmp_path / "name", "run.epochs=1", "checkpoint.monitor=val/min_recall_class"
    )  # a class name, not a number
    with pytest.raises(UsageError, match=r"checkpoint.monitor=val/min_recall_class is not a metric"):
        run_fit(r)


def test_fit_stops_at_max_steps_mid_epoch_and_evaluates(tmp_path):
    r = setup(
        tmp_path,
        "run.epochs=3",
        "run.max_steps=7",
        "checkpoint.keep_last=5",
        "checkpoint.every_steps=3",
        "sched.interval=step",
        sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
    )
    summary = run_fit(r)
    assert summary["global_step"] == 7 and summary["paused"] is False
    assert [x["step"] for x in r.rows("eval")] == [5, 7]  # epoch 1's end, and the stop
    assert (r.state.epoch, r.state.step_in_epoch) == (1, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == [
        "ckpt-e001-s0000003.pt",
        "ckpt-e001-s0000005.pt",
        "ckpt-e002-s0000006.pt",
        "ckpt-e002-s0000007.pt",
    ]
    assert r.opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)  # 7 steps, and no extra step at the epoch end
    assert (tmp_path / "last.safetensors").is_file()


def test_fit_pauses_mid_epoch_without_evaluating_and_continues_like_an_uninterrupted_run(tmp_path, capsys):
    full = setup(tmp_path / "full", "run.epochs=2")
    run_fit(full)
    r = setup(tmp_path / "r", "run.epochs=2", "run.stop_after_steps=3")
    summary = run_fit(r)
    assert summary["paused"] is True and summary["global_step"] == 3 and summary["final"] == {}
    assert r.rows("eval") == [] and [x["epoch"] for x in r.rows("epoch")] == [1]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("*.pt")) == ["ckpt-e001-s0000003.pt"]
    assert not (tmp_path / "r" / "last.safetensors").exists()
    assert (
        f"paused at step 3 (run.stop_after_steps); continue with checkpoint.resume=auto or `torchsprint train "
        f"--resume {tmp_path / 'r'}`" in capsys.readouterr().out
    )
    assert (r.state.epoch, r.state.step_in_epoch) == (0, 3)
    r.cfg = config.load(None, [*FAST, "optim.lr=0.1", f"run.dir={tmp_path / 'r'}", "run.epochs=2"])
    summary = run_fit(r)  # the same objects: continues at step 4
    assert summary["paused"] is False and summary["global_step"] == 10
    for a, b in zip(r.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [x["val/top1"] for x in r.rows("eval")] == [x["val/top1"] for x in full.rows("eval")]


def test_fit_pausing_at_an_epoch_end_evaluates_and_finishes_the_epoch(tmp_path):
    r = setup(tmp_path, "run.epochs=3", "run.stop_after_steps=5", "checkpoint.every_epochs=null")  # the pause saves
    summary = run_fit(r)
    assert summary["paused"] is True and summary["global_step"] == 5
    assert [x["epoch"] for x in r.rows("eval")] == [1] and summary["best_epoch"] == 1
    assert (r.state.epoch, r.state.step_in_epoch) == (1, 0)
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.pt")] == ["ckpt-e001-s0000005.pt"]
    assert not (tmp_path / "last.safetensors").exists()
    r2 = setup(tmp_path / "last", "run.epochs=1", "run.stop_after_steps=5")  # pausing at the very end: finished
    assert run_fit(r2)["paused"] is False and (tmp_path / "last" / "last.safetensors").is_file()


def test_fit_stops_early_when_the_monitor_stops_improving(tmp_path, capsys):
    r = setup(
        tmp_path,
        "run.epochs=6",
        "early_stop.patience=2",
        "early_stop.min_delta=0.5",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=0",
        "checkpoint.every_epochs=null",
    )  # the stop itself saves a checkpoint
    summary = run_fit(r, pass_task=False)  # top1 never improves by 0.5 after the first evaluation: stops after epoch 3
    evals = [x["val/top1"] for x in r.rows("eval")]
    assert len(evals) == 3
    assert summary["early_stop"] == {"stopped_epoch": 3, "best": evals[0], "wait": 2, "patience": 2, "min_delta": 0.5}
    assert summary["global_step"] == 15 and summary["paused"] is False
    rows = r.rows("early_stop")
    assert [(x["early_stop/wait"], x["early_stop/stopped"], x["epoch"], x["step"]) for x in rows] == [
        (0, False, 1, 5),
        (1, False, 2, 10),
        (2, True, 3, 15),
    ]
    # measured top1: 0.25, 0.333, 0.333: the best is the first of the two equal maxima, not the last evaluation
    assert summary["best_epoch"] == 1 + evals.index(max(evals)) == 2
    assert all(x["early_stop/best"] == evals[0] for x in rows)
    assert r.state.stopped_epoch == 2 and r.state.epoch == 3
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.pt")] == ["ckpt-e003-s0000015.pt"]
    assert (tmp_path / "last.safetensors").is_file()
    out = capsys.readouterr().out
    assert (
        f"early stop after epoch 3: val/top1 has not improved by more than 0.5 for 2 evaluation(s) (best "
        f"{evals[0]:.4g})" in out
    )
    assert f"epoch 3/6  {get_task('classification').summary(r.rows('eval')[-1])}\n" in out  # fit's default task


def test_fit_evaluates_and_saves_the_ema(tmp_path, capsys):
    r = setup(
        tmp_path,
        "run.epochs=2",
        "ema.enabled=true",
        "ema.decay=0.5",
        "checkpoint.monitor=ema/val/top1",
        "eval.per_class=true",
        ema=True,
        lr=0.5,
    )
    summary = run_fit(r)
    val = batches(r.loaders.val, 0)
    evals = r.rows("eval")
    # float32 k/24 vs the float64 ratio: measured 9.9e-9
    assert [x["ema/val/top1"] for x in evals][-1] == pytest.approx(plain_top1(r.ema.module, val), abs=3e-8)
    assert evals[-1]["val/top1"] == pytest.approx(plain_top1(r.model, val), abs=3e-8)
    assert summary["final"]["ema/val/count"] == N_VAL and summary["best_metric"] in [x["ema/val/top1"] for x in evals]
    ema_file = load_file(str(tmp_path / "ema.safetensors"))
    assert torch.equal(ema_file["1.weight"], r.ema.module[1].weight)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        assert f.metadata() == {"model": "tiny", "epoch": "2", "weights": "ema"}
    with safe_open(str(tmp_path / "best.safetensors"), "pt") as f:
        assert f.metadata()["weights"] == "ema"
    best = load_file(str(tmp_path / "best.safetensors"))
    if summary["best_epoch"] == 2:
        assert torch.equal(best["1.weight"], r.ema.module[1].weight)
    assert not torch.equal(r.ema.module[1].weight, r.model[1].weight)
    # The confusion matrix written with the best weights is the EMA's (measured: EMA top1 0.625, model 0.667)
    best_model = tiny_model()
    best_model[1].weight.data, best_model[1].bias.data = best["1.weight"], best["1.bias"]

    def confusion(m):
        x, y = torch.cat([b[0] for b in val]), torch.cat([b[1] for b in val])
        with torch.no_grad():
            pred = m(x).argmax(1)
        return [[int(((y == t) & (pred == q)).sum()) for q in range(K)] for t in range(K)]

    csv_rows = [line.split(",")[1:] for line in (tmp_path / "confusion_matrix.csv").read_text().splitlines()[1:]]
    assert [[int(v) for v in row] for row in csv_rows] == confusion(best_model)
    if summary["best_epoch"] == 2:
        assert confusion(best_model) != confusion(r.model)
    assert r.ema.updates == 10  # fit passes the EMA to every epoch: updated after each of the 10 steps
    task = get_task("classification")
    ema_row = {k[4:]: v for k, v in evals[-1].items() if k.startswith("ema/")}
    assert f"epoch 2/2  {task.summary(evals[-1])}  | EMA {task.summary(ema_row)}\n" in capsys.readouterr().out


class WrappedLoader:
    """A real loader, wrapped to act out what fit must handle: a length that promises more batches than it yields
    (a loader-length bug), or a slow loader (an input-bound run)."""

    def __init__(self, inner, extra_len: int = 0, sleep_s: float = 0.0):
        self.inner, self.extra_len, self.sleep_s = inner, extra_len, sleep_s
        self.skipped: list[str] = []

    def set_epoch(self, epoch, start_batch=0):
        self.inner.set_epoch(epoch, start_batch)

    def __len__(self):
        return len(self.inner) + self.extra_len

    def __iter__(self):
        for b in self.inner:
            time.sleep(self.sleep_s)
            yield b


def test_fit_refuses_a_loader_that_ends_before_the_epoch(tmp_path):
    r = setup(tmp_path, "run.epochs=1")
    r.loaders.train = WrappedLoader(r.loaders.train, extra_len=1)
    with pytest.raises(RuntimeError, match="^loader ended before the epoch did$"):
        run_fit(r)


def test_fit_reports_skipped_samples_and_input_bound_epochs(tmp_path, capsys):
    r = setup(tmp_path, "run.epochs=1")
    # 20 ms per batch against steps of well under a millisecond: data wait near 100% (flagged above 20%)
    r.loaders.train = WrappedLoader(r.loaders.train, sleep_s=0.02)
    r.loaders.train.skipped.append("bad.jpg")  # what a cpu loader records for an unreadable file
    r.loaders.info.backend = ""  # a loader that does not say which backend it is: the config's name is shown
    run_fit(r)
    out = capsys.readouterr().out
    assert "input-bound: the loader (memory) is the bottleneck" in out
    assert "1 unreadable sample(s) skipped this epoch, e.g. ['bad.jpg']" in out
    (row,) = r.rows("data")
    assert row["data/skipped_paths"] == ["bad.jpg"] and r.loaders.train.skipped == []
    assert r.rows("epoch")[0]["train/data_wait_share"] > 0.2


@pytest.mark.parametrize(("mode", "monitor"), [("max", "val/top1"), ("min", "val/loss")])
def test_fit_early_stop_follows_the_checkpoint_mode(tmp_path, mode, monitor):
    r = setup(
        tmp_path,
        "run.epochs=6",
        "early_stop.patience=1",
        f"checkpoint.monitor={monitor}",
        f"checkpoint.mode={mode}",
        lr=0.5,
    )
    summary = run_fit(r)
    values = [x[monitor] for x in r.rows("eval")]
    want = plain_early_stop(values, 1, 0.0, mode)
    stopped = [i for i, (*_, stop) in enumerate(want, 1) if stop]
    assert summary["early_stop"]["stopped_epoch"] == (stopped[0] if stopped else None)
    assert len(values) == (stopped[0] if stopped else 6)
    # the same values read in the other direction stop elsewhere: the mode is what decides
    other = [
        i for i, (*_, stop) in enumerate(plain_early_stop(values, 1, 0.0, "min" if mode == "max" else "max"), 1) if stop
    ]
    assert other[:1] != stopped[:1]

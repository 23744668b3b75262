"""run.train_time (train/time_fit.py): the run's length fitted to the time from its measured speed, the schedule
ending at the fitted step. A fake clock: no test here depends on this machine's speed."""

import math
from types import SimpleNamespace

import pytest
import torch

from torchsprint.config.training import SchedConfig
from torchsprint.optim.schedulers import build_scheduler, refit_schedule
from torchsprint.state.checkpoint import TrainState
from torchsprint.train.time_fit import FixedLength, TimeFit, epochs_limit, steps_limit


def drive(step_s, budget_s=10.0, spe=7, cap=10_000):
    """A loop as the engine's: a step takes step_s(step) fake seconds; returns the state, the lrs after each step."""
    now = [0.0]
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched_cfg = SchedConfig(name="cosine")
    sched = build_scheduler(sched_cfg, opt, epochs=cap / spe, steps_per_epoch=spe)  # provisional: a long run
    fit = TimeFit(
        budget_s,
        0.0,
        spe,
        lambda n: refit_schedule(sched, sched_cfg, steps=n, steps_per_epoch=spe),
        clock=lambda: now[0],
    )
    plan = SimpleNamespace(max_steps=None, epochs=cap, steps_per_epoch=spe)
    state, lrs = TrainState(), []
    while state.global_step < (steps_limit(plan, state) or cap):
        now[0] += step_s(state.global_step)
        opt.step()
        sched.step()
        state.global_step += 1
        state.step_in_epoch = (state.step_in_epoch % spe) + 1
        fit.after_step(state)
        lrs.append(opt.param_groups[0]["lr"])
    return state, lrs, fit, now[0], plan


def test_a_steady_run_is_fitted_to_the_time_and_its_cosine_ends_there():
    # 0.1 s a step, 10 s: 100 steps. A bug that measures the rate wrongly (the warm-up steps counted, the time
    # left taken from the wrong origin) gives another count; one that does not refit the schedule leaves the last
    # lr at the provisional 10,000-step cosine's (~1.0) instead of 0.
    state, lrs, fit, end, plan = drive(lambda i: 0.1)
    assert state.global_step == state.fitted_steps == 100
    assert end == pytest.approx(10.0)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)  # cosine over 100 steps, min_lr_ratio 0: ends at 0
    assert lrs[49] == pytest.approx(0.5 * (1 + math.cos(math.pi * 50 / 100)), abs=1e-9)  # the 100-step cosine
    assert epochs_limit(plan, state) == 15  # ceil(100 / 7)
    assert fit.record()["fitted_steps"] == 100 and fit.record()["fits"][0]["step"] >= 3 + 5


def test_a_run_that_slows_down_is_refit_at_each_epoch_and_still_ends_near_its_time():
    # Steps take 0.1 s, then 0.2 s from step 40 on (evaluations, a busier machine): the first fit (100 steps) would
    # overshoot to ~16 s; the refits at epoch starts bring the end within a few steps of 10 s.
    state, lrs, fit, end, _ = drive(lambda i: 0.1 if i < 40 else 0.2)
    assert len(fit.fits) > 2
    assert fit.fits[0]["fitted_steps"] >= 95
    assert end <= 10.0 + 0.2 * 7 + 1e-9  # at most one epoch's refit interval late
    assert state.global_step < 95
    assert lrs[-1] < 0.02  # the schedule's end follows the last fit


def test_the_fitted_length_survives_a_resume_and_is_not_refit():
    sched_calls = []
    fit = TimeFit(10.0, 0.0, 5, sched_calls.append, clock=lambda: 1e9)  # a clock far past the budget
    state = TrainState(global_step=30, fitted_steps=80)
    fit.restore(state)
    for _ in range(10):
        state.global_step += 1
        fit.after_step(state)
    assert state.fitted_steps == 80 and sched_calls == [80] and fit.record()["resumed"]


def test_a_fixed_length_run_changes_nothing():
    state = TrainState()
    FixedLength().after_step(state)
    assert state.fitted_steps is None and FixedLength().record() is None
    assert steps_limit(SimpleNamespace(max_steps=12), state) == 12

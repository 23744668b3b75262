"""`run.train_time`: a run's length fitted to a wall-clock time, its learning-rate schedule ending when the time does.

The run cannot know its speed before it trains, so it measures: from the end of step WARM_STEPS (compile, caches and
allocators settled) to a point MEASURE_SHARE of the time later (at least MIN_MEASURE_STEPS steps), then sets the
run's last step to what the measured rate fits in the time left, and sets the schedule's length to it. It refits at
the start of every epoch, from the rate since WARM_STEPS (evaluations and checkpoints included, so their cost is
amortised into it): the estimate sharpens as the run goes, and a setting that trains faster trains more steps.
Between refits the schedule is a plain per-step LambdaLR; a refit only changes its length (the warm-up, in epochs,
is unchanged). The fitted step count lives in TrainState (`fitted_steps`), so a resumed run continues to the same
length with the same schedule (it is not refitted: the time is this invocation's, as run.max_time's).

Under DDP every rank measures its own clock; the fitted count is the ranks' minimum (one all-reduce at each refit),
so every rank stops at the same step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

WARM_STEPS = 3  # the first steps are slow (allocator, compile, the first batches' decode): not measured
MEASURE_SHARE = 0.03  # measure over the first 3% of the time ...
MIN_MEASURE_STEPS = 5  # ... and at least this many steps


class FixedLength:
    """A run of fixed length (run.epochs, run.max_steps): nothing to measure or fit."""

    def restore(self, state) -> None:
        pass

    def after_step(self, state) -> None:
        pass

    def record(self) -> dict | None:
        return None


class TimeFit:
    """Fit `state.fitted_steps` (the run's last optimizer step) and the schedule's length to `budget_s` seconds
    counted from `t0` (the same clock as `clock`).

    Args:
        budget_s: run.train_time in seconds.
        t0: when the run started (train/run.py's t0, time.monotonic()).
        steps_per_epoch: optimizer steps of one epoch.
        set_schedule: called with the fitted length in optimizer steps (the schedule then ends there).
        agree: the ranks' minimum of an int (collectives.agree_min bound to the runtime); identity on one process.
        clock: seconds, monotonic (a test passes a fake one).
    """

    def __init__(
        self,
        budget_s: float,
        t0: float,
        steps_per_epoch: int,
        set_schedule: Callable[[int], None],
        agree: Callable[[int], int] = lambda n: n,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.budget_s, self.t0, self.spe = budget_s, t0, max(1, steps_per_epoch)
        self.set_schedule, self.agree, self.clock = set_schedule, agree, clock
        self.warm_at: tuple[int, float] | None = None  # (step, time) at the end of WARM_STEPS
        self.fits: list[dict] = []  # each refit: at which step and second, the rate, the fitted length
        self.resumed = False

    def restore(self, state) -> None:
        """A resumed run keeps the length its first invocation fitted (its schedule set again to it)."""
        if state.fitted_steps is not None:
            self.resumed = True
            self.set_schedule(state.fitted_steps)

    def after_step(self, state) -> None:
        """Called after every optimizer step (state.global_step already counts it). Decides at the measuring point
        and at the first step of each epoch; every rank calls it at the same steps (a collective then)."""
        if self.resumed:
            return
        step = state.global_step
        if self.warm_at is None:
            if step >= WARM_STEPS:
                self.warm_at = (step, self.clock())
            return
        now = self.clock()
        w_step, w_time = self.warm_at
        measured = step - w_step
        if state.fitted_steps is None:
            if measured < MIN_MEASURE_STEPS or now - w_time < MEASURE_SHARE * self.budget_s:
                return
        elif state.step_in_epoch != 1:
            return
        rate = measured / max(now - w_time, 1e-9)  # optimizer steps a second, evaluations included
        left = self.t0 + self.budget_s - now
        fitted = self.agree(max(step, step + math.floor(rate * max(left, 0.0) + 1e-6)))  # 1e-6: float noise
        state.fitted_steps = fitted
        self.set_schedule(fitted)
        self.fits.append(
            {"step": step, "elapsed_s": round(now - self.t0, 3), "steps_per_s": rate, "fitted_steps": fitted}
        )

    def record(self) -> dict:
        """summary.json's `train_time`: the budget, each fit, and the length the run ended with."""
        return {
            "budget_s": self.budget_s,
            "fits": self.fits,
            "fitted_steps": self.fits[-1]["fitted_steps"] if self.fits else None,
            "fitted_epochs": round(self.fits[-1]["fitted_steps"] / self.spe, 3) if self.fits else None,
            "resumed": self.resumed,
        }


def steps_limit(plan, state) -> int | None:
    """The run's last optimizer step: the fitted one (run.train_time) once fitted, else run.max_steps (None: the
    epochs alone end the run)."""
    return state.fitted_steps if state.fitted_steps is not None else plan.max_steps


def epochs_limit(plan, state) -> int:
    """The run's epoch count: the fitted length's epochs once fitted, else plan.epochs."""
    if state.fitted_steps is None:
        return plan.epochs
    return max(1, math.ceil(state.fitted_steps / max(plan.steps_per_epoch, 1)))

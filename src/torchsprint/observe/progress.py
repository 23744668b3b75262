"""Feedback while training: the progress bar, the heartbeat line and the time estimate of rank 0.

logging.RunLogger owns a `Feedback` and forwards the epoch's events to it (start_epoch, advance, step_stats,
end_epoch); its lines go out through the logger's `info`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

# A run that prints nothing for minutes looks hung, and a user learns only at the end of an epoch that the run takes
# hours; so: a progress line at least every HEARTBEAT_SECONDS where no progress bar can be drawn (CI logs, files),
# and, early in the first epoch, one estimate of the epoch's and the run's time, with advice when the run is long.
HEARTBEAT_SECONDS = 10.0  # not a terminal: a progress line at least this often (a timer thread: a step may be long)
FIRST_HEARTBEAT_SECONDS = 5.0  # ... and the first one this long after the epoch starts, even during its first step
ESTIMATE_AFTER_STEPS = 5  # the estimate line: after this many steps past the first (its warm-up is not counted) ...
ESTIMATE_AFTER_SECONDS = 5.0  # ... and this many seconds past the first step, whichever comes later;
ESTIMATE_LATEST_SECONDS = 30.0  # or, for slow steps, at the first step this long past the first one
LONG_RUN_SECONDS = 30 * 60  # a run estimated to take longer gets concrete advice on shortening it


def clock(seconds: float | None) -> str:
    """H:MM:SS (M:SS under an hour, '12.3 s' under a minute); '?' when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    if seconds < 59.95:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    return f"{h}:{m // 60:02d}:{m % 60:02d}" if h else f"{m // 60}:{m % 60:02d}"


class EpochClock:
    """The steps and images of one epoch against the clock; rates are measured from the end of the epoch's first
    step, so its warm-up (allocation, autotuning, a compile, the loader's first batch) does not skew them.

    `total`: the epoch's steps; `done`: steps already done when it starts (a resumed epoch).
    """

    def __init__(self, total: int, done: int = 0, now: float | None = None):
        self.total, self.start_done, self.done, self.images = total, done, done, 0
        self.t_start = time.monotonic() if now is None else now
        self.first: tuple[float, int, int] | None = None  # (time, steps done, images) at the end of the first step
        self.last = self.t_start  # the end of the latest step

    def step(self, n: int, images: int, now: float) -> None:
        self.done += n
        self.images += images
        self.last = now
        if self.first is None:
            self.first = (now, self.done, self.images)

    def steady_steps(self) -> int:
        """Steps timed after the first (warm-up) step."""
        return 0 if self.first is None else self.done - self.first[1]

    def rates(self, now: float) -> tuple[float, float] | None:
        """(steps/s, images/s) up to the end of the latest step (a step under way is not counted as time without
        progress): after the first step if a later one is done, else over the first step (rough). `now` bounds it."""
        end = min(self.last, now)
        if self.first is not None and self.done > self.first[1] and end > self.first[0]:
            t, done, images = self.first
            return (self.done - done) / (end - t), (self.images - images) / (end - t)
        if self.done > self.start_done and end > self.t_start:
            return (self.done - self.start_done) / (end - self.t_start), self.images / (end - self.t_start)
        return None

    def eta(self, now: float) -> float | None:
        """Seconds to the end of the epoch at the current rate (None before the first step), less the time the step
        under way has run: at most one step's worth, so a step that runs long raises the ETA instead of reaching 0."""
        r = self.rates(now)
        if r is None:
            return None
        left = max(self.total - self.done, 0) / r[0]
        return max(left - max(now - self.last, 0.0), left - 1 / r[0], 0.0) if left else 0.0


class Feedback:
    """One bar per epoch on an interactive terminal; elsewhere a line every HEARTBEAT_SECONDS; and once, early in
    the first epoch trained here, the estimate of the epoch's and the run's time (log.progress=false: none).

    Args:
        console: the run's console (the bar draws on it).
        say: prints one line (above the bar while one is drawn): the logger's `info`.
    """

    def __init__(self, console: Console, say: Callable[[str], None]):
        self.console, self.say = console, say
        self.progress: Progress | None = None
        self.task = None
        self.clock: EpochClock | None = None  # the epoch being trained (None: no progress feedback)
        self._plan: dict = {}  # what the run will do (expect), for the time estimate
        self._estimated = False  # the estimate line is printed once per process
        self._lock = threading.Lock()  # the heartbeat thread and the training thread print and read the clock
        self._stop: threading.Event | None = None  # set to stop the epoch's heartbeat thread

    def expect(self, cfg, decided: dict) -> None:
        """What the run will do, for the time estimate: run.epochs, max_steps and max_time, the evaluations
        (eval.every_epochs / every_steps over the validation images) and what the advice names (image size,
        backend, device). `decided`: run.decisions' dict (the start-up summary's facts)."""
        from torchsprint.runtime.preempt import parse_duration

        epochs, spe = cfg.run.epochs, max(int(decided.get("steps_per_epoch") or 1), 1)
        every = cfg.eval.every_epochs
        evals = sum(1 for e in range(1, epochs + 1) if e % every == 0 or e == epochs)
        if cfg.eval.every_steps:
            evals += epochs * spe // cfg.eval.every_steps
        self._plan = {
            "epochs": epochs,
            "steps_per_epoch": spe,
            "max_steps": cfg.run.max_steps,
            "max_time": None if cfg.run.max_time is None else parse_duration(cfg.run.max_time),
            "evaluations": evals,
            "val_images": int(decided.get("images", {}).get("val", 0)),
            "batch_shape": decided.get("batch_shape"),
            "backend": decided.get("backend"),
            "backend_config": decided.get("backend_config"),
            "device": str(decided.get("device", "")),
        }

    def start_epoch(self, epoch: int, epochs: int, total: int, done: int = 0, on: bool = True) -> None:
        """An epoch of `total` steps begins, `done` of them already done (a resumed epoch); `on`: feedback wanted
        (rank 0, log.progress, a console that is not silenced)."""
        self._stop_heartbeat()
        self.clock = None
        if not on:
            return
        self.clock = EpochClock(total, done)
        self._epoch, self._epochs = epoch, epochs
        if not sys.stdout.isatty():
            self._start_heartbeat(self.clock)
            return
        self.progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
            refresh_per_second=4,
        )
        self._pending, self._pushed = 0, time.monotonic()
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, stats="", rate="")

    def advance(self, n: int = 1, images: int = 0) -> None:
        """Count `n` steps of `images` images. The bar hears of them at most every 0.1 s (rich's update takes a lock
        and keeps speed samples: a per-step call is measurable beside a millisecond step) and redraws 4 times a
        second; without a bar a progress line is printed when HEARTBEAT_SECONDS have passed since the last."""
        c = self.clock
        if c is None:
            return
        now = time.monotonic()
        c.step(n, images, now)
        if self.progress is not None:
            self._pending += n
            if now - self._pushed >= 0.1:
                self.progress.update(self.task, advance=self._pending, rate=self.rate_text(now))
                self._pending, self._pushed = 0, now
        if not self._estimated:
            steady, since = c.steady_steps(), now - c.first[0]
            if (steady >= ESTIMATE_AFTER_STEPS and since >= ESTIMATE_AFTER_SECONDS) or (
                steady >= 1 and since >= ESTIMATE_LATEST_SECONDS
            ):
                with self._lock:
                    self.estimate(now)

    def _start_heartbeat(self, c: EpochClock) -> None:
        """Without a bar: a thread prints the progress line FIRST_HEARTBEAT_SECONDS after the epoch starts, then every
        HEARTBEAT_SECONDS, whether or not a step ended in between (a step of a minute, the first step's warm-up or a
        slow first batch still get a line); end_epoch stops it. A thread, not a check after each step: a check after
        the step that crosses 10 s prints at 10 s + a step, 17 s with a 7 s step (benchmarks/HISTORY.md,
        "A user's own photos through the CLI ... loaded machine")."""
        self._stop = threading.Event()
        self._every(self._stop, c.t_start, FIRST_HEARTBEAT_SECONDS, self.progress_line)

    @contextmanager
    def phase(self, what: str, on: bool = True):
        """Work outside the training steps (an evaluation: 400 300x300 images took 18.5 s on the 2-core CPU with no
        line): while it lasts, `what: elapsed ...` every HEARTBEAT_SECONDS from a thread, stopped when it ends."""
        if not on:
            yield
            return
        t0, stop = time.monotonic(), threading.Event()
        self._every(stop, t0, HEARTBEAT_SECONDS, lambda now: f"{what}: elapsed {clock(now - t0)}")
        try:
            yield
        finally:
            stop.set()

    def _every(self, stop: threading.Event, t0: float, first: float, line: Callable[[float], str]) -> None:
        """A thread that prints line(now) at t0 + first, then every HEARTBEAT_SECONDS, until `stop` is set (checked
        under the lock the training thread clears the clock under, so no line follows the end)."""

        def beat() -> None:
            due = t0 + first
            while not stop.wait(max(due - time.monotonic(), 0.0)):
                with self._lock:
                    if stop.is_set():
                        return
                    self.say(line(time.monotonic()))
                due += HEARTBEAT_SECONDS

        threading.Thread(target=beat, name="torchsprint-heartbeat", daemon=True).start()

    def _stop_heartbeat(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def rate_text(self, now: float) -> str:
        """'31.2 img/s  ETA 0:04:10' for the bar (the ETA of the epoch, from the first step on)."""
        c, r = self.clock, self.clock.rates(now)
        return "" if r is None else (f"{r[1]:.1f} img/s  " if r[1] else "") + f"ETA {clock(c.eta(now))}"

    def progress_line(self, now: float) -> str:
        """The heartbeat: steps done of the epoch, images/s, time elapsed and the epoch's ETA."""
        c = self.clock
        r = c.rates(now)
        rate = "" if r is None else (f"{r[1]:.1f} img/s, " if r[1] else f"{r[0]:.2f} steps/s, ")
        note = (
            " (the first step is under way: the first batch, allocation, warm-up)"
            if c.first is None
            else " (rough: from the first step, its warm-up included)"
            if c.steady_steps() == 0
            else ""
        )
        return (
            f"epoch {self._epoch + 1}/{self._epochs}: step {c.done}/{c.total} ({c.done / max(c.total, 1):.0%}), "
            f"{rate}elapsed {clock(now - c.t_start)}, ETA {clock(c.eta(now))}{note}"
        )

    def projection(self, now: float) -> dict:
        """The estimated seconds of this epoch (the time so far and what is left of it), of the evaluations and of the
        whole run (this epoch, the later ones at the measured step rate, the evaluations), from the rates so far.

        Evaluations are estimated before any has run: a validation image at a third of a training image's time
        (a forward pass without the backward pass and the update, which take about twice the forward's time)."""
        c, plan = self.clock, self._plan
        steps_s, images_s = c.rates(now)
        epoch_s = (now - c.t_start) + c.eta(now)
        spe = plan.get("steps_per_epoch", c.total)
        later = max(plan.get("epochs", self._epochs) - self._epoch - 1, 0) * spe  # steps of the later epochs
        if plan.get("max_steps") is not None:
            later = max(min(later, plan["max_steps"] - self._epoch * spe - c.total), 0)
        eval_s = plan.get("evaluations", 0) * plan.get("val_images", 0) / images_s / 3 if images_s else 0.0
        return {
            "epoch_s": epoch_s,
            "eval_s": eval_s,
            "run_s": epoch_s + later / steps_s + eval_s,
            "steps_s": steps_s,
            "images_s": images_s,
            "spe": spe,
            "epochs": plan.get("epochs", self._epochs) - self._epoch,
        }

    def estimate(self, now: float) -> None:
        """Print, once, the estimated time of this epoch and of the run (see projection), with advice when the run is
        estimated over LONG_RUN_SECONDS (or where run.max_time stops it)."""
        self._estimated = True
        p, plan = self.projection(now), self._plan
        evals = (
            f" + {plan['evaluations']} evaluation(s) of {plan['val_images']:,} images ~{clock(p['eval_s'])}"
            if plan.get("evaluations") and plan.get("val_images")
            else ""
        )
        rate = f"{p['images_s']:.1f} img/s" if p["images_s"] else f"{p['steps_s']:.2f} steps/s"
        self.say(
            f"estimate: epoch {self._epoch + 1} takes ~{clock(p['epoch_s'])} ({self.clock.total} steps at {rate}); "
            f"the run ~{clock(p['run_s'])} ({p['epochs']} epoch(s) x {p['spe']} steps{evals}), measured over "
            f"{self.clock.steady_steps()} steps after the first"
        )
        if plan.get("max_time") is not None and p["run_s"] > plan["max_time"]:
            self.say(
                f"  run.max_time={clock(plan['max_time'])} stops it before then (resumable: checkpoint.resume=auto)"
            )
        elif p["run_s"] > LONG_RUN_SECONDS:
            self.say(
                f"  over {LONG_RUN_SECONDS // 60:.0f} min; to shorten it: "
                + "; ".join(self.advice(plan, p["epoch_s"] + p["eval_s"] / max(p["epochs"], 1)))
            )

    @staticmethod
    def advice(plan: dict, epoch_s: float) -> list[str]:
        """Concrete ways to shorten a long run: the image size, the memory backend, a GPU, fewer epochs."""
        import torch

        out = []
        shape = plan.get("batch_shape")
        if shape and max(shape[-2:]) > 64:
            h, w = shape[-2:]
            out.append(
                f"a smaller image size (the batches are {w}x{h}: a smaller size in data.train.transforms and "
                f"data.eval.transforms, e.g. {max(h, w) // 2}; the time per image falls about with the pixels)"
            )
        if plan.get("backend") not in (None, "memory") and plan.get("backend_config") != "auto":
            out.append(
                "data.backend=memory (decodes the images once, not every epoch; data.backend=auto measures "
                "whether that pays off here)"
            )
        if plan.get("device", "cpu").startswith("cpu"):
            out.append("a GPU (run.device=cuda" + ("" if torch.cuda.is_available() else "; none is visible here") + ")")
        fit = int(LONG_RUN_SECONDS // max(epoch_s, 1e-9))
        if 1 <= fit < plan.get("epochs", 0):
            out.append(
                f"fewer epochs: run.epochs={fit} (~{clock(fit * epoch_s)}), or run.max_time=30m to stop after 30 "
                "minutes with a checkpoint to resume from"
            )
        return out

    def step_stats(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=self._pending, stats=text)
            self._pending = 0
        else:
            self.say(text)

    def end_epoch(self) -> None:
        self._stop_heartbeat()
        if self.progress is not None:
            self.progress.update(self.task, advance=self._pending)
            self._pending = 0
            self.progress.stop()
            self.progress = None
        c = self.clock
        if c is not None and not self._estimated and c.steady_steps() >= 1:
            # An epoch shorter than the estimate's wait: estimated at its end when the run is long or it took a while.
            now = time.monotonic()
            if now - c.first[0] >= ESTIMATE_AFTER_SECONDS or self.projection(now)["run_s"] > LONG_RUN_SECONDS:
                self.estimate(now)
        with self._lock:
            self.clock = None

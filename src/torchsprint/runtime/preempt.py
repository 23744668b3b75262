"""Stopping a run early at a step boundary, with a checkpoint: stop signals (preemption), run.max_time,
run.stop_after_steps; and SLURM's requeue after a signal stop.

A stop signal's handler only sets a flag (it never raises), so the step in progress and the checkpoint write
that follows it cannot be cut short by it, nor by a second signal during the save: the previous handlers come
back only once the run's files are written, and a process that exits 75 next (the CLI: `hold`) keeps ignoring them
until it is gone (a scheduler's repeated TERM, a second ^C). Under DDP the signal may reach one rank only (or the ranks
see max_time pass at different steps): each rank votes with every batch through AgreedLoader's per-batch
agreement (runtime/collectives.py), which the run pays anyway, so every rank stops after the same step at no extra
cost; in one process the flag is read directly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

from torchsprint.errors import UsageError

# The exit status of a run stopped by a stop signal (its checkpoint saved): EX_TEMPFAIL of sysexits.h, "try
# again later", which SLURM and Kubernetes users script as "requeue/retry"; distinct from 0 (done, also after
# max_time, stop_after_steps or early_stop), 1 (failure), 2 (usage error) and 128+N (killed by signal N).
EXIT_PREEMPTED = 75

# Votes, the smallest over the ranks wins (collectives.AgreedLoader agrees the minimum; 0 there: out of data).
SIGNAL, MAX_TIME, GO = 1, 2, 3

UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(value) -> float:
    """Seconds in a duration: a number of seconds (90, 5400.5) or text like '45m', '2h30m', '90s', '1h2m3s'.

    Raises ValueError naming the accepted forms for anything else, and for 0 or less.
    """
    if isinstance(value, bool):
        raise ValueError("must be a duration such as 45m, 2h30m, 90s or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        m = _DURATION.match(text)
        if text and re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        elif text and m:
            h, mins, s = (float(g) if g else 0.0 for g in m.groups())
            seconds = 3600 * h + 60 * mins + s
        else:
            raise ValueError(f"cannot read {value!r} as a duration: write e.g. 45m, 2h30m, 90s or a number of seconds")
    if seconds <= 0:
        raise ValueError("must be more than 0 (e.g. 45m, 2h30m, 90s), or null for no time limit")
    return seconds


def signal_name(name: str) -> str:
    """The canonical name of a stop signal ('term', 'SIGTERM' -> 'SIGTERM'); ValueError for unknown or uncatchable
    ones."""
    canon = str(name).strip().upper()
    canon = canon if canon.startswith("SIG") else "SIG" + canon
    known = sorted(s.name for s in signal.Signals if not s.name.startswith("SIGRT") and s.name not in UNCATCHABLE)
    if canon in UNCATCHABLE:
        raise ValueError(f"{canon} cannot be caught by a process; use e.g. SIGTERM, SIGUSR1 or SIGINT")
    if canon not in known:
        from torchsprint.errors import did_you_mean

        raise ValueError(
            f"unknown signal {name!r}.{did_you_mean(canon, known)} Use names like SIGTERM, SIGUSR1, SIGINT"
        )
    return canon


def check_requeue(run_cfg, resume: str | None, env: dict | None = None) -> None:
    """Refuse run.requeue where it cannot work: outside a SLURM job, or without a fixed run.dir and
    checkpoint.resume=auto (the requeued job runs the same command, which must find and continue this run)."""
    if not run_cfg.requeue:
        return
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        raise UsageError(
            "run.requeue=true requeues the SLURM job, but this is not a SLURM job (no SLURM_JOB_ID): "
            "set run.requeue=false, or start the run with sbatch (docs/cluster.md)."
        )
    if not run_cfg.stop_signals:
        raise UsageError(
            "run.requeue=true requeues after a stop signal, but run.stop_signals is empty: list the "
            "signal SLURM sends (e.g. run.stop_signals=[SIGUSR1, SIGTERM] with #SBATCH --signal=B:USR1@120)."
        )
    if not run_cfg.dir or resume != "auto":
        raise UsageError(
            "run.requeue=true: the requeued job runs the same command, so it needs a fixed run.dir and "
            "checkpoint.resume=auto to continue this run, e.g. run.dir=/shared/runs/x-$SLURM_JOB_ID "
            "checkpoint.resume=auto."
        )


class Stopper:
    """Whether the run stops after the step just done, and why: run.stop_after_steps (a pause at a step count of
    this invocation), run.max_time (a wall-clock budget of this invocation, counted from `t0`) or a stop signal.

    Args:
        run_cfg: the `run` section (stop_after_steps, max_time, stop_signals).
        start_step: the global step this invocation starts at (0, or the resumed checkpoint's).
        t0: time.monotonic() when the invocation started.
        hold: after a stop signal paused the run, leave the stop signals ignored on exit instead of restoring the
            previous handlers: for a process that exits 75 next (the CLI). Restored, the default action of a second
            signal (143 for SIGTERM, KeyboardInterrupt's 130 for SIGINT) would kill it while it closes its files
            and tears down, after the checkpoint was saved. SIG_IGN also survives interpreter shutdown, which puts
            SIG_DFL back for signals that have a Python handler.
    """

    def __init__(self, run_cfg, start_step: int = 0, t0: float | None = None, hold: bool = False):
        self.pause_at = None if run_cfg.stop_after_steps is None else start_step + run_cfg.stop_after_steps
        t0 = time.monotonic() if t0 is None else t0
        self.deadline = None if run_cfg.max_time is None else t0 + parse_duration(run_cfg.max_time)
        self.signals = [signal.Signals[signal_name(n)] for n in run_cfg.stop_signals]
        self.got: signal.Signals | None = None  # the first stop signal this process received
        self.reason: str | None = None  # stop_after_steps | max_time | signal, once decided
        self.loader = None
        self.hold = hold
        self._previous: dict = {}

    def attach(self, loader) -> None:
        """Vote through `loader`'s per-batch agreement when it has one (collectives.AgreedLoader, under DDP)."""
        if hasattr(loader, "vote"):
            loader.vote = self.vote
            self.loader = loader

    def vote(self) -> int:
        """This process's wish: SIGNAL, MAX_TIME or GO (a cheap local check: a flag and a clock read)."""
        if self.got is not None:
            return SIGNAL
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return MAX_TIME
        return GO

    def after_step(self, global_step: int) -> bool:
        """Whether to stop now, after optimizer step `global_step` (the same answer on every rank); sets `reason`."""
        if self.pause_at is not None and global_step >= self.pause_at:
            self.reason = "stop_after_steps"
        else:
            v = self.vote() if self.loader is None else self.loader.agreed
            self.reason = {SIGNAL: "signal", MAX_TIME: "max_time"}.get(v)
        return self.reason is not None

    # -- signal handlers
    def _on_signal(self, signum, frame) -> None:
        # Only a flag: no printing (not reentrant-safe), no exception (it would cut the step or the save short).
        if self.got is None:
            self.got = signal.Signals(signum)

    def __enter__(self):
        if self.signals and threading.current_thread() is threading.main_thread():  # Python handles signals there only
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        paused_by_signal = self.got is not None or self.reason == "signal"  # (reason: another rank got it)
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.hold and paused_by_signal else handler)
        self._previous = {}


# Set by launch.py for its torchrun workers when the agent may restart them (--max-restarts): the launcher's pid.
LAUNCHER_ENV = "TORCHSPRINT_LAUNCHER_PID"


def stop_launcher(stop: Stopper, rt, env: dict | None = None) -> bool:
    """After a pause by a stop signal under `train --nproc-per-node N --max-restarts K`: tell torchrun's elastic agent
    (this worker's parent, the launcher process) to stop, by sending it a stop signal from local rank 0.

    The agent restarts the worker group on any non-zero exit, 75 included, so a SIGTERM that reached one worker
    would restart the group, which resumes and trains on to exit 0 instead of pausing. Its stop-signal handler
    (launch.py lists run.stop_signals among TORCHELASTIC_SIGNALS_TO_HANDLE) stops the workers and the launcher
    exits 75. Called before teardown's barrier, so every local rank 0 has told its agent before any worker exits
    (an agent that saw an exit first would already be restarting). Returns whether it sent the signal.
    """
    env = os.environ if env is None else env
    launcher = env.get(LAUNCHER_ENV, "")
    if stop.reason != "signal" or rt.local_rank != 0 or not launcher.isdigit() or int(launcher) != os.getppid():
        return False
    os.kill(int(launcher), stop.got or stop.signals[0])
    return True


def requeue(job_id: str, log) -> bool:
    """`scontrol requeue JOB_ID` (run.requeue after a signal stop); logs and returns whether it worked."""
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log(f"[yellow]run.requeue: `scontrol requeue {job_id}` failed[/] ({e}); resubmit the job to continue")
        return False
    if out.returncode != 0:
        log(
            f"[yellow]run.requeue: `scontrol requeue {job_id}` failed[/] (exit {out.returncode}: "
            f"{(out.stderr or out.stdout).strip()[:200]}); resubmit the job to continue"
        )
        return False
    log(f"run.requeue: SLURM job {job_id} requeued; it continues from the checkpoint with the same command")
    return True

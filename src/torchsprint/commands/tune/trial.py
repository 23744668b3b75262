"""One trial of `torchsprint tune`: a normal `torchsprint train` run in its own folder (a child process, so that a
trial's memory, threads and a crash stay its own), watched while it trains for the pruner, and checked after it:
each setting the search asked for must be what the run's config.yaml says it ran with.

The pruner compares trials at the same elapsed time (with --trial-time: at each tenth of the trial's time, the
latest evaluation's value by then; without: at each epoch). A pruned trial is stopped with SIGTERM, which a run
obeys at the next step boundary with a resumable checkpoint (runtime/preempt.py): its folder stays a valid run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torchsprint.errors import UsageError

BUCKETS = 10  # with --trial-time, the pruner's steps: tenths of the trial's time
POLL_S = 0.5  # how often the trial's metrics.jsonl is read while it runs


@dataclass
class TrialSpec:
    """What one trial runs: its number, the settings the search chose (`params`, by dimension) and the overrides they
    became, its run folder, and how the study runs every trial."""

    number: int
    params: dict
    overrides: list[str]
    run_dir: Path
    metrics: list[str]  # what the trial is scored by (the first: the monitored one)
    trial_time_s: float | None
    config: str | None  # the study's base config file
    base: list[str]  # the study's own overrides (the user's), before the trial's
    env: dict = field(default_factory=dict)  # the child's environment additions (threads, CPU affinity)
    cpus: list[int] | None = None  # the CPUs this trial may use (--workers splits them)
    imports: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None


@dataclass
class TrialResult:
    """What a trial gave: `values` (one per metric; None where it has none, e.g. a failed run), whether it was
    pruned, its wall time, the run's summary figures, and an `error` line when it failed."""

    values: list[float | None]
    pruned: bool = False
    seconds: float = 0.0
    images_per_s: float | None = None
    fitted_steps: int | None = None
    steps: int | None = None
    error: str | None = None
    code: int | None = None  # the child's exit code (2: train refused the config)
    reports: list[tuple[int, float]] = field(default_factory=list)


def train_command(spec: TrialSpec) -> list[str]:
    """The `torchsprint train` command line of a trial."""
    cmd = [sys.executable, "-m", "torchsprint", "train"]
    if spec.config:
        cmd += ["-c", spec.config]
    for m in spec.imports:
        cmd += ["--import", m]
    if spec.nproc_per_node:
        cmd += ["--nproc-per-node", str(spec.nproc_per_node)]
    cmd += [*spec.base, *spec.overrides, f"run.dir={spec.run_dir}", f"checkpoint.monitor={spec.metrics[0]}"]
    if spec.trial_time_s is not None:
        cmd.append(f"run.train_time={spec.trial_time_s:g}")
    return cmd


def eval_rows(path: Path, seen: int) -> tuple[list[dict], int]:
    """The evaluation rows of a metrics.jsonl past byte `seen` (whole lines only), and the new position."""
    try:
        with open(path, "rb") as f:
            f.seek(seen)
            data = f.read()
    except FileNotFoundError:
        return [], seen
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "eval":
            rows.append(row)
    return rows, seen + end


def run_trial(spec: TrialSpec, report: Callable[[float, int], bool], log: Callable[[str], None]) -> TrialResult:
    """Run `spec` as a child `torchsprint train`, calling `report(value, step)` with the monitored metric at each
    pruner step (it returns True: prune now), and return what the run gave."""
    spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = spec.run_dir.parent / f"{spec.run_dir.name}.log"
    env = {**os.environ, **spec.env}
    preexec = (lambda: os.sched_setaffinity(0, spec.cpus)) if spec.cpus and hasattr(os, "sched_setaffinity") else None
    t0, wall0 = time.monotonic(), time.time()
    reported: set[int] = set()
    reports: list[tuple[int, float]] = []
    pruned = False
    seen = 0
    latest: float | None = None
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(train_command(spec), stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
        try:
            while True:
                done = proc.poll() is not None
                rows, seen = eval_rows(spec.run_dir / "metrics.jsonl", seen)
                for row in rows:
                    v = row.get(spec.metrics[0])
                    if not isinstance(v, int | float) or not math.isfinite(v):
                        continue
                    latest = float(v)
                    if spec.trial_time_s is None:  # the pruner's step: the epoch
                        step = int(row.get("epoch", 0))
                        if step not in reported and not pruned:
                            reported.add(step)
                            reports.append((step, latest))
                            pruned = report(latest, step)
                if spec.trial_time_s is not None and latest is not None and not pruned:
                    # the latest value at each tenth of the trial's time passed (steps 1..BUCKETS)
                    bucket = min(BUCKETS, int((time.time() - wall0) / spec.trial_time_s * BUCKETS))
                    for step in range(1, bucket + 1):
                        if step not in reported:
                            reported.add(step)
                            reports.append((step, latest))
                            pruned = report(latest, step) or pruned
                if pruned and not done:
                    proc.send_signal(signal.SIGTERM)  # a pause at the next step, with a checkpoint (exit 75)
                    proc.wait()
                    break
                if done:
                    break
                time.sleep(POLL_S)
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    seconds = time.monotonic() - t0
    return read_result(spec, proc.returncode, pruned, seconds, reports, log_path)


def read_result(spec: TrialSpec, code: int, pruned: bool, seconds: float, reports, log_path: Path) -> TrialResult:
    """A finished child's TrialResult: its summary.json's figures, or the last line of its log as the error."""
    summary_path = spec.run_dir / "summary.json"
    if pruned:
        return TrialResult([None] * len(spec.metrics), pruned=True, seconds=seconds, reports=reports)
    if code != 0 or not summary_path.is_file():
        lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1].strip() if lines else f"exit code {code}"
        return TrialResult([None] * len(spec.metrics), seconds=seconds, error=f"{last} (log: {log_path})", code=code)
    summary = json.loads(summary_path.read_text())
    values = [metric_value(m, summary, spec.run_dir) for m in spec.metrics]
    fitted = (summary.get("train_time") or {}).get("fitted_steps")
    return TrialResult(
        values,
        seconds=seconds,
        images_per_s=summary.get("train_images_per_s"),
        fitted_steps=fitted,
        steps=summary.get("global_step"),
        reports=reports,
    )


def metric_value(metric: str, summary: dict, run_dir: Path) -> float | None:
    """A finished run's value of `metric`: the monitored one's best (summary.json best_metric, the trial's
    checkpoint.monitor is the first metric), train_images_per_s from the summary, any other at the best step's
    evaluation (metrics.jsonl)."""
    if metric == "train_images_per_s":
        return summary.get("train_images_per_s")
    best_step = None
    for art in (summary.get("artifacts") or {}).values():
        if art.get("weights") == "best":
            best_step = art.get("step")
    rows, _ = eval_rows(run_dir / "metrics.jsonl", 0)
    at_best = [r for r in rows if r.get("step") == best_step and metric in r]
    if at_best:
        return float(at_best[-1][metric])
    return summary.get("best_metric") if rows and metric in rows[-1] else None


def check_applied(spec: TrialSpec, expected: dict) -> None:
    """Refuse a trial whose run did not run with what the search asked: each key of `expected` (a dotted config key ->
    the value the trial's overrides give it, validated) against the run's config.yaml."""
    import yaml

    path = spec.run_dir / "config.yaml"
    if not path.is_file():
        return  # the run never started (its error is the trial's)
    ran = yaml.safe_load(path.read_text())
    for key, want in expected.items():
        node = ran
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != want:
            raise UsageError(
                f"trial {spec.number}: {key} was asked to be {json.dumps(want)} but the run ran with "
                f"{json.dumps(node)} ({path}): a setting that did not apply is not a data point; fix the config "
                "(or the space) so that the setting is honoured"
            )

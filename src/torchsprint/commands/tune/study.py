"""`torchsprint tune`'s search: an Optuna study (TPE or random sampling, a median or successive-halving pruner) whose
trials are normal training runs (commands/tune/trial.py), stored where the study can be resumed and joined.

Why Optuna and what is hand-written: the sampler, the pruners and the storages (a journal file in the study's
folder; an RDB or Redis URL that several machines share) are Optuna's. What torchsprint adds is what makes trials
comparable and the study trustworthy: every trial trains for the same wall-clock time (run.train_time, the schedule
fitted to it), the pruner compares trials at the same elapsed time, each setting is checked to have applied, and
trial n is sampled with a seed from (seed, n) (n: the trials that did not fail before it: PerTrialSeed), so a
killed and resumed study asks for what an uninterrupted one would (the killed trial is run again with its settings,
counted once) and processes joined to one study draw different settings.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna  # the tune command's own module: `torchsprint --help` imports commands/tune/args.py only

from torchsprint.commands.tune.space import Dimension, overrides_of
from torchsprint.commands.tune.trial import TrialResult, TrialSpec, check_applied, run_trial
from torchsprint.errors import UsageError

JOURNAL = "study.journal"
MAX_FAILED_IN_A_ROW = 3  # trials failing one after another: the search stops (a broken config, not bad luck)
HOST = socket.gethostname()


@dataclass
class Study:
    """What every trial of one study shares: the base config every trial starts from (the user's, resolved, written to
    the study's folder), the space, the metrics and their directions, and how trials run."""

    out: Path
    base_config: Path
    base: dict  # base.yaml's content (the resolved config)
    dims: list[Dimension]
    metrics: list[str]
    directions: list[str]  # "maximize" | "minimize", one per metric
    trial_time_s: float | None
    seed: int
    sampler: str
    pruner: str
    imports: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None


def check_folder(out: Path, resume: bool) -> Path:
    """The journal file of the study in `out` (no --storage): a folder holding one needs --resume; --resume, one."""
    path = out / JOURNAL
    if path.exists() and not resume:
        raise UsageError(f"--out {out} holds a study ({path}): add --resume to continue it, or choose another --out.")
    if resume and not path.exists():
        raise UsageError(f"--resume: --out {out} holds no study ({JOURNAL} missing); start one without --resume.")
    return path


def open_storage(url: str | None, out: Path, resume: bool):
    """The study's Optuna storage: `url` (sqlite:///, postgresql://, mysql:// for RDBStorage; redis:// for the Redis
    journal; a path for a journal file), or the journal file in `out`. Without a URL a study folder is started once:
    continuing it takes --resume."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if url is None:
        path = check_folder(out, resume)
        out.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    if url.startswith(("sqlite://", "postgresql://", "postgres://", "mysql://")):
        return optuna.storages.RDBStorage(url)
    if url.startswith(("redis://", "rediss://")):
        from optuna.storages.journal import JournalRedisBackend

        return JournalStorage(JournalRedisBackend(url))
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(url))  # a journal file that processes on this machine (or NFS) share


def make_sampler(kind: str, seed: int, n: int):
    """The sampler of trial n: seeded from (seed, n), so that the n-th trial's draw depends on the history only. Not
    seed + n: studies of seeds 0 and 1 would then draw the same trials one apart (measured: BENCHMARKS.md, "torchsprint
    tune against the defaults")."""
    import numpy as np

    trial_seed = int(np.random.SeedSequence([seed, n]).generate_state(1)[0])
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=trial_seed)
    return optuna.samplers.TPESampler(seed=trial_seed, multivariate=True, n_startup_trials=5)


def rank_of(study, number: int) -> int:
    """A trial's rank: the trials before it (by number) that count, i.e. did not fail. Unique per trial even when
    several processes ask at once (each sees the others' earlier trials, none of the later ones), and the same after
    a kill and --resume as in an uninterrupted study (the killed trial failed; its rerun takes its rank)."""
    from optuna.trial import TrialState

    return sum(1 for t in study.get_trials(deepcopy=False) if t.number < number and t.state != TrialState.FAIL)


class PerTrialSeed(optuna.samplers.BaseSampler):
    """An Optuna sampler that samples trial n with make_sampler(kind, seed, rank of n): hand-written because Optuna
    seeds a sampler once per process, so two processes joined to one study (same seed, same history) would draw the
    same settings, and a resumed study would draw other settings than an uninterrupted one."""

    def __init__(self, kind: str, seed: int):
        self.kind, self.seed = kind, seed
        self.inner: dict[int, optuna.samplers.BaseSampler] = {}  # by trial number, while the trial is asked and runs
        self.lock = threading.Lock()

    def of(self, study, trial):
        with self.lock:
            if trial.number not in self.inner:
                self.inner[trial.number] = make_sampler(self.kind, self.seed, rank_of(study, trial.number))
            return self.inner[trial.number]

    def infer_relative_search_space(self, study, trial):
        return self.of(study, trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.of(study, trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.of(study, trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
        self.of(study, trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
        self.of(study, trial).after_trial(study, trial, state, values)
        with self.lock:
            self.inner.pop(trial.number, None)

    def reseed_rng(self):
        pass  # seeded per trial


def make_pruner(kind: str, several: bool):
    """The study's pruner: none for several objectives (Optuna prunes single-objective studies only)."""
    import optuna

    if several or kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    # After 3 finished trials, a trial whose value at step s is below the median of the others' at s stops; not
    # before its second report (the first tenth of a trial is mostly warm-up).
    return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_stale(study, log) -> int:
    """Trials left RUNNING by a tune of this machine that is gone (killed): failed in the storage, their settings queued
    again, so the study runs each of them once more and counts it once. Returns how many."""
    from optuna.trial import TrialState

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") != HOST or pid_alive(int(t.user_attrs.get("pid", -1))):
            continue  # another machine's, or a live process's
        study._storage.set_trial_user_attr(t._trial_id, "error", "interrupted (its tune was stopped); run again")
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"rerun_of": t.number})
        n += 1
    if n:
        log(f"tune: {n} interrupted trial(s) of this machine run again with the same settings")
    return n


def counted(study) -> int:
    """Trials that count: finished (complete or pruned) or running; failed ones do not."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))


def expected_values(study_def: Study, overrides: list[str]) -> dict:
    """The dotted keys a trial's overrides set, with the values the schema makes of them (what config.yaml must say)."""
    from torchsprint import config

    cfg = config.load(study_def.base_config, overrides, imports=study_def.imports)
    data = config.to_dict(cfg)
    out = {}
    for item in overrides:
        key = item.split("=", 1)[0]
        node = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


class Search:
    """Runs trials of `study_def` in `study` until `trials` count or the `deadline` (time.monotonic) leaves no room
    for another; `workers` side by side (threads, each trial a child process on its share of the CPUs)."""

    def __init__(
        self,
        study,
        study_def: Study,
        *,
        trials: int | None,
        deadline: float | None,
        workers: int,
        log,
        runner=run_trial,
    ):
        self.study, self.d, self.trials, self.deadline, self.workers = study, study_def, trials, deadline, workers
        self.log, self.runner = log, runner
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.durations: list[float] = []
        self.failed_in_a_row = 0
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        share = max(1, len(cpus) // workers)
        self.cpu_sets = [cpus[i * share : (i + 1) * share] or cpus for i in range(workers)]

    def room(self) -> bool:
        """Whether another trial may start: the trial count not reached, the time left for one more."""
        if self.error is not None:
            return False
        if self.trials is not None and counted(self.study) >= self.trials:
            return False
        if self.deadline is not None:
            need = self.d.trial_time_s or 0.0
            if self.durations:
                need = max(need, sum(self.durations) / len(self.durations))
            if time.monotonic() + need > self.deadline:
                return False
        return True

    def run(self) -> None:
        threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error

    def worker(self, i: int) -> None:
        try:
            while True:
                with self.lock:
                    if not self.room():
                        return
                    trial = self.ask()
                if trial is None:
                    return
                self.one(trial, i)
        except BaseException as e:  # noqa: BLE001 - the first error ends the search, raised by run()
            with self.lock:
                self.error = self.error or e

    def ask(self):
        """The next trial (sampled with a seed from (tune.seed, its rank)), or None where another process joined to
        the study took the last of --trials between room() and the ask (told FAIL with `skipped`, left out of the
        tables and the count)."""
        from optuna.trial import TrialState

        d = self.d
        if not isinstance(self.study.sampler, PerTrialSeed):
            self.study.sampler = PerTrialSeed(d.sampler, d.seed)
        trial = self.study.ask()
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        if self.trials is not None and rank_of(self.study, trial.number) >= self.trials:
            trial.set_user_attr("skipped", "the study's trials were all taken (another process asked first)")
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        for dim in d.dims:
            dim.suggest(trial)
        return trial

    def one(self, trial, worker: int) -> None:
        """Run one trial and tell the study what it gave."""
        from optuna.trial import TrialState

        d = self.d
        params = {dim.key: trial.params[dim.key] for dim in d.dims}
        overrides = overrides_of(params, BaseView(d.base))
        run_dir = d.out / "trials" / f"{trial.number:04d}"
        trial.set_user_attr("run_dir", str(run_dir))
        threads = len(self.cpu_sets[worker])
        spec = TrialSpec(
            trial.number,
            params,
            overrides,
            run_dir,
            d.metrics,
            d.trial_time_s,
            str(d.base_config),
            [],
            env={"OMP_NUM_THREADS": str(threads)} if self.workers > 1 else {},
            cpus=self.cpu_sets[worker] if self.workers > 1 else None,
            imports=d.imports,
            nproc_per_node=d.nproc_per_node,
        )
        shown = ", ".join(f"{k}={fmt(v)}" for k, v in params.items())
        self.log(f"trial {trial.number}: {shown}")
        several = len(d.metrics) > 1

        def report(value: float, step: int) -> bool:
            if several:
                return False
            trial.report(value, step)
            return trial.should_prune()

        result: TrialResult = self.runner(spec, report, self.log)
        self.durations.append(result.seconds)
        for k, v in {
            "seconds": result.seconds,
            "images_per_s": result.images_per_s,
            "fitted_steps": result.fitted_steps,
            "steps": result.steps,
        }.items():
            trial.set_user_attr(k, v)
        if result.error:
            trial.set_user_attr("error", result.error)
            self.study.tell(trial, state=TrialState.FAIL)
            self.log(f"trial {trial.number}: failed: {result.error}")
            if result.code == 2:  # train refused the config: every later trial would be refused as well
                raise UsageError(f"trial {trial.number} was refused by train: {result.error}")
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                raise RuntimeError(
                    f"tune: {self.failed_in_a_row} trials failed in a row, the last: {result.error}; the search stops"
                )
            return
        self.failed_in_a_row = 0
        try:
            check_applied(spec, expected_values(d, overrides))
        except UsageError:
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        if result.pruned:
            self.study.tell(trial, state=TrialState.PRUNED)
            last = f" at {fmt(result.reports[-1][1])}" if result.reports else ""
            self.log(f"trial {trial.number}: pruned{last} ({result.seconds:.0f} s)")
            return
        if any(v is None for v in result.values):
            trial.set_user_attr("error", f"no value of {d.metrics} in {run_dir}")
            self.study.tell(trial, state=TrialState.FAIL)
            return
        self.study.tell(trial, result.values)
        vals = ", ".join(f"{m} {fmt(v)}" for m, v in zip(d.metrics, result.values))
        self.log(f"trial {trial.number}: {vals} ({result.seconds:.0f} s)")


class BaseView:
    """The base config's data.train/eval.transforms as overrides_of reads them (cfg.data.train.transforms)."""

    def __init__(self, base: dict):
        from types import SimpleNamespace

        data = base.get("data", {})
        self.data = SimpleNamespace(
            train=SimpleNamespace(transforms=data.get("train", {}).get("transforms", [])),
            eval=SimpleNamespace(transforms=data.get("eval", {}).get("transforms", [])),
        )


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v)

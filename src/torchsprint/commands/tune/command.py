"""`torchsprint tune`: search the settings of a config (or of `data.root` alone) on the user's data, every trial a
normal run folder under --out, at equal cost per trial with --trial-time; resumable (--resume) and shared between
processes and machines (--storage). docs/tune.md."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from torchsprint.commands.tune.report import best_trial, plot_search, rows_of, write_best, write_tables
from torchsprint.commands.tune.space import (
    Dimension,
    auto_space,
    baseline_params,
    imbalance,
    overrides_of,
    user_space,
)
from torchsprint.commands.tune.study import BaseView, Search, Study, check_folder, open_storage, recover_stale
from torchsprint.errors import UsageError
from torchsprint.observe.logging import replace_file

DEFAULT_TRIALS = 20  # neither --trials nor --budget


def direction_of(metric: str, cfg) -> str:
    """maximize or minimize: the run's checkpoint.mode for its monitor; losses and errors down, the rest up."""
    if metric == cfg.checkpoint.monitor:
        return "maximize" if cfg.checkpoint.mode == "max" else "minimize"
    if metric == "train_images_per_s":
        return "maximize"
    return "minimize" if metric.split("/")[-1] in ("loss", "error", "mae", "mse") else "maximize"


def objectives(cfg, counts: list[int] | None = None) -> tuple[list[str], list[str]]:
    """What the study scores trials by and each metric's direction: tune.metric; else checkpoint.monitor where the
    config sets it; else the monitor a default run of these training classes (`counts`) would pick: balanced accuracy
    from the imbalance at which data.sampler=auto counters it (train/imbalance.py), checkpoint.monitor's default
    below. Several metrics with an explicit pruner are refused (Optuna prunes single-objective studies only)."""
    from torchsprint.data.core import AUTO_SAMPLER_RATIO
    from torchsprint.train.imbalance import MONITOR

    monitor = cfg.checkpoint.monitor
    if not cfg.set_by_user("checkpoint.monitor") and imbalance(counts) >= AUTO_SAMPLER_RATIO:
        monitor = MONITOR
    metrics = cfg.tune.metric if isinstance(cfg.tune.metric, list) else [cfg.tune.metric or monitor]
    if len(metrics) > 1 and cfg.tune.pruner != "none" and "pruner" in cfg.tune.model_fields_set:
        raise UsageError(
            "tune.pruner: Optuna prunes single-objective studies only; with several tune.metric set tune.pruner=none"
        )
    return metrics, [direction_of(m, cfg) for m in metrics]


def data_facts(cfg) -> tuple[list[int] | None, int | None, int | None]:
    """The training classes' counts, the training set's size and the images' median short side (None where they do
    not apply): what the automatic space is chosen from. Lists the files (no decoding beyond a few headers)."""
    from torchsprint.data.build import _labels
    from torchsprint.data.core import DATASETS
    from torchsprint.data.detect import measure, sample_paths

    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    labels = _labels(splits.train)
    counts = None
    if labels is not None and len(splits.classes) > 1:
        import torch

        counts = torch.bincount(labels, minlength=len(splits.classes)).tolist()
    side = None
    if cfg.data.root is not None:
        sizes, _ = measure(sample_paths(cfg.data))
        if sizes:
            side = int(statistics.median_low([min(w, h) for w, h in sizes]))
    return counts, len(splits.train), side


def check_values(dims: list[Dimension], base_config: Path, base: dict, imports) -> None:
    """Every value a trial may take, validated by the schema before any trial runs (a choice each, a range its ends):
    a bad one is refused in one line naming the dimension."""
    from torchsprint import config

    view = BaseView(base)
    for d in dims:
        for v in d.values:
            overrides = overrides_of({d.key: v}, view)
            try:
                config.load(base_config, overrides, imports=imports)
            except UsageError as e:
                raise UsageError(f"tune.space.{d.key}={json.dumps(v)}: {e}") from None


def write_base(cfg, out: Path, trial_time: bool) -> tuple[Path, dict]:
    """base.yaml: the user's config resolved once (the defaults the data decided are fixed for every trial, so a
    trial changes only what it searches). With --trial-time, run.epochs is dropped unless the user set it (the
    time decides the length)."""
    from torchsprint import config

    data = config.to_dict(cfg)
    data.pop("tune", None)
    for k in ("dir", "train_time", "max_time"):
        data["run"][k] = None
    if trial_time and not cfg.set_by_user("run.epochs"):
        data["run"].pop("epochs", None)
    import yaml

    path = out / "base.yaml"
    replace_file(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path, data


def tune(args, log=print) -> dict:
    """Run (or resume, or join) a study; returns tune.json's content."""
    import optuna

    from torchsprint import config
    from torchsprint.train.resolve import resolve

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trial_time = duration("--trial-time", args.trial_time)
    budget = duration("--budget", args.budget)
    trials = args.trials if args.trials is not None else (None if budget is not None else DEFAULT_TRIALS)
    out = Path(args.out)
    if args.storage is None:
        check_folder(out, args.resume)  # before the data is read: a folder started already is refused at once
    cfg = resolve(config.load(args.config, list(args.overrides), imports=args.imports))
    facts = data_facts(cfg)
    metrics, directions = objectives(cfg, facts[0])
    dims = user_space(cfg.tune.space) if cfg.tune.space else auto_space(cfg, *facts)
    with tempfile.TemporaryDirectory() as tmp:  # checked before the study's folder is touched: a refusal leaves none
        base_config, base = write_base(cfg, Path(tmp), trial_time is not None)
        check_values(dims, base_config, base, args.imports)
    plan = [
        f"{trials} trials" if trials is not None else "trials",
        f"of {args.trial_time} each" if trial_time else "",
        f"within {args.budget}" if budget else "",
        f"{args.workers} at a time" if args.workers > 1 else "",
    ]
    if getattr(args, "dry_run", False):
        describe(dims, metrics, directions, log)
        log("tune: --dry-run: would run " + " ".join(p for p in plan if p) + f" in {out}; nothing run or written")
        return {"dry_run": True, "metrics": metrics, "space": [[x.key, x.kind, x.values] for x in dims]}
    storage = open_storage(args.storage, out, args.resume)
    out.mkdir(parents=True, exist_ok=True)
    base_config, base = write_base(cfg, out, trial_time is not None)
    from torchsprint.commands.tune.study import make_pruner

    study = optuna.create_study(
        storage=storage,
        study_name=args.study,
        directions=directions,
        pruner=make_pruner(cfg.tune.pruner, len(metrics) > 1),
        load_if_exists=True,
    )
    if same_study(study, dims, metrics, trial_time) and not study.trials:
        start = baseline_params(dims, cfg, facts[0])  # a new study: trial 0 is the config as it stands
        study.enqueue_trial(start, user_attrs={"baseline": True})
        shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in start.items())
        log(f"tune: trial 0 is the config as it stands ({shown}; the rest drawn)")
    recover_stale(study, log)
    d = Study(
        out,
        base_config,
        base,
        dims,
        metrics,
        directions,
        trial_time,
        cfg.tune.seed,
        cfg.tune.sampler,
        cfg.tune.pruner,
        list(args.imports),
        args.nproc_per_node,
    )
    describe(dims, metrics, directions, log)
    log("tune: " + " ".join(p for p in plan if p) + f"; trials in {out / 'trials'}")
    deadline = time.monotonic() + budget if budget is not None else None
    Search(study, d, trials=trials, deadline=deadline, workers=args.workers, log=log).run()
    return finish(study, d, out, log, test=not args.no_test)


def describe(dims: list[Dimension], metrics: list[str], directions: list[str], log) -> None:
    log(f"tune: {len(dims)} settings searched, scored by {', '.join(metrics)} ({', '.join(directions)}):")
    for dim in dims:
        log(f"  {dim.describe()}")


def finish(study, d: Study, out: Path, log, test: bool = True) -> dict:
    """The study's files: the tables, the plot, best.yaml, tune.json (and the best trial's test split, where the data
    has one: data the search never saw)."""
    rows = rows_of(study, d.dims, d.metrics)
    write_tables(out, rows)
    plot_search(out, rows, d.dims, d.metrics[0])
    best = best_trial(study, d.directions)
    summary = {
        "study": study.study_name,
        "metrics": d.metrics,
        "directions": d.directions,
        "trial_time_s": d.trial_time_s,
        "space": [{"key": x.key, "kind": x.kind, "values": x.values, "why": x.why} for x in d.dims],
        "trials": {s: sum(r["state"] == s for r in rows) for s in ("complete", "pruned", "fail", "running")},
        "best": None,
    }
    if best is not None:
        write_best(out, best, len(rows), d.metrics)
        summary["best"] = {
            "trial": best.number,
            "values": best.values,
            "params": best.params,
            "run_dir": best.user_attrs.get("run_dir"),
        }
        if test:
            summary["best"]["test"] = test_metrics(Path(best.user_attrs["run_dir"]), log)
        shown = ", ".join(f"{m} {v:.4g}" for m, v in zip(d.metrics, best.values))
        log(f"tune: best trial {best.number}: {shown}; {out / 'best.yaml'} trains it again")
    else:
        log("tune: no trial finished")
    replace_file(out / "tune.json", json.dumps(summary, indent=1))
    log(f"tune: {out / 'trials.md'}, {out / 'search.png'}, {out / 'tune.json'}")
    return summary


def test_metrics(run_dir: Path, log) -> dict | None:
    """The best trial's metrics on the test split (`torchsprint eval --split test`), or None where the data has none."""
    import subprocess
    import sys

    decisions = json.loads((run_dir / "decisions.json").read_text())
    images = decisions.get("images") or {}
    if "test" not in images:
        return None
    r = subprocess.run(
        [sys.executable, "-m", "torchsprint", "eval", "-r", str(run_dir), "--split", "test", "--json"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        log(f"tune: the best trial's test split could not be evaluated: {r.stderr.strip().splitlines()[-1:]}")
        return None
    metrics = json.loads(r.stdout.strip().splitlines()[-1])
    log(
        "tune: the best trial on the test split (never seen by the search): "
        + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
    )
    return metrics


def same_study(study, dims: list[Dimension], metrics: list[str], trial_time) -> bool:
    """A resumed or joined study must search what it searched before: the space, the metrics and the trial time are
    stored with the study the first time (returns True: a new study), and refused if they differ."""
    mine = {"space": [[x.key, x.kind, x.values] for x in dims], "metrics": metrics, "trial_time_s": trial_time}
    have = study.user_attrs.get("definition")
    if have is None:
        study.set_user_attr("definition", mine)
        return True
    if have != json.loads(json.dumps(mine)):
        raise UsageError(
            f"study {study.study_name!r} searched {json.dumps(have)}; this command asks for {json.dumps(mine)}: "
            "resume or join it with the same config and --trial-time, or start another study (--study, --out)"
        )
    return False


def duration(flag: str, value) -> float | None:
    from torchsprint.runtime.preempt import parse_duration

    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        raise UsageError(f"{flag} {value}: {e}") from None


def tune_cli(args) -> int:
    tune(args)
    return 0

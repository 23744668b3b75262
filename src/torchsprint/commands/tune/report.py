"""What a study leaves in its folder: trials.csv and trials.md (one row per trial: settings, metric, time, images/s,
its state), search.png (the metric against the time each trial finished and against each setting), best.yaml (a
config that trains the best trial again: `torchsprint train -c best.yaml`) and tune.json (the study's summary:
the space, the best trial, its test split's metrics where the data has one)."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import yaml

from torchsprint.observe.logging import replace_file


def rows_of(study, dims, metrics) -> list[dict]:
    """One dict per trial, in trial order: number, state, each metric, each setting, seconds, images/s, steps."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("skipped"):
            continue  # asked past --trials by a joined process and never run (study.py Search.ask)
        row = {"trial": t.number, "state": t.state.name.lower()}
        values = t.values if t.values is not None else [None] * len(metrics)
        for m, v in zip(metrics, values):
            row[m] = v
        for d in dims:
            row[d.key] = t.params.get(d.key)
        ua = t.user_attrs
        row.update(
            seconds=ua.get("seconds"),
            images_per_s=ua.get("images_per_s"),
            steps=ua.get("steps"),
            fitted_steps=ua.get("fitted_steps"),
            finished=t.datetime_complete.timestamp() if t.datetime_complete else None,
            run_dir=ua.get("run_dir"),
            error=ua.get("error"),
        )
        rows.append(row)
    return rows


def cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        return json.dumps(v)
    return str(v)


def best_trial(study, directions):
    """The best finished trial (single objective), or the first of the Pareto front (several); None: none finished."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return None
    if len(directions) == 1:
        sign = 1 if directions[0] == "maximize" else -1
        return max(done, key=lambda t: (sign * t.values[0], -t.number))
    return study.best_trials[0]


def write_tables(out: Path, rows: list[dict]) -> None:
    """trials.csv and trials.md (the same rows; failed trials keep their error)."""
    cols = [c for c in rows[0] if c != "finished"] if rows else ["trial"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: cell(r.get(k)) for k in cols})
    replace_file(out / "trials.csv", buf.getvalue())
    md_cols = [c for c in cols if c not in ("run_dir", "error")]
    lines = ["| " + " | ".join(md_cols) + " |", "|" + "---|" * len(md_cols)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in md_cols) + " |" for r in rows]
    replace_file(out / "trials.md", "\n".join(lines) + "\n")


def plot_search(out: Path, rows: list[dict], dims, metric: str) -> None:
    """search.png: the metric of each trial against when it finished (minutes from the study's first), and against
    each setting (a log axis for log-uniform ones); pruned trials at their last reported value, as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchsprint.observe.plots import save

    done = [r for r in rows if r["state"] in ("complete", "pruned") and r.get("finished")]
    n = 1 + len(dims)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.0), squeeze=False)
    t0 = min((r["finished"] for r in done), default=0.0)
    for ax, dim in zip(axes[0], [None, *dims]):
        for state, marker in (("complete", "o"), ("pruned", "x")):
            pts = [r for r in done if r["state"] == state and r.get(metric) is not None]
            if dim is None:
                xs = [(r["finished"] - t0) / 60 for r in pts]
            else:
                xs = [r.get(dim.key) for r in pts]
                if dim.kind == "choice":
                    labels = [cell(v) for v in dim.values]
                    xs = [labels.index(cell(x)) if cell(x) in labels else math.nan for x in xs]
            ax.scatter(xs, [r[metric] for r in pts], marker=marker, label=state, s=18)
        if dim is None:
            ax.set_xlabel("finished (min)")
            ax.set_ylabel(metric)
        else:
            ax.set_xlabel(dim.key)
            if dim.kind == "loguniform":
                ax.set_xscale("log")
            if dim.kind == "choice":
                ax.set_xticks(range(len(dim.values)), [cell(v) for v in dim.values], rotation=30, fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save(fig, out / "search.png")
    plt.close(fig)


def write_best(out: Path, trial, n_trials: int, metrics: list[str]) -> Path | None:
    """best.yaml: the best trial's config.yaml without its run folder; a trial fitted to a time gets the length it
    fitted (run.max_steps, run.epochs) instead of run.train_time, so the same steps and schedule train again."""
    run_dir = Path(trial.user_attrs["run_dir"])
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["run"].pop("dir", None)
    cfg.pop("tune", None)
    cfg["run"]["name"] = "tuned"
    head = [
        f"# torchsprint tune: the best of {n_trials} trials (trial {trial.number}, {run_dir}),",
        "# " + ", ".join(f"{m} {cell(v)}" for m, v in zip(metrics, trial.values)) + ".",
    ]
    fitted = trial.user_attrs.get("fitted_steps")
    if cfg["run"].get("train_time") is not None and fitted:
        decisions = json.loads((run_dir / "decisions.json").read_text())
        spe = max(1, int(decisions.get("steps_per_epoch") or 1))
        head.append(
            f"# It trained for run.train_time={cfg['run']['train_time']}: {fitted} steps, written here as "
            "run.max_steps "
            f"(set run.train_time instead to fit the length to the time again)."
        )
        cfg["run"]["train_time"] = None
        cfg["run"]["max_steps"] = int(fitted)
        cfg["run"]["epochs"] = max(1, math.ceil(fitted / spe))
    head.append("# Train it: torchsprint train -c best.yaml")
    path = out / "best.yaml"
    replace_file(path, "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None))
    return path

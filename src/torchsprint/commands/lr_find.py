"""`torchsprint lr-find`: the learning-rate range test (Smith 2017; fastai's `lr_find`, Lightning's Tuner.lr_find).

The run's model, data, precision and switches are built by run.build_training, exactly as training builds them;
then the learning rate rises exponentially from `start` to `end` over `steps` optimizer steps (fastai's
SchedExp: lr_i = start * (end / start) ** (i / (steps - 1))), each step one real engine.train_step on the next
training batch. The loss is smoothed as fastai's Recorder and Lightning's _LRCallback do (an exponential moving
average, beta 0.98, debiased: avg_i / (1 - beta ** (i + 1))), and the test stops once the smoothed loss exceeds
4x the best so far (both libraries' divergence threshold) or is not finite.

The suggestion is fastai's `valley` rule (fastai 2.x's default suggestion; nbs/14_callback.schedule.ipynb, an
algorithm by ESRI, https://forums.fast.ai/t/automated-learning-rate-suggester/44199/30): over the smoothed
curve with its first steps // 10 and last 5 points dropped (as fastai's lr_find does), find the longest run of
decreasing losses (a longest-decreasing-subsequence), and take the point about 2/3 of the way through it.

No run folder is created, read or changed: the plot and the JSON go to --out or a fresh temporary folder.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from torchsprint.errors import UsageError
from torchsprint.observe.logging import replace_file
from torchsprint.observe.plots import fit_text, save

BETA = 0.98  # smoothing of the loss (fastai Recorder / Lightning _LRCallback: beta=0.98)
DIVERGE = 4.0  # stop when the smoothed loss exceeds this multiple of the best (fastai stop_div, Lightning diverge_th)
SKIP_END = 5  # points dropped at the end before suggesting (fastai lr_find: losses[num_it // 10 : -5])
RULE = (
    "fastai 'valley': the point 2/3 through the longest decreasing stretch of the smoothed loss, after dropping the "
    "first steps//10 and the last 5 points (fastai 2.x Learner.lr_find's default suggestion)"
)


def check_range(steps: int, start: float, end: float) -> None:
    """Refuse a range test that cannot run or cannot suggest anything."""
    if steps < 10:
        raise UsageError(
            f"lr-find --steps {steps}: the range test needs at least 10 steps (the suggestion drops the "
            "first tenth and the last 5 points); use e.g. --steps 100."
        )
    if not (start > 0 and end > 0 and math.isfinite(start) and math.isfinite(end)):
        raise UsageError(
            f"lr-find --start {start} --end {end}: both learning rates must be finite and positive, "
            "e.g. --start 1e-7 --end 10."
        )
    if start >= end:
        raise UsageError(
            f"lr-find --start {start} is not below --end {end}: the learning rate rises from start to "
            "end; swap them, e.g. --start 1e-7 --end 10."
        )


def lr_at(i: int, steps: int, start: float, end: float) -> float:
    """The learning rate of step i (0-based) of an exponential sweep from `start` to `end` in `steps` steps."""
    return start * (end / start) ** (i / (steps - 1))


def smooth(losses: list[float], beta: float = BETA) -> list[float]:
    """Debiased exponential moving average of `losses` (fastai's Recorder smooth_loss)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def valley(lrs: list[float], losses: list[float]) -> int:
    """fastai's `valley`: the index 2/3 through the longest decreasing subsequence of `losses` (see the module doc)."""
    n = len(losses)
    max_start, max_end = 0, 0
    lds = [1] * n
    for i in range(1, n):
        for j in range(i):
            if losses[i] < losses[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
            if lds[max_end] < lds[i]:
                max_end = i
                max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return max_start + int(sections) + int(sections / 2)


def suggest(lrs: list[float], smoothed: list[float], steps: int) -> tuple[float, int]:
    """(suggested lr, its index into lrs) by the valley rule over the trimmed curve."""
    lo, hi = steps // 10, len(lrs) - SKIP_END
    if hi - lo < 2:
        raise UsageError(
            f"lr-find: the loss diverged after {len(lrs)} of {steps} steps, too early to suggest a rate "
            "(the rule drops the first tenth and the last 5 points): lower --end, or raise --steps."
        )
    idx = lo + valley(lrs[lo:hi], smoothed[lo:hi])
    return lrs[idx], idx


def sweep(b, cfg, steps: int, start: float, end: float) -> dict:
    """Run the range test on a built run `b` (run.Built): returns lrs, raw and smoothed losses, why it stopped.

    Each parameter group keeps its own scale (optim.param_groups, optim.layer_decay): group g gets
    lr_i x g['lr_scale'], as the schedule would scale it. The run's scheduler is never stepped.
    """
    from torchsprint.runtime.rng import rng_isolated
    from torchsprint.train.engine import set_train_mode, train_step

    set_train_mode(b.model, b.frozen_norms)
    loader, accum = b.loaders.train, cfg.optim.accum_steps
    device = next(b.model.parameters()).device

    def batches():
        epoch = 0
        while True:  # the sweep may be longer than an epoch: the next epoch's order follows
            loader.set_epoch(epoch)
            yield from rng_isolated(loader, device)
            epoch += 1

    it = batches()
    lrs, losses, smoothed = [], [], []
    stopped, best, avg = "completed all steps", math.inf, 0.0
    for i in range(steps):
        lr = lr_at(i, steps, start, end)
        for g in b.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        micro = [next(it) for _ in range(accum)]
        loss = train_step(
            b, micro, cfg.optim.clip_grad_norm
        ).item()  # note: a host sync per step, to stop on divergence
        avg = BETA * avg + (1 - BETA) * loss
        s = avg / (1 - BETA ** (i + 1))
        lrs.append(lr)
        losses.append(loss)
        smoothed.append(s)
        if not math.isfinite(s) or s > DIVERGE * best:
            stopped = f"diverged at step {i + 1} (smoothed loss {s:.4g} > {DIVERGE:g} x best {best:.4g})"
            break
        best = min(best, s)
    return {"lrs": lrs, "losses": losses, "smoothed": smoothed, "stopped": stopped}


def plot(result: dict, path: Path) -> None:
    """lr_find.png: plot_figure written to `path`."""
    save(plot_figure(result), path)


def plot_figure(result: dict):
    """log-x learning rate against smoothed loss, the suggestion marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(result["lrs"], result["smoothed"], label="smoothed loss")
    ax.plot(result["lrs"], result["losses"], alpha=0.3, label="loss")
    i = result["suggestion_index"]
    ax.plot([result["lrs"][i]], [result["smoothed"][i]], "ro", label=f"suggestion {result['suggestion']:.2e} (valley)")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    top = max(v for v in result["smoothed"][: max(1, len(result["smoothed"]) - 1)] if math.isfinite(v))
    ax.set_ylim(top=top * 1.1 if top > 0 else None)  # the divergence spike would flatten the curve
    ax.legend()
    ax.set_title("learning-rate range test")
    fit_text(fig)
    return fig


def lr_find(
    cfg,
    *,
    steps: int = 100,
    start: float = 1e-7,
    end: float = 10.0,
    out: str | Path | None = None,
    log=print,
    overwrite: bool = False,
) -> dict:
    """The range test of `cfg`'s run; writes lr_find.json and lr_find.png into `out` (a new temp folder when None).

    Args:
        cfg: the run's config (its run folder is never created or touched).
        steps: optimizer steps of the sweep (fewer when the loss diverges first).
        start, end: the first and last learning rate of the exponential sweep (optim.lr is not used).
        out: folder for the results.
        log: where progress lines go.
    Returns the result dict (also in lr_find.json): lrs, losses, smoothed, suggestion, rule, stopped, files.
    """
    from torchsprint import runtime
    from torchsprint.config.schema import import_modules
    from torchsprint.state.rundir import writable_file
    from torchsprint.train.build import build_training
    from torchsprint.train.resolve import resolve

    check_range(steps, start, end)
    if cfg.strategy.name == "ddp":
        raise UsageError(
            "lr-find runs in one process: add strategy.name=single (its steps use data.batch_size images; "
            "under DDP each step sees data.batch_size x processes, so scale the suggestion accordingly)."
        )
    import_modules(cfg.imports)
    cfg = resolve(cfg)  # what the task and the data decide, as train resolves it
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="torchsprint-lr-find-"))
    for target in (out, out / "lr_find.json", out / "lr_find.png"):  # before the sweep, not found after it
        writable_file(target, "--out", folder=target == out, overwrite=overwrite)  # an earlier sweep's: --overwrite
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        b = build_training(cfg, rt, log)
        cfg = b.cfg  # batch_size=auto and precision=auto as they ran (the log line and lr_find.json say them)
        log(
            f"lr-find: {steps} steps, learning rate {start:g} -> {end:g} (exponential), batch {cfg.data.batch_size} x "
            f"accum {cfg.optim.accum_steps}, precision {cfg.precision.mode}; the run folder is not touched"
        )
        result = sweep(b, cfg, steps, start, end)
    finally:
        runtime.teardown(rt)
    result["suggestion"], result["suggestion_index"] = suggest(result["lrs"], result["smoothed"], steps)
    result |= {
        "rule": RULE,
        "steps": steps,
        "start": start,
        "end": end,
        "batch_size": cfg.data.batch_size,
        "accum_steps": cfg.optim.accum_steps,
        "optimizer": cfg.optim.name,
        "precision": cfg.precision.mode,
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
    }
    result["files"] = {"json": str(out / "lr_find.json"), "plot": str(out / "lr_find.png")}
    plot(result, out / "lr_find.png")
    replace_file(out / "lr_find.json", json.dumps(result, indent=1))
    log(f"lr-find: {result['stopped']}; suggested learning rate {result['suggestion']:.3g} (rule: {RULE})")
    log(
        f"lr-find: plot {out / 'lr_find.png'}, data {out / 'lr_find.json'}; "
        f"train with optim.lr={result['suggestion']:.3g}"
    )
    return result


__all__ = ["lr_find", "smooth", "valley", "lr_at"]

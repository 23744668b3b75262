"""The run plan: every run-time decision of one training run, resolved once (DESIGN rule 12).

`build_training` (train/run.py) resolves each decision where its inputs first exist (the CUDA-graph choice before
Precision, the memory formats before the loaders and the wrapping, the steps once the loaders exist) and
hands the same values to what it builds and to `build_plan`. Everything after reads the frozen `RunPlan`:
the engine (fit, train_one_epoch, Validation), decisions.json and the start-up summary (`decisions`,
`describe_decisions`). A writer that read the config instead could report what did not run; reading the
plan, it cannot (tests/e2e/train/test_plan.py checks the files against what ran).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchsprint.data.core import size_text
from torchsprint.runtime.parallel import (
    GraphsDecision,
    channels_last_on,
    check_speed,
    decide_cuda_graphs,
    has_conv2d,
)
from torchsprint.tasks.core import IMBALANCED


@dataclass(frozen=True)
class SpeedPlan:
    """The `speed` section resolved for one model on one machine: what wrap_model applies, and why."""

    channels_last: bool  # the model's weights in channels_last (NHWC)
    channels_last_why: str
    compile: bool
    compile_mode: str | None
    compile_backend: str
    fullgraph: bool
    cuda_graphs: GraphsDecision
    graphs_by_auto: bool  # speed.cuda_graphs=auto: a model that cannot be captured is refused in one line
    # torch.compile one graph per input shape (dynamic=False): data.progressive's few training sizes
    static_shapes: bool = False


NO_SPEED = SpeedPlan(False, "off", False, None, "inductor", False, GraphsDecision(False, "off"), False)


def decide_speed(
    speed_cfg,
    strategy_cfg,
    model: nn.Module,
    device: torch.device,
    world_size: int = 1,
    *,
    accum_steps: int = 1,
    graphs: GraphsDecision | None = None,
    static_shapes: bool = False,
    channels_last_why: str | None = None,
) -> SpeedPlan:
    """speed.* resolved for `model` (the unwrapped model) after check_speed refused what cannot run here.

    `graphs`: the run's decide_cuda_graphs result when it was made earlier (Precision needs it first); None:
    decided here. `static_shapes`: the input size changes between epochs (data.progressive). `channels_last_why`:
    speed_probe's words where it measured the format (`speed_cfg` then holds what it resolved); None: the rule's.
    """
    check_speed(speed_cfg, strategy_cfg, device, accum_steps)
    graphs = graphs or decide_cuda_graphs(speed_cfg, strategy_cfg, device, world_size)
    setting = speed_cfg.channels_last
    why = channels_last_why or f"speed.channels_last={str(setting).lower()}" + (
        (": the model has 2-D convolutions" if has_conv2d(model) else ": no 2-D convolutions")
        if setting == "auto"
        else ""
    )
    return SpeedPlan(
        channels_last_on(setting, model),
        why,
        speed_cfg.compile,
        speed_cfg.compile_mode,
        speed_cfg.compile_backend,
        speed_cfg.fullgraph,
        graphs,
        speed_cfg.cuda_graphs == "auto",
        static_shapes,
    )


def decide_input_format(speed_cfg) -> tuple[bool, str]:
    """Whether the loaders deliver channels_last batches, and why: only speed.channels_last=true converts them.

    Under auto the model is NHWC and the batches stay NCHW: the first convolution reorders its input, which
    costs less than a per-batch conversion on the loader side (BENCHMARKS.md, "channels_last by default").
    """
    setting = speed_cfg.channels_last
    if setting is True:
        return True, "speed.channels_last=true: model and input batches"
    if setting == "auto":
        return False, "speed.channels_last=auto: the model only; the first convolution reorders the NCHW batch"
    return False, "speed.channels_last=false"


# run.train_time with run.epochs unset: the epochs are what fits the time, no bound of their own
TIME_FITTED_EPOCHS_CAP = 100_000


def run_epochs(cfg) -> int:
    """The run's epoch count: run.epochs, or with run.train_time an upper bound (run.epochs where set, else none:
    the fitted length ends the run)."""
    if cfg.run.train_time is not None and not cfg.set_by_user("run.epochs"):
        return TIME_FITTED_EPOCHS_CAP
    return cfg.run.epochs


@dataclass(frozen=True)
class RunPlan:
    """Every run-time decision of one training run, made once; the engine and the run's records read this."""

    # What runs, where
    dataset: str
    root: str | None
    task: str
    chosen: tuple  # settings chosen from the data (config.chosen(): setting, value, why, override)
    device: str
    world_size: int
    # The loader backend that ran (after `auto` and any fallback), as build_loaders recorded it
    backend: str
    backend_why: str
    backend_config: str
    backend_fallback: str | None
    # auto's measurement on the user's files (images/s of each candidate, the memory backend's decode rate, the
    # estimated loading time of the run); None where nothing was measured (data.backend set, one candidate).
    backend_measured: dict | None
    # Speed and numerics
    speed: SpeedPlan  # channels_last of the model, compile, CUDA graphs
    channels_last_inputs: bool
    channels_last_inputs_why: str
    precision: str
    optimizer_impl: str
    optimizer_impl_why: str
    # Steps
    batch_size: int
    accum_steps: int
    effective_batch_size: int
    batch_size_why: str
    batch_size_search: dict | None
    steps_per_epoch: int
    epochs: int
    max_steps: int | None
    sched_interval: str  # "step" | "epoch"
    clip_grad_norm: float | None
    track_accuracy: bool  # training top-1 counted (tasks whose targets are class indices)
    # When to log, evaluate, checkpoint; what to monitor
    log_every_steps: int
    eval_every_epochs: int
    eval_every_steps: int | None
    checkpoint_every_epochs: int | None
    checkpoint_every_steps: int | None
    monitor: str
    mode: str  # "max" | "min"
    early_stop_patience: int | None
    early_stop_min_delta: float
    tta: object = None  # tta.TtaPlan of eval.tta (None: off): every evaluation of the run wraps the model with it
    train_sizes: str | None = None  # data.progressive: the training crop's side per epoch (from 1), in words; None: off
    swa: dict | None = None  # swa.enabled: the epoch SWA starts averaging (1-based), its lr and anneal; None: off
    distill: dict | None = None  # the teacher distill.build_teacher loaded (model, file, fingerprint...); None: off
    # precision.mode as set (auto or a mode) and why the run trains in `precision` (train/speed_probe.py)
    precision_config: str = "fp32"
    precision_why: str = "precision.mode"
    # precision=auto / speed.channels_last=auto's measurement on a CPU (img/s of each candidate, the margin, the
    # choice); None where nothing was measured (the why says why)
    speed_measured: dict | None = None

    @property
    def channels_last(self) -> bool:
        """The model's memory format (what decisions.json's channels_last reports)."""
        return self.speed.channels_last

    @property
    def cuda_graphs(self) -> GraphsDecision:
        return self.speed.cuda_graphs


def build_plan(
    cfg,
    rt,
    *,
    info,
    train_batches: int,
    speed: SpeedPlan,
    opt: torch.optim.Optimizer,
    inputs: tuple[bool, str] | None = None,
    batch=None,
    distill: dict | None = None,
    swa=None,
    auto=None,
) -> RunPlan:
    """The RunPlan of a run whose objects exist: `cfg` with the batch resolved (batch_size.resolved_config),
    `info` the loaders' DataInfo (None: a loader without one, tests only), `train_batches` len(the training
    loader), `speed` what wrap_model applied, `opt` the built optimizer, `inputs` decide_input_format's result
    the loaders were built with (None: decided here), `batch` the batch_size.BatchChoice (None: data.batch_size),
    `auto` speed_probe.AutoSpeed, what precision=auto became (None: cfg.precision.mode, auto read as fp32)."""
    from torchsprint.optim.optimizers import impl_in_use
    from torchsprint.state.precision import concrete_mode
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import plan_tta

    impl, impl_why = impl_in_use(opt, cfg.optim)
    inputs = inputs or decide_input_format(cfg.speed)
    accum = cfg.optim.accum_steps
    return RunPlan(
        dataset=cfg.data.dataset,
        root=cfg.data.root,
        task=cfg.task,
        chosen=tuple(cfg.chosen()),
        device=str(rt.device),
        world_size=rt.world_size,
        backend=(info.backend if info is not None else "")
        or cfg.data.backend,  # data.backend: a loader that does not say
        backend_why=info.backend_why if info is not None else "data.backend",
        backend_config=info.backend_config if info is not None else cfg.data.backend,
        backend_fallback=(info.fallback or None) if info is not None else None,
        backend_measured=(getattr(info, "backend_measured", None) or None) if info is not None else None,
        speed=speed,
        channels_last_inputs=inputs[0],
        channels_last_inputs_why=inputs[1],
        precision=auto.precision if auto is not None else concrete_mode(cfg.precision.mode),
        precision_config=auto.asked if auto is not None else cfg.precision.mode,
        precision_why=auto.precision_why if auto is not None else "precision.mode",
        speed_measured=auto.measured if auto is not None else None,
        optimizer_impl=impl,
        optimizer_impl_why=impl_why,
        batch_size=cfg.data.batch_size,
        accum_steps=accum,
        effective_batch_size=cfg.data.batch_size * accum * rt.world_size,
        batch_size_why=batch.why if batch is not None else "data.batch_size",
        batch_size_search=(batch.search or None) if batch is not None else None,
        steps_per_epoch=-(-train_batches // accum),
        epochs=run_epochs(cfg),
        max_steps=cfg.run.max_steps,
        sched_interval=cfg.sched.interval,
        clip_grad_norm=cfg.optim.clip_grad_norm,
        track_accuracy=get_task(cfg.task).targets == "class_index",
        log_every_steps=cfg.log.every_steps,
        eval_every_epochs=cfg.eval.every_epochs,
        eval_every_steps=cfg.eval.every_steps,
        checkpoint_every_epochs=cfg.checkpoint.every_epochs,
        checkpoint_every_steps=cfg.checkpoint.every_steps,
        monitor=cfg.checkpoint.monitor,
        mode=cfg.checkpoint.mode,
        early_stop_patience=cfg.early_stop.patience,
        early_stop_min_delta=cfg.early_stop.min_delta,
        tta=plan_tta(cfg.eval.tta, get_task(cfg.task), cfg.data.eval.transforms),
        distill=distill,
        train_sizes=train_sizes(cfg),
        swa={
            "start_epoch": swa.start + 1,
            "lr": cfg.swa.lr,
            "anneal_epochs": cfg.swa.anneal_epochs,
            "anneal_strategy": cfg.swa.anneal_strategy,
        }
        if swa is not None and swa.enabled
        else None,
    )


def decisions(plan: RunPlan, facts: dict) -> dict:
    """What torchsprint decided for this run (the plan) beside what it found in the data (`facts`, DataInfo.facts):
    printed at start, kept in decisions.json."""
    return {
        "dataset": plan.dataset,
        "root": plan.root,
        "task": plan.task,
        **facts,
        # Settings the config left unset and torchsprint chose from the data (data/detect.py), with why and how to
        # override.
        "chosen": list(plan.chosen),
        # The backend that ran (after `auto` and any data.fallback), as build_loaders recorded it; and what was asked.
        "backend": plan.backend,
        "backend_why": plan.backend_why,
        "backend_config": plan.backend_config,
        "backend_fallback": plan.backend_fallback,
        # auto's measurement on the user's files (images/s of each candidate, the memory backend's decode rate, the
        # estimated loading time of the run); None where nothing was measured (data.backend set, one candidate).
        "backend_measured": plan.backend_measured,
        "device": plan.device,
        "world_size": plan.world_size,
        "precision": plan.precision,
        # precision as set (auto or a mode) and why the run trains in `precision`; auto's measurement on a CPU (images/s
        # of each candidate, the margin, the choice: train/speed_probe.py), None where nothing was measured.
        "precision_config": plan.precision_config,
        "precision_why": plan.precision_why,
        "speed_measured": plan.speed_measured,
        "channels_last": plan.channels_last,
        "channels_last_why": plan.speed.channels_last_why,
        "cuda_graphs": plan.cuda_graphs.on,
        "cuda_graphs_why": plan.cuda_graphs.why,
        "optimizer_impl": plan.optimizer_impl,
        "optimizer_impl_why": plan.optimizer_impl_why,
        "batch_size": plan.batch_size,
        "accum_steps": plan.accum_steps,
        "effective_batch_size": plan.effective_batch_size,
        # Where the batch size and accumulation came from (data.batch_size, auto's search, data.effective_batch_size).
        "batch_size_why": plan.batch_size_why,
        "batch_size_search": plan.batch_size_search,
        "steps_per_epoch": plan.steps_per_epoch,
        "epochs": plan.epochs,
        "eval_tta": plan.tta.name if plan.tta is not None else "none",
        "distill": plan.distill,
        "swa": plan.swa,
        # data.progressive: the training crop's side per epoch (from 1), in words; None when off.
        "train_sizes": plan.train_sizes,
    }


def train_sizes(cfg) -> str | None:
    """data.progressive's sides over the run's epochs ('128 (epochs 1-3), 160 (epoch 4), ...'); None when off."""
    from torchsprint.data.preprocess.progressive import train_schedule

    schedule = train_schedule(cfg.data)
    return None if schedule is None else schedule.describe(cfg.run.epochs)


def describe_decisions(d: dict) -> list[str]:
    """The start-up summary, a few lines."""
    names = ", ".join(d.get("class_names", []))
    more = d.get("classes", 0) - len(d.get("class_names", []))
    counts = ", ".join(f"{k} {v:,}" for k, v in d.get("images", {}).items())
    lines = [
        f"{c['setting']}: {c['value']} ({c['why']}; to choose otherwise: {c['override']})" for c in d.get("chosen", [])
    ]
    lines += [
        f"data: {d['dataset']}{' at ' + str(d['root']) if d['root'] else ''}: {d.get('classes')} classes "
        f"({names}{f', ... {more} more' if more > 0 else ''}); images: {counts}"
    ]
    if d.get("source"):
        lines.append(f"  splits: {d['source']}")
    cc, size = d.get("class_counts"), d.get("image_size")
    extra = []
    if cc and cc["smallest"][1] == cc["largest"][1]:
        extra.append(f"balanced classes ({cc['smallest'][1]:,} training images each)")
    elif cc:
        lo, hi = cc["smallest"], cc["largest"]
        ratio = hi[1] / max(lo[1], 1)
        extra.append(
            f"smallest class {lo[0]} ({lo[1]:,}), largest {hi[0]} ({hi[1]:,}): {ratio:.1f}x imbalance"
            + (
                " (validation reports balanced accuracy and the weakest class's recall beside top-1; what "
                "counters it: docs/recipes.md, 'Imbalanced classes')"
                if ratio >= IMBALANCED
                else ""
            )
        )
    if size:
        lo, hi = size["min"], size["max"]
        extra.append(
            f"image size {lo[1]}x{lo[0]}"
            + (f" to {hi[1]}x{hi[0]}" if lo != hi else "")
            + f" (w x h, {size['sampled']} sampled)"
        )
    if extra:
        lines.append("  " + "; ".join(extra))
    if d.get("modes"):
        from torchsprint.data.build import describe_modes

        ch = d.get("channels", 3)
        lines.append(
            f"  colour modes ({sum(d['modes'].values())} sampled): {describe_modes(d['modes'], ch)}; read as "
            + ("3 channels (RGB)" if ch == 3 else "1 channel (grey)")
            + (" (data.options.mode=GRAY keeps 1 channel)" if ch == 3 else " (data.options.mode=GRAY)")
        )
    if d.get("skipped"):
        total = sum(v["count"] for v in d["skipped"].values())
        lines.append(f"  left out {total:,} file(s) below data.root that are not samples:")
        lines += [f"    {v['count']:,} {why}, e.g. {', '.join(v['examples'])}" for why, v in d["skipped"].items()]
    lines += [f"  {note}" for note in d.get("notes", [])]
    # The backend that runs (a fallback's why names the configured one), as decisions.json has it.
    if d.get("decoders"):
        decoder = "decoder " + ", ".join(
            f"{v['decoder']} ({fmt}: {v['files']:,} files)" for fmt, v in d["decoders"].items()
        )
    else:
        decoder = f"decoder {d['decoder']}" if d.get("decoder") else ""
    lines.append(f"loader: data.backend={d['backend']} ({d['backend_why']})" + (f", {decoder}" if decoder else ""))
    if d.get("cache"):
        lines.append(f"  {cache_line(d['cache'])}")
    lines.append(
        f"device {d['device']} x {d['world_size']}, precision {d['precision']}, channels_last "
        f"{'on' if d.get('channels_last') else 'off'} ({d.get('channels_last_why', '')}), batch {d['batch_size']} x "
        f"accum {d['accum_steps']} x {d['world_size']} process(es) = effective batch {d['effective_batch_size']}, "
        f"{d['steps_per_epoch']} steps per epoch, {d['epochs']} epochs"
    )
    if d.get("precision_config") == "auto":  # what auto became and why (measured: the figures; else why not)
        lines.append(f"  {d['precision_why']}")
    if d.get("batch_size_why", "data.batch_size") != "data.batch_size":
        lines.append(f"  batch size: {d['batch_size_why']}")
    if d.get("train_sizes"):
        lines.append(
            f"  progressive resizing (data.progressive): training crop {d['train_sizes']}; evaluation: "
            "data.eval.transforms as set"
        )
    if d.get("eval_tta", "none") != "none":
        lines.append(
            f"evaluation: eval.tta={d['eval_tta']} (test-time augmentation: probabilities averaged over the views)"
        )
    lines.append(
        f"CUDA graphs {'on' if d['cuda_graphs'] else 'off'} ({d['cuda_graphs_why']}); optimizer update "
        f"{d['optimizer_impl']} ({d['optimizer_impl_why']})"
    )
    return lines


def cache_line(cache: dict) -> str:
    """The decoded-image cache in one line of the start-up summary (data.cache; build_loaders' record)."""
    if cache.get("state") != "on":
        return f"decoded-image cache off ({cache.get('why', '')})"
    splits = cache["splits"]
    states = sorted({rec["state"] for rec in splits.values()})
    total = sum(rec["bytes"] for rec in splits.values())
    built = [f"{name} in {rec['seconds']:.1f} s" for name, rec in splits.items() if rec["state"] == "built"]
    when = max(rec["built"] for rec in splits.values())
    return (
        f"decoded-image cache {' + '.join(states)} ({', '.join(splits)}): {size_text(total)} in {cache['dir']}, "
        + (f"built now ({', '.join(built)})" if built else f"built {when} UTC")
        + " (data.cache)"
    )

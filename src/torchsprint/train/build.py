"""`build_training`: one run built in named phases, each a function of its inputs returning a small typed object:
`start` (what is decided before any data is read: the resolved config, the task, CUDA graphs, the batch, the input
format), `read_data` (the loaders, the distillation teacher), `make_model` (built, initialised, frozen: not yet
wrapped), `decide` (every decision that needs the model and the data, made once into one frozen `Decisions`: batch,
sampler, precision, memory format, loss, with their reasons; the plan reads it), `stack_model` (EMA/SWA copies,
wrapping, frozen norms), `feed` (the training loader's wrappers) and `optimize` (optimizer, plan, schedule).
train/run.py's `train` and `bench` build a run with it, so a benchmark measures exactly what training runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchsprint.config.schema import Config
from torchsprint.data import build_loaders
from torchsprint.data.core import DataInfo, Loaders
from torchsprint.data.preprocess.mix import check_mix, wrap_mix
from torchsprint.data.preprocess.progressive import check_compile, check_epochs
from torchsprint.errors import UsageError
from torchsprint.models import build_model
from torchsprint.models.download import fetch_run_weights
from torchsprint.models.init import HeadOnly, apply_freeze, frozen_norm_layers, head_only, init_model
from torchsprint.optim.optimizers import build_optimizer
from torchsprint.optim.schedulers import build_scheduler
from torchsprint.runtime.collectives import agree_on_data
from torchsprint.runtime.parallel import GraphsDecision, decide_cuda_graphs, unwrap, wrap_model
from torchsprint.state.ema import ModelEma, NoEma, build_ema
from torchsprint.state.precision import Precision, concrete_mode
from torchsprint.state.resume import (
    check_resumed_classes,
    decisions_at_start,
)
from torchsprint.state.swa import NoSwa, Swa, build_swa
from torchsprint.tasks.core import Task, check_data_task, get_task
from torchsprint.tasks.tta import plan_tta, with_loading_spec
from torchsprint.train.batch_size import BatchChoice, choose_batch, resolved_config
from torchsprint.train.distill import (
    DistillLoader,
    DistillLoss,
    build_teacher,
    check_distill,
    check_same_teacher,
)
from torchsprint.train.evaluation import (
    decide_run_loss,
    materialize_lazy,
)
from torchsprint.train.imbalance import before_data
from torchsprint.train.plan import (
    RunPlan,
    SpeedPlan,
    build_plan,
    decide_input_format,
    decide_speed,
    run_epochs,
)
from torchsprint.train.resolve import resolve
from torchsprint.train.speed_probe import AutoSpeed, decide_auto


@dataclass
class Built:
    """Everything one training run is made of, built from the config by `build_training`'s phases."""

    loaders: Loaders
    model: torch.nn.Module
    frozen_norms: list[torch.nn.Module]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    prec: Precision
    loss_fn: torch.nn.Module
    ema: ModelEma | NoEma
    init: dict  # how the model was initialised (checkpoint | pretrained | random) and, from pretrained, what was loaded
    cfg: Config  # the config with every decision written in (batch, accumulation, precision, format): read this one
    batch: BatchChoice  # the batch size, accumulation and why
    head_only: HeadOnly  # model.freeze_epochs (the no-op NO_HEAD_ONLY when off)
    plan: RunPlan  # every run-time decision, made once; the engine and the records read it
    swa: Swa | NoSwa = field(default_factory=NoSwa)


@dataclass(frozen=True)
class Start:
    """What is decided before any data is read."""

    cfg: (
        Config  # resolved (train/resolve.py), with data.batch_size and optim.accum_steps and data.sampler=auto resolved
    )
    task: Task
    graphs: GraphsDecision  # speed.cuda_graphs decided once for every reader
    prec: Precision  # as configured (precision=auto: fp32 until `decide` measures)
    mixing: bool  # Mixup/CutMix on
    distilling: bool
    batch: BatchChoice
    inputs: tuple[bool, str]  # (channels_last batches, why): the loaders and the plan read it
    progressive: bool  # the input size changes between epochs (data.progressive)


@dataclass(frozen=True)
class DataPhase:
    loaders: Loaders
    teacher: torch.nn.Module | None  # the distillation teacher (it needs the classes), or None
    distill: dict | None  # its record for the plan

    @property
    def info(self) -> DataInfo:
        return self.loaders.info


@dataclass(frozen=True)
class BareModel:
    """The model built, initialised (checkpoint > pretrained > random) and frozen; not yet copied or wrapped."""

    model: torch.nn.Module
    init: dict
    head: HeadOnly


@dataclass(frozen=True)
class Decisions:
    """Every decision that needs the model and the data, made once: the plan and the records read these."""

    cfg: Config  # precision and memory format written in (config.yaml says what ran)
    batch: BatchChoice  # batch size and accumulation, with `why`
    sampler: tuple[str, str]  # (data.sampler as it runs, why)
    prec: Precision  # the precision that trains
    auto: AutoSpeed  # precision=auto / speed.channels_last=auto: what they became and why, the figures
    speed: SpeedPlan  # the model's memory format, compile, CUDA graphs, with their reasons
    loss_fn: torch.nn.Module  # the task's loss (class weights, logit adjustment, smoothing as decided)


@dataclass(frozen=True)
class ModelStack:
    """The model as it trains: wrapped (DDP, compile), with its EMA/SWA copies and its frozen norm layers."""

    model: torch.nn.Module
    frozen_norms: list[torch.nn.Module]
    ema: ModelEma | NoEma
    swa: Swa | NoSwa


def build_training(cfg, rt, log, ckpt: dict | None = None, resume_path=None) -> Built:
    """The run in phases: start -> read_data -> make_model -> decide -> stack_model -> feed -> optimize.

    Shared by `train` and `bench` so that a benchmark measures exactly what training runs. The order is the one the
    random streams depend on (the model's initial weights come after the loaders), as each phase's docstring says.
    """
    s = start(cfg, rt, log, ckpt)
    d = read_data(s, rt, log, ckpt, resume_path)
    m = make_model(s, d, rt, log, ckpt, resume_path)
    dec = decide(s, d, m, rt, log, ckpt)
    stack = stack_model(s, dec, m, d, rt, log)
    feed(s, d, rt)
    opt, sched, plan, loss_fn = optimize(s, dec, stack, d, rt, log)
    check_monitor(dec.cfg, stack.ema)
    m.head.apply(0)  # built as epoch 1 trains (fit sets it again at every epoch, resumed or not)
    return Built(
        d.loaders,
        stack.model,
        stack.frozen_norms,
        opt,
        sched,
        dec.prec,
        loss_fn,
        stack.ema,
        m.init,
        dec.cfg,
        s.batch,
        m.head,
        plan,
        stack.swa,
    )


def start(cfg, rt, log, ckpt: dict | None) -> Start:
    """Before any data is read: resolve (a no-op after train()), the CUDA-graph choice, the task's checks, the weights
    (fetched once), the batch (its search leaves nothing behind) and the sampler, the input format."""
    cfg = resolve(cfg)
    progressive = cfg.data.progressive.start_size is not None
    graphs = decide_cuda_graphs(
        cfg.speed, cfg.strategy, rt.device, rt.world_size, cfg.data.drop_last, cfg.model.freeze_epochs, progressive
    )
    prec = Precision(
        concrete_mode(cfg.precision.mode), rt.device, on_nonfinite=cfg.precision.on_nonfinite, graph_safe=graphs.on
    )  # precision=auto: fp32 until the model exists and the probe decides
    task = get_task(cfg.task)
    task.check(cfg)
    mixing = check_mix(cfg.mix, cfg.task, task.targets, cfg.loss)
    distilling = check_distill(cfg, task.targets)
    fetch_run_weights(cfg.model, cfg.distill.teacher if distilling else None, rt, log, resuming=ckpt is not None)
    batch = choose_batch(cfg, rt, log, ckpt)
    cfg = before_data(
        resolved_config(cfg, batch), task.targets
    )  # data.sampler=auto: shuffle where it has nothing to do
    return Start(cfg, task, graphs, prec, mixing, distilling, batch, decide_input_format(cfg.speed), progressive)


def read_data(s: Start, rt, log, ckpt: dict | None, resume_path) -> DataPhase:
    """The loaders (eval.tta=five_crop/ten_crop loads larger eval images, to crop from), then what the data must have,
    a resumed run's classes (before the model: it would not load, blaming the file) and the distillation teacher."""
    cfg = s.cfg
    loaders = build_loaders(
        with_loading_spec(cfg.data, cfg.eval.tta),
        rt,
        seed=cfg.run.seed,
        channels_last=s.inputs[0],
        allowed=s.task.backends,
        splits=s.batch.splits,
        epochs=cfg.run.epochs,
        keep_backend=backend_at_start(cfg, ckpt, resume_path),
        log=log,
    )
    s.batch.splits = None  # the run's loaders hold the data set now
    check_resumed_classes(ckpt, resume_path, loaders.info.classes)
    teacher, distill = check_data_and_teacher(cfg, rt, s.task, loaders.info, s.prec, s.distilling, log)
    check_same_teacher(distill, ckpt, resume_path)  # a resumed run learns from the teacher it began with
    return DataPhase(loaders, teacher, distill)


def make_model(s: Start, d: DataPhase, rt, log, ckpt: dict | None, resume_path) -> BareModel:
    """The model (its random initial weights drawn after the loaders were built), initialised and frozen."""
    cfg = s.cfg
    model = build_model(cfg.model, d.info.num_classes, d.info.in_channels).to(rt.device)
    materialize_lazy(model, d.loaders.val, plan_tta(cfg.eval.tta, s.task, cfg.data.eval.transforms))
    init = init_and_freeze(model, cfg.model, ckpt, resume_path, d.info.num_classes, log)
    check_freeze_epochs(cfg, s.graphs)
    head = head_only(model, cfg.model, log)  # the body's parameters, before wrapping (they stay the same tensors)
    return BareModel(model, init, head)


def decide(s: Start, d: DataPhase, m: BareModel, rt, log, ckpt: dict | None) -> Decisions:
    """The loss, precision=auto and speed.channels_last=auto (the probe steps copies of the bare model), the speed
    plan: once, into one frozen object."""
    cfg, prec, auto, loss_fn = decide_loss_and_precision(
        s.cfg, rt, m.model, d.loaders, s.task, s.prec, ckpt, s.distilling, log
    )
    speed = decide_speed(
        cfg.speed,
        cfg.strategy,
        m.model,
        rt.device,
        rt.world_size,
        accum_steps=cfg.optim.accum_steps,
        graphs=s.graphs,
        static_shapes=s.progressive,
        channels_last_why=auto.channels_last_why,
    )
    return Decisions(cfg, s.batch, (d.info.sampler, d.info.sampler_why), prec, auto, speed, loss_fn)


def stack_model(s: Start, dec: Decisions, m: BareModel, d: DataPhase, rt, log) -> ModelStack:
    """EMA and SWA copies (plain and fp32, taken before wrapping), the wrapped model, its frozen norm layers (after
    wrapping: SyncBatchNorm replaces the BatchNorm modules), and what follows the module the optimizer updates."""
    cfg = dec.cfg
    ema = build_ema(cfg.ema, m.model, rt.device, dec.speed.channels_last)
    swa = build_swa(cfg.swa, m.model, cfg.run.epochs, rt.device, dec.speed.channels_last)
    model = wrap_model(
        m.model,
        cfg.strategy,
        rt,
        speed=dec.speed,
        prec=dec.prec,
        log=log,
        example=lambda: next(iter(d.loaders.train))[0],
        frozen_norms=frozen_norm_layers if cfg.model.freeze_bn_stats else None,
    )
    frozen_norms = frozen_norm_layers(model) if cfg.model.freeze_bn_stats else []
    m.head.attach(model)  # DDP: the reducer follows the head-only flags from here on (and the same SyncBN point)
    ema.attach(unwrap(model))  # the EMA follows the module the optimizer updates, never the DDP/compile wrapper
    swa.attach(unwrap(model))
    return ModelStack(model, frozen_norms, ema, swa)


def feed(s: Start, d: DataPhase, rt) -> None:
    """The training loader's wrappers, in order: mixing after the loader (every backend's batches mixed the same
    way), the teacher's logits after mixing (it sees what the student sees), ranks stopping together."""
    cfg, loaders = s.cfg, d.loaders
    if s.mixing:
        loaders.train = wrap_mix(loaders.train, cfg.mix, d.info.num_classes, cfg.run.seed, rt.rank, rt.world_size)
    if s.distilling:
        loaders.train = DistillLoader(loaders.train, d.teacher)
    loaders.train = agree_on_data(loaders.train, rt)


def optimize(s: Start, dec: Decisions, stack: ModelStack, d: DataPhase, rt, log) -> tuple:
    """The optimizer (half-weight modes keep resumed state fp32), the plan (every run-time decision), the schedule
    (swa.enabled: SWALR from swa.start) and the training loss (with the teacher's term under distillation):
    (opt, sched, plan, loss_fn)."""
    cfg = dec.cfg
    opt = build_optimizer(cfg.optim, stack.model)
    say_param_groups(cfg.optim, opt, log)
    dec.prec.attach(opt)
    plan = build_plan(
        cfg,
        rt,
        info=d.info,
        train_batches=len(d.loaders.train),
        speed=dec.speed,
        opt=opt,
        batch=dec.batch,
        inputs=s.inputs,
        distill=d.distill,
        swa=stack.swa,
        auto=dec.auto,
    )
    sched = stack.swa.schedule(build_schedule(cfg, opt, plan.steps_per_epoch), opt)
    loss_fn = DistillLoss(dec.loss_fn, cfg.distill.temperature, cfg.distill.alpha) if s.distilling else dec.loss_fn
    return opt, sched, plan, loss_fn


def decide_loss_and_precision(cfg, rt, model, loaders, task, prec, ckpt, distilling: bool, log) -> tuple:
    """The imbalance default (train/imbalance.py), precision=auto and speed.channels_last=auto (train/speed_probe.py)
    decided once: (the config saying what runs, for config.yaml, the Precision that trains, the AutoSpeed for the plan,
    the run's loss). The batches stay NCHW under auto and the false it may become: the loaders built before stand."""
    cfg, loss_fn = decide_run_loss(
        cfg, task.targets, loaders.info, rt.device, log
    )  # before the probe: it trains with it
    auto = decide_auto(cfg, rt, model, loaders.train, loss_fn, ckpt=ckpt, distilling=distilling)
    cfg = auto.resolved(cfg)
    if auto.precision != prec.mode:  # never under distillation (not measured): the teacher's Precision is the first
        prec = Precision(auto.precision, rt.device, on_nonfinite=cfg.precision.on_nonfinite, graph_safe=prec.graph_safe)
    return cfg, prec, auto, loss_fn


def check_data_and_teacher(cfg, rt, task, info, prec, distilling: bool, log) -> tuple:
    """After the data is read: what the data must have (a test split, the task's targets, data.progressive's epochs
    and graphs), then the distillation teacher (it needs the classes): (teacher, its record) or (None, None)."""
    if cfg.eval.test_at_end and info.facts.get("images", {}).get("test") is None:
        raise UsageError(
            f"eval.test_at_end=true: data.dataset={cfg.data.dataset} (root={cfg.data.root}) has no test split "
            "(image_folder reads test/ beside train/). Add one, or set eval.test_at_end=false."
        )
    check_data_task(cfg, info)
    check_epochs(cfg.data, cfg.run.epochs)
    if cfg.speed.compile:
        check_compile(cfg.data, cfg.run.epochs)
    if not distilling:
        return None, None
    return build_teacher(cfg.distill, info, rt.device, prec, cfg.speed.channels_last, log)


def build_schedule(cfg, opt, steps_per_epoch: int):
    """The run's learning-rate schedule over run.epochs (or run.max_steps, when it ends the run first)."""
    if cfg.eval.every_steps is not None and cfg.eval.every_steps > steps_per_epoch:
        raise UsageError(
            f"eval.every_steps={cfg.eval.every_steps} is more than an epoch ({steps_per_epoch} steps): "
            f"use eval.every_epochs for longer intervals, or eval.every_steps <= {steps_per_epoch}."
        )
    # run.train_time: a provisional length until the run has measured its speed (train/time_fit.py refits it)
    epochs = run_epochs(cfg)
    if cfg.run.max_steps is not None:
        epochs = min(epochs, cfg.run.max_steps / steps_per_epoch)
    return build_scheduler(cfg.sched, opt, epochs=epochs, steps_per_epoch=steps_per_epoch)


def init_and_freeze(model, model_cfg, ckpt: dict | None, resume_path, num_classes: int, log) -> dict:
    """Initialise (checkpoint > pretrained > random) and freeze `model`, saying how; returns how it was initialised
    ({"from": checkpoint | pretrained | random, and from pretrained what was loaded})."""
    record: dict = {}
    how = init_model(model, model_cfg, ckpt, log, record, num_classes)
    log(
        f"model {model_cfg.name}: initialised from "
        + {
            "checkpoint": f"checkpoint {resume_path}",
            "pretrained": f"pretrained weights {model_cfg.pretrained}"
            + (f" ({record.get('file')})" if record.get("file") != model_cfg.pretrained else ""),
            "random": "random initialisation",
        }[how]
    )
    trainable, frozen = apply_freeze(model, model_cfg.freeze, model_cfg.train_only)
    log(f"parameters: {trainable:,} trainable, {frozen:,} frozen")
    return {"from": how, **record}


def check_freeze_epochs(cfg, graphs) -> None:
    """Refuse model.freeze_epochs where what it toggles is fixed at start-up (`graphs`: the decision, not the
    setting)."""
    if cfg.model.freeze_epochs and (cfg.strategy.name == "dp" or graphs.on or cfg.precision.mode in ("fp16", "bf16")):
        raise UsageError(
            "model.freeze_epochs toggles which parameters get gradients between epochs, which CUDA graphs "
            "and the fp16/bf16 master weights fix at start-up (and DataParallel is not yet verified with "
            "it): it runs with strategy=single or strategy=ddp, speed.cuda_graphs=false and fp32/amp "
            "precision only."
        )


def say_param_groups(optim_cfg, opt, log) -> None:
    """One line on the parameter groups and their lr scales, when optim.param_groups or optim.layer_decay made them."""
    if optim_cfg.param_groups or optim_cfg.layer_decay is not None:
        scales = sorted({round(g["lr_scale"], 6) for g in opt.param_groups}, reverse=True)
        log(
            f"optimizer: {len(opt.param_groups)} parameter groups, lr x {', '.join(f'{x:g}' for x in scales[:8])}"
            f"{' ...' if len(scales) > 8 else ''} (optim.param_groups / optim.layer_decay)"
        )


def check_monitor(cfg, ema) -> None:
    """Refuse early_stop.min_delta without patience, and an ema/ monitor the run does not evaluate."""
    if cfg.early_stop.patience is None and cfg.early_stop.min_delta != 0:
        raise UsageError(
            f"early_stop.min_delta={cfg.early_stop.min_delta} has no effect without early_stop.patience; "
            "set early_stop.patience (evaluations without improvement before stopping), or remove it."
        )
    if cfg.checkpoint.monitor.startswith("ema/") and not ema.evaluates:
        raise UsageError(
            f"checkpoint.monitor={cfg.checkpoint.monitor} is a metric of the EMA weights, which this run does "
            "not evaluate: set ema.enabled=true (and ema.eval=true, ema.device=model), or monitor "
            f"{cfg.checkpoint.monitor[4:]}."
        )
    if cfg.checkpoint.monitor.startswith("swa/"):
        raise UsageError(
            f"checkpoint.monitor={cfg.checkpoint.monitor}: the SWA average is evaluated once, after the last "
            "epoch, so it cannot pick the best weights during training; monitor "
            f"{cfg.checkpoint.monitor[4:]} (swa.safetensors and its swa/val/... metrics come at the end)."
        )


def backend_at_start(cfg, ckpt, resume_path) -> str | None:
    """The backend data.backend=auto chose when a resumed run started (its decisions.json beside checkpoints/), or None:
    a measured choice could differ now, and another backend augments differently."""
    if ckpt is None or cfg.data.backend != "auto":
        return None
    backend = decisions_at_start(resume_path).get("backend")
    return backend if isinstance(backend, str) else None

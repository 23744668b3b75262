"""The flow of one run, every object passed explicitly: load -> setup -> loaders -> model -> fit."""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint import config as config_mod
from torchsprint.config.schema import import_modules
from torchsprint.errors import UsageError
from torchsprint.models.download import fetch_run_weights
from torchsprint.observe.logging import replace_file
from torchsprint.runtime.machine import environment
from torchsprint.state.rundir import claim_run_dir, finished, how_to_continue
from torchsprint.state.swa import NoSwa
from torchsprint.tasks.tta import plan_tta, with_loading_spec
from torchsprint.train.context import RunContext
from torchsprint.train.evaluation import (
    decide_run_loss,
    evaluate_run,
    evaluate_test,
    finish_swa,
    input_too_small,
    materialize_lazy,
    not_deterministic,
)
from torchsprint.train.imbalance import before_data
from torchsprint.train.resolve import resolve


def on_main(rt, fn):
    """fn() on rank 0; its result (or its UsageError, raised on every rank) shared with every rank."""
    from torchsprint.runtime.collectives import broadcast_object

    result, error = None, None
    if rt.is_main:
        try:
            result = fn()
        except UsageError as e:
            error = str(e)
    result, error = broadcast_object((result, error), rt)
    if error is not None:
        raise UsageError(error)
    return result


@dataclass
class Built:
    """Everything one training run is made of, built from the config in the documented order."""

    loaders: object
    model: torch.nn.Module
    frozen_norms: list
    opt: torch.optim.Optimizer
    sched: object
    prec: object
    loss_fn: torch.nn.Module
    ema: object  # ema.ModelEma, or the no-op ema.NoEma
    init: dict  # how the model was initialised (checkpoint | pretrained | random) and, from pretrained, what was loaded
    cfg: object  # the config with data.batch_size and optim.accum_steps resolved (batch_size.choose_batch): read this one
    batch: object  # batch_size.BatchChoice: the batch size, accumulation and why
    head_only: object = None  # models.init.HeadOnly of model.freeze_epochs (the no-op NO_HEAD_ONLY when off)
    plan: object = None  # plan.RunPlan: every run-time decision, made once; the engine and the records read it
    swa: object = field(default_factory=NoSwa)  # swa.Swa, or the no-op swa.NoSwa


def build_training(cfg, rt, log, ckpt: dict | None = None, resume_path=None) -> Built:
    """loaders -> model -> init (checkpoint > pretrained > random) -> freeze -> wrap -> optimizer -> scheduler -> loss.

    Shared by `train` and `bench` so that a benchmark measures exactly what training runs. data.batch_size=auto and
    data.effective_batch_size are resolved first (batch_size.choose_batch); everything after reads `Built.cfg`.
    """
    from torchsprint.data import build_loaders
    from torchsprint.data.preprocess.mix import check_mix, wrap_mix
    from torchsprint.models import build_model
    from torchsprint.models.init import frozen_norm_layers, head_only
    from torchsprint.optim.optimizers import build_optimizer
    from torchsprint.runtime.collectives import agree_on_data
    from torchsprint.runtime.parallel import decide_cuda_graphs, unwrap, wrap_model
    from torchsprint.state.ema import build_ema
    from torchsprint.state.precision import Precision, concrete_mode
    from torchsprint.state.resume import check_resumed_classes
    from torchsprint.state.swa import build_swa
    from torchsprint.tasks.core import get_task
    from torchsprint.train.batch_size import choose_batch, resolved_config
    from torchsprint.train.distill import DistillLoader, DistillLoss, check_distill, check_same_teacher
    from torchsprint.train.plan import build_plan, decide_input_format, decide_speed

    cfg = resolve(cfg)  # the first phase, a no-op after train(); then cuda_graphs, decided once for every reader
    progressive = cfg.data.progressive.start_size is not None  # the input size changes between epochs
    graphs = decide_cuda_graphs(cfg.speed, cfg.strategy, rt.device, rt.world_size, cfg.data.drop_last,
                                cfg.model.freeze_epochs, progressive)
    prec = Precision(concrete_mode(cfg.precision.mode), rt.device, on_nonfinite=cfg.precision.on_nonfinite,
                     graph_safe=graphs.on)  # precision=auto: fp32 until the model exists and speed_probe decides
    task = get_task(cfg.task)
    task.check(cfg)
    mixing = check_mix(cfg.mix, cfg.task, task.targets, cfg.loss)
    distilling = check_distill(cfg, task.targets)
    fetch_run_weights(cfg.model, cfg.distill.teacher if distilling else None, rt, log, resuming=ckpt is not None)
    batch = choose_batch(cfg, rt, log, ckpt)  # before anything of the run is built: the search leaves nothing behind
    cfg = resolved_config(cfg, batch)
    cfg = before_data(cfg, task.targets)  # data.sampler=auto: shuffle where it has nothing to do; refusals
    inputs = decide_input_format(cfg.speed)  # (channels_last batches, why): the loaders and the plan read this
    # eval.tta=five_crop/ten_crop loads larger eval images, to crop from (tta.loading_spec); training is unchanged
    loaders = build_loaders(with_loading_spec(cfg.data, cfg.eval.tta), rt, seed=cfg.run.seed, channels_last=inputs[0],
                            allowed=task.backends, splits=batch.splits, epochs=cfg.run.epochs,
                            keep_backend=backend_at_start(cfg, ckpt, resume_path), log=log)
    batch.splits = None  # the run's loaders hold the data set now
    info = loaders.info
    check_resumed_classes(ckpt, resume_path, info.classes)  # before the model: it would not load, blaming the file
    teacher, distill = check_data_and_teacher(cfg, rt, task, info, prec, distilling, log)
    check_same_teacher(distill, ckpt, resume_path)  # a resumed run learns from the teacher it began with
    model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
    materialize_lazy(model, loaders.val, plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms))
    init = init_and_freeze(model, cfg.model, ckpt, resume_path, info.num_classes, log)
    check_freeze_epochs(cfg, graphs)
    head = head_only(model, cfg.model, log)  # the body's parameters, before wrapping (they stay the same tensors)
    cfg, prec, auto, loss_fn = decide_precision_and_format(cfg, rt, model, loaders, task, prec, ckpt, distilling, log)
    speed = decide_speed(cfg.speed, cfg.strategy, model, rt.device, rt.world_size, accum_steps=cfg.optim.accum_steps,
                         graphs=graphs, static_shapes=progressive, channels_last_why=auto.channels_last_why)
    ema = build_ema(cfg.ema, model, rt.device, speed.channels_last)  # copied before wrap_model: plain and fp32
    swa = build_swa(cfg.swa, model, cfg.run.epochs, rt.device, speed.channels_last)  # the same
    model = wrap_model(model, cfg.strategy, rt, speed=speed, prec=prec, log=log,
                       example=lambda: next(iter(loaders.train))[0],
                       frozen_norms=frozen_norm_layers if cfg.model.freeze_bn_stats else None)
    # After wrap_model: SyncBatchNorm conversion replaces the BatchNorm modules.
    frozen_norms = frozen_norm_layers(model) if cfg.model.freeze_bn_stats else []
    head.attach(model)  # DDP: the reducer follows the head-only flags from here on (and the same SyncBN point)
    ema.attach(unwrap(model))  # the EMA follows the module the optimizer updates, never the DDP/compile wrapper
    swa.attach(unwrap(model))
    if mixing:  # after the loader, so every backend's batches are mixed the same way
        loaders.train = wrap_mix(loaders.train, cfg.mix, info.num_classes, cfg.run.seed, rt.rank, rt.world_size)
    if distilling:  # after mixing: the teacher sees the images the student sees; one unwrapped copy per rank
        loaders.train = DistillLoader(loaders.train, teacher)
    loaders.train = agree_on_data(loaders.train, rt)  # ranks stop together when one runs out of data
    opt = build_optimizer(cfg.optim, model)
    say_param_groups(cfg.optim, opt, log)
    prec.attach(opt)  # half-weight modes: resumed optimizer state stays fp32
    plan = build_plan(cfg, rt, info=info, train_batches=len(loaders.train), speed=speed, opt=opt, batch=batch,
                      inputs=decide_input_format(cfg.speed), distill=distill, swa=swa, auto=auto)
    sched = swa.schedule(build_schedule(cfg, opt, plan.steps_per_epoch), opt)  # swa.enabled: SWALR from swa.start
    if distilling:  # training batches carry the teacher's logits; evaluation's plain targets get the task loss alone
        loss_fn = DistillLoss(loss_fn, cfg.distill.temperature, cfg.distill.alpha)
    check_monitor(cfg, ema)
    head.apply(0)  # built as epoch 1 trains (fit sets it again at every epoch, resumed or not)
    return Built(loaders, model, frozen_norms, opt, sched, prec, loss_fn, ema, init, cfg, batch, head, plan, swa)


def decide_precision_and_format(cfg, rt, model, loaders, task, prec, ckpt, distilling: bool, log) -> tuple:
    """The imbalance default (train/imbalance.py), precision=auto and speed.channels_last=auto (train/speed_probe.py)
    decided once: (the config saying what runs, for config.yaml, the Precision that trains, the AutoSpeed for the plan,
    the run's loss). The batches stay NCHW under auto and the false it may become: the loaders built before stand."""
    from torchsprint.state.precision import Precision
    from torchsprint.train.speed_probe import decide_auto

    cfg, loss_fn = decide_run_loss(cfg, task.targets, loaders.info, rt.device, log)  # before the probe: it trains with it
    auto = decide_auto(cfg, rt, model, loaders.train, loss_fn, ckpt=ckpt, distilling=distilling)
    cfg = auto.resolved(cfg)
    if auto.precision != prec.mode:  # never under distillation (not measured): the teacher's Precision is the first
        prec = Precision(auto.precision, rt.device, on_nonfinite=cfg.precision.on_nonfinite, graph_safe=prec.graph_safe)
    return cfg, prec, auto, loss_fn


def check_data_and_teacher(cfg, rt, task, info, prec, distilling: bool, log) -> tuple:
    """After the data is read: what the data must have (a test split, the task's targets, data.progressive's epochs
    and graphs), then the distillation teacher (it needs the classes): (teacher, its record) or (None, None)."""
    from torchsprint.data.preprocess.progressive import check_compile, check_epochs
    from torchsprint.tasks.core import check_data_task
    from torchsprint.train.distill import build_teacher

    if cfg.eval.test_at_end and info.facts.get("images", {}).get("test") is None:
        raise UsageError(f"eval.test_at_end=true: data.dataset={cfg.data.dataset} (root={cfg.data.root}) has no test split "
                         "(image_folder reads test/ beside train/). Add one, or set eval.test_at_end=false.")
    check_data_task(cfg, info)
    check_epochs(cfg.data, cfg.run.epochs)
    if cfg.speed.compile:
        check_compile(cfg.data, cfg.run.epochs)
    if not distilling:
        return None, None
    return build_teacher(cfg.distill, info, rt.device, prec, cfg.speed.channels_last, log)


def build_schedule(cfg, opt, steps_per_epoch: int):
    """The run's learning-rate schedule over run.epochs (or run.max_steps, when it ends the run first)."""
    from torchsprint.optim.schedulers import build_scheduler

    if cfg.eval.every_steps is not None and cfg.eval.every_steps > steps_per_epoch:
        raise UsageError(f"eval.every_steps={cfg.eval.every_steps} is more than an epoch ({steps_per_epoch} steps): "
                         f"use eval.every_epochs for longer intervals, or eval.every_steps <= {steps_per_epoch}.")
    epochs = cfg.run.epochs
    if cfg.run.max_steps is not None:
        epochs = min(epochs, cfg.run.max_steps / steps_per_epoch)
    return build_scheduler(cfg.sched, opt, epochs=epochs, steps_per_epoch=steps_per_epoch)


def init_and_freeze(model, model_cfg, ckpt: dict | None, resume_path, num_classes: int, log) -> dict:
    """Initialise (checkpoint > pretrained > random) and freeze `model`, saying how; returns how it was initialised
    ({"from": checkpoint | pretrained | random, and from pretrained what was loaded})."""
    from torchsprint.models.init import apply_freeze, init_model

    record: dict = {}
    how = init_model(model, model_cfg, ckpt, log, record, num_classes)
    log(f"model {model_cfg.name}: initialised from "
        + {"checkpoint": f"checkpoint {resume_path}", "pretrained": f"pretrained weights {model_cfg.pretrained}"
           + (f" ({record.get('file')})" if record.get("file") != model_cfg.pretrained else ""),
           "random": "random initialisation"}[how])
    trainable, frozen = apply_freeze(model, model_cfg.freeze, model_cfg.train_only)
    log(f"parameters: {trainable:,} trainable, {frozen:,} frozen")
    return {"from": how, **record}


def check_freeze_epochs(cfg, graphs) -> None:
    """Refuse model.freeze_epochs where what it toggles is fixed at start-up (`graphs`: the decision, not the setting)."""
    if cfg.model.freeze_epochs and (cfg.strategy.name == "dp" or graphs.on or cfg.precision.mode in ("fp16", "bf16")):
        raise UsageError("model.freeze_epochs toggles which parameters get gradients between epochs, which CUDA graphs "
                         "and the fp16/bf16 master weights fix at start-up (and DataParallel is not yet verified with "
                         "it): it runs with strategy=single or strategy=ddp, speed.cuda_graphs=false and fp32/amp "
                         "precision only.")


def say_param_groups(optim_cfg, opt, log) -> None:
    """One line on the parameter groups and their lr scales, when optim.param_groups or optim.layer_decay made them."""
    if optim_cfg.param_groups or optim_cfg.layer_decay is not None:
        scales = sorted({round(g["lr_scale"], 6) for g in opt.param_groups}, reverse=True)
        log(f"optimizer: {len(opt.param_groups)} parameter groups, lr x {', '.join(f'{x:g}' for x in scales[:8])}"
            f"{' ...' if len(scales) > 8 else ''} (optim.param_groups / optim.layer_decay)")


def check_monitor(cfg, ema) -> None:
    """Refuse early_stop.min_delta without patience, and an ema/ monitor the run does not evaluate."""
    if cfg.early_stop.patience is None and cfg.early_stop.min_delta != 0:
        raise UsageError(f"early_stop.min_delta={cfg.early_stop.min_delta} has no effect without early_stop.patience; "
                         "set early_stop.patience (evaluations without improvement before stopping), or remove it.")
    if cfg.checkpoint.monitor.startswith("ema/") and not ema.evaluates:
        raise UsageError(f"checkpoint.monitor={cfg.checkpoint.monitor} is a metric of the EMA weights, which this run does "
                         "not evaluate: set ema.enabled=true (and ema.eval=true, ema.device=model), or monitor "
                         f"{cfg.checkpoint.monitor[4:]}.")
    if cfg.checkpoint.monitor.startswith("swa/"):
        raise UsageError(f"checkpoint.monitor={cfg.checkpoint.monitor}: the SWA average is evaluated once, after the last "
                         "epoch, so it cannot pick the best weights during training; monitor "
                         f"{cfg.checkpoint.monitor[4:]} (swa.safetensors and its swa/val/... metrics come at the end).")


def backend_at_start(cfg, ckpt, resume_path) -> str | None:
    """The backend data.backend=auto chose when a resumed run started (its decisions.json beside checkpoints/), or None:
    a measured choice could differ now, and another backend augments differently."""
    from torchsprint.state.resume import decisions_at_start

    if ckpt is None or cfg.data.backend != "auto":
        return None
    backend = decisions_at_start(resume_path).get("backend")
    return backend if isinstance(backend, str) else None


def train(cfg, *, quiet: bool = False, overwrite: bool = False, dry_run: bool = False, hold_signals: bool = False) -> dict:
    """Train one run described by `cfg` and return its summary (also written to summary.json).

    Args:
        cfg: the run's config.
        quiet: no console output (files are still written).
        overwrite: run.dir holds another run: move its files into replaced-<time>/ and start over there.
        dry_run: build and check everything (config, data, model, optimizer), report, and stop before changing any file.
        hold_signals: once a stop signal paused the run, ignore further ones (Stopper's `hold`; the CLI exits 75 next).
    Everything that can be validated (names, data, model, transforms) is built before the run folder is created; a
    finished run asked to resume says so and leaves its files alone.
    """
    from torchsprint import runtime
    from torchsprint.observe.logging import RunLogger, check_sinks
    from torchsprint.runtime.preempt import Stopper, check_requeue, requeue, stop_launcher
    from torchsprint.state.resume import disk_full_error, find_resume, restore_run
    from torchsprint.state.rundir import RunLock, create_unique, make_folder
    from torchsprint.tasks.core import get_task

    t0 = time.monotonic()  # run.max_time counts from here: building the data and model is part of the budget
    import_modules(cfg.imports)
    task = get_task(resolve(cfg).task)  # the first phase (cfg filled in place): what the task and the data decide
    check_sinks(cfg.log)
    check_requeue(cfg.run, cfg.checkpoint.resume)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    lock, clean, logger, run_dir = None, False, None, None
    try:
        logger = RunLogger(None, cfg.log, enabled=rt.is_main, console=not quiet)
        held = {}  # the lock stays in rank 0's process; only the decision is shared

        def claim():
            path, exists, held["lock"] = claim_run_dir(cfg, overwrite, logger.info, dry_run)
            return str(path), exists

        run_dir, exists = on_main(rt, claim)
        run_dir, lock = Path(run_dir), held.get("lock")
        resume_path, ckpt = find_resume(cfg.checkpoint.resume, run_dir, logger.info, rt)
        if ckpt is not None and finished(ckpt, cfg.run) and (run_dir / "summary.json").is_file():
            summary = finished_summary(ckpt, cfg, run_dir, logger)
            logger.close()
            clean = True
            return summary
        b = build_training(cfg, rt, logger.info, ckpt, resume_path)
        cfg = b.cfg  # data.batch_size and optim.accum_steps resolved (auto, effective_batch_size): config.yaml says them
        if dry_run:
            logger.info(f"dry run: everything checked ({rt.world_size} process(es)); would train in {run_dir}"
                        f"{' (resuming)' if ckpt else ''}; nothing was written")
            clean = True
            return {"dry_run": True, "run_dir": str(run_dir), "resume": str(resume_path) if resume_path else None}
        if not exists:  # only now, with everything validated: a folder no other run can get, locked
            run_dir = Path(on_main(rt, lambda: str(make_folder(run_dir) if cfg.run.dir else create_unique(run_dir))))
            if rt.is_main:
                lock = RunLock(run_dir)
        rt.barrier()
        state = restore_run(ckpt, b, rt, resume_path, logger.info)  # its refusals before any file is written
        write_run_records(cfg, rt, b, run_dir, logger, ckpt)
        saver, weights_meta = make_saver(cfg, rt, b, run_dir, ckpt, state, logger)
        # Stop signals are handled (a flag, no exception) from the first step until the run's files are written.
        stop = Stopper(cfg.run, state.global_step, t0, hold=hold_signals)
        ctx = RunContext(rt, run_dir, logger, saver, stop, weights_meta=weights_meta, task=task,
                         make_metrics=lambda: task.make_metrics(b.loaders.info, cfg.eval, rt.device))
        with stop:
            summary = fit_explained(cfg, b, state, ctx)
        logger.close(finished=not summary["paused"])
        if summary["stopped"] == "signal" and cfg.run.requeue and rt.is_main:  # last: SLURM ends this job at once
            summary["requeued"] = requeue(os.environ["SLURM_JOB_ID"], logger.info)
        stop_launcher(stop, rt)  # torchrun's agent would restart a paused group (--max-restarts)
        clean = True
        return summary
    except OSError as e:  # a full disk anywhere (metrics.jsonl, the plots, summary.json): one line, the checkpoint kept
        full = disk_full_error(e, run_dir)
        if full is None:
            raise
        raise full from e
    finally:
        if logger is not None:
            logger.close(finished=False)  # an error: MLflow/W&B mark the run failed (a no-op after a normal close)
        if lock is not None:
            lock.release()
        runtime.teardown(rt, clean)


def finished_summary(ckpt: dict, cfg, run_dir: Path, logger) -> dict:
    """A finished run asked to train again: say so, and return its summary.json as it is (files left alone)."""
    ts = ckpt["train_state"]
    steps = f" of run.max_steps={cfg.run.max_steps}" if cfg.run.max_steps is not None else ""
    logger.info(f"{run_dir} is a finished run (epoch {ts['epoch']} of {cfg.run.epochs}, step {ts['global_step']}"
                f"{steps}): nothing to do, its files are left as they are (results: summary.json); "
                f"{how_to_continue(ts, cfg.run, run_dir)}.")
    try:
        summary = json.loads((run_dir / "summary.json").read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        summary = None
    if not isinstance(summary, dict):  # a damaged results file is said, not a traceback; nothing is rewritten
        logger.info(f"note: {run_dir / 'summary.json'} is damaged (not a JSON object); left as it is.")
        summary = {}
    return summary | {"run_dir": str(run_dir), "already_finished": True}


def write_run_records(cfg, rt, b: Built, run_dir: Path, logger, ckpt: dict | None) -> None:
    """Before step 0: the log files (cut back to what `ckpt`, the checkpoint resumed from, covers), config.yaml,
    env.json, and decisions.json with the start-up summary, both written from the plan the run trains with (they
    cannot disagree with it)."""
    from torchsprint.train.plan import decisions, describe_decisions

    logger.open_files(run_dir, params=config_mod.to_dict(cfg), out_dir=cfg.run.out_dir,
                      resumed_step=None if ckpt is None else ckpt["train_state"]["global_step"],
                      resumed_counts=None if ckpt is None else ckpt.get("log_records"))
    if rt.is_main:
        replace_file(run_dir / "config.yaml", config_mod.dump_yaml(cfg))  # each file whole or not at all (a full disk)
        replace_file(run_dir / "env.json", json.dumps(environment(rt, cfg.run.seed), indent=1))
    logger.info(f"run folder: {run_dir}  device: {rt.device}  world size: {rt.world_size}")
    decided = decisions(b.plan, b.loaders.info.facts)
    for line in describe_decisions(decided):
        logger.info(line)
    if rt.is_main:
        replace_file(run_dir / "decisions.json", json.dumps(decided, indent=1))
    if b.swa.enabled:
        from torchsprint.state.swa import describe

        logger.info(describe(b.swa, cfg.run.epochs))
    logger.expect(cfg, decided | {"batch_shape": b.loaders.info.image_size})  # for the run's time estimate


def make_saver(cfg, rt, b: Built, run_dir: Path, ckpt: dict | None, state, logger) -> tuple:
    """(checkpoint.Saver, the weights files' metadata), once the run is accepted and its records written."""
    from torchsprint.state.checkpoint import Saver, data_geometry

    info = b.loaders.info
    resolved = config_mod.to_dict(cfg)
    saver = Saver(run_dir, cfg.checkpoint, rt, {"classes": info.classes, "config": resolved},
                  geometry=data_geometry(cfg, rt.world_size), resumed_step=state.global_step if ckpt is not None else None,
                  log=logger.info, ema=b.ema, flush_logs=logger.flush, swa=b.swa)
    weights_meta = {"classes": json.dumps(info.classes), "model": cfg.model.name, "in_channels": str(info.in_channels),
                    "format": "torchsprint", "task": cfg.task, "config": json.dumps(resolved)}
    return saver, weights_meta


def fit_explained(cfg, b: Built, state, ctx: RunContext) -> dict:
    """engine.fit, then the test split and summary.json; an out-of-memory error, too-small inputs or a missing
    deterministic kernel become one UsageError that says what to change."""
    from torchsprint.train.batch_size import is_oom, oom_message
    from torchsprint.train.engine import fit

    try:
        summary = fit(b.plan, b, state, ctx)
        finish_swa(cfg, b, ctx, summary)
        finish_summary(cfg, b, ctx, summary)
    except RuntimeError as e:
        if is_oom(e):  # the checkpoints saved so far are whole files (atomic writes): the message names the last
            evaluating = any(f.name == "evaluate" for f in traceback.extract_tb(e.__traceback__))
            step = state.global_step + (0 if evaluating else 1)  # the step that failed, not the last one done
            raise UsageError(oom_message(e, cfg, ctx.rt, step, ctx.run_dir, evaluating)) from e
        explained = input_too_small(e, b.model, cfg, b.loaders) or not_deterministic(e, cfg)
        if explained is None:
            raise
        raise explained from e
    return summary


def finish_summary(cfg, b: Built, ctx: RunContext, summary: dict) -> None:
    """After fit: the test split (eval.test_at_end), then summary.json and the closing table (rank 0)."""
    rt, run_dir, logger = ctx.rt, ctx.run_dir, ctx.logger
    if cfg.eval.test_at_end and not summary["paused"]:
        summary["test"] = evaluate_test(cfg, b, ctx, summary["global_step"])
    summary["run_dir"] = str(run_dir)
    summary["init"] = b.init
    if rt.is_main:
        replace_file(run_dir / "summary.json", json.dumps(summary, indent=1))
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in summary["final"].items()]
        rows += [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in summary.get("test", {}).items()]
        rows += [("best " + cfg.checkpoint.monitor, f"{summary['best_metric']:.4f} (epoch {summary['best_epoch']})"
                  if summary["best_metric"] is not None else "-"),
                 ("stopped", summary["stopped"] + (f" ({summary['signal']})" if summary.get("signal") else "")),
                 ("train images/s", f"{summary['train_images_per_s']:.0f}"),
                 ("data-wait share", f"{summary['data_wait_share']:.0%}"),
                 ("wall time", f"{summary['seconds']:.1f} s"), ("run folder", str(run_dir))]
        logger.summary("run summary", rows)


__all__ = ["train", "evaluate_run"]

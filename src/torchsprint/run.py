"""The flow of one run, every object passed explicitly: load -> setup -> loaders -> model -> fit."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint import config as config_mod
from torchsprint.config import import_modules
from torchsprint.errors import UsageError
from torchsprint.rundir import claim_run_dir, finished, how_to_continue  # noqa: F401  (how_to_continue: tests)
from torchsprint.saved_config import load_run_config, naming_imports, resumed_run_config  # noqa: F401  (re-exported)
from torchsprint.swa import NoSwa
from torchsprint.tta import first_view, plan_tta, with_loading_spec, wrap_tta


def on_main(rt, fn):
    """fn() on rank 0; its result (or its UsageError, raised on every rank) shared with every rank."""
    from torchsprint.collectives import broadcast_object

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


def environment(rt, seed: int) -> dict:
    """Versions, git revision, device, seed: what it takes to reproduce a run (written before step 0)."""
    import torchvision

    from torchsprint.version import __version__

    def git_rev():
        try:
            here = Path(__file__).resolve().parent
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5)
            return (out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    dev = str(rt.device)
    if rt.device.type == "cuda":
        dev += f" ({torch.cuda.get_device_name(rt.device)})"
    return {
        "torchsprint": __version__, "torch": torch.__version__, "torchvision": torchvision.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(), "device": dev, "world_size": rt.world_size, "seed": seed,
        "git_revision": git_rev(), "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def materialize_lazy(model, loader, tta=None) -> None:
    """Run one no-grad forward when the model has lazy modules (LazyLinear) so shapes are known.

    `tta` (tta.TtaPlan or None): with multi-crop the eval loader's images are larger than the model's input;
    one view of them is its shape."""
    from torch.nn.parameter import UninitializedParameter

    if any(isinstance(p, UninitializedParameter) for p in model.parameters()):
        loader.set_epoch(0)
        images, _ = next(iter(loader))
        with torch.no_grad():
            model(first_view(images[:1], tta))


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
    from torchsprint.batch_size import choose_batch, resolved_config
    from torchsprint.collectives import agree_on_data
    from torchsprint.data import build_loaders
    from torchsprint.ema import build_ema
    from torchsprint.models import build_model
    from torchsprint.models.init import apply_freeze, frozen_norm_layers, head_only, init_model
    from torchsprint.optim.optimizers import build_optimizer
    from torchsprint.optim.schedulers import build_scheduler
    from torchsprint.parallel import decide_cuda_graphs, unwrap, wrap_model
    from torchsprint.plan import build_plan, decide_input_format, decide_speed
    from torchsprint.precision import Precision
    from torchsprint.swa import build_swa

    # speed.cuda_graphs decided once: the capture, autocast's cache and decisions.json all read `graphs`.
    graphs = decide_cuda_graphs(cfg.speed, cfg.strategy, rt.device, rt.world_size, cfg.data.drop_last,
                                cfg.model.freeze_epochs)
    prec = Precision(cfg.precision.mode, rt.device, on_nonfinite=cfg.precision.on_nonfinite, graph_safe=graphs.on)
    from torchsprint.data.preprocess.mix import check_mix, wrap_mix
    from torchsprint.distill import DistillLoader, DistillLoss, build_teacher, check_distill
    from torchsprint.tasks import check_data_task, get_task

    task = get_task(cfg.task)
    task.check(cfg)
    mixing = check_mix(cfg.mix, cfg.task, task.targets, cfg.loss)
    distilling = check_distill(cfg, task.targets)
    batch = choose_batch(cfg, rt, log, ckpt)  # before anything of the run is built: the search leaves nothing behind
    cfg = resolved_config(cfg, batch)
    check_imbalance(cfg, task.targets)
    inputs = decide_input_format(cfg.speed)  # (channels_last batches, why): the loaders and the plan read this
    # eval.tta=five_crop/ten_crop loads larger eval images, to crop from (tta.loading_spec); training is unchanged
    loaders = build_loaders(with_loading_spec(cfg.data, cfg.eval.tta), rt, seed=cfg.run.seed, channels_last=inputs[0],
                            allowed=task.backends, splits=batch.splits)
    batch.splits = None  # the run's loaders hold the data set now
    if cfg.eval.test_at_end and loaders.info.facts.get("images", {}).get("test") is None:
        raise UsageError(f"eval.test_at_end=true: data.dataset={cfg.data.dataset} (root={cfg.data.root}) has no test split "
                         "(image_folder reads test/ beside train/). Add one, or set eval.test_at_end=false.")
    info = loaders.info
    check_data_task(cfg, info)
    teacher, distill = build_teacher(cfg.distill, info, rt.device, prec, cfg.speed.channels_last, log) if distilling \
        else (None, None)  # after the data (its classes), before the student model and the run folder
    model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
    materialize_lazy(model, loaders.val, plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms))
    init_record: dict = {}
    how = init_model(model, cfg.model, ckpt, log, init_record, info.num_classes)
    log(f"model {cfg.model.name}: initialised from "
        + {"checkpoint": f"checkpoint {resume_path}", "pretrained": f"pretrained weights {cfg.model.pretrained}"
           + (f" ({init_record.get('file')})" if init_record.get("file") != cfg.model.pretrained else ""),
           "random": "random initialisation"}[how])
    trainable, frozen = apply_freeze(model, cfg.model.freeze, cfg.model.train_only)
    log(f"parameters: {trainable:,} trainable, {frozen:,} frozen")
    if cfg.model.freeze_epochs and (cfg.strategy.name == "dp" or graphs.on  # graphs: the decision, not the setting
                                    or cfg.precision.mode in ("fp16", "bf16")):
        raise UsageError("model.freeze_epochs toggles which parameters get gradients between epochs, which CUDA graphs "
                         "and the fp16/bf16 master weights fix at start-up (and DataParallel is not yet verified with "
                         "it): it runs with strategy=single or strategy=ddp, speed.cuda_graphs=false and fp32/amp "
                         "precision only.")
    head = head_only(model, cfg.model, log)  # the body's parameters, before wrapping (they stay the same tensors)
    speed = decide_speed(cfg.speed, cfg.strategy, model, rt.device, rt.world_size, accum_steps=cfg.optim.accum_steps,
                         graphs=graphs)  # what wrap_model applies and the plan reports: one object
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
    if cfg.optim.param_groups or cfg.optim.layer_decay is not None:
        scales = sorted({round(g["lr_scale"], 6) for g in opt.param_groups}, reverse=True)
        log(f"optimizer: {len(opt.param_groups)} parameter groups, lr x {', '.join(f'{x:g}' for x in scales[:8])}"
            f"{' ...' if len(scales) > 8 else ''} (optim.param_groups / optim.layer_decay)")
    prec.attach(opt)  # half-weight modes: resumed optimizer state stays fp32
    plan = build_plan(cfg, rt, info=info, train_batches=len(loaders.train), speed=speed, opt=opt, inputs=inputs,
                      batch=batch, distill=distill, swa=swa)
    steps_per_epoch = plan.steps_per_epoch
    if cfg.eval.every_steps is not None and cfg.eval.every_steps > steps_per_epoch:
        raise UsageError(f"eval.every_steps={cfg.eval.every_steps} is more than an epoch ({steps_per_epoch} steps): "
                         f"use eval.every_epochs for longer intervals, or eval.every_steps <= {steps_per_epoch}.")
    epochs = cfg.run.epochs
    if cfg.run.max_steps is not None:
        epochs = min(epochs, cfg.run.max_steps / steps_per_epoch)
    sched = build_scheduler(cfg.sched, opt, epochs=epochs, steps_per_epoch=steps_per_epoch)
    sched = swa.schedule(sched, opt)  # swa.enabled: SWALR takes over from swa.start (the same object otherwise)
    loss_fn = build_run_loss(cfg, task.targets, info, log).to(rt.device)
    if distilling:  # training batches carry the teacher's logits; evaluation's plain targets get the task loss alone
        loss_fn = DistillLoss(loss_fn, cfg.distill.temperature, cfg.distill.alpha)
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
    head.apply(0)  # built as epoch 1 trains (fit sets it again at every epoch, resumed or not)
    return Built(loaders, model, frozen_norms, opt, sched, prec, loss_fn, ema, {"from": how, **init_record}, cfg, batch, head,
                 plan, swa)


def check_imbalance(cfg, targets: str) -> None:
    """Refuse data.sampler=balanced and loss.class_weights=auto where they have no meaning (before any data is read)."""
    asked = [s for s, on in (("data.sampler=balanced", cfg.data.sampler == "balanced"),
                             ("loss.class_weights=auto", cfg.loss.class_weights == "auto")) if on]
    if asked and targets != "class_index":
        raise UsageError(f"{' and '.join(asked)} balance classes, but task={cfg.task} has no single class per image "
                         f"(its targets are {targets}); remove {' and '.join(s.split('=')[0] for s in asked)}.")
    if cfg.loss.class_weights != "auto":
        return
    if cfg.loss.terms or cfg.loss.name != "cross_entropy":
        raise UsageError(f"loss.class_weights=auto sets cross_entropy's per-class weight, but the loss is "
                         f"{'loss.terms' if cfg.loss.terms else cfg.loss.name}; use loss.name=cross_entropy, or give "
                         "per-class weights in the loss's own args.")
    if "weight" in cfg.loss.args:
        raise UsageError("loss.class_weights=auto and loss.args.weight both set the per-class weights; keep one.")


def build_run_loss(cfg, targets: str, info, log=lambda *_: None):
    """build_loss of the run, with loss.class_weights=auto resolved from the training counts in `info.facts`
    (training and every later evaluation of the run use the same weighted loss)."""
    from torchsprint.optim.losses import build_loss

    loss_cfg = cfg.loss
    if cfg.loss.class_weights == "auto":
        weight = class_weights(info)
        loss_cfg = cfg.loss.model_copy(update={"args": {**cfg.loss.args, "weight": weight}})
        log("loss.class_weights=auto: cross_entropy weight per class (1 / training count, mean 1): "
            + ", ".join(f"{c} {w:.3g}" for c, w in list(zip(info.classes, weight.tolist()))[:10])
            + (f", ... {len(weight) - 10} more" if len(weight) > 10 else ""))
    return build_loss(loss_cfg, targets, info.num_classes)


def class_weights(info) -> torch.Tensor:
    """loss.class_weights=auto: inverse training frequency per class, normalised to mean 1 (float32, class order)."""
    counts = info.facts.get("class_counts", {}).get("per_class")
    if counts is None:
        raise UsageError("loss.class_weights=auto needs the training set's class counts, which this dataset does not "
                         "give (no per-sample class labels); set loss.args.weight (one value per class) instead.")
    empty = [c for c, n in zip(info.classes, counts) if n == 0]
    if empty:
        raise UsageError(f"loss.class_weights=auto: class(es) {empty[:5]} have no training images, so their inverse "
                         "frequency is infinite; add images, or set loss.args.weight (one value per class) instead.")
    inv = 1.0 / torch.tensor(counts, dtype=torch.float64)
    return (inv / inv.mean()).float()


def train(cfg, *, quiet: bool = False, overwrite: bool = False, dry_run: bool = False) -> dict:
    """Train one run described by `cfg` and return its summary (also written to summary.json).

    Args:
        cfg: the run's config.
        quiet: no console output (files are still written).
        overwrite: run.dir holds another run: move its files into replaced-<time>/ and start over there.
        dry_run: build and check everything (config, data, model, optimizer), report, and stop before
            creating or changing any file.
    Everything that can be validated (names, data, model, transforms) is built before the run folder
    is created; a finished run asked to resume says so and leaves its files alone.
    """
    from torchsprint import runtime
    from torchsprint.batch_size import is_oom, oom_message
    from torchsprint.checkpoint import Saver, TrainState, data_geometry
    from torchsprint.engine import fit
    from torchsprint.logging import RunLogger, check_sinks
    from torchsprint.preempt import Stopper, check_requeue, requeue
    from torchsprint.resume import find_resume, restore
    from torchsprint.rundir import RunLock, create_unique, make_folder
    from torchsprint.tasks import get_task

    t0 = time.monotonic()  # run.max_time counts from here: building the data and model is part of the budget
    import_modules(cfg.imports)
    task = get_task(cfg.task)
    check_sinks(cfg.log)
    check_requeue(cfg.run, cfg.checkpoint.resume)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    lock, clean, logger = None, False, None
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
            logger.close()
            clean = True
            return summary | {"run_dir": str(run_dir), "already_finished": True}
        b = build_training(cfg, rt, logger.info, ckpt, resume_path)
        cfg = b.cfg  # data.batch_size and optim.accum_steps resolved (auto, effective_batch_size): config.yaml says them
        if dry_run:
            logger.info(f"dry run: everything checked; would train in {run_dir}{' (resuming)' if ckpt else ''}; "
                        "nothing was written")
            clean = True
            return {"dry_run": True, "run_dir": str(run_dir), "resume": str(resume_path) if resume_path else None}
        if not exists:  # only now, with everything validated: a folder no other run can get, locked
            run_dir = Path(on_main(rt, lambda: str(make_folder(run_dir) if cfg.run.dir else create_unique(run_dir))))
            if rt.is_main:
                lock = RunLock(run_dir)
        rt.barrier()
        logger.open_files(run_dir, params=config_mod.to_dict(cfg), out_dir=cfg.run.out_dir,
                          resumed_step=None if ckpt is None else ckpt["train_state"]["global_step"])
        if rt.is_main:
            (run_dir / "config.yaml").write_text(config_mod.dump_yaml(cfg))
            (run_dir / "env.json").write_text(json.dumps(environment(rt, cfg.run.seed), indent=1))
        logger.info(f"run folder: {run_dir}  device: {rt.device}  world size: {rt.world_size}")
        info = b.loaders.info
        from torchsprint.plan import decisions, describe_decisions

        decided = decisions(b.plan, info.facts)  # from the plan the run trains with: they cannot disagree
        for line in describe_decisions(decided):
            logger.info(line)
        if rt.is_main:
            (run_dir / "decisions.json").write_text(json.dumps(decided, indent=1))
        if b.swa.enabled:
            from torchsprint.swa import describe

            logger.info(describe(b.swa, cfg.run.epochs))
        geometry = data_geometry(cfg, rt.world_size)
        state = TrainState()
        if ckpt is not None:
            state = restore(ckpt, b.opt, b.sched, b.prec, rt, geometry, logger.info)
            b.ema.load_state_dict(ckpt.get("ema"), logger.info)
            b.swa.load_state_dict(ckpt.get("swa"), state.epoch, logger.info)
            logger.info(f"resuming at epoch {state.epoch + 1}, step {state.global_step} "
                        f"({state.step_in_epoch} step(s) into the epoch) from {resume_path}")
        resolved = config_mod.to_dict(cfg)
        saver = Saver(run_dir, cfg.checkpoint, rt, {"classes": info.classes, "config": resolved}, geometry=geometry,
                      resumed_step=state.global_step if ckpt is not None else None, log=logger.info, ema=b.ema,
                      flush_logs=logger.flush, swa=b.swa)
        weights_meta = {"classes": json.dumps(info.classes), "model": cfg.model.name, "in_channels": str(info.in_channels),
                        "format": "torchsprint", "task": cfg.task, "config": json.dumps(resolved)}
        # Stop signals are handled (a flag, no exception) from the first step until the run's files are written.
        stop = Stopper(cfg.run, state.global_step, t0)
        try:
            with stop:
                summary = fit(b.plan, b, state, rt=rt, run_dir=run_dir, logger=logger, saver=saver, stop=stop, task=task,
                              weights_meta=weights_meta, make_metrics=lambda: task.make_metrics(info, cfg.eval, rt.device))
                finish_swa(cfg, rt, b, run_dir, task, logger, summary, weights_meta)
                finish_summary(cfg, rt, b, run_dir, task, logger, summary)
        except RuntimeError as e:
            if is_oom(e):  # the checkpoints saved so far are whole files (atomic writes): the message names the last
                evaluating = any(f.name == "evaluate" for f in traceback.extract_tb(e.__traceback__))
                step = state.global_step + (0 if evaluating else 1)  # the step that failed, not the last one done
                raise UsageError(oom_message(e, cfg, rt, step, run_dir, evaluating)) from e
            explained = input_too_small(e, b.model, cfg, b.loaders) or not_deterministic(e, cfg)
            if explained is None:
                raise
            raise explained from e
        logger.close(finished=not summary["paused"])
        if summary["stopped"] == "signal" and cfg.run.requeue and rt.is_main:  # last: SLURM ends this job at once
            summary["requeued"] = requeue(os.environ["SLURM_JOB_ID"], logger.info)
        clean = True
        return summary
    finally:
        if logger is not None:
            logger.close(finished=False)  # an error: MLflow/W&B mark the run failed (a no-op after a normal close)
        if lock is not None:
            lock.release()
        runtime.teardown(rt, clean)


def finish_swa(cfg, rt, b: Built, run_dir: Path, task, logger, summary: dict, weights_meta: dict) -> None:
    """swa.enabled, after fit: BatchNorm statistics of the average (update_bn over the training data), its evaluation
    (swa/val/... in summary['final'] and the eval log) and swa.safetensors; summary['swa'] says what was averaged."""
    from torchsprint.checkpoint import save_weights
    from torchsprint.engine import evaluate

    swa = b.swa
    if not swa.enabled or summary["paused"]:
        return
    info = {"start_epoch": swa.start + 1, "averaged_epochs": swa.count, "lr": cfg.swa.lr,
            "anneal_epochs": cfg.swa.anneal_epochs, "anneal_strategy": cfg.swa.anneal_strategy}
    summary["swa"] = info
    if swa.count == 0:  # stopped (early_stop, run.max_steps) before the first averaged epoch ended
        info["file"] = None
        logger.info(f"[yellow]SWA: no epoch averaged[/] (the run stopped before the end of epoch {swa.start + 1}); "
                    "no swa.safetensors")
        return
    swa.update_bn(b.loaders.train, cfg.run.epochs, rt, b.prec, cfg.run.seed)
    out = evaluate(swa.module, b.loaders.val, b.loss_fn, b.prec, task.make_metrics(b.loaders.info, cfg.eval, rt.device))
    metrics = {f"swa/val/{k}": v for k, v in out.items() if not isinstance(v, list)}
    summary["final"] |= metrics
    info["file"] = "swa.safetensors"
    logger.scalars(summary["global_step"], metrics | {"epoch": cfg.run.epochs}, "eval")
    last = swa.start + swa.count
    logger.info(f"SWA of epochs {swa.start + 1}-{last} ({swa.count} averaged, BatchNorm statistics recomputed): "
                f"{task.summary({k[4:]: v for k, v in metrics.items()})}")
    if rt.is_main:
        save_weights(run_dir / "swa.safetensors", swa.module, weights_meta | {
            "epoch": str(last), "step": str(summary["global_step"]), "weights": "swa",
            "swa_epochs": f"{swa.start + 1}-{last}", "swa_averaged": str(swa.count)})


def finish_summary(cfg, rt, b: Built, run_dir: Path, task, logger, summary: dict) -> None:
    """After fit: the test split (eval.test_at_end), then summary.json and the closing table (rank 0)."""
    if cfg.eval.test_at_end and not summary["paused"]:
        summary["test"] = evaluate_test(cfg, rt, b, run_dir, task, logger, summary["global_step"])
    summary["run_dir"] = str(run_dir)
    summary["init"] = b.init
    if rt.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in summary["final"].items()]
        rows += [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in summary.get("test", {}).items()]
        rows += [("best " + cfg.checkpoint.monitor, f"{summary['best_metric']:.4f} (epoch {summary['best_epoch']})"
                  if summary["best_metric"] is not None else "-"),
                 ("stopped", summary["stopped"] + (f" ({summary['signal']})" if summary.get("signal") else "")),
                 ("train images/s", f"{summary['train_images_per_s']:.0f}"),
                 ("data-wait share", f"{summary['data_wait_share']:.0%}"),
                 ("wall time", f"{summary['seconds']:.1f} s"), ("run folder", str(run_dir))]
        logger.summary("run summary", rows)


def evaluate_test(cfg, rt, b: Built, run_dir: Path, task, logger, step: int) -> dict:
    """eval.test_at_end: the best weights on the test split (every rank; rank 0 reads the file and shares it)."""
    from safetensors.torch import load_file

    from torchsprint.collectives import broadcast_object
    from torchsprint.data import build_loaders
    from torchsprint.engine import evaluate
    from torchsprint.parallel import unwrap

    state = load_file(str(run_dir / "best.safetensors")) if rt.is_main else None
    unwrap(b.model).load_state_dict(broadcast_object(state, rt))
    loaders = build_loaders(with_loading_spec(cfg.data, cfg.eval.tta), rt, seed=cfg.run.seed,
                            channels_last=b.plan.channels_last_inputs, split="test", allowed=EVAL_BACKENDS)
    tta = plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms)
    out = evaluate(wrap_tta(b.model, tta), loaders.val, b.loss_fn, b.prec, task.make_metrics(loaders.info, cfg.eval, rt.device))
    out = {f"test/{k}": v for k, v in out.items() if not isinstance(v, list)}
    logger.scalars(step, out, "test")  # at the last step: every sink's steps stay in order
    logger.info(f"test split, best weights: {task.summary({k.replace('test/', 'val/'): v for k, v in out.items()})}")
    return out


# What PyTorch's pooling and convolution layers say when an input is smaller than they can take.
_TOO_SMALL = ("Output size is too small", "Kernel size can't be greater than actual input size",
              "smaller than kernel size", "Padding size should be less than the corresponding input dimension")


def input_too_small(error: RuntimeError, model, cfg, loaders) -> UsageError | None:
    """A UsageError naming the smallest input the model takes, when `error` says the images are too small."""
    if not any(t in str(error) for t in _TOO_SMALL):
        return None
    from torchsprint.models.core import min_input_size
    from torchsprint.parallel import unwrap

    side = min_input_size(unwrap(model), loaders.info.in_channels)
    need = f"at least {side}x{side} pixels" if side else "larger images than 1024x1024"
    loaders.val.set_epoch(0)
    h, w = next(iter(loaders.val))[0].shape[-2:]  # the error path only: one batch to say what the data is
    size = f"{h}x{w}"
    return UsageError(f"model {cfg.model.name} needs inputs of {need}, but the batches are {size} (dataset "
                      f"{cfg.data.dataset}). Add a resize step, e.g. data.train.transforms=[resize: {side or 224}] and "
                      f"the same in data.eval.transforms, or pick a model made for small images (small_cnn, "
                      "cifar_resnet18).")


def not_deterministic(error: RuntimeError, cfg) -> UsageError | None:
    """A UsageError naming the operation, when run.deterministic=true met one without a deterministic kernel."""
    text = str(error)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(" does not have a deterministic implementation")[0].strip()
    return UsageError(f"run.deterministic=true: {op} has no deterministic implementation on {cfg.run.device} "
                      "(torch.use_deterministic_algorithms), so this run cannot be bit-exact. Set run.deterministic=false, "
                      "or change the model or settings that use it.")


def weights_file(run_dir: Path, weights: str) -> Path:
    """The file of `weights`: a run's best/last/ema/swa.safetensors, or a .safetensors path as given (`average`'s)."""
    if weights.endswith(".safetensors"):
        if not Path(weights).is_file():
            raise UsageError(f"--weights {weights}: no such file.")
        return Path(weights)
    return Path(run_dir) / f"{weights}.safetensors"


def evaluate_run(run_dir: str | Path, weights: str = "best", overrides: list[str] = (), split: str = "val") -> dict:
    """Re-evaluate a run's saved weights (best or last) on its validation (or test) split."""
    from safetensors.torch import load_file

    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.engine import evaluate
    from torchsprint.models import build_model
    from torchsprint.precision import Precision

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir, list(overrides) + ["strategy.name=single"])
    wpath = weights_file(run_dir, weights)
    if not wpath.is_file():
        raise UsageError(f"{wpath} not found: the run has not finished an evaluation yet. Use --weights last or best{', or train with ema.enabled=true for --weights ema' if weights == 'ema' else ''}{', or train with swa.enabled=true for --weights swa' if weights == 'swa' else ''}.")
    from torchsprint.tasks import check_data_task, get_task

    with naming_imports(cfg.imports, run_dir):  # a name the run's unimported module registers: say which --import
        task = get_task(cfg.task)
        task.check(cfg)
        rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
        # Evaluation streams one split: auto picks cpu or gpu (the memory backend would decode the training set too).
        plan = plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms)  # eval.tta (an override or the run's own)
        loaders = build_loaders(with_loading_spec(cfg.data, cfg.eval.tta), rt, seed=cfg.run.seed, split=split,
                                allowed=EVAL_BACKENDS)
        info = loaders.info
        check_data_task(cfg, info)
        model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
        materialize_lazy(model, loaders.val, plan)
    try:
        model.load_state_dict(load_file(str(wpath), device=str(rt.device)))
    except Exception as e:  # a truncated or corrupt file, or weights of another model
        raise UsageError(f"{wpath}: cannot load its weights into {cfg.model.name} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}). The file is corrupt or from another model; evaluate "
                         "--weights last/best, or re-train.") from None
    metrics = task.make_metrics(info, cfg.eval, rt.device)
    with naming_imports(cfg.imports, run_dir):
        loss_fn = build_run_loss(cfg, task.targets, info).to(rt.device)
    out = evaluate(wrap_tta(model, plan), loaders.val, loss_fn, Precision(cfg.precision.mode, rt.device), metrics)
    from torchsprint.checkpoint import read_safetensors_metadata

    meta = read_safetensors_metadata(wpath)  # which weights these are: the epoch and step they were saved at
    out["weights"], out["split"], out["tta"] = str(wpath), split, cfg.eval.tta
    out["epoch"] = int(meta["epoch"]) if meta.get("epoch", "").isdigit() else None
    out["step"] = int(meta["step"]) if meta.get("step", "").isdigit() else None
    return out


EVAL_BACKENDS = ("cpu", "gpu")  # what data.backend=auto may pick when only one split is read (eval, report, export)


__all__ = ["train", "evaluate_run"]

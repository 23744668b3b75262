"""A run's weights evaluated (the test split after training, `torchsprint eval`, the SWA average), the pieces training
shares with evaluation: the run's loss (loss.class_weights=auto resolved from the data) and lazy-module shapes, and
the errors a run meets explained as one UsageError (inputs too small for the model, no deterministic kernel)."""

from __future__ import annotations

from pathlib import Path

import torch

from torchsprint.config.saved import load_run_config, naming_imports
from torchsprint.errors import UsageError
from torchsprint.tasks.tta import first_view, plan_tta, with_loading_spec, wrap_tta


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


def build_run_loss(cfg, targets: str, info, log=lambda *_: None):
    """build_loss of the run, with loss.class_weights=auto and loss.logit_adjust resolved from the training counts in
    `info.facts` (training and every later evaluation of the run use the same loss)."""
    from torchsprint.optim.losses import LogitAdjusted, build_loss

    loss_cfg = cfg.loss
    if cfg.loss.class_weights == "auto":
        weight = class_weights(info)
        loss_cfg = cfg.loss.model_copy(update={"args": {**cfg.loss.args, "weight": weight}})
        log(
            "loss.class_weights=auto: cross_entropy weight per class (1 / training count, mean 1): "
            + ", ".join(f"{c} {w:.3g}" for c, w in list(zip(info.classes, weight.tolist()))[:10])
            + (f", ... {len(weight) - 10} more" if len(weight) > 10 else "")
        )
    loss_fn = build_loss(loss_cfg, targets, info.num_classes)
    if cfg.loss.logit_adjust > 0:
        counts = torch.tensor(
            training_counts(info, f"loss.logit_adjust={cfg.loss.logit_adjust:g}"), dtype=torch.float64
        )
        loss_fn = LogitAdjusted(loss_fn, counts / counts.sum(), cfg.loss.logit_adjust)
        log(
            f"loss.logit_adjust={cfg.loss.logit_adjust:g}: training logits shifted by tau x log(class share): "
            + ", ".join(f"{c} {s:+.2f}" for c, s in list(zip(info.classes, loss_fn.shift.tolist()))[:10])
            + (f", ... {len(counts) - 10} more" if len(counts) > 10 else "")
        )
    return loss_fn


def class_weights(info) -> torch.Tensor:
    """loss.class_weights=auto: inverse training frequency per class, normalised to mean 1 (float32, class order)."""
    inv = 1.0 / torch.tensor(training_counts(info, "loss.class_weights=auto"), dtype=torch.float64)
    return (inv / inv.mean()).float()


def decide_run_loss(cfg, targets: str, info, device, log) -> tuple:
    """(the config the run trains with, its loss on `device`): data.sampler=auto as build_loaders resolved it, and the
    monitor that goes with it (train/imbalance.py's after_data), first, so that config.yaml and the records agree."""
    from torchsprint.train.imbalance import after_data

    cfg = after_data(cfg, info)
    return cfg, build_run_loss(cfg, targets, info, log).to(device)


def training_counts(info, setting: str) -> list[int]:
    """The training images per class (info.facts), every one > 0; else a UsageError naming `setting`."""
    counts = info.facts.get("class_counts", {}).get("per_class")
    if counts is None:
        raise UsageError(
            f"{setting} needs the training set's class counts, which this dataset does not give (no "
            "per-sample class labels); remove it (or set loss.args.weight, one value per class)."
        )
    empty = [c for c, n in zip(info.classes, counts) if n == 0]
    if empty:
        raise UsageError(
            f"{setting}: class(es) {empty[:5]} have no training images, so their frequency is 0 (its "
            "inverse and its log are infinite); add images, or remove it."
        )
    return counts


def evaluate_test(cfg, b, ctx, step: int) -> dict:
    """eval.test_at_end: the best weights on the test split (every rank; rank 0 reads the file and shares it).
    `ctx`: the run's context.RunContext (rt, run_dir, task, logger)."""
    from safetensors.torch import load_file

    from torchsprint.data import build_loaders
    from torchsprint.runtime.collectives import broadcast_object
    from torchsprint.runtime.parallel import unwrap
    from torchsprint.train.validation import evaluate

    rt, task, logger = ctx.rt, ctx.task, ctx.logger
    state = load_file(str(ctx.run_dir / "best.safetensors")) if rt.is_main else None
    unwrap(b.model).load_state_dict(broadcast_object(state, rt))
    loaders = build_loaders(
        with_loading_spec(cfg.data, cfg.eval.tta),
        rt,
        seed=cfg.run.seed,
        channels_last=b.plan.channels_last_inputs,
        split="test",
        allowed=EVAL_BACKENDS,
    )
    tta = plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms)
    out = evaluate(
        wrap_tta(b.model, tta), loaders.val, b.loss_fn, b.prec, task.make_metrics(loaders.info, cfg.eval, rt.device)
    )
    out = {f"test/{k}": v for k, v in out.items() if not isinstance(v, list)}
    logger.scalars(step, out, "test")  # at the last step: every sink's steps stay in order
    logger.info(f"test split, best weights: {task.summary({k.replace('test/', 'val/'): v for k, v in out.items()})}")
    return out


def weights_file(run_dir: Path, weights: str) -> Path:
    """The file of `weights`: a run's best/last/ema/swa.safetensors, or a .safetensors path as given (`average`'s)."""
    if weights.endswith(".safetensors"):
        if not Path(weights).is_file():
            raise UsageError(f"--weights {weights}: no such file.")
        return Path(weights)
    return Path(run_dir) / f"{weights}.safetensors"


def trained_classes(path: Path) -> list | None:
    """The classes a weights file's metadata says it was trained on (None when it does not say, or is unreadable:
    loading it says what is wrong)."""
    from torchsprint.config.saved import metadata_entry
    from torchsprint.state.checkpoint import read_safetensors_metadata

    try:
        meta = read_safetensors_metadata(path)
    except Exception:  # noqa: BLE001 - a damaged file: load_state_dict below names it
        return None
    return metadata_entry(meta, "classes", path, default=None)


def evaluate_run(run_dir: str | Path, weights: str = "best", overrides: list[str] = (), split: str = "val") -> dict:
    """Re-evaluate a run's saved weights (best or last) on its validation (or test) split."""
    from safetensors.torch import load_file

    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.models import build_model
    from torchsprint.runtime.parallel import channels_last_on
    from torchsprint.state.precision import Precision, concrete_mode
    from torchsprint.state.resume import check_same_classes
    from torchsprint.train.plan import decide_input_format
    from torchsprint.train.validation import evaluate

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir, list(overrides) + ["strategy.name=single"])
    wpath = weights_file(run_dir, weights)
    if not wpath.is_file():
        others = [
            w for w in ("best", "last", "ema", "swa") if w != weights and (run_dir / f"{w}.safetensors").is_file()
        ]
        how = {
            "best": "the run has not finished an evaluation yet",
            "last": "the run has not finished (a paused run writes last.safetensors when it completes; resume it "
            "with `torchsprint train --resume RUN`)",
            "ema": "the run did not train with ema.enabled=true",
            "swa": "the run did not train with swa.enabled=true",
        }
        raise UsageError(
            f"{wpath} not found: {how.get(weights, 'no such weights file')}. "
            + (
                f"Weights this run has: --weights {' or '.join(others)}."
                if others
                else "This run has no weights file yet."
            )
        )
    from torchsprint.tasks.core import check_data_task, get_task

    with naming_imports(cfg.imports, run_dir):  # a name the run's unimported module registers: say which --import
        task = get_task(cfg.task)
        task.check(cfg)
        rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
        # Evaluation streams one split: auto picks cpu or gpu (the memory backend would decode the training set too).
        plan = plan_tta(cfg.eval.tta, task, cfg.data.eval.transforms)  # eval.tta (an override or the run's own)
        # The run's memory formats (plan.decide_input_format, parallel.channels_last_on): its own validation's
        # figures, to the last digit (NCHW throughout gave a val/loss 3.3e-9 off on digits)
        loaders = build_loaders(
            with_loading_spec(cfg.data, cfg.eval.tta),
            rt,
            seed=cfg.run.seed,
            split=split,
            allowed=EVAL_BACKENDS,
            channels_last=decide_input_format(cfg.speed)[0],
        )
        info = loaders.info
        check_data_task(cfg, info)
        check_same_classes(
            trained_classes(wpath),
            info.classes,
            wpath,
            "evaluate on the data the run trained on (restore "
            "those class folders, or give its copy with data.root=...), or train a new run on the classes "
            "as they are now.",
        )
        model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
        materialize_lazy(model, loaders.val, plan)
        if channels_last_on(cfg.speed.channels_last, model):
            model = model.to(memory_format=torch.channels_last)
    prec = Precision(concrete_mode(cfg.precision.mode), rt.device)  # a run's config.yaml names it (auto: an override)
    if cfg.precision.mode == "fp64":  # float64 weights loaded into float64 parameters, not rounded to fp32
        model = model.double()
    try:
        model.load_state_dict(load_file(str(wpath), device=str(rt.device)))
    except Exception as e:  # a truncated or corrupt file, or weights of another model
        raise UsageError(
            f"{wpath}: cannot load its weights into {cfg.model.name} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). The file is corrupt or from another model; evaluate "
            "--weights last/best, or re-train."
        ) from None
    metrics = task.make_metrics(info, cfg.eval, rt.device)
    with naming_imports(cfg.imports, run_dir):
        loss_fn = build_run_loss(cfg, task.targets, info).to(rt.device)
    if cfg.precision.mode == "fp64":
        model = prec.prepare(model)  # batches cast to float64 on the way in, as in training
    out = evaluate(wrap_tta(model, plan), loaders.val, loss_fn, prec, metrics)
    from torchsprint.state.checkpoint import read_safetensors_metadata

    meta = read_safetensors_metadata(wpath)  # which weights these are: the epoch and step they were saved at
    out["weights"], out["split"], out["tta"] = str(wpath), split, cfg.eval.tta
    out["epoch"] = int(meta["epoch"]) if meta.get("epoch", "").isdigit() else None
    out["step"] = int(meta["step"]) if meta.get("step", "").isdigit() else None
    return out


def finish_swa(cfg, b, ctx, summary: dict) -> None:
    """swa.enabled, after fit: BatchNorm statistics of the average (update_bn over the training data), its evaluation
    (swa/val/... in summary['final'] and the eval log) and swa.safetensors; summary['swa'] says what was averaged.
    `ctx`: the run's context.RunContext (rt, run_dir, task, logger, weights_meta)."""
    from torchsprint.state.checkpoint import save_weights
    from torchsprint.train.validation import evaluate

    swa, rt, task, logger = b.swa, ctx.rt, ctx.task, ctx.logger
    if not swa.enabled or summary["paused"]:
        return
    info = {
        "start_epoch": swa.start + 1,
        "averaged_epochs": swa.count,
        "lr": cfg.swa.lr,
        "anneal_epochs": cfg.swa.anneal_epochs,
        "anneal_strategy": cfg.swa.anneal_strategy,
    }
    summary["swa"] = info
    if swa.count == 0:  # stopped (early_stop, run.max_steps) before the first averaged epoch ended
        info["file"] = None
        logger.info(
            f"[yellow]SWA: no epoch averaged[/] (the run stopped before the end of epoch {swa.start + 1}); "
            "no swa.safetensors"
        )
        return
    swa.update_bn(b.loaders.train, cfg.run.epochs, rt, b.prec, cfg.run.seed)
    out = evaluate(swa.module, b.loaders.val, b.loss_fn, b.prec, task.make_metrics(b.loaders.info, cfg.eval, rt.device))
    metrics = {f"swa/val/{k}": v for k, v in out.items() if not isinstance(v, list)}
    summary["final"] |= metrics
    info["file"] = "swa.safetensors"
    logger.scalars(summary["global_step"], metrics | {"epoch": cfg.run.epochs}, "eval")
    last = swa.start + swa.count
    logger.info(
        f"SWA of epochs {swa.start + 1}-{last} ({swa.count} averaged, BatchNorm statistics recomputed): "
        f"{task.summary({k[4:]: v for k, v in metrics.items()})}"
    )
    if rt.is_main:
        save_weights(
            ctx.run_dir / "swa.safetensors",
            swa.module,
            ctx.weights_meta
            | {
                "epoch": str(last),
                "step": str(summary["global_step"]),
                "weights": "swa",
                "swa_epochs": f"{swa.start + 1}-{last}",
                "swa_averaged": str(swa.count),
            },
        )


# What PyTorch's pooling and convolution layers say when an input is smaller than they can take.
_TOO_SMALL = (
    "Output size is too small",
    "Kernel size can't be greater than actual input size",
    "smaller than kernel size",
    "Padding size should be less than the corresponding input dimension",
)


def input_too_small(error: RuntimeError, model, cfg, loaders) -> UsageError | None:
    """A UsageError naming the smallest input the model takes, when `error` says the images are too small."""
    if not any(t in str(error) for t in _TOO_SMALL):
        return None
    from torchsprint.models.core import min_input_size
    from torchsprint.runtime.parallel import unwrap

    side = min_input_size(unwrap(model), loaders.info.in_channels)
    need = f"at least {side}x{side} pixels" if side else "larger images than 1024x1024"
    start = cfg.data.progressive.start_size
    if start is not None and (side is None or start < side):  # the first epochs' crops, not the eval batches, are small
        return UsageError(
            f"data.progressive.start_size={start}: the first epochs train on {start}x{start} crops, but "
            f"model {cfg.model.name} needs inputs of {need}. Raise data.progressive.start_size to at least "
            f"{side or 1024} (a multiple of data.progressive.step), or remove data.progressive."
        )
    loaders.val.set_epoch(0)
    h, w = next(iter(loaders.val))[0].shape[-2:]  # the error path only: one batch to say what the data is
    size = f"{h}x{w}"
    return UsageError(
        f"model {cfg.model.name} needs inputs of {need}, but the batches are {size} (dataset "
        f"{cfg.data.dataset}). Add a resize step, e.g. data.train.transforms=[resize: {side or 224}] and "
        f"the same in data.eval.transforms, or pick a model made for small images (small_cnn, "
        "cifar_resnet18)."
    )


def not_deterministic(error: RuntimeError, cfg) -> UsageError | None:
    """A UsageError naming the operation, when run.deterministic=true met one without a deterministic kernel."""
    text = str(error)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(" does not have a deterministic implementation")[0].strip()
    return UsageError(
        f"run.deterministic=true: {op} has no deterministic implementation on {cfg.run.device} "
        "(torch.use_deterministic_algorithms), so this run cannot be bit-exact. Set run.deterministic=false, "
        "or change the model or settings that use it."
    )


EVAL_BACKENDS = ("cpu", "gpu")  # what data.backend=auto may pick when only one split is read (eval, report, export)

"""A run's weights evaluated (the test split after training, `torchsprint eval`), and the pieces training shares
with evaluation: the run's loss (loss.class_weights=auto resolved from the data) and lazy-module shapes."""

from __future__ import annotations

from pathlib import Path

import torch

from torchsprint.errors import UsageError
from torchsprint.saved_config import load_run_config, naming_imports


def materialize_lazy(model, loader) -> None:
    """Run one no-grad forward when the model has lazy modules (LazyLinear) so shapes are known."""
    from torch.nn.parameter import UninitializedParameter

    if any(isinstance(p, UninitializedParameter) for p in model.parameters()):
        loader.set_epoch(0)
        images, _ = next(iter(loader))
        with torch.no_grad():
            model(images[:1])


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


def evaluate_test(cfg, rt, b, run_dir: Path, task, logger, step: int) -> dict:
    """eval.test_at_end: the best weights on the test split (every rank; rank 0 reads the file and shares it)."""
    from safetensors.torch import load_file

    from torchsprint.collectives import broadcast_object
    from torchsprint.data import build_loaders
    from torchsprint.engine import evaluate
    from torchsprint.parallel import unwrap

    state = load_file(str(run_dir / "best.safetensors")) if rt.is_main else None
    unwrap(b.model).load_state_dict(broadcast_object(state, rt))
    loaders = build_loaders(cfg.data, rt, seed=cfg.run.seed, channels_last=b.plan.channels_last_inputs, split="test",
                            allowed=EVAL_BACKENDS)
    out = evaluate(b.model, loaders.val, b.loss_fn, b.prec, task.make_metrics(loaders.info, cfg.eval, rt.device))
    out = {f"test/{k}": v for k, v in out.items() if not isinstance(v, list)}
    logger.scalars(step, out, "test")  # at the last step: every sink's steps stay in order
    logger.info(f"test split, best weights: {task.summary({k.replace('test/', 'val/'): v for k, v in out.items()})}")
    return out


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
    wpath = run_dir / f"{weights}.safetensors"
    if not wpath.is_file():
        raise UsageError(f"{wpath} not found: the run has not finished an evaluation yet. Use --weights last or best{', or train with ema.enabled=true for --weights ema' if weights == 'ema' else ''}.")
    from torchsprint.tasks import check_data_task, get_task

    with naming_imports(cfg.imports, run_dir):  # a name the run's unimported module registers: say which --import
        task = get_task(cfg.task)
        task.check(cfg)
        rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
        # Evaluation streams one split: auto picks cpu or gpu (the memory backend would decode the training set too).
        loaders = build_loaders(cfg.data, rt, seed=cfg.run.seed, split=split, allowed=EVAL_BACKENDS)
        info = loaders.info
        check_data_task(cfg, info)
        model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
        materialize_lazy(model, loaders.val)
    try:
        model.load_state_dict(load_file(str(wpath), device=str(rt.device)))
    except Exception as e:  # a truncated or corrupt file, or weights of another model
        raise UsageError(f"{wpath}: cannot load its weights into {cfg.model.name} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]}). The file is corrupt or from another model; evaluate "
                         "--weights last/best, or re-train.") from None
    metrics = task.make_metrics(info, cfg.eval, rt.device)
    with naming_imports(cfg.imports, run_dir):
        loss_fn = build_run_loss(cfg, task.targets, info).to(rt.device)
    out = evaluate(model, loaders.val, loss_fn, Precision(cfg.precision.mode, rt.device), metrics)
    from torchsprint.checkpoint import read_safetensors_metadata

    meta = read_safetensors_metadata(wpath)  # which weights these are: the epoch and step they were saved at
    out["weights"], out["split"] = str(wpath), split
    out["epoch"] = int(meta["epoch"]) if meta.get("epoch", "").isdigit() else None
    out["step"] = int(meta["step"]) if meta.get("step", "").isdigit() else None
    return out


EVAL_BACKENDS = ("cpu", "gpu")  # what data.backend=auto may pick when only one split is read (eval, report, export)

"""Imbalanced classes learned by default: data.sampler=auto before the data is read (shuffle where the config chose a
loss counter-measure or the targets have no class per image) and after (the sampler it became, and the monitor),
each applied counter-measure recorded as a choice (the start-up summary and decisions.json)."""

from __future__ import annotations

from torchsprint.errors import UsageError

MONITOR = "val/balanced_acc"  # the metric that picks best.safetensors where auto counters imbalance


def before_data(cfg, targets: str):
    """The config the loaders are built from: `cfg`, or with data.sampler=auto made shuffle where it has nothing to do
    (targets that are not one class per image, or loss.class_weights=auto / loss.logit_adjust on). Refuses the explicit
    counter-measures where they have no meaning, before any data is read."""
    asked = [
        s
        for s, on in (
            (f"data.sampler={cfg.data.sampler}", cfg.data.sampler not in ("auto", "shuffle")),
            ("loss.class_weights=auto", cfg.loss.class_weights == "auto"),
            (f"loss.logit_adjust={cfg.loss.logit_adjust:g}", cfg.loss.logit_adjust > 0),
        )
        if on
    ]
    if asked and targets != "class_index":
        raise UsageError(
            f"{' and '.join(asked)} balance classes, but task={cfg.task} has no single class per image "
            f"(its targets are {targets}); remove {' and '.join(s.split('=')[0] for s in asked)}."
        )
    if cfg.data.sampler_from_epoch > cfg.run.epochs:
        raise UsageError(
            f"data.sampler_from_epoch={cfg.data.sampler_from_epoch} is after the run's last epoch "
            f"(run.epochs={cfg.run.epochs}), so data.sampler={cfg.data.sampler} would never apply; set it to "
            f"at most {cfg.run.epochs}."
        )
    for setting, on in (
        ("loss.class_weights=auto", cfg.loss.class_weights == "auto"),
        (f"loss.logit_adjust={cfg.loss.logit_adjust:g}", cfg.loss.logit_adjust > 0),
    ):
        if on and (cfg.loss.terms or cfg.loss.name != "cross_entropy"):
            raise UsageError(
                f"{setting} changes cross_entropy, but the loss is "
                f"{'loss.terms' if cfg.loss.terms else cfg.loss.name}; use loss.name=cross_entropy"
                + (
                    ", or give per-class weights in the loss's own args."
                    if "weights" in setting
                    else ", or remove loss.logit_adjust."
                )
            )
    if cfg.loss.class_weights == "auto" and "weight" in cfg.loss.args:
        raise UsageError("loss.class_weights=auto and loss.args.weight both set the per-class weights; keep one.")
    loss_counters = cfg.loss.class_weights == "auto" or cfg.loss.logit_adjust > 0
    if cfg.data.sampler == "auto" and (targets != "class_index" or loss_counters):
        return cfg.model_copy(update={"data": cfg.data.model_copy(update={"sampler": "shuffle"})})
    return cfg


def after_data(cfg, info):
    """The config the run trains with and records (config.yaml): data.sampler=auto replaced by what build_loaders
    resolved it to (`info.sampler`, a concrete sampler that eval and resume read back), and, where that counters
    imbalance, checkpoint.monitor=MONITOR unless the config set checkpoint.monitor or checkpoint.mode; each change
    that counters imbalance is added to `cfg.chosen()` with why and how to choose otherwise.

    Args:
        cfg: the run's config (not changed; a changed copy is returned).
        info: the loaders' DataInfo (`sampler`, `sampler_why`: what data.sampler=auto became, and why).
    """
    if cfg.data.sampler != "auto":
        return cfg
    update = {"data": cfg.data.model_copy(update={"sampler": info.sampler})}
    chosen = []
    if info.sampler != "shuffle":
        chosen.append(
            {
                "setting": "data.sampler",
                "value": info.sampler,
                "why": f"data.sampler=auto: {info.sampler_why}; square-root-frequency sampling was the best trade "
                "measured on imbalanced photos: +18 to +31 points of balanced accuracy, top-1 up too, on a set "
                "where without it the smallest class went unlearned (BENCHMARKS.md, "
                "'Imbalanced classes where the defaults miss the smallest class' and 'Imbalanced classes: "
                "what the default counters with')",
                "override": "set data.sampler=shuffle (off), or another counter-measure (data.sampler=balanced, "
                "loss.class_weights=auto, loss.logit_adjust=1)",
            }
        )
        if not (cfg.set_by_user("checkpoint.monitor") or cfg.set_by_user("checkpoint.mode")):
            update["checkpoint"] = cfg.checkpoint.model_copy(update={"monitor": MONITOR, "mode": "max"})
            chosen.append(
                {
                    "setting": "checkpoint.monitor",
                    "value": MONITOR,
                    "why": "imbalanced classes (above): best.safetensors is the epoch with the best mean recall "
                    "over the classes, where top-1 would favour weights that neglect the small classes",
                    "override": "set checkpoint.monitor=val/top1",
                }
            )
    out = cfg.model_copy(update=update)
    out._chosen = [*cfg.chosen(), *chosen]
    return out

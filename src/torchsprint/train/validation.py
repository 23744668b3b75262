"""Evaluation during training and best-checkpoint tracking: `evaluate`, `Validation` (every eval.every_epochs
epochs, every eval.every_steps steps and at the end; logs, early_stop, best.safetensors), `weights_tag`.

engine.fit builds one Validation and calls it; engine.train_one_epoch calls it for eval.every_steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.runtime.parallel import unwrap
from torchsprint.runtime.rng import rng_isolated
from torchsprint.state.checkpoint import TrainState, save_weights
from torchsprint.tasks.tta import wrap_tta


def set_train_mode(model: nn.Module, frozen_norms: list[nn.Module]) -> None:
    """model.train(), but BatchNorm layers with frozen parameters keep their running statistics."""
    model.train()
    for m in frozen_norms:
        m.eval()


@torch.inference_mode()
def evaluate(model, loader, loss_fn, prec, metrics) -> dict:
    """Run the model over `loader` once and return metrics.compute() (reduced over ranks)."""
    was_training = model.training
    model.eval()
    loader.set_epoch(0)
    device = next(unwrap(model).parameters()).device
    for images, targets in rng_isolated(loader, device):  # evaluating must not change how training continues
        with prec.autocast():
            logits = model(images)
            loss = loss_fn(logits, targets)
        metrics.update(logits, targets, loss)
    model.train(was_training)
    return metrics.compute()


def is_better(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` in direction `mode` (any value beats None)."""
    return best is None or (value - min_delta > best if mode == "max" else value + min_delta < best)


def early_stop_check(state: TrainState, metric: float, patience: int | None, min_delta: float, mode: str) -> bool:
    """Count an evaluation for early_stop (Keras/Lightning EarlyStopping semantics); True: stop now.

    An improvement by more than min_delta resets the count and becomes the new reference; otherwise the
    count grows, and reaching `patience` evaluations without one stops the run. State lives in TrainState
    (checkpointed), so a resumed run stops where an uninterrupted one would.
    """
    if patience is None:
        return False
    if is_better(metric, state.stop_best, mode, min_delta):
        state.stop_best, state.stop_wait = metric, 0
    else:
        state.stop_wait += 1
    return state.stop_wait >= patience


@dataclass
class Validation:
    """The run's evaluations: every eval.every_epochs epochs (fit), every eval.every_steps steps (train_one_epoch)
    and at the end. Each evaluates the model (and the EMA), logs, counts for early_stop and keeps the best
    weights (best.safetensors and the task's artifacts). `last`: the latest metrics; `last_at`: (epoch 1-based,
    global step) of the weights they describe."""

    b: object  # the run's objects (train/run.py's Built): model, loaders, loss_fn, prec, ema, frozen_norms
    plan: object  # plan.RunPlan
    ctx: object  # context.RunContext: rt, run_dir, logger, make_metrics, weights_meta, task
    last: dict = field(default_factory=dict)
    last_at: tuple | None = None

    def due_mid_epoch(self, global_step: int) -> bool:
        """Whether eval.every_steps asks for an evaluation after `global_step` (global: the same after a resume)."""
        return bool(self.plan.eval_every_steps) and global_step % self.plan.eval_every_steps == 0

    def metric_at(self, global_step: int) -> float | None:
        """The monitored metric of an evaluation after `global_step`; None when none ran there."""
        return self.last[self.plan.monitor] if self.last_at and self.last_at[1] == global_step else None

    def __call__(self, state: TrainState) -> bool:
        """Evaluate after step state.global_step; True when early_stop says stop (state.stopped_epoch set)."""
        b, ctx, plan, monitor = self.b, self.ctx, self.plan, self.plan.monitor
        ema, logger, task = b.ema, ctx.logger, ctx.task

        def evaluate_here(m):  # with eval.tta, the views' combined outputs (tasks/tta.py); the loader loads for them
            return evaluate(wrap_tta(m, plan.tta), b.loaders.val, b.loss_fn, b.prec, ctx.make_metrics())

        with logger.phase(f"epoch {state.epoch + 1}/{plan.epochs}: evaluating"):  # a line every 10 s while it lasts
            self.last = {f"val/{k}": v for k, v in evaluate_here(b.model).items()}
            if ema.evaluates:
                ema.sync(ctx.rt)  # rank 0's BatchNorm statistics on every rank
                self.last |= {f"ema/val/{k}": v for k, v in evaluate_here(ema.module).items()}
        set_train_mode(b.model, b.frozen_norms)  # evaluate() restores train(), not frozen norms' eval mode
        self.last_at = (state.epoch + 1, state.global_step)
        logger.scalars(
            state.global_step,
            {k: v for k, v in self.last.items() if not isinstance(v, list)} | {"epoch": state.epoch + 1},
            "eval",
        )
        if not isinstance(self.last.get(monitor), int | float):  # a number to compare (not a list or a class name)
            numbers = sorted(k for k, v in self.last.items() if isinstance(v, int | float))
            raise UsageError(f"checkpoint.monitor={monitor} is not a metric; available: {numbers}")
        metric = self.last[monitor]
        stop = early_stop_check(state, metric, plan.early_stop_patience, plan.early_stop_min_delta, plan.mode)
        if stop:
            state.stopped_epoch = state.epoch
        if plan.early_stop_patience is not None:
            logger.scalars(
                state.global_step,
                {
                    "early_stop/wait": state.stop_wait,
                    "early_stop/best": state.stop_best,
                    "early_stop/stopped": state.stopped_epoch is not None,
                    "epoch": state.epoch + 1,
                },
                "early_stop",
            )
        ema_eval = {k[4:]: v for k, v in self.last.items() if k.startswith("ema/")}  # as val/... keys
        where = f"epoch {state.epoch + 1}/{plan.epochs}" + (
            f" step {state.global_step}" if plan.eval_every_steps else ""
        )
        logger.info(f"{where}  {task.summary(self.last)}" + (f"  | EMA {task.summary(ema_eval)}" if ema_eval else ""))
        if is_better(metric, state.best_metric, plan.mode):
            state.best_metric, state.best_epoch, state.best_step = metric, state.epoch + 1, state.global_step
            if ctx.rt.is_main:
                best, which = (ema.module, "ema") if monitor.startswith("ema/") else (b.model, "model")
                save_weights(
                    ctx.run_dir / "best.safetensors",
                    best,
                    ctx.weights_meta
                    | {
                        "epoch": str(state.epoch + 1),
                        "step": str(state.global_step),
                        monitor: str(metric),
                        "weights": which,
                    },
                )
                task.write_artifacts(
                    ctx.run_dir,
                    ema_eval if which == "ema" else self.last,
                    b.loaders.info,
                    weights_tag("best", state.best_epoch, state.best_step),
                )
        return stop


def weights_tag(weights: str, epoch: int | None, step: int | None) -> dict:
    """Which saved weights a file or figure describes: best or last, their file, epoch (1-based) and global step."""
    return {"weights": weights, "file": f"{weights}.safetensors", "epoch": epoch, "step": step}

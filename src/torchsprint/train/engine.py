"""The only training loop: train_step, train_one_epoch, fit (evaluation and the best weights: train/validation.py).

The engine never asks which data backend, precision or parallel strategy it runs under: those
arrive as objects (a loader yielding on-device batches, a Precision, a wrapped model).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from torchsprint.runtime.parallel import no_sync, unwrap
from torchsprint.runtime.preempt import Stopper
from torchsprint.runtime.rng import rng_isolated
from torchsprint.state.checkpoint import TrainState, save_weights
from torchsprint.state.ema import NoEma
from torchsprint.state.swa import NoSwa
from torchsprint.train.context import RunContext
from torchsprint.train.time_fit import epochs_limit, steps_limit
from torchsprint.train.validation import Validation, set_train_mode, weights_tag

NO_EMA = NoEma()  # the no-op EMA and SWA, for run objects made without build_training (the engine tests)
NO_SWA = NoSwa()
NO_LIMITS = SimpleNamespace(stop_after_steps=None, max_time=None, stop_signals=())  # a Stopper that only obeys `stop`
INPUT_BOUND_SHARE = 0.20  # data-wait share above which the log calls a run input-bound


def train_step(t, micro_batches, clip_grad_norm: float | None = None, correct: list | None = None) -> torch.Tensor:
    """One optimizer step over `micro_batches` (gradient accumulation when there are several).

    `t`: what the step uses, `t.model`, `t.loss_fn`, `t.opt` and `t.prec` (train/run.py's Built, or a
    context.Trainable). Returns the mean loss as a detached device tensor (no host sync here). With `correct` (a list),
    each
    micro-batch's (top-1 predictions, targets) are appended to it, as device tensors (class-index targets):
    one argmax per step; EpochTotals.fold compares and counts them all at once.
    """
    model, loss_fn, opt, prec = t.model, t.loss_fn, t.opt, t.prec
    n = len(micro_batches)
    losses = []
    for i, (images, targets) in enumerate(micro_batches):
        # DDP all-reduces gradients only on the last micro-step; no_sync is a null context elsewhere.
        with no_sync(model) if i < n - 1 else nullcontext():
            with prec.autocast():
                logits = model(images)
                loss = loss_fn(logits, targets)
            prec.backward(loss / n if n > 1 else loss)
        losses.append(loss.detach())
        if correct is not None:  # targets with extra loss inputs are a tuple, the task's first (distill.Distilled)
            correct.append((logits.detach().argmax(1), targets[0] if isinstance(targets, tuple) else targets))
    if clip_grad_norm is not None:
        prec.unscale_(opt)
        # The optimizer's parameters: in fp16/bf16 modes these are the fp32 masters that hold the gradients.
        nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip_grad_norm)
    prec.step(opt)
    opt.zero_grad(set_to_none=True)
    # One micro-batch (the usual case) returns its loss as is: no extra kernels in the step.
    return losses[0] if n == 1 else torch.stack(losses).float().mean()


def train_one_epoch(b, state: TrainState, plan, ctx: RunContext, validation: Validation | None = None) -> dict:
    """Train until the end of `state.epoch` (or run.max_steps, or `ctx.stop` says so), resuming at state.step_in_epoch.

    `b`: the run's objects (train/run.py's Built: model, loaders.train, loss_fn, opt, sched, prec, and ema, a no-op
    object when absent). `plan` (plan.RunPlan): accumulation, schedule interval, clipping, when to log and checkpoint,
    max_steps. `ctx.stop` (preempt.Stopper): asked after every step (pauses, max_time, stop signals; None: never);
    `validation`: runs the eval.every_steps evaluations (an early stop there ends the epoch). Returns epoch statistics:
    images, seconds, data-wait seconds, mean loss, whether the epoch finished.
    """
    model, loader, opt, sched, prec = b.model, b.loaders.train, b.opt, b.sched, b.prec
    ema, logger, saver = b.ema, ctx.logger, ctx.saver
    stop = ctx.stop or Stopper(NO_LIMITS, state.global_step)
    stop.attach(loader)
    accum, per_step_sched = plan.accum_steps, plan.sched_interval == "step"
    loader.set_epoch(state.epoch)  # the full epoch's length, whatever start the previous epoch resumed at
    steps_per_epoch = math.ceil(len(loader) / accum)
    loader.set_epoch(state.epoch, start_batch=state.step_in_epoch * accum)
    logger.start_epoch(state.epoch, epochs_limit(plan, state), steps_per_epoch, state.step_in_epoch)
    device = next(unwrap(model).parameters()).device
    window = LogWindow()  # this log window's step losses (on the device) and images
    totals = EpochTotals(plan.track_accuracy)  # the epoch's training loss and accuracy, summed without per-step syncs
    images_seen = 0
    data_wait = 0.0
    t_start = time.perf_counter()
    it = rng_isolated(loader, device)  # data loading must not shift the model's RNG stream (exact resume)
    done = False
    while not done:
        t0 = time.perf_counter()
        micro, done = next_micro_batches(it, accum)
        data_wait += time.perf_counter() - t0
        if not micro:
            break
        loss = train_step(b, micro, plan.clip_grad_norm, totals.hits)
        if per_step_sched:
            sched.step()
        n_images = sum(b[0].shape[0] for b in micro)
        images_seen += n_images
        window.add(loss, n_images)
        totals.losses.append(loss)
        totals.samples += n_images
        state.step_in_epoch += 1
        state.global_step += 1
        ema.update(state.global_step)  # a no-op object when ema.enabled=false
        ctx.length.after_step(state)  # run.train_time: measure the speed, fit the run's length (else a no-op)
        logger.advance(images=n_images)  # the heartbeat and the time estimate (progress.Feedback)
        if state.global_step % plan.log_every_steps == 0:
            window.log(state, b, totals, logger)
        # An evaluation due at this step comes before its checkpoint: a resume from it neither repeats nor skips one.
        if validation is not None and validation.due_mid_epoch(state.global_step):
            if validation(state):
                break  # early stop (state.stopped_epoch is set); fit saves
            # The cpu backend's train and eval loaders share one set of workers, so the evaluation ended this
            # iteration: training goes on from a fresh one at this position, exactly as a resumed run does.
            loader.set_epoch(state.epoch, start_batch=state.step_in_epoch * accum)
            it = rng_isolated(loader, device)
        if plan.checkpoint_every_steps and state.global_step % plan.checkpoint_every_steps == 0:
            totals.fold(state)  # the checkpoint keeps this epoch's sums so far
            saver.save(
                state, model, opt, sched, prec, metric=validation.metric_at(state.global_step) if validation else None
            )
        last = steps_limit(plan, state)  # run.max_steps, or the length fitted to run.train_time
        if last is not None and state.global_step >= last:
            break
        if stop.after_step(state.global_step):
            break
    logger.end_epoch()
    # Count the steps since the last log step too (all ranks call it: it reduces). Note: a sync point.
    check_finite(prec, state, window.losses, opt)
    totals.fold(state)
    seconds = time.perf_counter() - t_start
    return {
        "images": images_seen,
        "seconds": seconds,
        "data_wait": data_wait,
        "finished_epoch": state.step_in_epoch >= steps_per_epoch,
    }


def next_micro_batches(it, accum: int) -> tuple[list, bool]:
    """Up to `accum` batches from `it` (one optimizer step's micro-batches), and whether `it` ran out."""
    micro = []
    for _ in range(accum):
        batch = next(it, None)
        if batch is None:
            return micro, True
        micro.append(batch)
    return micro, False


class LogWindow:
    """The step losses (device scalars) and images since the last log step: summed at log steps only."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []
        self.images = 0
        self.t = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        self.losses.append(loss)
        self.images += images

    def log(self, state: TrainState, t, totals: EpochTotals, logger) -> None:
        """Log the window's mean loss, the lr and images/s at step state.global_step, fold the totals, start anew.
        `t`: the step's objects (its `opt` and `prec`)."""
        opt, prec = t.opt, t.prec
        mean_loss = torch.stack(self.losses).float().mean().item()  # note: a CPU-GPU sync point, once per log step
        check_finite(prec, state, self.losses, opt, math.isfinite(mean_loss))
        totals.fold(state)
        now = time.perf_counter()
        stats = {
            "train/loss": mean_loss,
            "train/lr": opt.param_groups[0]["lr"],
            "train/skipped_steps": state.skipped_steps,
            "train/images_per_s": self.images / max(now - self.t, 1e-9),
            "epoch": state.epoch + 1,
        }
        logger.scalars(state.global_step, stats, "train")
        logger.step_stats(f"loss {mean_loss:.4f}  lr {stats['train/lr']:.3g}  {stats['train/images_per_s']:.0f} img/s")
        self.losses.clear()
        self.images = 0
        self.t = now


class EpochTotals:
    """Step losses, top-1 predictions with their targets, and sample counts not yet added to the epoch's sums
    in TrainState (device tensors, so the step itself never syncs; comparing and counting the predictions
    here, once per fold, instead of per step saves two small kernels per step). `fold` adds them, summed over ranks, at
    log steps,
    checkpoints and epoch ends: the state then holds global sums, and a resumed epoch reports the same
    means as an uninterrupted one. Note: a host sync and, under DDP, one small all-reduce per fold."""

    def __init__(self, accuracy: bool):
        self.losses: list[torch.Tensor] = []
        self.hits: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if accuracy else None
        self.samples = 0

    def fold(self, state: TrainState) -> None:
        from torchsprint.runtime.collectives import all_reduce_sum

        if not self.losses and not self.samples:
            return
        dev = self.losses[0].device if self.losses else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        t = torch.stack(
            [
                torch.stack(self.losses).double().sum() if self.losses else zero,
                torch.tensor(float(len(self.losses)), dtype=torch.float64, device=dev),
                hits_sum(self.hits) if self.hits else zero,
                torch.tensor(float(self.samples if self.hits is not None else 0), dtype=torch.float64, device=dev),
            ]
        )
        loss_sum, steps, correct, samples = all_reduce_sum(t).tolist()
        state.epoch_loss_sum += loss_sum
        state.epoch_steps += int(steps)
        state.epoch_correct += int(correct)
        state.epoch_samples += int(samples)
        self.losses.clear()
        if self.hits is not None:
            self.hits.clear()
        self.samples = 0


def hits_sum(hits: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Top-1 hits in (predictions, targets) pairs, as a float64 device scalar."""

    def hard(
        t,
    ):  # Mixed (soft) targets count against the class with the larger weight (Mixup/CutMix: data/preprocess/mix.py)
        return t.argmax(1) if t.ndim == 2 else t.reshape(-1)

    preds = torch.cat([p for p, _ in hits]) if len(hits) > 1 else hits[0][0]
    targets = torch.cat([hard(t) for _, t in hits]) if len(hits) > 1 else hard(hits[0][1])
    return (preds == targets).sum().double()


def epoch_means(state: TrainState) -> dict:
    """This epoch's mean training loss (over steps, all ranks) and top-1 accuracy (over samples) so far."""
    out = {}
    if state.epoch_steps:
        out["train/epoch_loss"] = state.epoch_loss_sum / state.epoch_steps
    if state.epoch_samples:
        out["train/epoch_top1"] = state.epoch_correct / state.epoch_samples
    return out


def check_finite(prec, state: TrainState, window: list, opt, loss_finite: bool | None = None) -> None:
    """Add the steps skipped for non-finite gradients since the last check to state.skipped_steps.

    `window`: the step losses since the last check (device scalars); `loss_finite`: whether they are all
    finite when the caller knows already (a NaN/inf anywhere makes their mean non-finite, so the log
    step's mean answers it for free). Precision counts skipped steps on the device (no per-step host
    sync) and raises errors.Diverged here under precision.on_nonfinite=stop, naming the first bad step.
    Note: a CPU-GPU sync point, at log steps and epoch ends.
    """
    if loss_finite is None:
        loss_finite = not window or bool(torch.isfinite(torch.stack(window).float().sum()))
    bad_step = None
    if not loss_finite:  # the rare path: find which step it was
        finite = torch.isfinite(torch.stack(window).float()).tolist()
        bad_step = state.global_step - len(window) + 1 + finite.index(False)
    state.skipped_steps += prec.pop_nonfinite(
        state.global_step, loss_finite, bad_step=bad_step, lr=opt.param_groups[0]["lr"]
    )


def fit(plan, b, state: TrainState, ctx: RunContext) -> dict:
    """Train for plan.epochs (or plan.max_steps) from `state`, evaluating and checkpointing.

    `plan` (plan.RunPlan): every decision the loop follows (steps, when to log, evaluate and checkpoint, what to
    monitor, early stop). `b`: the built objects (build.Built or any object with its attributes model, loaders,
    loss_fn, opt, sched, prec, ema, frozen_norms, head_only):
    `b.ema` (ema.ModelEma or the no-op NoEma) is updated after every optimizer step, evaluated beside the model
    (metrics ema/val/...) and saved as ema.safetensors; best.safetensors holds the EMA weights when the monitor
    names an ema/ metric. `b.head_only` (models.init.HeadOnly; a no-op when model.freeze_epochs=0): which
    parameters train in each epoch.
    `ctx` (context.RunContext): the run's services. `ctx.stop` (preempt.Stopper) pauses the run after a step:
    run.stop_after_steps, run.max_time or a stop signal. A pause saves a checkpoint, adds no evaluation and leaves
    the schedule untouched, so that a later resume continues exactly as if never stopped.
    `ctx.task` (tasks.Task; classification when None) formats the evaluation line and writes the extra
    artifacts that go with the best weights (the confusion matrix for classification).
    `b.swa` (swa.Swa or the no-op NoSwa; NoSwa when `b` has none): averages the weights at the end of each epoch
    from swa.start on (train/run.py updates its BatchNorm statistics, evaluates and saves it after fit).
    Returns the summary: final and best validation metrics, time and throughput, why the run stopped, and
    `artifacts`: which weights each per-class file and figure describes (file name -> {weights, file, epoch, step}).
    """
    from torchsprint.tasks.core import get_task

    if ctx.task is None:
        ctx = replace(ctx, task=get_task("classification"))
    model, loaders, opt, sched, prec, logger, saver = b.model, b.loaders, b.opt, b.sched, b.prec, ctx.logger, ctx.saver
    stop = ctx.stop or Stopper(NO_LIMITS, state.global_step)
    ctx = replace(ctx, stop=stop)
    swa = b.swa
    val = Validation(b, plan, ctx)
    totals = {"images": 0, "seconds": 0.0, "data_wait": 0.0}
    t_fit = time.perf_counter()
    pausing = False
    ctx.length.restore(state)  # a resumed run.train_time run: the length its first invocation fitted
    while state.epoch < epochs_limit(plan, state):
        b.head_only.apply(state.epoch)  # model.freeze_epochs: from the epoch number alone, so exact across resume
        set_train_mode(model, b.frozen_norms + b.head_only.norms(state.epoch))
        ep = train_one_epoch(b, state, plan, ctx, val)
        for k in totals:
            totals[k] += ep[k]
        last = steps_limit(plan, state)
        stopping = (last is not None and state.global_step >= last) or state.stopped_epoch is not None
        pausing = stop.reason is not None and not stopping
        if not ep["finished_epoch"] and not stopping and not pausing:
            raise RuntimeError("loader ended before the epoch did")  # a loader length bug, never expected
        if ep["finished_epoch"] and plan.sched_interval == "epoch":
            sched.step()
        swa.end_epoch(state.epoch, ep["finished_epoch"])  # before the epoch's checkpoint, which holds the average
        report_epoch(logger, state, ep, loaders.train, plan.backend)
        if not ep["finished_epoch"] and (pausing or state.stopped_epoch is not None):
            # Mid-epoch: a pause adds no evaluation (an uninterrupted run has none here); an early stop just evaluated.
            saver.save(state, model, opt, sched, prec, metric=val.metric_at(state.global_step))
            break
        last_epoch = state.epoch + 1 >= epochs_limit(plan, state) or stopping
        if ((state.epoch + 1) % plan.eval_every_epochs == 0 or last_epoch) and val.metric_at(state.global_step) is None:
            stopping = val(state) or stopping  # (None: eval.every_steps evaluated after this very step already)
        if ep["finished_epoch"]:
            start_next_epoch(state)
        if (
            (plan.checkpoint_every_epochs and state.epoch % plan.checkpoint_every_epochs == 0)
            or last_epoch
            or pausing
            or stopping
        ):
            saver.save(state, model, opt, sched, prec, val.metric_at(state.global_step))
        if stopping or pausing:
            break
    paused = pausing and state.epoch < epochs_limit(plan, state) and state.stopped_epoch is None
    artifacts = finish_fit(b, state, val, ctx, paused)
    return fit_summary(
        state,
        val,
        stop,
        {
            "paused": paused,
            "totals": totals,
            "seconds": time.perf_counter() - t_fit,
            "artifacts": artifacts,
            "length": ctx.length.record(),
        },
    )


def fit_summary(state: TrainState, val: Validation, stop: Stopper, outcome: dict) -> dict:
    """fit's return value (see fit). `outcome`: paused (bool), totals (the images, seconds and data-wait seconds of
    the epochs trained), seconds (fit's wall time) and artifacts (finish_fit's)."""
    plan, paused, totals = val.plan, outcome["paused"], outcome["totals"]
    return {
        "final": {k: v for k, v in val.last.items() if not isinstance(v, list)},
        "best_metric": state.best_metric,
        "best_epoch": state.best_epoch,
        "seconds": outcome["seconds"],
        "train_images_per_s": totals["images"] / max(totals["seconds"], 1e-9),
        "data_wait_share": totals["data_wait"] / max(totals["seconds"], 1e-9),
        "global_step": state.global_step,
        "skipped_steps": state.skipped_steps,
        **({"train_time": outcome["length"]} if outcome.get("length") else {}),
        "artifacts": outcome["artifacts"],
        "paused": paused,
        # Why training ended: completed (run.epochs or run.max_steps), early_stop, or a pause: stop_after_steps,
        # max_time, signal (then "signal" names it where this process received it).
        "stopped": stop.reason if paused else "early_stop" if state.stopped_epoch is not None else "completed",
        **({"signal": stop.got.name if stop.got else None} if paused and stop.reason == "signal" else {}),
        "early_stop": None
        if plan.early_stop_patience is None
        else {
            "stopped_epoch": None if state.stopped_epoch is None else state.stopped_epoch + 1,  # 1-based, as printed
            "best": state.stop_best,
            "wait": state.stop_wait,
            "patience": plan.early_stop_patience,
            "min_delta": plan.early_stop_min_delta,
        },
    }


def start_next_epoch(state: TrainState) -> None:
    """The epoch is done: count it and clear its running sums."""
    state.epoch += 1
    state.step_in_epoch = 0
    state.epoch_loss_sum, state.epoch_steps, state.epoch_correct, state.epoch_samples = 0.0, 0, 0, 0


def finish_fit(b, state: TrainState, val: Validation, ctx: RunContext, paused: bool) -> dict:
    """After the loop: say why it stopped, save last.safetensors (and ema.safetensors) unless paused, and return
    which weights each artifact file describes (file name -> weights_tag)."""
    plan, rt, run_dir, logger, task, weights_meta = (
        val.plan,
        ctx.rt,
        ctx.run_dir,
        ctx.logger,
        ctx.task,
        ctx.weights_meta,
    )
    if state.stopped_epoch is not None:
        logger.info(
            f"early stop after epoch {state.stopped_epoch + 1}: {plan.monitor} has not improved by more than "
            f"{plan.early_stop_min_delta} for {plan.early_stop_patience} evaluation(s) (best {state.stop_best:.4g})"
        )
    if paused:
        logger.info(pause_message(ctx.stop, state, run_dir))
    else:
        b.ema.sync(rt)
        if rt.is_main:
            save_weights(
                run_dir / "last.safetensors",
                b.model,
                weights_meta | {"epoch": str(state.epoch), "step": str(state.global_step)},
            )
            if b.ema.enabled:
                save_weights(
                    run_dir / "ema.safetensors",
                    b.ema.module,
                    weights_meta | {"epoch": str(state.epoch), "weights": "ema"},
                )
            if val.last_at is not None:  # the last evaluation saw these weights (the loop ends right after one)
                # The model's own metrics (val/...), as last.safetensors holds the model's weights, not the EMA's.
                task.write_artifacts(run_dir, val.last, b.loaders.info, weights_tag("last", *val.last_at))
    artifacts = {}
    tags = [weights_tag("best", state.best_epoch, state.best_step)] + (
        [weights_tag("last", *val.last_at)] if val.last_at is not None and not paused else []
    )
    for tag in tags:
        artifacts |= {name: tag for name in task.artifacts(tag["weights"]) if (run_dir / name).is_file()}
    return artifacts


def pause_message(stop: Stopper, state: TrainState, run_dir: Path) -> str:
    """The line that says why a paused run stopped and how to continue it."""
    why = {
        "stop_after_steps": "run.stop_after_steps",
        "max_time": "run.max_time: the time budget of this invocation is spent",
        "signal": f"{stop.got.name if stop.got else 'a stop signal (received by another rank)'}: preempted",
    }[stop.reason]
    return (
        f"paused at step {state.global_step} ({why}); continue with checkpoint.resume=auto "
        f"or `torchsprint train --resume {run_dir}`"
    )


def report_epoch(logger, state: TrainState, ep: dict, loader, backend: str) -> None:
    """Per-epoch training loss and accuracy, throughput, data-wait share, and skipped samples; flags input-bound
    runs."""
    share = ep["data_wait"] / max(ep["seconds"], 1e-9)
    ips = ep["images"] / max(ep["seconds"], 1e-9)
    means = epoch_means(state)
    logger.scalars(
        state.global_step,
        means | {"train/epoch_images_per_s": ips, "train/data_wait_share": share, "epoch": state.epoch + 1},
        "epoch",
    )
    said = "".join(f"{k.split('_', 1)[1]} {v:.4f}, " for k, v in means.items())
    msg = f"epoch {state.epoch + 1}: train {said}{ips:.0f} img/s, data wait {share:.0%}"
    if share > INPUT_BOUND_SHARE:
        msg += (
            f" [yellow]- input-bound: the loader ({backend}) is the bottleneck; try more data.num_workers or "
            "another data.backend (memory for small datasets, gpu for JPEGs on CUDA); `torchsprint bench` "
            "measures which pays off[/]"
        )
    logger.info(msg)
    skipped = getattr(loader, "skipped", [])
    if skipped:
        logger.info(f"[yellow]{len(skipped)} unreadable sample(s) skipped this epoch[/], e.g. {skipped[:3]}")
        logger.scalars(state.global_step, {"data/skipped": len(skipped), "data/skipped_paths": skipped[:100]}, "data")
        skipped.clear()

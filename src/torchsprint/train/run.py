"""The flow of one run, every object passed explicitly: resolve -> setup -> the run folder -> `build_training`
(train/build.py) -> fit -> the run's records."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from torchsprint import config as config_mod
from torchsprint import runtime
from torchsprint.config.schema import import_modules
from torchsprint.errors import UsageError
from torchsprint.observe.logging import RunLogger, check_sinks, replace_file
from torchsprint.optim.schedulers import refit_schedule
from torchsprint.runtime.collectives import agree_min, broadcast_object
from torchsprint.runtime.machine import environment
from torchsprint.runtime.preempt import Stopper, check_requeue, parse_duration, requeue, stop_launcher
from torchsprint.state.checkpoint import Saver, data_geometry
from torchsprint.state.resume import (
    disk_full_error,
    find_resume,
    restore_run,
)
from torchsprint.state.rundir import RunLock, claim_run_dir, create_unique, finished, how_to_continue, make_folder
from torchsprint.state.swa import describe as describe_swa
from torchsprint.tasks.core import get_task
from torchsprint.train.batch_size import is_oom, oom_message
from torchsprint.train.build import Built, build_training
from torchsprint.train.context import RunContext
from torchsprint.train.engine import fit
from torchsprint.train.evaluation import (
    evaluate_run,
    evaluate_test,
    finish_swa,
    input_too_small,
    not_deterministic,
)
from torchsprint.train.plan import (
    decisions,
    describe_decisions,
)
from torchsprint.train.resolve import resolve
from torchsprint.train.time_fit import FixedLength, TimeFit


def on_main(rt, fn):
    """fn() on rank 0; its result (or its UsageError, raised on every rank) shared with every rank."""
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


def train(
    cfg, *, quiet: bool = False, overwrite: bool = False, dry_run: bool = False, hold_signals: bool = False
) -> dict:
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
        cfg = (
            b.cfg
        )  # data.batch_size and optim.accum_steps resolved (auto, effective_batch_size): config.yaml says them
        if dry_run:
            logger.info(
                f"dry run: everything checked ({rt.world_size} process(es)); would train in {run_dir}"
                f"{' (resuming)' if ckpt else ''}; nothing was written"
            )
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
        ctx = RunContext(
            rt,
            run_dir,
            logger,
            saver,
            stop,
            weights_meta=weights_meta,
            task=task,
            make_metrics=lambda: task.make_metrics(b.loaders.info, cfg.eval, rt.device),
            length=run_length(cfg, b, rt, t0),
        )
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


def run_length(cfg, b: Built, rt, t0: float) -> TimeFit | FixedLength:
    """What ends the run: run.train_time's TimeFit (the length fitted to the time, counted from `t0`), or the fixed
    length of run.epochs / run.max_steps."""
    if cfg.run.train_time is None:
        return FixedLength()
    spe = b.plan.steps_per_epoch

    def set_schedule(steps: int) -> None:
        refit_schedule(b.sched, cfg.sched, steps=steps, steps_per_epoch=spe)

    agree = (lambda n: agree_min(n, rt)) if rt.world_size > 1 else (lambda n: n)
    return TimeFit(parse_duration(cfg.run.train_time), t0, spe, set_schedule, agree)


def finished_summary(ckpt: dict, cfg, run_dir: Path, logger) -> dict:
    """A finished run asked to train again: say so, and return its summary.json as it is (files left alone)."""
    ts = ckpt["train_state"]
    steps = f" of run.max_steps={cfg.run.max_steps}" if cfg.run.max_steps is not None else ""
    logger.info(
        f"{run_dir} is a finished run (epoch {ts['epoch']} of {cfg.run.epochs}, step {ts['global_step']}"
        f"{steps}): nothing to do, its files are left as they are (results: summary.json); "
        f"{how_to_continue(ts, cfg.run, run_dir)}."
    )
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
    logger.open_files(
        run_dir,
        params=config_mod.to_dict(cfg),
        out_dir=cfg.run.out_dir,
        resumed_step=None if ckpt is None else ckpt["train_state"]["global_step"],
        resumed_counts=None if ckpt is None else ckpt.get("log_records"),
    )
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
        logger.info(describe_swa(b.swa, cfg.run.epochs))
    logger.expect(cfg, decided | {"batch_shape": b.loaders.info.image_size})  # for the run's time estimate


def make_saver(cfg, rt, b: Built, run_dir: Path, ckpt: dict | None, state, logger) -> tuple:
    """(checkpoint.Saver, the weights files' metadata), once the run is accepted and its records written."""
    info = b.loaders.info
    resolved = config_mod.to_dict(cfg)
    saver = Saver(
        run_dir,
        cfg.checkpoint,
        rt,
        {"classes": info.classes, "config": resolved},
        geometry=data_geometry(cfg, rt.world_size),
        resumed_step=state.global_step if ckpt is not None else None,
        log=logger.info,
        ema=b.ema,
        flush_logs=logger.flush,
        swa=b.swa,
    )
    weights_meta = {
        "classes": json.dumps(info.classes),
        "model": cfg.model.name,
        "in_channels": str(info.in_channels),
        "format": "torchsprint",
        "task": cfg.task,
        "config": json.dumps(resolved),
    }
    return saver, weights_meta


def fit_explained(cfg, b: Built, state, ctx: RunContext) -> dict:
    """engine.fit, then the test split and summary.json; an out-of-memory error, too-small inputs or a missing
    deterministic kernel become one UsageError that says what to change."""
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
        rows += [
            (
                "best " + cfg.checkpoint.monitor,
                f"{summary['best_metric']:.4f} (epoch {summary['best_epoch']})"
                if summary["best_metric"] is not None
                else "-",
            ),
            ("stopped", summary["stopped"] + (f" ({summary['signal']})" if summary.get("signal") else "")),
            ("train images/s", f"{summary['train_images_per_s']:.0f}"),
            ("data-wait share", f"{summary['data_wait_share']:.0%}"),
            ("wall time", f"{summary['seconds']:.1f} s"),
            ("run folder", str(run_dir)),
        ]
        logger.summary("run summary", rows)


__all__ = ["train", "evaluate_run"]

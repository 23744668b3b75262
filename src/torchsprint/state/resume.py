"""Resume: find the checkpoint to continue from (auto, a file, a run folder) and restore its state."""

from __future__ import annotations

from pathlib import Path

from torchsprint.errors import UsageError, disk_full
from torchsprint.runtime.collectives import broadcast_object
from torchsprint.runtime.files import read_regular
from torchsprint.runtime.rng import set_rng_state
from torchsprint.state.checkpoint import (
    CKPT_RE,
    TrainState,
    data_geometry,
    load_checkpoint,
    parse_checkpoint_name,
)


def find_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run folder, newest (highest step, then epoch) first."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [(*reversed(parse_checkpoint_name(p.name)), p) for p in d.iterdir() if CKPT_RE.match(p.name)]
    return [p for *_, p in sorted(found, reverse=True)]


def find_resume(resume: str | None, run_dir: Path | None, log, rt=None) -> tuple[Path | None, dict | None]:
    """Resolve `checkpoint.resume` to (path, loaded checkpoint), or (None, None) to start fresh.

    Args:
        resume: None (start fresh), 'auto' (the newest readable checkpoint of `run_dir`; none
            there starts fresh), a checkpoint file, or a run folder.
        run_dir: the run folder (for 'auto').
        log: callable for one-line messages.
        rt: the Runtime; with several processes rank 0 chooses the file and every rank loads that
            one, so ranks can never resume from different checkpoints.
    A truncated or corrupt newest file is reported and skipped, and the previous one is used.
    """
    if rt is None or not rt.distributed:
        return _find_resume(resume, run_dir, log)
    choice: tuple[str | None, str | None] = (None, None)  # (path, error)
    if rt.is_main:
        try:
            path, _ = _find_resume(resume, run_dir, log)
            choice = (str(path) if path else None, None)
        except UsageError as e:
            choice = (None, str(e))
    path, error = broadcast_object(choice, rt)
    if error is not None:
        raise UsageError(error)
    return (Path(path), load_checkpoint(path)) if path else (None, None)


def _find_resume(resume: str | None, run_dir: Path | None, log) -> tuple[Path | None, dict | None]:
    if resume is None:
        return None, None
    if resume != "auto":
        p = Path(resume)
        if p.is_dir() and p.name == "checkpoints" and not find_checkpoints(p):
            p = p.parent  # the run's checkpoints/ folder itself
        if p.is_dir():
            if not find_checkpoints(p):
                raise UsageError(
                    f"checkpoint.resume={resume}: no checkpoints/ckpt-*.pt in that folder. "
                    "Pass a run folder that saved checkpoints, or a ckpt-*.pt file."
                )
            return _find_resume("auto", p, log)
        if not p.exists():
            raise UsageError(
                f"checkpoint.resume={resume}: no such file or folder. Pass a ckpt-*.pt file, a run folder, or 'auto'."
            )
        return p, load_checkpoint(p)
    candidates = find_checkpoints(run_dir) if run_dir is not None else []
    if not candidates:
        log(
            f"checkpoint.resume=auto: no checkpoint in {run_dir}; starting from scratch "
            "(to continue a run, set run.dir to its folder or use `torchsprint train --resume RUN_DIR`)"
        )
        return None, None
    for p in candidates:
        try:
            return p, load_checkpoint(p)
        except UsageError as e:
            log(f"[yellow]skipping unreadable checkpoint[/] {e}; trying the previous one")
    raise UsageError(
        f"checkpoint.resume=auto: none of the {len(candidates)} checkpoint(s) in {Path(run_dir) / 'checkpoints'} "
        "could be read (see above). Move them away to start over, or resume from another file."
    )


def restore(ckpt: dict, opt, sched, prec, rt, geometry: dict[str, int], log) -> TrainState:
    """Load optimizer, scheduler, scaler and RNG states from `ckpt` and return its TrainState.

    Args:
        ckpt: a checkpoint from `load_checkpoint` (the model is loaded by models.init.init_model).
        opt, sched, prec: the freshly built optimizer, scheduler and Precision of this run.
        rt: the Runtime (each rank gets back its own RNG stream).
        geometry: `data_geometry(cfg, world_size)` of this run.
        log: callable for one-line messages.
    A mid-epoch checkpoint refuses another batch size, accumulation, world size or seed: its data
    position would point at other samples, so some would be repeated and others skipped.
    """
    state = TrainState(**ckpt["train_state"])
    saved = {k: ckpt["sampler"][k] for k in geometry if k in ckpt.get("sampler", {})}
    changed = {k: (saved[k], v) for k, v in geometry.items() if k in saved and saved[k] != v}
    if state.step_in_epoch > 0 and changed:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        raise UsageError(
            f"the checkpoint was saved in the middle of epoch {state.epoch + 1} (step {state.global_step}) "
            f"and this run changes {what}: the data position would no longer match. Resume with the "
            "same data.batch_size, optim.accum_steps, number of processes, run.seed, data.repeated_aug, data.sampler "
            "and data.sampler_from_epoch, or from a checkpoint saved at an epoch boundary."
        )
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UsageError(
            f"the checkpoint's optimizer state does not fit this run's optimizer ({e}). Were "
            "model.freeze/train_only or optim.name changed? Resume with the same settings, or "
            "start from its weights with model.pretrained=<checkpoint>."
        ) from None
    sched.load_state_dict(ckpt["scheduler"])
    prec.load_state_dict(ckpt["scaler"])
    rngs = ckpt["rng"]
    if len(rngs) == rt.world_size:
        set_rng_state(rngs[rt.rank], rt.device)
    else:
        log(
            f"[yellow]RNG states not restored[/]: the checkpoint has {len(rngs)} process(es), this run "
            f"{rt.world_size}; data order and augmentation stay exact, random layers (dropout) do not"
        )
    return state


def restore_run(ckpt: dict | None, built, rt, resume_path, log) -> TrainState:
    """The TrainState a run starts from: `restore` of `ckpt` into `built`'s optimizer, schedule and precision, and
    its EMA and SWA states, when resuming; a fresh TrainState otherwise. Raises every refusal of the resume and
    writes nothing: the run's flow calls it before the run's records are written (a refused resume leaves them)."""
    if ckpt is None:
        return TrainState()
    state = restore(ckpt, built.opt, built.sched, built.prec, rt, data_geometry(built.cfg, rt.world_size), log)
    built.ema.load_state_dict(ckpt.get("ema"), log)
    built.swa.load_state_dict(ckpt.get("swa"), state.epoch, log)
    log(
        f"resuming at epoch {state.epoch + 1}, step {state.global_step} ({state.step_in_epoch} step(s) into the "
        f"epoch) from {resume_path}"
    )
    return state


def decisions_at_start(resume_path) -> dict:
    """The decisions.json a resumed run wrote when it started (beside checkpoints/, or beside the checkpoint
    itself), or {} when there is none: what a resume must keep as it began (the backend `auto` chose, the teacher)."""
    import json

    if resume_path is None:
        return {}
    for folder in Path(resume_path).parents[:2]:
        try:
            decided = json.loads(
                read_regular(folder / "decisions.json")
            )  # a FIFO there: refused (an OSError), not read
        except (OSError, ValueError):
            continue
        if isinstance(decided, dict):
            return decided
    return {}


def check_same_classes(saved, now, source, fix: str) -> None:
    """Refuse weights trained on other classes than the data has now (a class folder added, removed or renamed since),
    naming the classes added and removed and what to do (`fix`); None or [] for either (a task without class names,
    an older file) checks nothing. Without this the model, built for today's class count, failed to load with a
    state_dict size mismatch that blamed the file, or (same count) would score the classes under each other's names."""
    saved, now = list(saved or []), list(now or [])
    if not saved or not now or saved == now:
        return
    added, removed = [c for c in now if c not in saved], [c for c in saved if c not in now]

    def names(cs: list) -> str:
        return ", ".join(map(str, cs[:5])) + (f" (+{len(cs) - 5} more)" if len(cs) > 5 else "")

    what = "; ".join(
        part
        for part in (f"added: {names(added)}" if added else "", f"removed: {names(removed)}" if removed else "")
        if part
    )
    raise UsageError(
        f"the data's classes changed since {source} was saved ({len(saved)} classes then, {len(now)} now; "
        f"{what or 'the same names in another order'}): {fix}"
    )


def check_resumed_classes(ckpt: dict | None, resume_path, classes) -> None:
    """check_same_classes for a run resumed from `ckpt` (the classes its checkpoint was saved with) on data of
    `classes`."""
    if ckpt is None:
        return
    run = Path(resume_path).parents[1] if Path(resume_path).parent.name == "checkpoints" else "<the run>"
    check_same_classes(
        ckpt.get("classes"),
        classes,
        resume_path,
        "to resume, restore the data's class folders as they "
        "were; to train on the classes as they are now, start a new run (model.pretrained="
        f"{run}/best.safetensors starts it from these weights, with a new head).",
    )


def disk_full_error(error: BaseException, run_dir: Path | None) -> UsageError | None:
    """One line for a run whose write found no room (a full disk, a quota, ulimit -f): which file, and that its newest
    checkpoint is intact (checkpoints are written atomically: a full disk leaves the old ones as they were) with the
    command that continues from it; None for any other error."""
    line = disk_full(error, where=f"into {run_dir}" if run_dir else None)
    if line is None:
        return None
    newest = find_checkpoints(run_dir)[:1] if run_dir else []
    if newest:
        return UsageError(
            f"{line}; the last checkpoint, {newest[0]}, is intact: free space, then continue with "
            f"`torchsprint train --resume {run_dir}`."
        )
    return UsageError(f"{line}; no checkpoint was saved yet: free space and start the run again.")

"""Saving: atomic checkpoint files, last-K/best-K retention with status.json, safetensors weights, TrainState.

Resume discovery and restore are in state/resume.py; the RNG states a checkpoint carries in runtime/rng.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.runtime.collectives import broadcast_object, gather_objects
from torchsprint.runtime.files import read_regular
from torchsprint.runtime.rng import rng_state

FORMAT = "torchsprint-checkpoint"
FORMAT_VERSION = 1
CKPT_RE = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")
TEMP_RE = re.compile(r"^\..+\.tmp-\d+$")  # left behind by a process killed inside atomic_write


@dataclass
class TrainState:
    """The loop's position: everything besides module/optimizer states needed to continue exactly."""

    epoch: int = 0  # epoch in progress (0-based)
    step_in_epoch: int = 0  # optimizer steps already done in `epoch`
    global_step: int = 0  # optimizer steps done in total
    best_metric: float | None = None
    best_epoch: int | None = None
    best_step: int | None = None  # global step of the best weights (their per-class files and summary.json name it)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite values
    # This epoch's training loss and accuracy so far (summed at log steps and checkpoints, so a resumed epoch
    # reports the same means): sum of step losses, steps summed, correct top-1 predictions, samples counted.
    epoch_loss_sum: float = 0.0
    epoch_steps: int = 0
    epoch_correct: int = 0
    epoch_samples: int = 0
    # early_stop: the best monitored value by at least min_delta, evaluations since it, and the epoch
    # (0-based) whose evaluation stopped the run (None: not stopped).
    stop_best: float | None = None
    stop_wait: int = 0
    stopped_epoch: int | None = None
    # run.train_time: the run's last optimizer step as fitted to the time (train/time_fit.py); None: not fitted
    fitted_steps: int | None = None


# ---------------------------------------------------------------- names


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove wrapper prefixes from parameter names.

    DataParallel/DDP store the model as `.module` and torch.compile as `._orig_mod`, so weights
    saved from a wrapped model carry `module.` / `_orig_mod.` prefixes that the plain model lacks.
    This is the one place they are removed.
    """
    out = {}
    for k, v in state.items():
        while k.startswith(("module.", "_orig_mod.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


# ---------------------------------------------------------------- files


class _GuardedFile:
    """The temp file as seen by a serializer: remembers the first OSError a write raised.

    torch.save turns a failed write (ENOSPC) into an unrelated RuntimeError while closing its zip
    archive; atomic_write re-raises the recorded OSError instead, so a full disk reads as one.
    """

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp file name in `path`'s folder (unique to this process) to write; on a clean exit the temp
    file is fsync-ed and renamed over `path`, on any error removed and the error re-raised.

    A crash at any moment leaves either the old file or the complete new one under `path`, never a torn
    file (rename is atomic within one filesystem; fsync before it makes the data durable first), and two
    processes writing the same `path` each rename a whole file of their own. For writers that take a file
    name (torch.jit.save, the ONNX exporter); atomic_write is the same for a write(file) callable.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write(path: Path, write) -> int:
    """Write via `write(file)` into a temp file in the same folder, fsync, then rename over `path` (atomic_path).

    On any error the temp file is removed and the error re-raised (a failed write as its OSError).
    Returns the size in bytes.
    """
    path = Path(path)
    guarded = None
    try:
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            guarded = _GuardedFile(f)
            write(guarded)
            f.flush()
    except BaseException as e:
        if guarded is not None and guarded.error is not None and e is not guarded.error:
            raise guarded.error from e
        raise
    return path.stat().st_size


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a resumable checkpoint with weights_only=True: tensors and plain containers, never code.

    Raises UsageError naming the file when it is missing, unreadable (truncated, corrupt, not a
    torch file) or not a torchsprint checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}. Pass an existing ckpt-*.pt file or a run folder.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(
            f"{path} is not a readable checkpoint (truncated, corrupt or another format): "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        hint = (
            " It looks like a weights file: start from it with model.pretrained=<file> instead."
            if isinstance(ckpt, dict) and ckpt and all(torch.is_tensor(v) for v in ckpt.values())
            else ""
        )
        raise UsageError(f"{path} is not a torchsprint checkpoint (no '{FORMAT}' format marker).{hint}")
    missing = [k for k in ("model", "optimizer", "scheduler", "train_state", "rng") if k not in ckpt]
    if missing:
        raise UsageError(f"{path} is an incomplete torchsprint checkpoint: missing {missing}.")
    return ckpt


def save_weights(path: Path, model: nn.Module, metadata: dict[str, str]) -> int:
    """Write the model's weights as safetensors (loadable without torchsprint) atomically.

    Args:
        path: destination file, e.g. <run>/best.safetensors.
        model: the (possibly wrapped) model; wrapper prefixes are stripped.
        metadata: string key/values stored in the safetensors header (classes, model name...).
    """
    from safetensors.torch import save

    from torchsprint.runtime.parallel import unwrap

    state = {k: v.detach().cpu().contiguous() for k, v in strip_prefixes(unwrap(model).state_dict()).items()}
    data = save(state, metadata=metadata)
    try:
        return atomic_write(path, lambda f: f.write(data))
    except OSError as e:
        raise UsageError(
            f"could not write {path}: {e.strerror or e}. The previous {path.name}, if any, is intact; "
            "free disk space or fix permissions, then resume the run."
        ) from None


# ---------------------------------------------------------------- saver


def data_geometry(cfg, world_size: int) -> dict[str, int | str]:
    """What fixes the meaning of a mid-epoch data position: batch size, accumulation, ranks, seed."""
    return {
        "batch_size": cfg.data.batch_size,
        "accum_steps": cfg.optim.accum_steps,
        "world_size": world_size,
        "seed": cfg.run.seed,
        "repeated_aug": cfg.data.repeated_aug,
        "data_sampler": cfg.data.sampler,
        "data_sampler_from_epoch": cfg.data.sampler_from_epoch,
    }


def epoch_number(state: TrainState) -> int:
    """The 1-based number of the epoch a state belongs to, as the console, metrics.jsonl and checkpoint names
    count: the epoch in progress, or the one just finished (ckpt-e003-... is saved during or at the end of
    epoch 3). TrainState.epoch itself counts finished epochs."""
    return state.epoch if state.step_in_epoch == 0 and state.epoch > 0 else state.epoch + 1


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """(epoch, step) of a ckpt-e<epoch>-s<step>.pt file name, None for other names."""
    m = CKPT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class Saver:
    """Saves resumable checkpoints into <run_dir>/checkpoints and keeps the last K and the best K.

    Only rank 0 writes; every rank waits for it and learns whether it worked, so a failed save
    stops all ranks with the same error instead of leaving some waiting for a timeout.
    `checkpoints/status.json` lists the checkpoints on disk and the history of every save
    (epoch, step, metric, bytes, time).

    Args:
        run_dir: the run folder.
        ckpt_cfg: the `checkpoint` section (keep_last, keep_best, monitor, mode).
        rt: the Runtime.
        meta: extra entries stored in every checkpoint (resolved config, classes).
        geometry: `data_geometry(cfg, world_size)`, stored with the data position.
        resumed_step: global step of the checkpoint this run resumed from, or None for a fresh start.
            Checkpoints of the folder beyond it belong to an abandoned timeline (or were unreadable)
            and are moved into checkpoints/superseded-<time>/ so that a later `resume: auto` never
            picks them.
        log: callable for one-line messages.
        ema: the run's ema.ModelEma, saved in every checkpoint (its state_dict), or None / the no-op NoEma.
        swa: the run's swa.Swa (its averaged weights, their count and SWALR's state: entry `swa`), or None / NoSwa.
        flush_logs: called on rank 0 before each checkpoint is written (RunLogger.flush): the records logged up
            to its step reach the disk first, so a resume from it finds them all (it cuts only later ones); it
            returns their count per kind, which the checkpoint keeps (`log_records`).
    """

    def __init__(
        self,
        run_dir: Path,
        ckpt_cfg,
        rt,
        meta: dict[str, Any],
        *,
        geometry: dict[str, int],
        resumed_step: int | None = None,
        log=print,
        ema=None,
        flush_logs=None,
        swa=None,
    ):
        self.dir = Path(run_dir) / "checkpoints"
        self.cfg, self.rt, self.meta, self.geometry, self.log = ckpt_cfg, rt, meta, geometry, log
        self.ema, self.swa = ema, swa
        self.flush_logs = flush_logs
        self.status_path = self.dir / "status.json"
        self.status: dict[str, Any] = {}
        self._last_saved: tuple | None = None
        error = None
        if rt.is_main:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._remove_temp_files()
                self.status = self._read_status()
                self._set_aside_after(resumed_step)
            except OSError as e:
                error = (
                    f"cannot use the checkpoint folder {self.dir}: "
                    f"{e.strerror or e}. Make the run folder writable or set run.dir."
                )
        if (error := broadcast_object(error, rt)) is not None:
            raise UsageError(error)

    # -- status file
    def _read_status(self) -> dict[str, Any]:
        try:
            status = json.loads(read_regular(self.status_path))  # a FIFO there: refused (an OSError), not read
            if (
                not isinstance(status, dict)
                or not isinstance(status.get("checkpoints"), list)
                or not isinstance(status.get("history", []), list)
                or not all(isinstance(e, dict) and {"file", "epoch", "step"} <= e.keys() for e in status["checkpoints"])
            ):
                raise ValueError("unexpected layout")  # e.g. edited by hand: rebuilt, not a crash at the first save
        except FileNotFoundError:
            status = {}
        except (ValueError, OSError, RecursionError) as e:  # RecursionError: JSON nested past Python's limit
            self.log(
                f"[yellow]ignoring unreadable {self.status_path}[/] ({type(e).__name__}: {str(e)[:100]}); "
                "rebuilding it from the files"
            )
            status = {}
        status.setdefault("checkpoints", [])
        status.setdefault("history", [])
        # Reconcile with the disk: a crash between a checkpoint's rename and the status update
        # leaves a file the status does not list; a manual deletion leaves an entry without a file.
        on_disk = {p.name: p for p in self.dir.iterdir() if CKPT_RE.match(p.name)}
        entries = [e for e in status["checkpoints"] if e.get("file") in on_disk]
        listed = {e["file"] for e in entries}
        for name, p in on_disk.items():
            if name not in listed:
                entries.append(self._entry_from_file(p))
        status["checkpoints"] = sorted(entries, key=lambda e: (e["step"], e["epoch"]))
        return status

    def _entry_from_file(self, p: Path) -> dict[str, Any]:
        epoch, step = parse_checkpoint_name(p.name)
        try:
            ckpt = load_checkpoint(p)
            metric, step_in_epoch = ckpt.get("metric"), ckpt["train_state"]["step_in_epoch"]
        except UsageError:
            metric, step_in_epoch = None, None  # unreadable: find_resume reports it if it is ever tried
        return {
            "file": p.name,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "step": step,
            "metric": metric,
            "bytes": p.stat().st_size,
            "time": p.stat().st_mtime,
        }

    def _write_status(self) -> None:
        self.status.update(
            monitor=self.cfg.monitor,
            mode=self.cfg.mode,
            latest=self.status["checkpoints"][-1]["file"] if self.status["checkpoints"] else None,
            best=self._best_file(),
        )
        data = json.dumps(self.status, indent=1).encode()
        atomic_write(self.status_path, lambda f: f.write(data))

    def _best_file(self) -> str | None:
        scored = [e for e in self.status["checkpoints"] if e.get("metric") is not None]
        if not scored:
            return None
        pick = max if self.cfg.mode == "max" else min
        return pick(scored, key=lambda e: e["metric"])["file"]

    def _remove_temp_files(self) -> None:
        for p in self.dir.iterdir():
            if TEMP_RE.match(p.name):
                p.unlink(missing_ok=True)

    def _set_aside_after(self, resumed_step: int | None) -> None:
        newer = [e for e in self.status["checkpoints"] if resumed_step is None or e["step"] > resumed_step]
        if not newer:
            return
        dest = self.dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        dest.mkdir(exist_ok=True)
        for e in newer:
            os.replace(self.dir / e["file"], dest / e["file"])
        self.status["checkpoints"] = [e for e in self.status["checkpoints"] if e not in newer]
        self._write_status()
        why = "this run starts from scratch" if resumed_step is None else f"this run resumed from step {resumed_step}"
        self.log(
            f"[yellow]moved {len(newer)} checkpoint(s) beyond the resume point into {dest}[/] ({why}): "
            f"{', '.join(e['file'] for e in newer[:4])}"
        )

    # -- saving
    def save(self, state: TrainState, model, opt, sched, prec, metric: float | None) -> Path:
        """Save a full checkpoint of the current state; call it on every rank.

        Raises UsageError (on every rank) when the checkpoint cannot be written, e.g. a full disk;
        the checkpoints saved before stay intact and listed.
        """
        path = self.dir / f"ckpt-e{epoch_number(state):03d}-s{state.global_step:07d}.pt"
        key = (state.epoch, state.step_in_epoch, state.global_step, metric)
        if key == self._last_saved:  # the same on every rank, so all ranks skip together
            return path  # e.g. a pause right after a step checkpoint: nothing changed since
        rngs = gather_objects(rng_state(self.rt.device), self.rt)  # every rank's stream, restored per rank
        if self.ema is not None:
            self.ema.sync(self.rt)  # rank 0's EMA BatchNorm statistics everywhere, as after a resume
        error = None
        if self.rt.is_main:
            try:
                logged = self.flush_logs() if self.flush_logs is not None else None
                self._write(path, state, model, opt, sched, prec, metric, rngs, logged)
            except OSError as e:
                name = errno.errorcode.get(e.errno, "") if e.errno else ""
                error = (
                    f"could not save checkpoint {path}: {e.strerror or e}{f' ({name})' if name else ''}. "
                    f"Nothing saved before was lost: the previous checkpoints in {self.dir} are intact. "
                    "Free disk space or fix permissions, then continue with `torchsprint train --resume "
                    f"{self.dir.parent}`."
                )
        if (error := broadcast_object(error, self.rt)) is not None:  # also the barrier: every rank waits for rank 0
            raise UsageError(error)
        self._last_saved = key
        return path

    def _write(self, path: Path, state, model, opt, sched, prec, metric, rngs, logged: dict | None = None) -> None:
        from torchsprint.runtime.parallel import unwrap

        ckpt = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": strip_prefixes(unwrap(model).state_dict()),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": prec.state_dict(),
            "train_state": asdict(state),
            # The sampler's position: the loader skips `batches_done` batches of `epoch`'s permutation.
            "sampler": {
                "epoch": state.epoch,
                "batches_done": state.step_in_epoch * self.geometry["accum_steps"],
                **self.geometry,
            },
            "rng": rngs,
            "metric": metric,
            # metrics.jsonl's records per kind (logging.Covered). {} is a count too (nothing logged yet, e.g. a step
            # checkpoint before the first log step): left out, a resume fell back to cutting by step and kept the
            # epoch row logged after a step checkpoint at the epoch's last step, which it then logged again.
            **({"log_records": logged} if logged is not None else {}),
            **({"ema": self.ema.state_dict()} if self.ema is not None and self.ema.enabled else {}),
            **({"swa": self.swa.state_dict()} if self.swa is not None and self.swa.enabled else {}),
            **self.meta,
        }
        size = atomic_write(path, lambda f: torch.save(ckpt, f))
        entry = {
            "file": path.name,
            "epoch": epoch_number(state),
            "step_in_epoch": state.step_in_epoch,
            "step": state.global_step,
            "metric": metric,
            "bytes": size,
            "time": round(time.time(), 3),
        }
        self.status["history"].append(entry)
        entries = [e for e in self.status["checkpoints"] if e["file"] != path.name] + [entry]
        keep = self._keep(entries)
        self.status["checkpoints"] = sorted(
            (e for e in entries if e["file"] in keep), key=lambda e: (e["step"], e["epoch"])
        )
        self._write_status()
        # Delete only after the status no longer lists them: a crash here leaves extra files, never missing ones.
        for e in entries:
            if e["file"] not in keep:
                (self.dir / e["file"]).unlink(missing_ok=True)

    def _keep(self, entries: list[dict]) -> set[str]:
        """Names of the last `keep_last` checkpoints plus the best `keep_best` by `monitor`."""
        by_step = sorted(entries, key=lambda e: (e["step"], e["epoch"]))
        keep = {e["file"] for e in by_step[-self.cfg.keep_last :]}
        scored = [e for e in entries if e.get("metric") is not None]
        sign = -1 if self.cfg.mode == "max" else 1
        # Ties go to the earlier checkpoint: the first time a score was reached.
        ranked = sorted(scored, key=lambda e: (sign * e["metric"], e["step"]))
        keep |= {e["file"] for e in ranked[: self.cfg.keep_best]}
        return keep


def read_safetensors_metadata(path) -> dict[str, str]:
    """The text metadata of a .safetensors file (what save_weights wrote: epoch, step, classes, config...)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}

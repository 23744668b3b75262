"""Atomic checkpoint save/load, resume discovery and restore, last-K/best-K bookkeeping, safetensors weights."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchsprint.errors import UsageError

FORMAT = "torchsprint-checkpoint"
FORMAT_VERSION = 1
CKPT_RE = re.compile(r"^ckpt-e(\d+)-s(\d+)\.pt$")
TEMP_RE = re.compile(r"^\..+\.tmp-\d+$")  # left behind by a process killed inside atomic_write

# Test-only hook: simulate a slow disk so that a test can SIGKILL the process while a checkpoint is
# being written. Seconds to sleep after every 4 KiB chunk (each chunk is flushed first, so the
# temp file really is partly written at that moment). Unset in normal use.
SLOW_WRITE_ENV = "TORCHSPRINT_TEST_SLOW_WRITE_S"
_SLOW_CHUNK = 4096


@dataclass
class TrainState:
    """The loop's position: everything besides module/optimizer states needed to continue exactly."""

    epoch: int = 0  # epoch in progress (0-based)
    step_in_epoch: int = 0  # optimizer steps already done in `epoch`
    global_step: int = 0  # optimizer steps done in total
    best_metric: float | None = None
    best_epoch: int | None = None
    skipped_steps: int = 0  # optimizer steps skipped for non-finite values


# ---------------------------------------------------------------- names and RNG


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


def rng_state(device: torch.device) -> dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and the CUDA training device, as weights_only-loadable types.

    Args:
        device: the training device; its CUDA generator is saved when it is a CUDA device. Only the
            training device's generator is kept (not get_rng_state_all) so that a checkpoint resumes
            on a machine with another number of visible GPUs.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # uint32 -> int64 is lossless and a plain tensor type for the weights_only unpickler.
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` saved (the CUDA part only when training on CUDA)."""
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list | tuple) else x


def rng_isolated(iterable, device: torch.device, every_batch: bool = False):
    """Iterate `iterable` on its own torch RNG stream, leaving the global one to the model.

    A DataLoader without its own `generator` draws a base seed from the global generator every time
    an iterator is created (persistent workers: only in a process's first epoch), so a resumed run
    would see another dropout/stochastic-depth stream than an uninterrupted one. Data order and
    augmentation have their own seeds (data.core.sample_seed), and torchsprint's loaders pass their
    DataLoaders a seeded generator; this wrapper protects loaders that do not (user-registered ones).
    It isolates the iterator's creation and first batch, where DataLoaders draw; `every_batch=True`
    isolates every batch too, for a loader that draws from the global RNG per batch (two CPU RNG state
    copies of ~5 KB per batch, plus the device's on CUDA: measurable for tiny steps, hence opt-in).
    The loader's stream is seeded from the global seed plus a constant, not copied from the global
    state, so a loader that draws per batch never replays the numbers the model stream will draw.
    """
    cuda = device.type == "cuda"

    def get():
        return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None)

    def put(state) -> None:
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1], device)

    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.manual_seed((torch.initial_seed() + 0x5EED) % 2**63)  # deterministic per run seed and rank
        loader_rng = get()
    it, isolate = None, True
    while True:
        if not isolate:
            yield from it
            return
        model_rng = get()
        put(loader_rng)
        try:
            if it is None:
                it = iter(iterable)
            item = next(it)
        except StopIteration:
            return
        finally:
            loader_rng = get()
            put(model_rng)
        isolate = every_batch
        yield item


# ---------------------------------------------------------------- files


class _GuardedFile:
    """The temp file as seen by a serializer: remembers the first OSError a write raised.

    torch.save turns a failed write (ENOSPC) into an unrelated RuntimeError while closing its zip
    archive; atomic_write re-raises the recorded OSError instead, so a full disk reads as one.
    Also carries the test-only slow-disk hook (SLOW_WRITE_ENV).
    """

    def __init__(self, f, delay_s: float):
        self.f, self.delay_s = f, delay_s
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            if self.delay_s <= 0:
                return self.f.write(data)
            view = memoryview(data).cast("B")
            for i in range(0, len(view), _SLOW_CHUNK):
                self.f.write(view[i : i + _SLOW_CHUNK])
                self.f.flush()  # so that the temp file on disk really is partly written during the sleep
                time.sleep(self.delay_s)
            return len(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: Path, write) -> int:
    """Write via `write(file)` into a temp file in the same folder, fsync, then rename over `path`.

    A crash at any moment leaves either the old file or the complete new one under `path`, never
    a torn file (rename is atomic within one filesystem; fsync before it makes the data durable
    first). On any error the temp file is removed and the error re-raised (a failed write as its
    OSError). Returns the size in bytes.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    guarded = None
    try:
        with open(tmp, "wb") as f:
            guarded = _GuardedFile(f, float(os.environ.get(SLOW_WRITE_ENV, "0") or 0))
            write(guarded)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if guarded is not None and guarded.error is not None and e is not guarded.error:
            raise guarded.error from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
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
        hint = " It looks like a weights file: start from it with model.pretrained=<file> instead." \
            if isinstance(ckpt, dict) and ckpt and all(torch.is_tensor(v) for v in ckpt.values()) else ""
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

    from torchsprint.parallel import unwrap

    state = {k: v.detach().cpu().contiguous() for k, v in strip_prefixes(unwrap(model).state_dict()).items()}
    data = save(state, metadata=metadata)
    try:
        return atomic_write(path, lambda f: f.write(data))
    except OSError as e:
        raise UsageError(f"could not write {path}: {e.strerror or e}. The previous {path.name}, if any, is intact; "
                         "free disk space or fix permissions, then resume the run.") from None


# ---------------------------------------------------------------- saver


def data_geometry(cfg, world_size: int) -> dict[str, int]:
    """What fixes the meaning of a mid-epoch data position: batch size, accumulation, ranks, seed."""
    return {"batch_size": cfg.data.batch_size, "accum_steps": cfg.optim.accum_steps,
            "world_size": world_size, "seed": cfg.run.seed}


def _share(obj, rt, src: int = 0):
    """rank `src`'s object on every rank (identity in one process). All ranks wait here."""
    if not rt.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _gather(obj, rt) -> list:
    """Every rank's object, in rank order (a one-element list in one process)."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def _parse_name(name: str) -> tuple[int, int] | None:
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
    """

    def __init__(self, run_dir: Path, ckpt_cfg, rt, meta: dict[str, Any], *, geometry: dict[str, int],
                 resumed_step: int | None = None, log=print):
        self.dir = Path(run_dir) / "checkpoints"
        self.cfg, self.rt, self.meta, self.geometry, self.log = ckpt_cfg, rt, meta, geometry, log
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
                error = f"cannot use the checkpoint folder {self.dir}: {e.strerror or e}. Make the run folder writable or set run.dir."
        if (error := _share(error, rt)) is not None:
            raise UsageError(error)

    # -- status file
    def _read_status(self) -> dict[str, Any]:
        try:
            status = json.loads(self.status_path.read_text())
            if not isinstance(status, dict) or not isinstance(status.get("checkpoints"), list):
                raise ValueError("unexpected layout")
        except FileNotFoundError:
            status = {}
        except (ValueError, OSError) as e:
            self.log(f"[yellow]ignoring unreadable {self.status_path}[/] ({e}); rebuilding it from the files")
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
        epoch, step = _parse_name(p.name)
        try:
            ckpt = load_checkpoint(p)
            metric, step_in_epoch = ckpt.get("metric"), ckpt["train_state"]["step_in_epoch"]
        except UsageError:
            metric, step_in_epoch = None, None  # unreadable: find_resume reports it if it is ever tried
        return {"file": p.name, "epoch": epoch, "step_in_epoch": step_in_epoch, "step": step, "metric": metric,
                "bytes": p.stat().st_size, "time": p.stat().st_mtime}

    def _write_status(self) -> None:
        self.status.update(monitor=self.cfg.monitor, mode=self.cfg.mode,
                           latest=self.status["checkpoints"][-1]["file"] if self.status["checkpoints"] else None,
                           best=self._best_file())
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
        self.log(f"[yellow]moved {len(newer)} checkpoint(s) beyond the resume point into {dest}[/] ({why}): "
                 f"{', '.join(e['file'] for e in newer[:4])}")

    # -- saving
    def save(self, state: TrainState, model, opt, sched, prec, metric: float | None) -> Path:
        """Save a full checkpoint of the current state; call it on every rank.

        Raises UsageError (on every rank) when the checkpoint cannot be written, e.g. a full disk;
        the checkpoints saved before stay intact and listed.
        """
        path = self.dir / f"ckpt-e{state.epoch:03d}-s{state.global_step:07d}.pt"
        key = (state.epoch, state.step_in_epoch, state.global_step, metric)
        if key == self._last_saved:  # the same on every rank, so all ranks skip together
            return path  # e.g. a pause right after a step checkpoint: nothing changed since
        rngs = _gather(rng_state(self.rt.device), self.rt)  # every rank's stream, restored per rank
        error = None
        if self.rt.is_main:
            try:
                self._write(path, state, model, opt, sched, prec, metric, rngs)
            except OSError as e:
                name = errno.errorcode.get(e.errno, "") if e.errno else ""
                error = (f"could not save checkpoint {path}: {e.strerror or e}{f' ({name})' if name else ''}. "
                         f"Nothing saved before was lost: the previous checkpoints in {self.dir} are intact. "
                         "Free disk space or fix permissions, then continue with `torchsprint train --resume "
                         f"{self.dir.parent}`.")
        if (error := _share(error, self.rt)) is not None:  # also the barrier: every rank waits for rank 0
            raise UsageError(error)
        self._last_saved = key
        return path

    def _write(self, path: Path, state, model, opt, sched, prec, metric, rngs) -> None:
        from torchsprint.parallel import unwrap

        ckpt = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": strip_prefixes(unwrap(model).state_dict()),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": prec.state_dict(),
            "train_state": asdict(state),
            # The sampler's position: the loader skips `batches_done` batches of `epoch`'s permutation.
            "sampler": {"epoch": state.epoch, "batches_done": state.step_in_epoch * self.geometry["accum_steps"],
                        **self.geometry},
            "rng": rngs,
            "metric": metric,
            **self.meta,
        }
        size = atomic_write(path, lambda f: torch.save(ckpt, f))
        entry = {"file": path.name, "epoch": state.epoch, "step_in_epoch": state.step_in_epoch,
                 "step": state.global_step, "metric": metric, "bytes": size, "time": round(time.time(), 3)}
        self.status["history"].append(entry)
        entries = [e for e in self.status["checkpoints"] if e["file"] != path.name] + [entry]
        keep = self._keep(entries)
        self.status["checkpoints"] = sorted((e for e in entries if e["file"] in keep), key=lambda e: (e["step"], e["epoch"]))
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


# ---------------------------------------------------------------- resume


def find_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run folder, newest (highest step, then epoch) first."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [(*reversed(_parse_name(p.name)), p) for p in d.iterdir() if CKPT_RE.match(p.name)]
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
    path, error = _share(choice, rt)
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
                raise UsageError(f"checkpoint.resume={resume}: no checkpoints/ckpt-*.pt in that folder. "
                                 "Pass a run folder that saved checkpoints, or a ckpt-*.pt file.")
            return _find_resume("auto", p, log)
        if not p.exists():
            raise UsageError(f"checkpoint.resume={resume}: no such file or folder. Pass a ckpt-*.pt file, "
                             "a run folder, or 'auto'.")
        return p, load_checkpoint(p)
    candidates = find_checkpoints(run_dir) if run_dir is not None else []
    if not candidates:
        log(f"checkpoint.resume=auto: no checkpoint in {run_dir}; starting from scratch "
            "(to continue a run, set run.dir to its folder or use `torchsprint train --resume RUN_DIR`)")
        return None, None
    for p in candidates:
        try:
            return p, load_checkpoint(p)
        except UsageError as e:
            log(f"[yellow]skipping unreadable checkpoint[/] {e}; trying the previous one")
    raise UsageError(f"checkpoint.resume=auto: none of the {len(candidates)} checkpoint(s) in {Path(run_dir) / 'checkpoints'} "
                     "could be read (see above). Move them away to start over, or resume from another file.")


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
        raise UsageError(f"the checkpoint was saved in the middle of epoch {state.epoch + 1} (step {state.global_step}) "
                         f"and this run changes {what}: the data position would no longer match. Resume with the "
                         "same data.batch_size, optim.accum_steps, number of processes and run.seed, or from a "
                         "checkpoint saved at an epoch boundary.")
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise UsageError(f"the checkpoint's optimizer state does not fit this run's optimizer ({e}). Were "
                         "model.freeze/train_only or optim.name changed? Resume with the same settings, or "
                         "start from its weights with model.pretrained=<checkpoint>.") from None
    sched.load_state_dict(ckpt["scheduler"])
    prec.load_state_dict(ckpt["scaler"])
    rngs = ckpt["rng"]
    if len(rngs) == rt.world_size:
        set_rng_state(rngs[rt.rank], rt.device)
    else:
        log(f"[yellow]RNG states not restored[/]: the checkpoint has {len(rngs)} process(es), this run "
            f"{rt.world_size}; data order and augmentation stay exact, random layers (dropout) do not")
    return state

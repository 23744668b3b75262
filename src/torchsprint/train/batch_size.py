"""data.batch_size: auto, the largest batch that trains (found with real steps), and data.effective_batch_size.

The search follows PyTorch Lightning's `scale_batch_size(mode="binsearch")`: double the batch while a trial
trains, then bisect between the last size that trained and the first that ran out of memory. Each trial is
real: the run's model, freezing, channels_last, precision (a half-weight model, a GradScaler), optimizer, loss
and EMA, `engine.train_step` forward + backward + optimizer step on batches of the run's own training data.
torch.compile, CUDA graphs and DDP wrapping are not applied during the search (compiled graphs usually need
less memory than eager, so the eager result is on the safe side).

Where an out-of-memory error is the signal (CUDA), the trials are the search. On the CPU an allocation
failure can mean swapping or the kernel's OOM killer first, so the upper bound comes from free memory
instead (`cpu_bound`, the rule documented there) and one real trial confirms it, bisecting down if it fails.

Nothing the search does reaches the run: it builds its own throwaway loaders, model, optimizer, Precision
and EMA (freed before the run's own are built), and puts the process's RNG states (Python, NumPy, torch,
CUDA) back as they were. A run with `auto` is the run with the number it found written in (tested bit for bit).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint.errors import UsageError

AUTO_START = 2  # the first trial (Lightning's init_val)
STEPS_PER_TRIAL = 2  # step 1 creates the optimizer state after backward freed the activations; step 2 holds both
MAX_TRIALS = 25  # Lightning's max_trials
# Beyond a few thousand images per device, large-batch training needs its own recipe (linear LR scaling
# held to ~8k images in total in Goyal et al. 2017, "Accurate, Large Minibatch SGD"); set such a batch by hand.
AUTO_MAX = 4096
PROBE_SIZES = (2, 8)  # CPU: the two small batches whose peak memory gives the per-image cost
CPU_MEMORY_SHARE = 0.5  # CPU: the share of free memory the batch may take (room for the data, workers, fragmentation)
# What an allocation failure says when it is not a torch.OutOfMemoryError (Lightning's is_oom_error list).
_OOM_TEXT = (
    "CUDA out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory failure (CUDA's torch.OutOfMemoryError, or the CPU allocator's)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(t in str(error) for t in _OOM_TEXT)
    )


@dataclass
class BatchChoice:
    """What the run trains with, and why (decisions.json's batch_size_why and batch_size_search)."""

    batch_size: int
    accum_steps: int
    why: str
    search: dict = field(default_factory=dict)  # the trials, bounds and measurements of an `auto` search
    splits: object = None  # the data set the search built, handed to build_loaders (built once)


def binsearch(fits, start: int, cap: int, good: int = 0, max_trials: int = MAX_TRIALS) -> tuple[int, list]:
    """The largest size <= cap for which `fits(size)` is true, Lightning's 'binsearch': double from `start`
    while sizes fit (never past `cap`), then bisect between the last that fit and the first that did not.

    Args:
        fits: size -> bool (False: out of memory).
        start: the first size tried.
        cap: the largest size tried.
        good: a size known to fit already (0: none).
        max_trials: stop after this many trials, keeping the largest size that fit.
    Returns (largest size that fit, or 0 when none did; [(size, fitted), ...] in the order tried).
    """
    trials: list[tuple[int, bool]] = []
    size, bad = min(max(start, 1), cap), None
    while len(trials) < max_trials:
        ok = fits(size)
        trials.append((size, ok))
        if ok:
            good = size
            if bad is None:
                if size >= cap:
                    break
                size = min(2 * size, cap)
                continue
        else:
            bad = size
        if bad - good <= 1:
            break
        size = (good + bad) // 2
    return good, trials


def cpu_bound(peak_small: int, peak_large: int, sizes: tuple[int, int], available: int, processes: int = 1) -> dict:
    """The CPU rule: the largest batch whose step's memory fits CPU_MEMORY_SHARE of the free memory.

    A training step's extra memory grows linearly with the batch (activations kept for backward, their
    gradients, the batch itself) on top of a fixed part; two measured steps give both:
    per_image = (peak_large - peak_small) / (large - small), fixed = peak_small - small x per_image. The bound
    is (available x CPU_MEMORY_SHARE / processes on this machine - fixed) / per_image.

    Args:
        peak_small, peak_large: bytes the process's resident memory rose during one step at each size.
        sizes: (small, large) batch sizes of those steps.
        available: bytes free on this machine (or in this container) now.
        processes: training processes sharing this machine's memory (DDP on one host).
    """
    small, large = sizes
    per_image = max((peak_large - peak_small) / (large - small), 1.0)  # a flat measurement: tiny images, any batch
    fixed = max(peak_small - small * per_image, 0.0)
    budget = available * CPU_MEMORY_SHARE / processes
    return {
        "per_image_bytes": round(per_image),
        "fixed_bytes": round(fixed),
        "available_bytes": available,
        "budget_bytes": round(budget),
        "bound": max(int((budget - fixed) // per_image), 0),
    }


def power_of_two_floor(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


# ---------------------------------------------------------------- measuring memory on the CPU


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # the file gives kB
    raise OSError(f"{key} not in /proc/self/status")


def step_peak_bytes(fn) -> int | None:
    """How far the process's resident memory rose above its level before `fn()` at its peak, in bytes.

    Linux keeps the peak (VmHWM) and resets it to the current level when "5" is written to
    /proc/self/clear_refs (proc(5), Linux >= 4.0). tracemalloc would not see it: torch allocates outside
    Python's allocator. None where that file cannot be written (not Linux, or not allowed).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
    except OSError:
        return None
    fn()
    return max(_status_bytes("VmHWM") - before, 0)


def available_memory() -> int | None:
    """Bytes this process may still use: MemAvailable, or less where a cgroup (container) limit is lower."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(free, 0)


# ---------------------------------------------------------------- resolving data.batch_size and the effective batch


def check_batch_settings(cfg, world_size: int) -> None:
    """Refuse combinations that cannot hold, before anything is built (one line each, naming the fix)."""
    data, target, accum = cfg.data, cfg.data.effective_batch_size, cfg.optim.accum_steps
    if data.batch_size == "auto" and cfg.strategy.name == "dp":
        raise UsageError(
            "data.batch_size=auto with strategy=dp: nn.DataParallel splits each batch over the GPUs and "
            "gathers on GPU 0, which a one-device search cannot size. Set data.batch_size to a number, or use "
            "strategy=ddp (one process per GPU, each searched)."
        )
    if target is None:
        return
    if target % world_size:
        raise UsageError(
            f"data.effective_batch_size={target} is not divisible by the {world_size} processes: each "
            f"takes an equal share. Use a multiple of {world_size}, e.g. "
            f"{max(world_size, target // world_size * world_size)}."
        )
    per_process = target // world_size
    if data.batch_size == "auto":
        if accum != 1:
            raise UsageError(
                f"data.effective_batch_size={target} with data.batch_size=auto sets optim.accum_steps itself "
                f"(effective / (batch found x processes)); remove optim.accum_steps={accum}."
            )
        return
    if per_process % data.batch_size:
        fits = [b for b in range(min(data.batch_size, per_process), 0, -1) if per_process % b == 0][0]
        raise UsageError(
            f"data.effective_batch_size={target} is not a whole number of batches of data.batch_size="
            f"{data.batch_size} x {world_size} process(es): set data.batch_size to a divisor of "
            f"{per_process} (e.g. {fits}), data.batch_size=auto, or another effective_batch_size."
        )
    if accum not in (1, per_process // data.batch_size):
        raise UsageError(
            f"data.effective_batch_size={target} = data.batch_size={data.batch_size} x optim.accum_steps x "
            f"{world_size} process(es) needs optim.accum_steps={per_process // data.batch_size}, but it is "
            f"{accum}: remove optim.accum_steps (it is derived) or data.effective_batch_size."
        )


def choose_batch(cfg, rt, log, ckpt: dict | None = None) -> BatchChoice:
    """The run's batch size per process and accumulation steps, from data.batch_size (a number or auto),
    data.effective_batch_size and optim.accum_steps: the one place they are resolved.

    Args:
        cfg: the run's config; rt: its Runtime; log: rank 0's one-line logger.
        ckpt: the checkpoint being resumed, or None. Resuming an `auto` run takes the size it found when it
            started (a new search could find another and move the mid-epoch data position).
    """
    check_batch_settings(cfg, rt.world_size)
    data, target, world = cfg.data, cfg.data.effective_batch_size, rt.world_size
    if data.batch_size != "auto":
        if target is None:
            return BatchChoice(data.batch_size, cfg.optim.accum_steps, "data.batch_size")
        accum = target // world // data.batch_size
        return BatchChoice(
            data.batch_size,
            accum,
            f"data.batch_size; optim.accum_steps={accum} keeps data.effective_batch_size={target}",
        )
    saved = (ckpt or {}).get("sampler", {})
    if "batch_size" in saved:
        largest, search = int(saved["batch_size"]), {"from_checkpoint": True}
        why = f"auto: {largest}, found when the run started (kept from the checkpoint; no new search on resume)"
    else:
        largest, search = search_batch_size(cfg, rt, log)
        why = f"auto: the largest that trains here ({search['rule']})"
    if target is None:
        choice = BatchChoice(largest, cfg.optim.accum_steps, why, search)
    else:
        per_process = target // world
        b = max(d for d in range(1, min(largest, per_process) + 1) if per_process % d == 0)
        choice = BatchChoice(
            b,
            per_process // b,
            why
            + (f"; {b}, the largest divisor of {per_process} not above it" if b != largest else "")
            + f"; optim.accum_steps={per_process // b} keeps data.effective_batch_size={target}",
            search,
        )
    choice.splits = search.pop("splits", None)
    return choice


def resolved_config(cfg, choice: BatchChoice):
    """A copy of `cfg` with the chosen batch size and accumulation written in (what the run reads from here on,
    and what its config.yaml says: resuming from the folder trains with the same numbers)."""
    out = cfg.model_copy(deep=True)
    out.data.batch_size, out.optim.accum_steps = choice.batch_size, choice.accum_steps
    return out


def search_batch_size(cfg, rt, log) -> tuple[int, dict]:
    """Run the search (module docstring) on throwaway objects; every rank searches, all take the smallest."""
    from torchsprint.runtime.collectives import agree_min
    from torchsprint.runtime.rng import rng_state, set_rng_state

    saved = rng_state(rt.device)
    found, record, error = 0, {}, None
    try:
        found, record = _search(cfg, rt)
    except UsageError as e:  # shared below, so that no rank waits at agree_min for one that failed
        error = str(e)
    finally:
        gc.collect()
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()  # the trials' cached blocks go back before the run allocates its own
        set_rng_state(saved, rt.device)
    found = agree_min(found, rt)
    if error is not None:
        raise UsageError(error)
    if found < 1:
        raise UsageError(
            f"data.batch_size=auto: another process found no batch size that trains on its device "
            f"(this one: {record.get('found')}). Set data.batch_size to a number."
        )
    record["found"] = found
    log(
        f"data.batch_size=auto: {found} per process ({record['rule']}; trials "
        + ", ".join(f"{n}{'' if ok else ' (out of memory)'}" for n, ok in record["trials"])
        + ")"
    )
    return found, record


def _search(cfg, rt) -> tuple[int, dict]:
    """The search on throwaway objects: (the batch size found, the record of its cap, rule and trials)."""
    trial, splits = probe_trial(cfg, rt)  # held until this frame ends: its model, optimizer and EMA take memory
    device = rt.device
    per_rank = len(splits.train) // rt.world_size
    cap = max(min(per_rank, AUTO_MAX), 1)
    record = {
        "cap": cap,
        "cap_why": f"min({per_rank} training images per process, AUTO_MAX={AUTO_MAX})",
        "splits": splits,
    }
    if device.type == "cuda":
        record["rule"] = (
            f"doubling from {AUTO_START}, then bisecting on CUDA out-of-memory, up to {cap}; "
            "eager, without torch.compile/CUDA graphs"
        )
        found, trials = binsearch(trial.fits, AUTO_START, cap)
    else:
        found, trials = cpu_search(trial.fits, cap, rt, record)
    record["trials"] = trials
    if found < 1:
        raise UsageError(
            f"data.batch_size=auto: even a batch of 1 runs out of memory on {device} with model "
            f"{cfg.model.name} and precision {cfg.precision.mode}. Use smaller images, a smaller model or "
            "precision=amp_bf16 (amp_fp16), or free the device."
        )
    return found, record  # the throwaway objects go with this frame (search_batch_size then empties the CUDA cache)


def cpu_search(fits, cap: int, rt, record: dict) -> tuple[int, list]:
    """On the CPU: the bound from free memory and two measured small steps (cpu_bound), a power of two at most
    `cap`, confirmed by a real step (bisecting down if it fails). Adds the bound's figures and the rule to `record`."""
    small, large = PROBE_SIZES
    fits(small)  # warm: the optimizer state and the allocator's first blocks are not per-image memory
    peaks = [step_peak_bytes(lambda n=n: fits(n)) for n in (small, large)]
    available = available_memory()
    if None in peaks or available is None:
        raise UsageError(
            "data.batch_size=auto on the CPU measures a step's peak memory through Linux's "
            "/proc/self/clear_refs and /proc/meminfo, which this system does not offer. Set "
            "data.batch_size to a number."
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    bound = cpu_bound(peaks[0], peaks[1], PROBE_SIZES, available, local)
    start = power_of_two_floor(min(bound["bound"], cap))
    record.update(
        bound,
        rule=f"{CPU_MEMORY_SHARE:.0%} of the free memory / measured step memory, a power of two, "
        f"at most {cap}, confirmed by a real step",
    )
    if start < 1:
        raise UsageError(
            f"data.batch_size=auto: not even one image per step fits in {CPU_MEMORY_SHARE:.0%} of the "
            f"{available / 2**30:.1f} GiB free (a step takes about {bound['fixed_bytes'] / 2**30:.1f} GiB "
            f"plus {bound['per_image_bytes'] / 2**20:.1f} MiB per image). Free memory, use smaller "
            "images or a smaller model, or set data.batch_size to a number."
        )
    # Below `start` the bisection stops at `large`, measured above: it trained.
    return binsearch(fits, start, start, good=large if large <= start else 0)


@dataclass
class Trial:
    """The run's training objects, built for the search (probe_trial); `fits(n)`: whether n images train."""

    model: object
    loss_fn: object
    opt: object
    prec: object
    ema: object  # unused by a step, but its copy of the weights takes memory in the run too
    images: torch.Tensor  # the probe batch, repeated to n images
    targets: torch.Tensor
    four_d: bool  # NCHW images given channels_last
    clip_grad_norm: float | None
    device: torch.device
    keep: tuple = ()  # the probe loaders, alive as long as the search

    def batch(self, n: int):
        images, targets = self.images, self.targets
        idx = torch.arange(n, device=images.device) % images.shape[0]  # the probe batch repeated to n images
        x = images[idx]
        return (x.contiguous(memory_format=torch.channels_last) if self.four_d else x), targets[idx]

    def fits(self, n: int) -> bool:
        from torchsprint.train.context import Trainable
        from torchsprint.train.engine import train_step

        device, opt = self.device, self.opt
        ok = True
        try:
            x, y = self.batch(n)
            for _ in range(STEPS_PER_TRIAL):
                train_step(Trainable(self.model, self.loss_fn, opt, self.prec), [(x, y)], self.clip_grad_norm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an asynchronous failure surfaces here, inside the trial
        except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; anything else is raised
            if not is_oom(e):
                raise
            ok = False
        # Out of the except block: the traceback's frames (holding the trial's tensors) are gone (Accelerate's
        # find_executable_batch_size frees the same way), then the allocator's cache is emptied.
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ok


def probe_trial(cfg, rt) -> tuple[Trial, object]:
    """(the Trial, the data set's Splits): the run's data (one probe batch of the cpu backend), model, freezing,
    channels_last, precision, EMA, optimizer and loss, as the run builds them."""
    from torchsprint.data import build_loaders
    from torchsprint.data.core import DATASETS
    from torchsprint.data.preprocess.mix import check_mix, wrap_mix
    from torchsprint.models import build_model
    from torchsprint.models.init import apply_freeze, frozen_norm_layers
    from torchsprint.optim.losses import build_loss
    from torchsprint.optim.optimizers import build_optimizer
    from torchsprint.runtime.parallel import channels_last_on
    from torchsprint.state.ema import build_ema
    from torchsprint.state.precision import Precision, concrete_mode
    from torchsprint.tasks.core import get_task
    from torchsprint.train.engine import set_train_mode
    from torchsprint.train.plan import decide_input_format

    task, device = get_task(cfg.task), rt.device
    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    # The cpu backend, one process: the same preprocessing spec (shapes, dtype) as any backend, without decoding
    # the whole data set up front as the memory backend would; the run's own loaders are built afterwards.
    # data.progressive off: the probe crops at random_resized_crop's own size, the run's largest (its final one).
    probe_cfg = cfg.data.model_copy(
        update={
            "batch_size": PROBE_SIZES[1],
            "backend": "cpu",
            "fallback": None,
            "cpu_fraction": 0.0,
            "num_workers": 0,
            "prefetch_factor": 2,
            "progressive": type(cfg.data.progressive)(),
        }
    )
    probe = build_loaders(
        probe_cfg, rt, seed=cfg.run.seed, channels_last=cfg.speed.channels_last is True, splits=splits
    )
    info = probe.info
    train = probe.train
    if check_mix(cfg.mix, cfg.task, task.targets, cfg.loss):
        train = wrap_mix(train, cfg.mix, info.num_classes, cfg.run.seed, rt.rank, rt.world_size)
    train.set_epoch(0)
    images, targets = next(iter(train))

    model = build_model(cfg.model, info.num_classes, info.in_channels).to(device)
    from torch.nn.parameter import UninitializedParameter

    if any(isinstance(p, UninitializedParameter) for p in model.parameters()):
        with torch.no_grad():
            model(images[:1])
    apply_freeze(model, cfg.model.freeze, cfg.model.train_only)
    channels_last = channels_last_on(cfg.speed.channels_last, model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = build_ema(cfg.ema, model, device, channels_last)  # its copy of the weights takes memory in the run too
    prec = Precision(concrete_mode(cfg.precision.mode), device, on_nonfinite=cfg.precision.on_nonfinite)
    model = prec.prepare(model)
    ema.attach(model)
    opt = build_optimizer(cfg.optim, model)
    prec.attach(opt)
    loss_fn = build_loss(cfg.loss, task.targets, info.num_classes).to(device)
    set_train_mode(model, frozen_norm_layers(model) if cfg.model.freeze_bn_stats else [])
    # The batches' format as the run's loaders deliver it (plan.decide_input_format: under speed.channels_last=auto the
    # model is NHWC and the batches stay NCHW), not the model's: the probe measures the memory the run will use.
    four_d = images.ndim == 4 and decide_input_format(cfg.speed)[0]
    return Trial(
        model, loss_fn, opt, prec, ema, images, targets, four_d, cfg.optim.clip_grad_norm, device, keep=(probe, train)
    ), splits


def oom_message(error: BaseException, cfg, rt, step: int, run_dir: Path, evaluating: bool) -> str:
    """The one line a run that ran out of memory mid-training ends with: where, the batch size, what to lower,
    and the checkpoint that is left to resume."""
    from torchsprint.state.checkpoint import parse_checkpoint_name
    from torchsprint.state.resume import find_checkpoints

    b = cfg.data.batch_size
    where = (
        f"evaluating (data.eval_batch_size={cfg.data.eval_batch_size or 2 * b})"
        if evaluating
        else f"training (data.batch_size={b} per process x optim.accum_steps={cfg.optim.accum_steps})"
    )
    fix = (
        f"lower data.eval_batch_size (e.g. {max((cfg.data.eval_batch_size or 2 * b) // 2, 1)})"
        if evaluating
        else f"lower data.batch_size (e.g. {max(b // 2, 1)}"
        + (
            "; data.effective_batch_size keeps the effective batch through accumulation)"
            if cfg.data.effective_batch_size
            else "; or set data.effective_batch_size to keep the effective batch through accumulation)"
        )
    )
    fix += ", or use precision=amp_bf16/amp_fp16 or smaller images"
    ckpts = find_checkpoints(run_dir)
    if ckpts:
        epoch_step = parse_checkpoint_name(ckpts[0].name)
        left = (
            f"; the last checkpoint, {ckpts[0].relative_to(run_dir)}, is intact: resume with `torchsprint train "
            f"--resume {run_dir}`"
            + (f" (from step {epoch_step[1]})" if epoch_step else "")
            + "; a checkpoint saved mid-epoch resumes only with the same batch size"
        )
    else:
        left = "; no checkpoint was saved yet (checkpoint.every_steps saves during an epoch)"
    device = str(rt.device)
    if rt.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(rt.device)
        device += f", {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use"
    return f"out of memory on {device} at step {step} while {where}: {fix}{left}."

"""Runtime: device, rank and world size of this process; process group, seeds and backend flags."""

from __future__ import annotations

import itertools
import os
import random
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from torchsprint.errors import UsageError


@dataclass(frozen=True)
class Runtime:
    """Where this process runs. Travels explicitly to every builder that needs it (no globals).

    `control_group` is a gloo group for small host-side agreements (does every rank still have
    data?) when the main backend is NCCL: a gloo all-reduce of a CPU flag does not wait for the
    GPU stream, where an NCCL all-reduce read back with .item() would. None means "use the
    default group" (gloo runs, or a single process that never communicates).
    """

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    control_group: Any = None
    owns_group: bool = False  # setup() created the process group (teardown destroys only such a group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.distributed:
            torch.distributed.barrier()


@dataclass(frozen=True)
class LaunchEnv:
    """How this process was launched: rank, world size, local rank, and where to rendezvous.

    `init_method` is None for torchrun (its env:// variables MASTER_ADDR/PORT are already set),
    or an explicit tcp:// address for a bare SLURM `srun` launch.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single process"
    init_method: str | None = None


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM hostlist: 'gpu[07-09,12],cpu1' -> 'gpu07', 'a,b' -> 'a'.

    SLURM compresses node lists; the first node hosts the rendezvous store.
    """
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise UsageError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR to the first node's host name.")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]  # keeps zero padding: 'gpu[07-09]' -> 'gpu07'
    return prefix + first


def slurm_port(env: dict[str, str]) -> int:
    """MASTER_PORT, or a port derived from the job id so that two jobs on one node don't collide."""
    if "MASTER_PORT" in env:
        return int(env["MASTER_PORT"])
    return 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000


def launch_env(env: dict[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables: torchrun (RANK, WORLD_SIZE, LOCAL_RANK) first, then SLURM `srun`.

    SLURM is used only inside a job step (SLURM_PROCID and SLURM_STEP_ID set) with SLURM_NTASKS > 1,
    so a plain `python` in an `sbatch` script or an `salloc` shell stays a single process.
    """
    env = dict(os.environ) if env is None else env
    if "WORLD_SIZE" in env:
        return LaunchEnv(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")), "torchrun")
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    if ntasks > 1 and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        addr = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        )
        return LaunchEnv(
            int(env["SLURM_PROCID"]),
            ntasks,
            int(env.get("SLURM_LOCALID", "0")),
            "slurm",
            f"tcp://{addr}:{slurm_port(env)}",
        )
    return LaunchEnv()


def resolve_device(name: str, local_rank: int = 0, what: str = "run.device") -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is present, else cpu; validates explicit names: a device of this
    machine (cpu, cuda, cuda:N of a GPU it has). `what` names the setting or flag in the error."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):  # meta, mps, xla... would fail later, mid-run
        raise UsageError(f"{what} '{name}' is not a device torchsprint runs on. Use auto, cpu, cuda or cuda:N.")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{what}={name} but this machine has no CUDA device. Use {what}=cpu (or auto).")
        if dev.index is None:
            dev = torch.device(f"cuda:{local_rank}")
        elif dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"{what}={name} but this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}."
            )
    return dev


def resolve_backend(strategy_cfg, device: torch.device) -> str:
    """strategy.backend, with 'auto' -> NCCL on CUDA and gloo on CPU; NCCL on CPU is refused."""
    backend = strategy_cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("strategy.backend=nccl needs CUDA devices; on CPU use strategy.backend=gloo (or auto).")
    return backend


def check_strategy(strategy_cfg, world_size: int, source: str = "single process") -> None:
    """Refuse a launch the strategy cannot use: DataParallel is one process driving every GPU; DDP needs a
    launcher (a plain `torchsprint train` with strategy=ddp would otherwise train alone, silently)."""
    if strategy_cfg.name == "ddp" and source == "single process":
        raise UsageError(
            "strategy=ddp runs one process per device: start it with `torchsprint train --nproc-per-node N` "
            "(or torchrun / srun); for one process set strategy=single."
        )
    if world_size > 1 and strategy_cfg.name == "dp":
        raise UsageError(
            f"launched as {world_size} processes (torchrun/SLURM) but strategy=dp (nn.DataParallel) runs in one "
            "process. Use strategy=ddp with several processes, or launch one process for dp."
        )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def attempt_store(launch: LaunchEnv, timeout: timedelta):
    """Under torchrun: the env:// store, its keys prefixed by the restart attempt; None (init_method) elsewhere.

    torchrun's agent keeps serving one store when it restarts the worker group (--max-restarts), and the
    process group's keys (each rank's gloo address) are the same names in every attempt: a restarted rank
    could read a dead rank's address from the attempt before and fail to connect (seen with torch 2.14:
    "connectFullMesh failed ... Connection refused" after a restart). A prefix per attempt keeps them apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if launch.source != "torchrun" or launch.init_method is not None or attempt is None:
        return None
    base, _, _ = next(torch.distributed.rendezvous("env://", launch.rank, launch.world_size, timeout=timeout))
    # Also one prefix per group this process creates (several runs in one worker, as the Python API and
    # tests do): every rank creates its groups in the same order, so the counters agree.
    return torch.distributed.PrefixStore(f"torchsprint/attempt_{attempt}/group_{next(_GROUPS_MADE)}", base)


_GROUPS_MADE = itertools.count()  # process groups this process initialised through attempt_store


def setup(run_cfg, strategy_cfg, speed_cfg=None) -> Runtime:
    """Create the Runtime: read the launcher's environment, init the process group, seed, set backend flags.

    A run started by torchrun or `srun` with several processes is DDP even when the config says
    strategy=single (the same config runs under `torchsprint train --nproc-per-node N` and a
    plain `torchrun -m torchsprint train`); strategy=dp there is refused.

    Args:
        run_cfg: the `run` section (device, seed, deterministic).
        strategy_cfg: the `strategy` section (name, backend, timeout_s).
        speed_cfg: the `speed` section (cudnn_benchmark, tf32), optional.
    """
    launch = launch_env()
    device = resolve_device(run_cfg.device, launch.local_rank)
    check_strategy(strategy_cfg, launch.world_size, launch.source)
    backend, control, owns = None, None, False
    if launch.world_size > 1:
        backend = resolve_backend(strategy_cfg, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=strategy_cfg.timeout_s)
        owns = not torch.distributed.is_initialized()  # a caller's own group is used as is, and left alive
        if owns:
            # The timeout bounds every collective: a rank that died or hangs makes the others
            # fail after `timeout_s` instead of waiting forever (gloo raises; NCCL's watchdog aborts).
            torch.distributed.init_process_group(
                backend=backend,
                init_method=launch.init_method,
                store=attempt_store(launch, timeout),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
            )
        if backend == "nccl":
            control = torch.distributed.new_group(backend="gloo", timeout=timeout)
    seed_everything(run_cfg.seed + launch.rank)
    # Set both ways: these flags are process-wide, and a second run in the same process (the Python API,
    # bench) must not inherit the first one's.
    # Strict: an operation without a deterministic implementation raises (run.train names it), where
    # warn_only would print a warning and run it anyway, breaking the promise of bit-exact reruns.
    torch.use_deterministic_algorithms(run_cfg.deterministic)
    if run_cfg.deterministic:  # cuBLAS's deterministic workspace: set when torchsprint is imported (__init__.py)
        torch.backends.cudnn.benchmark = False
    elif speed_cfg is not None and device.type == "cuda":
        torch.backends.cudnn.benchmark = speed_cfg.cudnn_benchmark
    if speed_cfg is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = speed_cfg.tf32
        torch.backends.cudnn.allow_tf32 = speed_cfg.tf32
    return Runtime(
        device=device,
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        backend=backend,
        control_group=control,
        owns_group=owns,
    )


def teardown(rt: Runtime, clean: bool = True) -> None:
    """Destroy the process group if setup() made it (a group the caller initialised stays theirs).

    `clean`: this rank finished normally. Then every rank first meets at a barrier, so no rank tears
    its group down (and exits) while another still writes files or waits in a collective; a rank that
    exits early under torchrun was seen to take its peer down with "terminate called without an active
    exception" (exit 134) after the run had finished. After an error there is no barrier: the others
    may be gone, and the strategy timeout bounds the wait anyway.
    """
    if rt.owns_group and torch.distributed.is_initialized():
        if clean:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def lost_peer(error: BaseException) -> str | None:
    """One line for a collective that failed because another rank died or hung, else None.

    Under DDP the survivors of a dead worker or machine see gloo's "Connection closed by peer" or
    "Connection reset by peer", or a timeout after strategy.timeout_s, from deep inside a backward pass
    or an all_reduce; that traceback says nothing a user can act on. The CLI prints this line instead
    (the traceback with --debug).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the group itself is torn down by the time the CLI sees this
    if world < 2 or not torch.distributed.is_available():
        return None
    msg = str(error)
    dist_error = isinstance(error, getattr(torch.distributed, "DistError", ()))
    closed = any(k in msg for k in ("closed by peer", "reset by peer", "Broken pipe", "Connection refused"))
    timed_out = "imed out" in msg or "timeout" in msg.lower()
    # A plain RuntimeError counts only when it comes from the communication library (a DataLoader's own
    # "timed out" is not a lost peer).
    from_backend = any(k in msg.lower() for k in ("gloo", "nccl", "processgroup", "c10d"))
    if not (dist_error or ((closed or timed_out) and from_backend and isinstance(error, RuntimeError))):
        return None
    rank = os.environ.get("RANK", "?")
    why = (
        "another rank's connection closed: a worker or its machine died"
        if closed
        else "another rank did not answer within strategy.timeout_s: a worker or machine hung or died"
        if timed_out
        else "a collective operation failed"
    )
    first = (msg.strip().splitlines() or [""])[0][:160]
    return (
        f"DDP rank {rank} of {world} lost contact with the group ({why}; {type(error).__name__}: {first}). "
        "With --max-restarts K the group restarts from the newest checkpoint; --debug shows the traceback."
    )


def exit_process(code: int) -> None:
    """Leave a torchrun worker with os._exit once everything is written and closed: interpreter shutdown
    would still destroy objects that hold gloo's worker threads (a DDP reducer's process-group reference)
    after the group is gone, which aborted about 1 run in 40 with "terminate called without an active
    exception" (exit 134; tests/stress/ddp_exit.py). stdout and stderr are flushed here; every file the run
    writes is closed by then (the run's logger and checkpoint writer close theirs)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------- memory this process and its children may use

NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2^63-1 rounded to a page; v2 writes "max"


def proc_bytes(path: str, key: str) -> int | None:
    """A `Key:   N kB` line of a /proc file (meminfo, status) in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory() -> tuple[int, int, str] | None:
    """(limit, usage, its file) of the tightest memory limit of this process's cgroup and its ancestors: v2 memory.max
    (memory.current), v1 memory.limit_in_bytes (memory.usage_in_bytes); None when no cgroup limits memory. A
    container's limit is the one its OOM killer enforces, whatever the host's RAM."""
    from pathlib import Path

    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            base, limit_name, usage_name = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name = (
                Path("/sys/fs/cgroup/memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        folder = base / rel.lstrip("/")
        for d in [folder, *folder.parents]:
            try:
                text = (d / limit_name).read_text().strip()
                limit = NO_LIMIT if text == "max" else int(text)
                usage = int((d / usage_name).read_text().strip())
            except (OSError, ValueError):
                limit = NO_LIMIT
            if limit < NO_LIMIT and (best is None or limit - usage < best[0] - best[1]):
                best = (limit, usage, str(d / limit_name))
            if d == base:
                break
    return best


def memory_cap() -> tuple[int, str]:
    """(bytes, where that figure comes from): the most memory this process can hold: the smallest of the host's RAM,
    its cgroup's memory limit (cgroup_memory) and, under `ulimit -v` (RLIMIT_AS), the address space it may still
    map (the limit less what is mapped already: importing torch maps gigabytes). The memory backend's budget is a
    share of it: of the RAM alone, a limited process passed the check and died decoding with a MemoryError."""
    import resource

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    caps = [(ram, f"the {ram / 2**30:.0f} GiB of RAM")] if ram else []
    group = cgroup_memory()
    if group is not None:
        caps.append((group[0], f"the {group[0] / 2**30:.1f} GiB memory limit of this process's cgroup ({group[2]})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = proc_bytes("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        left = max(0, soft - mapped)
        caps.append(
            (
                left,
                f"the {left / 2**30:.2f} GiB this process may still map under its address-space limit of "
                f"{soft / 2**30:.2f} GiB (ulimit -v)",
            )
        )
    return min(caps, default=(0, "no memory figure"), key=lambda c: c[0])


def memory_available() -> tuple[int, str]:
    """(bytes, where from): what new processes can take now: the kernel's MemAvailable, or the cgroup's limit less
    its usage when that is smaller (0, "" when neither can be read)."""
    free = proc_bytes("/proc/meminfo", "MemAvailable")
    out = (free, "available (MemAvailable)") if free is not None else (0, "")
    group = cgroup_memory()
    if group is not None and (free is None or group[0] - group[1] < free):
        out = (max(0, group[0] - group[1]), f"left under the cgroup's memory limit ({group[2]})")
    return out

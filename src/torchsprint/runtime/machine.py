"""The machine a run's figures come from: the CPU (its model, cores, the instruction sets that change PyTorch's speed
and numbers: AVX2, AVX-512, native bf16, AMX; the kernels PyTorch picked and its thread counts) and `environment`,
the record env.json holds (versions, git revision, device, CPU, seed).

The CPU is recorded in every run's env.json and in `torchsprint bench`'s bench.json, so two figures from two machines
can be told apart.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

# The /proc/cpuinfo flags that change what PyTorch's CPU kernels do (vector width, native bf16 dot products, AMX tiles).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@lru_cache(maxsize=1)
def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ('', empty) where there is none (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX-BF16): only then can bf16 autocast beat fp32 on it.
    Without them PyTorch's bf16 kernels convert to fp32 and back (slower than fp32 itself)."""
    flags = _proc_cpuinfo()[1] if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_info() -> dict:
    """The CPU as env.json and bench.json record it."""
    import torch

    model, flags = _proc_cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))  # the cores this process may run on (a container's or taskset's share)
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "model": model or platform.processor() or "unknown",
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "flags": {f: f in flags for f in FLAGS},
        "native_bf16": native_bf16(flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the ATen kernels PyTorch picked
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


def cpu_text(info: dict | None = None) -> str:
    """One line: 'AMD EPYC (2 cores; avx2, no avx512; PyTorch kernels AVX2; 2 threads)'."""
    info = info or cpu_info()
    f = info["flags"]
    isa = ", ".join(n for n in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f.get(n)) or "no avx2"
    return (
        f"{info['model']} ({info['usable_cores']} cores; {isa}; PyTorch kernels {info['torch_cpu_capability']}; "
        f"{info['torch_threads']} threads)"
    )


def environment(rt, seed: int) -> dict:
    """Versions, git revision, device, seed: what it takes to reproduce a run (written before step 0)."""
    import torch
    import torchvision

    from torchsprint.version import __version__

    def git_rev():
        try:
            here = Path(__file__).resolve().parent
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
            dirty = subprocess.run(
                ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=5
            )
            return (out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    dev = str(rt.device)
    if rt.device.type == "cuda":
        dev += f" ({torch.cuda.get_device_name(rt.device)})"
    return {
        "torchsprint": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "device": dev,
        "world_size": rt.world_size,
        "seed": seed,
        "git_revision": git_rev(),
        "argv": sys.argv,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

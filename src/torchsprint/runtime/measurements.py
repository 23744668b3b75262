"""Start-up measurements kept per machine: what a probe measured (precision/memory format: train/speed_probe.py),
stored under the user's cache folder with everything that decides its result (the CPU's model and flags, the
threads, torch's version and kernel set, and the caller's own keys: model, input size, batch, data), and reused by
the next run that has the same keys instead of measured again. `--remeasure` (TORCHSPRINT_REMEASURE=1) measures
anew and replaces the stored figures.

One JSON file per kind of measurement, `<cache>/torchsprint/measured/<kind>.json`, rewritten atomically under a
lock (two runs starting together never lose each other's entry).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

REMEASURE_ENV = "TORCHSPRINT_REMEASURE"  # 1: measure again and replace what is stored (train --remeasure sets it)
LIMIT = 200  # entries kept per kind, the least recently written dropped first


def folder() -> Path:
    """$TORCHSPRINT_MEASURED_DIR, else <$XDG_CACHE_HOME or ~/.cache>/torchsprint/measured."""
    if os.environ.get("TORCHSPRINT_MEASURED_DIR"):
        return Path(os.environ["TORCHSPRINT_MEASURED_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torchsprint" / "measured"


def cpu_identity() -> dict:
    """What makes one CPU measure differently from another: its model name, its flags, the threads torch uses."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {
        "cpu": model,
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "aten_cap": os.environ.get("ATEN_CPU_CAPABILITY", ""),
    }


def key_of(keys: dict) -> tuple[dict, str]:
    """(the whole key: this machine's identity and `keys`, its hash)."""
    whole = {**cpu_identity(), **keys}
    return whole, hashlib.sha256(json.dumps(whole, sort_keys=True, default=str).encode()).hexdigest()[:24]


def recall(kind: str, keys: dict) -> dict | None:
    """What was stored for these keys on this machine ({"value", "date", "key"}), or None (never measured, the
    keys changed, or --remeasure)."""
    if os.environ.get(REMEASURE_ENV) == "1":
        return None
    _, digest = key_of(keys)
    try:
        entries = json.loads((folder() / f"{kind}.json").read_text())
    except (OSError, ValueError):
        return None
    entry = entries.get(digest) if isinstance(entries, dict) else None
    return entry if isinstance(entry, dict) and "value" in entry else None


def remember(kind: str, keys: dict, value) -> None:
    """Store `value` for these keys on this machine; a folder that cannot be written is left alone (the run goes on:
    the next one measures again)."""
    whole, digest = key_of(keys)
    path = folder() / f"{kind}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = json.loads(path.read_text())
                entries = entries if isinstance(entries, dict) else {}
            except (OSError, ValueError):
                entries = {}
            entries[digest] = {"key": whole, "value": value, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            keep = sorted(entries, key=lambda k: entries[k].get("date", ""))[-LIMIT:]
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({k: entries[k] for k in keep}, indent=1, default=str))
            os.replace(tmp, path)
    except OSError:
        pass

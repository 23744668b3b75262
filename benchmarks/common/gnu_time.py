"""A command's wall time and peak resident memory under GNU time (`/usr/bin/time -v`)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

# GNU time's line for the peak RSS of the process and the children it waited for
MAXRSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def peak_mib(stderr: str) -> int:
    """The peak RSS in MiB from GNU time's report (on the command's stderr)."""
    return int(MAXRSS.search(stderr).group(1)) // 1024


def timed(cmd: list[str], cwd: Path) -> tuple[str, float, int]:
    """Run cmd under GNU time: (output, wall seconds, peak RSS in MiB); exits with the output if cmd fails."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{cmd[1]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr, wall, peak_mib(r.stderr)

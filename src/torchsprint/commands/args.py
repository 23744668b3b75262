"""The types of the commands' flags, checked while the command line is parsed, as the config schema checks its
fields: whole numbers where counts are meant, finite numbers in range, devices this machine has, output paths
that can be written. A bad value is one line (`error: torchsprint predict: argument --batch-size: ...`, exit
code 2) before any work starts: `predict --batch-size 0`, `--topk -1` and `--device cuda` without a GPU were
tracebacks, `lr-find --out` on a file was found only after the whole sweep, `--nproc-per-node 0` ran one process.

Each type keeps what it accepts as attributes (tests/test_cli_flags.py draws bad values from them).
"""

from __future__ import annotations

import argparse
import math
import re


class Count:
    """A whole number >= `minimum` (images, steps, processes, ranks)."""

    def __init__(self, minimum: int = 1, why: str = ""):
        self.minimum, self.why = minimum, why

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a whole number >= {self.minimum}, got {text!r}") from None
        if value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be >= {self.minimum}{self.why}, got {value}")
        return value


class Number:
    """A finite number in [low, high] (`above`: low itself excluded)."""

    def __init__(self, low: float | None = None, high: float | None = None, above: bool = False):
        self.low, self.high, self.above = low, high, above

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = self.low is None or value > self.low or (value == self.low and not self.above)
        if not (math.isfinite(value) and low_ok and (self.high is None or value <= self.high)):
            where = [f"{'>' if self.above else '>='} {self.low:g}"] if self.low is not None else []
            where += [f"<= {self.high:g}"] if self.high is not None else []
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + ' and '.join(where) if where else ''}, "
                                             f"got {text!r}")
        return value


def device(text: str) -> str:
    """cpu, cuda or cuda:N of a GPU this machine has (runtime.resolve_device's rules); 'auto' becomes what it
    resolves to."""
    if text == "cpu":  # the default: no torch import to parse it
        return text
    from torchsprint.errors import UsageError
    from torchsprint.runtime.core import resolve_device

    try:
        resolved = resolve_device(text, what="--device")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return str(resolved) if text == "auto" else text


def nnodes(text: str) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job (whole numbers >= 1, MIN <= MAX)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX machines (whole numbers >= 1, MIN <= MAX), got {text!r}")
    return text


def shard_size(text: str) -> str:
    """`data shard --shard-size`: a size such as 1GB, 500MB, 64MiB (shard.parse_size's rules)."""
    from torchsprint.data.commands.shard import parse_size
    from torchsprint.errors import UsageError

    try:
        parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None  # parse_size's line without its flag
    return text


class Output:
    """An output file (or `folder`) a command writes: rundir.writable_file's checks (not a run's own file, not a
    folder for a file nor a file for a folder, writable), creating nothing; the command checks again, with its
    --overwrite, when it writes."""

    def __init__(self, folder: bool = False):
        self.folder = folder

    def __call__(self, text: str) -> str:
        from torchsprint.errors import UsageError
        from torchsprint.train.rundir import writable_file

        try:
            writable_file(text, "", folder=self.folder, create=False)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text


class OneLineParser(argparse.ArgumentParser):
    """argparse with every refusal on one line, as the commands' own (`error: ...`, exit code 2), naming the command."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")

"""Rank-0 console, progress bar, metrics.jsonl and TensorBoard. Other ranks get a silent logger."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


class RunLogger:
    """Writes what a run reports. Construct with `enabled=False` on ranks other than 0.

    Args:
        run_dir: the run folder (metrics.jsonl and tb/ go there); None for console only.
        log_cfg: the `log` section.
        enabled: False makes every method a no-op (non-zero ranks).
        console: False silences the terminal but still writes files.
    """

    def __init__(self, run_dir: Path | None, log_cfg, enabled: bool = True, console: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=False, highlight=False, soft_wrap=True, quiet=not console)
        self.cfg = log_cfg
        self.jsonl = None
        self.tb = None
        self.progress: Progress | None = None
        self.task = None
        if run_dir is not None:
            self.open_files(run_dir)

    def open_files(self, run_dir: Path) -> None:
        """Start writing metrics.jsonl (appended to, so a resumed run continues it) and TensorBoard into run_dir."""
        if not self.enabled or self.jsonl is not None:
            return
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def info(self, msg: str) -> None:
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(msg)

    def scalars(self, step: int, values: dict[str, Any], kind: str) -> None:
        """One metrics.jsonl line and TensorBoard scalars for every numeric value."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": kind, "step": step, "time": round(time.time(), 3), **values}) + "\n")
        if self.tb:
            for k, v in values.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    # -- progress: one bar per epoch (interactive terminals), a line per log step otherwise
    def start_epoch(self, epoch: int, epochs: int, total: int, done: int = 0) -> None:
        if not (self.enabled and self.cfg.progress and sys.stdout.isatty() and not self.console.quiet):
            return
        self.progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{epochs}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=done, stats="")

    def advance(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=n)

    def step_stats(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, stats=text)
        else:
            self.info(text)

    def end_epoch(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, title: str, rows: list[tuple[str, str]]) -> None:
        if not self.enabled:
            return
        table = Table(title=title, show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)

    def close(self) -> None:
        self.end_epoch()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()

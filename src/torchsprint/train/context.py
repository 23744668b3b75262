"""`RunContext`: a run's services travelling as one object, and `Trainable`: the objects one optimizer step uses.

train/run.py builds one RunContext per run (after the run folder, the logger, the saver and the stopper exist) and
hands it to `engine.fit(plan, built, state, ctx)`; the loop and its evaluations read their services from it instead
of taking them one keyword at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchsprint.train.time_fit import FixedLength, TimeFit

if TYPE_CHECKING:  # annotations only: the context is built by train/run.py, which imports them all
    import torch

    from torchsprint.observe.logging import RunLogger
    from torchsprint.runtime.core import Runtime
    from torchsprint.runtime.preempt import Stopper
    from torchsprint.state.checkpoint import Saver
    from torchsprint.state.precision import Precision
    from torchsprint.tasks.core import Task


@dataclass(frozen=True)
class RunContext:
    """What a run's loop writes to and asks, built once by the run's flow.

    Attributes:
        rt: runtime.Runtime (device, rank, world size; rank 0 writes the files).
        run_dir: the run folder.
        logger: observe.logging.RunLogger (console, metric sinks, progress).
        saver: train.checkpoint.Saver (resumable checkpoints, retention).
        stop: runtime.preempt.Stopper, asked after every step (pauses, run.max_time, stop signals); None: never stops.
        make_metrics: a fresh evaluator per evaluation (the task's make_metrics for the run's data).
        weights_meta: the metadata every weights file of the run carries (classes, model, config, ...).
        task: tasks.core.Task (None: classification).
        length: train.time_fit.TimeFit (run.train_time: the run's length fitted to the time) or FixedLength (a
            no-op: run.epochs and run.max_steps end the run).
    """

    rt: Runtime
    run_dir: Path
    logger: RunLogger
    saver: Saver | None = None
    stop: Stopper | None = None
    make_metrics: Callable[[], Any] | None = None  # the task's evaluator (tasks' metrics classes share no base)
    weights_meta: dict = field(default_factory=dict)
    task: Task | None = None
    length: TimeFit | FixedLength = field(default_factory=FixedLength)


@dataclass
class Trainable:
    """The objects one optimizer step uses (train/run.py's Built has the same attributes and is passed as is).

    Attributes:
        model: the (wrapped) model; loss_fn: loss(logits, targets); opt: the optimizer; prec: train.precision.Precision.
    """

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    opt: torch.optim.Optimizer
    prec: Precision

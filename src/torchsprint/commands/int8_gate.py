"""The int8 check `export --int8` runs before it writes: on the validation split, the int8 graph's top-1 within 1
point of the fp32 graph it was quantized from (and its balanced accuracy, where the run monitors val/balanced_acc),
AND more images per second than fp32 at the serving batch, both measured side by side on this machine.

Why both: quantization that loses accuracy is a worse model, and quantization that is not faster buys nothing
(on an Intel Xeon, int8 activations (S8S8) ran slower than fp32: commands/quantize.py). The speed is measured where
the export runs, which is the machine it is checked on, not necessarily the one that serves it: `--force` writes
the file anyway, with the figures said.

The clock is `timed` below, one function: tests replace it with a stub (a graph made slower or faster on purpose),
as they cannot rely on timings of a loaded CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAX_DROP = 0.01  # the largest top-1 (and balanced accuracy) loss accepted: 1 point, as a fraction
WARMUP = 3  # untimed runs of each graph first (onnxruntime allocates its arena and picks kernels on the first)
ROUNDS = 15  # timed runs of each graph, interleaved; the median of each is its time


def timed(label: str, run: Callable[[], object]) -> float:
    """Seconds one call of `run` takes on the wall clock (time.perf_counter). `label` (fp32 or int8) names the
    graph: a test's stub clock answers by it."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved_times(
    runs: dict[str, Callable[[], object]], warmup: int = WARMUP, rounds: int = ROUNDS
) -> dict[str, list[float]]:
    """Seconds of each call of each run (`timed`): `warmup` untimed calls each, then `rounds` rounds that time each
    once, in alternating order (A B, B A, ...: neither always runs first, on a warm or a cooling core). The runs
    share the machine as they would in turn."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    order = list(runs)
    for r in range(rounds):
        for label in order if r % 2 == 0 else order[::-1]:
            times[label].append(timed(label, runs[label]))
    return times


def measure_speed(
    runs: dict[str, Callable[[], object]], images: int, warmup: int = WARMUP, rounds: int = ROUNDS
) -> dict[str, float]:
    """Images per second of each run (one call: a batch of `images`): the median of its interleaved_times."""
    times = interleaved_times(runs, warmup, rounds)
    return {label: images / max(statistics.median(t), 1e-12) for label, t in times.items()}


@dataclass(frozen=True)
class Int8Check:
    """The figures of the check and its verdict: `refusals` empty when the int8 graph may be written."""

    fp32: dict  # evaluate_exported's metrics of each graph on the validation split
    int8: dict
    speed: dict  # images/s at the serving batch: {"fp32": .., "int8": ..}
    batch: int
    balanced: bool  # whether balanced accuracy is held to MAX_DROP too (the run monitors val/balanced_acc)
    refusals: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.refusals

    @property
    def ratio(self) -> float:
        return self.speed["int8"] / self.speed["fp32"]

    def figures(self) -> str:
        """One line of every figure: top-1, balanced accuracy, images/s of both graphs, and the ratio."""
        f, i = self.fp32, self.int8
        line = (
            f"on the {f['split']} split ({f['count']} images) top-1 int8 {i['top1']:.4f} vs fp32 {f['top1']:.4f} "
            f"({100 * (i['top1'] - f['top1']):+.2f} points)"
        )
        if "balanced_acc" in f and "balanced_acc" in i:
            line += (
                f", balanced acc {i['balanced_acc']:.4f} vs {f['balanced_acc']:.4f} "
                f"({100 * (i['balanced_acc'] - f['balanced_acc']):+.2f} points)"
            )
        return (
            line + f"; {self.speed['int8']:.0f} vs {self.speed['fp32']:.0f} img/s at batch {self.batch} "
            f"({self.ratio:.2f}x; medians of {ROUNDS} interleaved runs after {WARMUP} warm-ups)"
        )

    def as_dict(self) -> dict:
        keep = ("top1", "top5", "balanced_acc", "loss", "count")
        return {
            "passed": self.passed,
            "refusals": self.refusals,
            "batch": self.batch,
            "speed": self.speed,
            "ratio": self.ratio,
            "balanced_checked": self.balanced,
            "fp32": {k: self.fp32[k] for k in keep if k in self.fp32},
            "int8": {k: self.int8[k] for k in keep if k in self.int8},
        }


def judge(fp32: dict, int8: dict, speed: dict, balanced: bool) -> list[str]:
    """Why the int8 graph is refused (empty: it is not): top-1 (and balanced accuracy when `balanced`) more than
    MAX_DROP below fp32's, or not more images per second."""
    out = []
    for key, name in (("top1", "top-1"), ("balanced_acc", "balanced accuracy")):
        if key == "balanced_acc" and not balanced:
            continue
        drop = fp32[key] - int8[key]
        if drop > MAX_DROP + 1e-12:  # counts over counts: 1e-12 keeps an exact 1-point drop inside
            out.append(f"its {name} is {100 * drop:.2f} points below fp32's (at most {100 * MAX_DROP:g} allowed)")
    if not speed["int8"] > speed["fp32"]:
        out.append(f"it is not faster ({speed['int8'] / speed['fp32']:.2f}x fp32's images/s)")
    return out


def speed_batch(trained, batch: int, uint8_input: bool) -> torch.Tensor:
    """`batch` validation images (export's parity sample, repeated where the split has fewer), as the graph takes
    them: uint8, or normalised with the eval spec's constants."""
    from torchsprint.commands.export import normalize, sample_batch

    x = sample_batch(trained, batch)
    x = x.repeat(-(-batch // len(x)), *([1] * (x.ndim - 1)))[:batch]
    return x if uint8_input else normalize(x, trained.pipeline)


def check_int8(fp32_path: Path, int8_path: Path, trained, uint8_input: bool) -> Int8Check:
    """Evaluate both graphs in one pass over the validation split, time both at the serving batch (the run's
    serve.max_batch), and judge."""
    from torchsprint.commands.eval_export import evaluate_exported, open_exported

    models = {"fp32": open_exported(fp32_path), "int8": open_exported(int8_path)}
    metrics = evaluate_exported(models, "val")
    batch = trained.cfg.serve.max_batch
    x = speed_batch(trained, batch, uint8_input)
    speed = measure_speed({label: (lambda m=m: m.forward(x)) for label, m in models.items()}, len(x))
    balanced = trained.cfg.checkpoint.monitor == "val/balanced_acc"
    return Int8Check(
        metrics["fp32"],
        metrics["int8"],
        speed,
        batch,
        balanced,
        judge(metrics["fp32"], metrics["int8"], speed, balanced),
    )


def refusal(check: Int8Check, out: Path) -> str:
    """The one line of a refused int8 export: what, the figures, what to do."""
    return (
        f"export --int8 refused, {out} not written: {'; '.join(check.refusals)}. Figures: {check.figures()}. "
        "Serve the fp32 export, or try --calibration with more images or --int8-activations s8; --force "
        "writes it anyway."
    )

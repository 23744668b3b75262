"""precision=auto and speed.channels_last=auto on a CPU: decided once, before the run's plan, by timing a few real
training steps of the run's own model and batch for each candidate (`decide_auto`). On CUDA the existing choices
stand (fp32; channels_last by parallel.channels_last_on's rule).

The candidates vary only what was left on auto:
  precision      fp32, and amp_bf16 where the CPU computes bf16 natively (runtime/machine.py's native_bf16: AVX-512
                 BF16 or AMX) and PyTorch's oneDNN has bf16 kernels. Without native bf16 PyTorch converts to fp32
                 and back, slower than fp32 itself (BENCHMARKS.md, AMD EPYC AVX2), so auto never tries it there.
  memory format  the rule's (NHWC for a model with 2-D convolutions; the batches stay NCHW), and NCHW.
The baseline is what the run does without measuring: fp32 (or the precision named) in the rule's format.

The rule (`pick`): MEASURE_ROUNDS rounds, every candidate once per round, each round starting with the next one, so a
change in the machine's load falls on all of them alike; each candidate's speedup over the baseline in each round,
and the median of those. The largest median replaces the baseline only when it is MIN_MARGIN or more; a tie keeps
the baseline. Where the rounds disagree about the winner (one says it gains the margin, another that it is slower:
the load changed during the probe), EXTRA_ROUNDS more rounds are measured before the median is taken.

Measured once per machine (runtime/measurements.py): the figures are stored with the CPU's model and flags, the
threads, torch, the model, its input spec, the batch and the data set, and the next run with the same keys takes
them ("measured before, <date>") instead of measuring again; `train --remeasure` measures anew.

Measuring costs steps, so it runs only where it can pay (`not_measured`): a CPU device, one process (DDP's processes
share the cores: one process's figures would not be the run's), eager steps (speed.compile's differ), no
distillation (the teacher is built with the precision before the student exists), a new run (a resumed one keeps
what it began with: its checkpoint's config), two candidates or more, the probe's steps at most MAX_PROBE_SHARE of
the run's, and the run's fp32 training estimated (one timed baseline step x the run's steps) at MEASURE_MIN_S or
more. Every test's run is far below that, so the suite trains the same on CPUs with and without native bf16.

Nothing of the probe reaches the run: it trains deep copies of the initialised model, with their own optimizers and
Precision objects, on half of one batch of the run's training loader (`half`: less memory), then puts the process's
RNG states back (the run's weights are bit for bit those of a run that named the chosen settings:
tests/e2e/train/test_speed_probe.py).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from torchsprint.runtime.machine import native_bf16
from torchsprint.runtime.measurements import recall, remember
from torchsprint.runtime.parallel import channels_last_on, has_conv2d

WARMUP_STEPS = 1  # per candidate, untimed: oneDNN creates its primitives and reorders the weights on first use
MEASURE_ROUNDS = 3  # timed steps per candidate, one per round (their median is the candidate's figure)
EXTRA_ROUNDS = 2  # more rounds where the first ones disagree about the winner (`disagree`)
MIN_MARGIN = 0.05  # the least speedup that replaces the baseline, whatever the rounds' spread
# The probe's steps are at most this share of the run's training steps... Where amp_bf16 wins it saves 25-42% of
# the run (1.34x small_cnn, 1.73x ResNet-18: BENCHMARKS.md "amp_bf16 on a CPU with native bf16"), so a tenth is
# repaid many times; 3% left the photo defaults' own job (250 steps) and a 3-epoch ResNet-18 (188) unmeasured.
MAX_PROBE_SHARE = 0.10
# TORCHSPRINT_SPEED_PROBE=off: never measure (the baseline: fp32, or the precision named, in the rule's format), so
# runs train the same on CPUs with and without native bf16 whatever their length or the machine's load. The test
# suite sets it (tests/conftest.py): a loaded CI machine can make a test's run look long enough to measure.
OFF_ENV = "TORCHSPRINT_SPEED_PROBE"
MEASURE_MIN_S = 60.0  # ...and the run's fp32 training is estimated at this long at least: below, a few percent of it
# is seconds, not worth a decision that differs between machines (and below it no test's run measures anything)
RULE = (
    "each candidate's speedup over the baseline in each of the interleaved rounds, their median; the largest "
    "replaces the baseline (fp32, or the precision named, in the rule's format) when it is 5% or more; rounds that "
    "disagree about the winner measured again"
)


@dataclass(frozen=True)
class Candidate:
    """One combination the probe can time: a precision mode and the model's memory format."""

    precision: str
    channels_last: bool

    @property
    def name(self) -> str:
        return f"{self.precision} {'NHWC' if self.channels_last else 'NCHW'}"


@dataclass(frozen=True)
class AutoSpeed:
    """What precision=auto and speed.channels_last=auto became, and why (decisions.json, the start-up summary)."""

    asked: str  # precision.mode as set (auto, or a mode)
    precision: str  # the mode the run trains with
    precision_why: str
    channels_last: bool | str  # speed.channels_last as the run reads it: as set, or false where NCHW measured faster
    channels_last_why: str | None = None  # None: nothing measured about the format (plan.decide_speed says why)
    measured: dict | None = None  # the figures (decisions.json's speed_measured); None where nothing was measured

    def resolved(self, cfg):
        """`cfg` with the precision and memory format that run written in: config.yaml says them, so --resume, eval
        and export read what trained."""
        out = cfg.model_copy(deep=True)
        out.precision.mode, out.speed.channels_last = self.precision, self.channels_last
        return out


def bf16_kernels() -> bool:
    """Whether amp_bf16 can beat fp32 on this CPU: native bf16 instructions, and PyTorch's oneDNN built with bf16."""
    return native_bf16() and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def candidates(asked: str, setting: bool | str, model: torch.nn.Module) -> tuple[list[Candidate], list[str]]:
    """(the candidates, baseline first; notes on a dimension left on auto that does not vary here)."""
    notes, precisions = [], [asked]
    if asked == "auto":
        precisions = ["fp32"]
        if bf16_kernels():
            precisions.append("amp_bf16")
        else:
            notes.append(
                "amp_bf16 not tried: this CPU has no native bf16 (AVX-512 BF16 or AMX), where bf16 autocast "
                "runs slower than fp32"
            )
    formats = [channels_last_on(setting, model)]
    if setting == "auto" and has_conv2d(model):
        formats.append(not formats[0])
    return [Candidate(p, f) for p in precisions for f in formats], notes


def probe_steps(count: int) -> int:
    """The training steps measuring `count` candidates takes: warm-ups, the baseline's estimating step, the rounds."""
    return count * (WARMUP_STEPS + MEASURE_ROUNDS) + 1


def not_measured(cfg, rt, cands: list[Candidate], distilling: bool, run_batches: int) -> str | None:
    """Why the candidates are not measured in this run (module docstring), or None: measure them."""
    if rt.device.type != "cpu":
        return f"on {rt.device.type} the existing choices stand"
    if os.environ.get(OFF_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"{OFF_ENV}={os.environ[OFF_ENV]}"
    if len(cands) < 2:
        return "nothing to compare"
    if rt.world_size > 1:
        return f"{rt.world_size} processes share the cores (one process's figures would not be the run's)"
    if cfg.speed.compile:
        return "speed.compile=true (the probe's eager steps would not be the compiled run's)"
    if distilling:
        return "distillation (the teacher takes the run's precision before the student exists)"
    need = probe_steps(len(cands))
    if need > MAX_PROBE_SHARE * run_batches:
        return (
            f"run too short ({run_batches:,} training steps; measuring takes {need}, which pays from "
            f"{math.ceil(need / MAX_PROBE_SHARE):,}: {MAX_PROBE_SHARE:.0%} of the run)"
        )
    return None


def run_batches(cfg, batches_per_epoch: int) -> int:
    """Training batches (micro-batches) this invocation will take: every epoch's, or up to run.max_steps or
    run.stop_after_steps (a slice of a longer run pays for its own probe: a resume measures nothing)."""
    total = batches_per_epoch * cfg.run.epochs
    for steps in (cfg.run.max_steps, cfg.run.stop_after_steps):
        if steps is not None:
            total = min(total, steps * cfg.optim.accum_steps)
    return total


def measure(
    cands: list[Candidate], step, batches: int, budget_s: float | None = None, scale: float = 1.0
) -> tuple[dict | None, str | None]:
    """Time the candidates (`step(candidate)` -> seconds of one real training step; cands[0] the baseline):
    (figures, None), or (None, why not) when the baseline's first timed step says the run (`batches` steps, within
    run.max_time's `budget_s`) is too short for it. `scale`: the run's batch over the probe's (the probe steps half
    a batch: `half`), so that its step time estimates the run's."""
    t_all = time.perf_counter()
    base = cands[0]
    for _ in range(WARMUP_STEPS):
        step(base)
    first = step(base) * scale
    estimate = first * batches
    if budget_s is not None and budget_s < estimate:
        estimate, how = budget_s, "run.max_time"
    else:
        how = f"in {base.name}: {batches:,} steps x {1000 * first:.0f} ms" + (
            f" (from a step of 1/{scale:g} of a batch)" if scale != 1 else ""
        )
    if estimate < MEASURE_MIN_S:
        return None, f"run too short (~{estimate:.0f} s {how}; measured from {MEASURE_MIN_S:.0f} s)"
    for c in cands[1:]:
        for _ in range(WARMUP_STEPS):
            step(c)
    times: dict[Candidate, list[float]] = {c: [] for c in cands}
    rounds = MEASURE_ROUNDS
    for r in range(MEASURE_ROUNDS + EXTRA_ROUNDS):
        if r == MEASURE_ROUNDS and not disagree(times, base):
            break
        rounds = r + 1  # the rounds disagree (a load change during one): measure EXTRA_ROUNDS more
        for c in cands[r % len(cands) :] + cands[: r % len(cands)]:  # each round starts with the next candidate
            times[c].append(step(c))
    return {"times": times, "estimate_s": estimate, "seconds": time.perf_counter() - t_all, "rounds": rounds}, None


def ratios(times: dict[Candidate, list[float]], base: Candidate) -> dict[Candidate, list[float]]:
    """Each candidate's speedup over the baseline round by round (the baseline's step over its own, both timed in the
    same round, so a change in the machine's load falls on both)."""
    return {c: [b / x for b, x in zip(times[base], t)] for c, t in times.items()}


def pick(times: dict[Candidate, list[float]], base: Candidate) -> tuple[Candidate, float]:
    """(the winner, the margin): the candidate whose median speedup over the baseline, round by round, is the
    largest, where that median is MIN_MARGIN or more; else the baseline. One disturbed round moves one ratio of
    each candidate, never the median of three: with the margin taken from the baseline's own spread, one slow
    baseline round (67 img/s amp_bf16 against 40 fp32 on a machine running another job: a 306% "spread") vetoed a
    1.7x gain, and a shared machine trained at 0.6x the speed it measured."""
    speedup = {c: statistics.median(r) for c, r in ratios(times, base).items()}
    fastest = max(speedup, key=lambda c: (speedup[c], c == base))  # a tie: the baseline
    return (fastest if speedup[fastest] >= 1 + MIN_MARGIN else base), MIN_MARGIN


def disagree(times: dict[Candidate, list[float]], base: Candidate) -> bool:
    """The rounds disagree about the winner: some say it gains the margin, others that it is slower."""
    chosen, _ = pick(times, base)
    if chosen == base:
        chosen = max(times, key=lambda c: statistics.median(ratios(times, base)[c]) if c != base else 0)
    r = ratios(times, base)[chosen]
    return max(r) >= 1 + MIN_MARGIN and min(r) < 1


def figures(measured: dict, base: Candidate, chosen: Candidate, margin: float, images: int, batches: int) -> dict:
    """decisions.json's speed_measured: images/s and step times of each candidate, the margin, the choice."""
    med = {c: statistics.median(t) for c, t in measured["times"].items()}
    return {
        "candidates": {
            c.name: {
                "precision": c.precision,
                "channels_last": c.channels_last,
                "images_per_s": round(images / med[c], 2),
                "step_ms": [round(1000 * t, 2) for t in measured["times"][c]],
            }
            for c in med
        },
        "baseline": base.name,
        "chosen": chosen.name,
        "speedup": round(med[base] / med[chosen], 3),
        "margin": round(margin, 3),
        "rule": RULE,
        "batch_images": images,
        "rounds": measured.get("rounds", MEASURE_ROUNDS),
        "speedups": {c.name: [round(x, 3) for x in r] for c, r in ratios(measured["times"], base).items()},
        "warmup_steps": WARMUP_STEPS,
        "run_batches": batches,
        "estimate_s": round(measured["estimate_s"], 1),
        "seconds": round(measured["seconds"], 2),
    }


def measured_text(m: dict) -> str:
    """The figures in words: 'fp32 NHWC 52 img/s (baseline), amp_bf16 NHWC 95 img/s: ...'."""
    rates = ", ".join(
        f"{name} {c['images_per_s']:.0f} img/s" + (" (baseline)" if name == m["baseline"] else "")
        for name, c in m["candidates"].items()
    )
    when = (
        f"measured before, {m['measured_before']} (on this machine, model, input and batch; --remeasure to "
        "measure again): "
        if m.get("measured_before")
        else "measured "
    )
    return f"{when}{rates} ({m['rounds']} rounds of batch {m['batch_images']}, {m['seconds']:.1f} s): {m['chosen']}" + (
        f", {m['speedup']:.2f}x the baseline"
        if m["chosen"] != m["baseline"]
        else f" (nothing faster by the margin, {m['margin']:.0%})"
    )


class ProbeSteps:
    """Real training steps of the candidates on one deep copy of the run's model, with an optimizer built as the run's
    and a Precision per candidate (the precisions share the weights: autocast leaves them alone). Between candidates
    of different memory formats the copy and its optimizer state are converted in place, outside the timing: one copy
    rather than one per format keeps the probe's peak memory a model, its gradients and its optimizer state lower
    (135 MB for ResNet-18; BENCHMARKS.md "torchsprint beside timm's train.py"). Called with a candidate: one step of
    `batch` (engine.train_step), its seconds."""

    def __init__(self, cfg, model: torch.nn.Module, loss_fn, batch: tuple):
        self.cfg, self.model, self.loss_fn, self.batch = cfg, model, loss_fn, batch
        self.device = next(iter(model.parameters())).device
        self.copy: tuple | None = None  # (the prepared copy, its optimizer, whether it is channels_last now)
        self.trainables: dict[Candidate, object] = {}

    def trainable(self, c: Candidate):
        """The candidate's (model, loss, optimizer, Precision), built on first use; the copy in c's memory format."""
        from torchsprint.models.init import frozen_norm_layers
        from torchsprint.optim.optimizers import build_optimizer
        from torchsprint.state.precision import Precision
        from torchsprint.train.context import Trainable
        from torchsprint.train.validation import set_train_mode

        prec = None
        if c not in self.trainables:
            prec = Precision(c.precision, self.device, on_nonfinite=self.cfg.precision.on_nonfinite)
        if self.copy is None:
            model = copy.deepcopy(self.model)  # the run's model is never trained here
            model = prec.prepare(model)  # half-weight modes (named): the copy in fp16/bf16 with fp32 masters
            set_train_mode(model, frozen_norm_layers(model) if self.cfg.model.freeze_bn_stats else [])
            self.copy = (model, build_optimizer(self.cfg.optim, model), False)
        model, opt, channels_last = self.copy
        if channels_last != c.channels_last:
            fmt = torch.channels_last if c.channels_last else torch.contiguous_format
            model.to(
                memory_format=fmt
            )  # weights, buffers and gradients, in place (the parameters stay the same objects)
            for state in opt.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.dim() == 4:
                        state[k] = v.contiguous(memory_format=fmt)
            self.copy = (model, opt, c.channels_last)
        if prec is not None:
            prec.attach(opt)
            self.trainables[c] = Trainable(model, self.loss_fn, opt, prec)
        return self.trainables[c]

    def __call__(self, c: Candidate) -> float:
        from torchsprint.train.engine import train_step

        t = self.trainable(c)  # a format change happens here, before the clock starts
        t0 = time.perf_counter()  # a CPU device: the step's kernels have finished when train_step returns
        train_step(t, [self.batch], self.cfg.optim.clip_grad_norm)
        return time.perf_counter() - t0


def decide_auto(
    cfg, rt, model: torch.nn.Module, loader, loss_fn, *, ckpt: dict | None = None, distilling: bool = False, step=None
) -> AutoSpeed:
    """precision=auto and speed.channels_last=auto resolved for this run (the module docstring), once.

    Args:
        cfg: the run's config, precision.mode and speed.channels_last as set (auto or not); rt: its Runtime.
        model: the run's initialised and frozen model, unwrapped (it is copied, never trained here).
        loader: the run's training loader (its length; one batch is taken when measuring); loss_fn: the run's loss.
        ckpt: the checkpoint resumed from, or None.
        distilling: distillation is on (then nothing is measured).
        step: candidate -> seconds of one training step, for tests; None: real steps (ProbeSteps).
    """
    asked, setting = cfg.precision.mode, cfg.speed.channels_last
    if ckpt is not None:
        return as_began(ckpt, asked, setting)
    if rt.device.type != "cpu":
        return AutoSpeed(
            asked,
            "fp32" if asked == "auto" else asked,
            f"precision={asked}"
            + (
                f": fp32 (on {rt.device.type} the existing choice stands; amp_bf16 or amp_fp16 when set: "
                "precision=amp_bf16)"
                if asked == "auto"
                else ""
            ),
            setting,
        )
    cands, notes = candidates(asked, setting, model)
    base, batches = cands[0], run_batches(cfg, len(loader))
    why_not, measured = not_measured(cfg, rt, cands, distilling, batches), None
    keys = probe_keys(cfg, model, cands)
    stored = recall("speed_probe", keys) if why_not is None and step is None else None
    if stored is not None:  # this machine measured this model, input and batch before: its figures decide
        m = {**stored["value"], "measured_before": stored["date"]}
        chosen = next((c for c in cands if c.name == m.get("chosen")), None)
        if chosen is not None:
            return chosen_speed(asked, base, chosen, setting, m, notes)
    if why_not is None:
        from torchsprint.runtime.rng import rng_state, set_rng_state

        saved = rng_state(rt.device)  # the probe's draws (dropout, the loader's seed) must not move the run's
        try:
            whole = next(iter(loader)) if step is None else None
            batch = half(whole) if whole is not None else None
            images = len(batch[0]) if batch is not None else cfg.data.batch_size
            scale = len(whole[0]) / images if batch is not None and batch is not whole else 1.0
            measured, why_not = measure(
                cands, step or ProbeSteps(cfg, model, loss_fn, batch), batches, budget_s(cfg), scale
            )
        finally:
            whole = batch = step = None
            gc.collect()  # the copies, their optimizer state and activations, before the run builds its own
            set_rng_state(saved, rt.device)
    if why_not is not None:
        return unmeasured(asked, cands, setting, why_not, notes)
    chosen, margin = pick(measured["times"], base)
    m = figures(measured, base, chosen, margin, images, batches)
    if step is None:  # real steps: the next run with the same keys on this machine reads them
        remember("speed_probe", keys, m)
    return chosen_speed(asked, base, chosen, setting, m, notes)


def probe_keys(cfg, model: torch.nn.Module, cands: list[Candidate]) -> dict:
    """What the probe's figures depend on beyond the machine (runtime/measurements.py adds the CPU, its flags, the
    threads and torch): the model (name, arguments, parameter count), its training input (the transforms, the
    channels), the batch, the candidates, the data set."""
    return {
        "model": cfg.model.name,
        "model_args": cfg.model.args,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "input": [cfg.data.train.transforms, cfg.data.options, cfg.data.progressive.model_dump()],
        "batch": cfg.data.batch_size,
        "accum": cfg.optim.accum_steps,
        "optimizer": cfg.optim.name,
        "candidates": [c.name for c in cands],
        "data": [cfg.data.dataset, cfg.data.root],
        "task": cfg.task,
    }


def half(batch):
    """The first half of a training batch (of every tensor in it as long as the images): the probe times the
    candidates on it. An fp32 candidate's activations at the run's full batch were the run's peak memory, above the
    bf16 training that follows (ResNet-18, batch 32 at 112 px: 1,307 MiB peak against 1,111 naming the precision;
    BENCHMARKS.md "torchsprint beside timm's train.py"); each candidate's time per image at half the batch ranks
    them as at the full one for the convolutional nets measured there."""
    if not isinstance(batch, (tuple, list)) or not torch.is_tensor(batch[0]) or len(batch[0]) < 2:
        return batch
    n = len(batch[0])
    return type(batch)(x[: n // 2] if torch.is_tensor(x) and x.dim() > 0 and len(x) == n else x for x in batch)


def budget_s(cfg) -> float | None:
    """run.max_time in seconds (None: no budget): a run that stops there trains no longer than that."""
    from torchsprint.runtime.preempt import parse_duration

    return None if cfg.run.max_time is None else parse_duration(cfg.run.max_time)


def as_began(ckpt: dict, asked: str, setting: bool | str) -> AutoSpeed:
    """A resumed run: what its checkpoint's config says it trained with, for each setting left on auto (a new
    measurement could choose otherwise, and the optimizer state and numerics belong to the first choice)."""
    saved = ckpt.get("config") or {}
    mode = (saved.get("precision") or {}).get("mode", "fp32") if asked == "auto" else asked
    mode = "fp32" if mode == "auto" else mode
    began = (saved.get("speed") or {}).get("channels_last", setting) if setting == "auto" else setting
    why = f"precision={asked}" + (f": {mode}, as the run began (its checkpoint's config)" if asked == "auto" else "")
    return AutoSpeed(
        asked,
        mode,
        why,
        began,
        None if began == setting else "speed.channels_last=auto: false, as the run began (its checkpoint's config)",
    )


def unmeasured(asked: str, cands: list[Candidate], setting: bool | str, why_not: str, notes: list[str]) -> AutoSpeed:
    """Nothing measured: the baseline (cands[0]) runs, saying why."""
    why = f"not measured: {'; '.join([why_not, *notes])}"
    if asked == "auto":
        return AutoSpeed(asked, cands[0].precision, f"precision=auto: fp32, {why}; set precision to choose", setting)
    formats_vary = len({c.channels_last for c in cands}) == 2  # else the decide_speed's why says it all
    return AutoSpeed(
        asked,
        asked,
        f"precision={asked}",
        setting,
        f"speed.channels_last=auto: the model has 2-D convolutions; {why}" if formats_vary else None,
    )


def chosen_speed(
    asked: str, base: Candidate, chosen: Candidate, setting: bool | str, m: dict, notes: list[str]
) -> AutoSpeed:
    """The measured choice, in the run's settings and words."""
    other = "amp_bf16" if chosen.precision == "fp32" else "fp32"
    prec_why = (
        (
            f"precision=auto: {chosen.precision}, {measured_text(m)}; to choose otherwise: precision={other}"
            + "".join(f"; {n}" for n in notes)
        )
        if asked == "auto"
        else f"precision={asked}"
    )
    cl_why = None
    rates = {
        c["channels_last"]: c["images_per_s"] for c in m["candidates"].values() if c["precision"] == chosen.precision
    }
    if len(rates) == 2:  # the format was measured (speed.channels_last=auto, a model with 2-D convolutions)
        cl_why = (
            f"speed.channels_last=auto: {'on' if chosen.channels_last else 'off'}, measured NHWC "
            f"{rates[True]:.0f} vs NCHW {rates[False]:.0f} img/s in {chosen.precision}"
            + (" (the rule's choice)" if chosen.channels_last == base.channels_last else "")
            + f"; to choose otherwise: speed.channels_last={str(not chosen.channels_last).lower()}"
        )
    # Measured NCHW faster: false in the run's config (config.yaml, a resume); else auto stays (the rule's NHWC).
    resolved = False if setting == "auto" and not chosen.channels_last else setting
    return AutoSpeed(asked, chosen.precision, prec_why, resolved, cl_why, m)

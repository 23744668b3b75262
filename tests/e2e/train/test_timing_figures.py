"""Throughput and timing figures against the wall clock: a run whose step, first step or loader is slow on
purpose must show it in the right figure, with the size the test's own clock measured.

The model and the dataset registered here keep their own clocks (time.perf_counter at every training
forward, time spent in every __getitem__): that is the independent reference the reported figures
(summary.json, metrics.jsonl, the console line, `torchsprint bench`'s rows) are checked against.

On a loaded machine (CI: 2 cores running 2 test processes and more) a sleep returns late and any line can be
preempted, so most checks bracket a reported time between moments the clocks saw before and after it (a
window ends after its step's forward returned and before its metrics.jsonl record was written): such a check
holds however slow the machine is. The few ratios left are set from figures measured with 3 busy processes
on the 2 cores (worse than CI), written beside each.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time

import pytest
import torch
from torch import nn

from torchsprint import config
from torchsprint.data.core import DATASETS
from torchsprint.models.core import MODELS
from torchsprint.train.run import train

# What the registered model does, set per test: a sleep of `step_s` seconds in every training forward,
# `first_s` more in the first one (a compile or autotuning warm-up), times `amp_factor` under autocast.
PLAN = {"step_s": 0.0, "first_s": 0.0, "amp_factor": 1.0}
SERIALS = itertools.count()
# (model serial, perf_counter at entry, time.time at entry, seconds asked to sleep, seconds the forward took: the
# sleep as it really ran, late wake-up included, measured by the same clock)
CLOCK: list[tuple[int, float, float, float, float]] = []
LOADS: list[tuple[float, float]] = []  # perf_counter at entry and at return of each training-split __getitem__
LOAD_S = 0.002  # the slow dataset's sleep per sample


class Sleepy(nn.Module):
    """A linear classifier on 8x8 digits whose training forward sleeps as PLAN says (eval: no sleep)."""

    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)
        self.serial = next(SERIALS)  # not id(self): a freed model's id can be reused by the next one

    def forward(self, x):
        if self.training:
            t, wall = time.perf_counter(), time.time()
            s = PLAN["step_s"] + (PLAN["first_s"] if not any(c[0] == self.serial for c in CLOCK) else 0.0)
            if torch.is_autocast_enabled("cpu"):
                s *= PLAN["amp_factor"]
            time.sleep(s)
            CLOCK.append((self.serial, t, wall, s, time.perf_counter() - t))
        return self.fc(x.flatten(1).float())


MODELS.register("test_sleepy", override=True)(lambda num_classes, in_channels=3: Sleepy(num_classes, in_channels))


class SlowItems(torch.utils.data.Dataset):
    """A split whose every sample takes LOAD_S seconds to read (a slow disk or decoder); `clock` keeps when each
    read began and ended, measured here."""

    def __init__(self, raw, clock: list | None):
        self.raw, self.clock = raw, clock

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, i):
        t = time.perf_counter()
        time.sleep(LOAD_S)
        item = self.raw[i]
        if self.clock is not None:
            self.clock.append((t, time.perf_counter()))
        return item


@DATASETS.register("test_slow_digits", override=True)
def slow_digits(data_cfg):
    """digits whose training split reads slowly (the validation split reads at full speed)."""
    splits = DATASETS.get("digits")(data_cfg)
    splits.train = SlowItems(splits.train, LOADS)
    return splits


EPOCH_STARTS: list[float] = []  # perf_counter when the engine announced each epoch, just before its clocks start


@pytest.fixture(autouse=True)
def fresh_clocks(monkeypatch):
    CLOCK.clear()
    LOADS.clear()
    EPOCH_STARTS.clear()
    PLAN.update(step_s=0.0, first_s=0.0, amp_factor=1.0)
    from torchsprint.observe.logging import RunLogger

    announce = RunLogger.start_epoch

    def start_epoch(self, *args, **kwargs):  # the real method, with the moment it was called noted
        EPOCH_STARTS.append(time.perf_counter())
        return announce(self, *args, **kwargs)

    monkeypatch.setattr(RunLogger, "start_epoch", start_epoch)
    yield


def wall_to_perf(wall: float) -> float:
    """A time.time() reading on the perf_counter scale: the two clocks' offset, read at every forward (median: a
    preemption between the two readings shifts one of them)."""
    return wall - statistics.median(c[2] - c[1] for c in CLOCK)


def run(tmp_path, *overrides, steps: int, batch: int, capsys=None):
    """Train `steps` steps of the registered model, logging every step; returns (summary, jsonl records, console)."""
    cfg = config.load(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            f"run.max_steps={steps}",
            "model.name=test_sleepy",
            f"data.batch_size={batch}",
            "log.every_steps=1",
            "log.tensorboard=false",
            "log.progress=false",
            "eval.per_class=false",
            *overrides,
        ],
    )
    t0 = time.perf_counter()
    summary = train(cfg, quiet=capsys is None)
    wall = time.perf_counter() - t0
    # The loop's own time never exceeds the call's; the training time is part of the loop's.
    assert summary["seconds"] <= wall
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, records, capsys.readouterr().out if capsys else ""


def test_a_slow_step_and_a_slow_first_step_show_in_images_per_s_not_in_the_data_wait(tmp_path, capsys, figure):
    steps, batch = 10, 64
    PLAN.update(step_s=0.04, first_s=0.3)
    summary, records, out = run(tmp_path, steps=steps, batch=batch, capsys=capsys)
    starts = [c[1] for c in CLOCK]
    ends = [c[1] + c[4] for c in CLOCK]  # each forward's return (its sleep over)
    assert len(starts) == steps and len(EPOCH_STARTS) == 1
    step_s = statistics.median(b - a for a, b in zip(starts[1:], starts[2:]))  # a step after the first, measured
    # The epoch ran from before the first forward (first batch loaded) to after the last step: the span of the
    # forwards plus one more step. The loader here (memory backend, 8x8 images) adds < 5 ms to that.
    epoch_s = starts[-1] - starts[0] + step_s
    want_ips = steps * batch / epoch_s
    figure("summary images/s / reference", summary["train_images_per_s"] / want_ips)
    # Measured 0.994-1.002 on a quiet machine, 0.990-1.006 with 3 busy processes on the 2 cores (the reference
    # lacks the first batch's load and the epoch-end bookkeeping, and takes the median step for the last one);
    # bound 5%, 5x the worst gap.
    assert summary["train_images_per_s"] == pytest.approx(want_ips, rel=0.05)
    epoch = [r for r in records if r["kind"] == "epoch"]
    assert len(epoch) == 1 and epoch[0]["train/epoch_images_per_s"] == pytest.approx(
        summary["train_images_per_s"], rel=1e-9
    )

    train_rows = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    # When each window closed, on the perf_counter scale: after its step's forward returned, before its record was
    # written (the record's time: time.time() rounded to the ms, hence the 1 ms), and so before the next forward.
    written = [wall_to_perf(r["time"]) + 1e-3 for r in train_rows]
    assert all(e <= w for e, w in zip(ends, written)) and all(w - 2e-3 <= s for w, s in zip(written, starts[1:]))
    # The first step: its log line comes the first step's sleep (warm-up and step) after the first forward began.
    first_record_after = train_rows[0]["time"] - CLOCK[0][2]
    figure("first record - first forward (s)", first_record_after)
    assert PLAN["first_s"] + PLAN["step_s"] <= first_record_after + 1e-3
    # Each window's images/s, as a time (the batch over it), lies between what the clocks allow: the first window
    # opens between the epoch's announcement and the first forward and closes between that forward's return and
    # its record; window k opens when window k-1 closed. Brackets, not ratios: they hold on a machine of any load,
    # and a window that lost its step's time (shorter than the forward) or kept an earlier step's (longer than
    # two steps and their logging) falls outside. Widths measured: 0.3-25 ms against 40-340 ms windows.
    lows = [ends[0] - starts[0]] + [e - w for e, w in zip(ends[1:], written)]
    highs = [written[0] - EPOCH_STARTS[0]] + [w - e for w, e in zip(written[1:], ends)]
    got = [batch / r["train/images_per_s"] for r in train_rows]
    figure("first window / first forward", got[0] / (ends[0] - starts[0]))
    figure("widest window bracket (s)", max(h - lo for lo, h in zip(lows, highs)))
    for k, (lo, g, h) in enumerate(zip(lows, got, highs), 1):
        assert lo <= g <= h, (k, lo, g, h)
    # A slow step is compute: the data wait is not where the forwards' time went. The epoch's data wait fits in what
    # its time leaves once the forwards are taken out (the forwards, measured, come after each batch's wait).
    seconds = steps * batch / summary["train_images_per_s"]
    figure("data-wait share, slow step", summary["data_wait_share"])
    assert summary["data_wait_share"] * seconds <= seconds - sum(c[4] for c in CLOCK)
    # Measured 0.002-0.01 on a quiet machine, up to 0.038 with 3 busy processes on the 2 cores (gathering 64 8x8
    # images from memory); the hint's threshold is 0.2, 5x that.
    assert summary["data_wait_share"] < 0.2
    assert "input-bound" not in out


def test_a_slow_loader_shows_in_the_data_wait_share_and_the_input_bound_hint(tmp_path, capsys, figure):
    steps, batch = 8, 16
    PLAN.update(step_s=0.01)
    summary, records, out = run(
        tmp_path,
        "data.dataset=test_slow_digits",
        "data.backend=cpu",
        "data.num_workers=0",
        steps=steps,
        batch=batch,
        capsys=capsys,
    )
    assert len(LOADS) == steps * batch and len(CLOCK) == steps and len(EPOCH_STARTS) == 1  # num_workers=0: every
    # read happens in this process, inside the loop, before its batch's forward
    reads = [LOADS[k * batch : (k + 1) * batch] for k in range(steps)]
    assert all(b[-1][1] <= c[1] for b, c in zip(reads, CLOCK))
    seconds = steps * batch / summary["train_images_per_s"]  # the training time the figures were made from
    waited = summary["data_wait_share"] * seconds
    epoch_written = wall_to_perf(next(r for r in records if r["kind"] == "epoch")["time"]) + 1e-3
    # The epoch's time: from before its first read to after its last forward, and over before its record.
    assert CLOCK[-1][1] + CLOCK[-1][4] - LOADS[0][0] <= seconds <= epoch_written - EPOCH_STARTS[0]
    # Each step's wait holds its batch's reads, first to last, and fits between the previous forward's return (the
    # epoch's announcement for the first) and this batch's forward. Brackets: they hold on a machine of any load;
    # a wait that took in the forwards, or lost some batches' reads, falls outside.
    spans = sum(b[-1][1] - b[0][0] for b in reads)
    room = CLOCK[0][1] - EPOCH_STARTS[0] + sum(c[1] - p[1] - p[4] for p, c in zip(CLOCK, CLOCK[1:]))
    figure("reported data wait - reads' spans, per step (s)", (waited - spans) / steps)
    figure("room for the wait - reported data wait, per step (s)", (room - waited) / steps)
    assert spans <= waited <= room
    # What is not waiting is the step: the model's forwards as measured, plus its backward, optimizer update and log
    # line. Measured 0.3-3.3 ms per step on a quiet machine; with 3 busy processes on the 2 cores, see the figure.
    slept = sum(c[4] for c in CLOCK)
    figure("reported non-wait time - model forwards, per step (s)", (seconds - waited - slept) / steps)
    assert slept <= seconds - waited
    share = [r for r in records if r["kind"] == "epoch"][0]["train/data_wait_share"]
    figure("data-wait share, slow loader", share)
    assert share == pytest.approx(summary["data_wait_share"], rel=1e-9)
    assert "input-bound: the loader (cpu) is the bottleneck" in out  # 32 ms of reading per 10 ms step


def test_bench_images_per_s_and_speedup_follow_each_variant_measured_step_time(tmp_path, figure):
    """A variant made 2x slower on purpose (the model sleeps twice as long under autocast) shows ~0.5x, and each
    row's images/s is the batch over the step time the model's own clock measured."""
    from torchsprint.commands.bench.main import bench

    PLAN.update(step_s=0.05, amp_factor=2.0)
    steps, warmup, batch = 6, 2, 32
    rows = bench(
        None,
        ["model.name=test_sleepy", f"data.batch_size={batch}", "log.tensorboard=false"],
        steps=steps,
        warmup=warmup,
        repeats=1,
        only=["+ amp_bf16"],
        out=tmp_path / "b",
        isolate=False,
    )
    by = {r["variant"]: r for r in rows}
    models = list(dict.fromkeys(c[0] for c in CLOCK))  # one model per variant measured, in order
    assert len(models) == 2
    measured = {}
    for name, model in zip(("baseline (seeds)", "+ amp_bf16"), models):
        timed = [c for c in CLOCK if c[0] == model][warmup:]  # the timed steps' forwards
        starts = [c[1] for c in timed]
        assert len(starts) == steps
        step_s = (starts[-1] - starts[0]) / (steps - 1)
        measured[name] = batch / step_s
        figure(f"bench {name} images/s / reference", by[name]["images_per_s"] / measured[name])
        # Measured 0.98-1.024 (the timed region adds one batch's fetch, the reference takes the forwards'
        # span), 0.986-1.028 with 3 busy processes on the 2 cores; bound 7%, 2.5x that.
        assert by[name]["images_per_s"] == pytest.approx(measured[name], rel=0.07)
        # The time not spent waiting for data holds every timed forward (measured: each comes after its batch's
        # wait), whatever the load. Which side of the 20% threshold the wait falls is the machine's doing: the
        # baseline's two loader workers fell behind a 50 ms step with 3 busy processes on the 2 cores (share above
        # 0.2 once in 3 runs), so the label is checked against the share the row reports.
        step_ms = by[name]["step_ms"]
        assert (1 - by[name]["data_wait_share"]) * step_ms / 1000 * steps >= sum(c[4] for c in timed)
        assert by[name]["bottleneck"] == ("input-bound" if by[name]["data_wait_share"] > 0.2 else "compute-bound")
    want = measured["+ amp_bf16"] / measured["baseline (seeds)"]
    # The plan: twice the sleep. The loader and the optimizer add the same few ms to both, so the ratio is a bit
    # above 0.5: measured 0.53-0.64 (busy machine).
    assert 0.45 < want < 0.7
    figure("bench speedup / reference", by["+ amp_bf16"]["speedup"] / want)
    # Measured 0.98-1.021 on a quiet machine, 0.968-1.027 with 3 busy processes on the 2 cores (two images/s
    # figures' errors, each up to 3%); bound 10%, 3x the worst. A speedup against the wrong row is 2x or 0.5x off.
    assert by["+ amp_bf16"]["speedup"] == pytest.approx(want, rel=0.10)
    assert by["baseline (seeds)"]["speedup"] == 1.0


def test_bench_names_a_slow_loader_input_bound(tmp_path, figure):
    """The bench's baseline on a dataset that reads slowly: its data-wait share is what the step's own time leaves."""
    from torchsprint.commands.bench.main import bench

    PLAN.update(step_s=0.02)
    steps, warmup, batch = 6, 2, 32
    rows = bench(
        None,
        [
            "model.name=test_sleepy",
            "data.dataset=test_slow_digits",
            f"data.batch_size={batch}",
            "log.tensorboard=false",
        ],
        steps=steps,
        warmup=warmup,
        repeats=1,
        only=["baseline (seeds)"],
        out=tmp_path / "b",
        isolate=False,
    )
    base = next(r for r in rows if r["variant"] == "baseline (seeds)")
    step_s = base["step_ms"] / 1000
    # The baseline's two DataLoader workers read 32 x 2 ms per batch each: a batch every ~32 ms at best.
    assert step_s >= 0.8 * batch * LOAD_S / 2  # measured 0.99-1.1 of it (prefetched batches make some steps shorter)
    models = list(dict.fromkeys(c[0] for c in CLOCK))
    assert len(models) == 1
    timed = [c for c in CLOCK if c[0] == models[0]][warmup:]  # the timed steps' forwards
    assert len(timed) == steps
    slept = sum(c[4] for c in timed) / steps  # the forwards as they ran, late wake-ups included
    computing = 1 - base["data_wait_share"]
    figure("bench non-wait time - model forwards, per step (s)", computing * step_s - slept)
    # The share of the step not spent waiting is the model's (its forward, backward and optimizer update): measured
    # 0.9-2.6 ms over the forwards' requested sleep on a quiet machine, up to 7.1 ms with 3 busy processes on the 2
    # cores (late wake-ups from the sleep); over the forwards as measured, 1.7-2.9 ms loaded; bound 8 ms, 2.7x that.
    assert slept <= computing * step_s <= slept + 0.008
    assert base["bottleneck"] == "input-bound"

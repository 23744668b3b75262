"""Feedback within seconds: where no progress bar can be drawn (a pipe, as in CI logs), a line at least
every HEARTBEAT_SECONDS with the epoch's steps, images/s and ETA; and once, early, the estimated time of the epoch and
of the run, with advice when the run is long.

The references are independent of the logger: the arrival time of each line at the reading end of the pipe, and
the clock of a model whose training forward sleeps a known time (its own time.time() at every forward).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time

from torch import nn

from torchsprint import config
from torchsprint.models.core import MODELS
from torchsprint.observe import progress as tprog
from torchsprint.train.run import train

HEARTBEAT = re.compile(
    r"^epoch (\d+)/(\d+): step (\d+)/(\d+) \(\d+%\), ([\d.]+) img/s, elapsed ([\d.]+) "
    r"s, ETA ([\d.]+) s( \(rough: from the first step, its warm-up included\))?$"
)
FIRST = re.compile(
    r"^epoch (\d+)/(\d+): step 0/(\d+) \(0%\), elapsed ([\d.]+) s, ETA \? "
    r"\(the first step is under way: the first batch, allocation, warm-up\)$"
)
ESTIMATE = re.compile(
    r"^estimate: epoch 1 takes ~([\d.]+) s \((\d+) steps at ([\d.]+) img/s\); the run ~([\d.]+) s "
    r"\((\d+) epoch\(s\) x (\d+) steps \+ (\d+) evaluation\(s\) of ([\d,]+) images"
)
PLAN = {"step_s": 0.15, "first_s": 0.6, "batch": 128}
CLOCK: list[tuple[float, bool]] = []  # (time.time() at each forward's entry, training)


class Timed(nn.Module):
    """Its training forward sleeps PLAN["step_s"] (the first one PLAN["first_s"] more: a warm-up the rates must not
    count); its evaluation forward a third of a training image's time per image
    (the cost model the estimate uses for evaluations, progress.Feedback.projection): how long the run's training and
    evaluations take is known from the sleeps and this model's own clock."""

    def __init__(self, num_classes, in_channels=3):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        first = not CLOCK
        CLOCK.append((time.time(), self.training))
        step_s = PLAN["step_s"]
        time.sleep(step_s + first * PLAN["first_s"] if self.training else step_s / PLAN["batch"] * x.shape[0] / 3)
        return self.fc(x.flatten(1).float())


MODELS.register("test_timed_steps", override=True)(lambda num_classes, in_channels=3: Timed(num_classes, in_channels))


def train_timed(writer, run_dir, monkeypatch, tty: bool) -> None:
    """Train the timed model (digits, 2 epochs, batch PLAN["batch"]) with stdout = `writer` (a pipe or a terminal, as
    `tty` says), which is closed after, so that the reading end sees the end of its output."""
    CLOCK.clear()
    cfg = config.load(
        None,
        [
            "model.name=test_timed_steps",
            "run.epochs=2",
            f"data.batch_size={PLAN['batch']}",
            "log.tensorboard=false",
            "eval.per_class=false",
            f"run.dir={run_dir}",
        ],
    )
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", writer)
            assert sys.stdout.isatty() == tty
            train(cfg)
    finally:
        writer.close()


def test_a_pipe_gets_heartbeat_lines_with_an_honest_eta_and_an_early_estimate(tmp_path, monkeypatch):
    """stdout is a pipe (as in CI), read by a thread that notes when each line arrives. Digits (1,437 training
    images, 360 validation) at batch 128: 11 steps of ~0.15 s per epoch (drop_last), 2 epochs. With the heartbeat at
    0.5 s: lines 0.5 s to 0.5 s + a step apart; each ETA within a measured margin of when the epoch really ended;
    the estimate's epoch and run time within a margin of the time the model's clock measured."""
    step_s, batch, hb_s, first_s = PLAN["step_s"], PLAN["batch"], 0.5, 0.25
    # Shorter waits than the shipped 5 s / 10 s, 5 steps and 5 s, so the test takes seconds; the logic is the same.
    monkeypatch.setattr(tprog, "FIRST_HEARTBEAT_SECONDS", first_s)
    monkeypatch.setattr(tprog, "HEARTBEAT_SECONDS", hb_s)
    monkeypatch.setattr(tprog, "ESTIMATE_AFTER_STEPS", 3)
    monkeypatch.setattr(tprog, "ESTIMATE_AFTER_SECONDS", 0.5)
    read_fd, write_fd = os.pipe()
    writer = os.fdopen(write_fd, "w")  # block-buffered, as a pipe is: lines arrive late unless the logger flushes
    lines: list[tuple[float, str]] = []

    def read():
        with os.fdopen(read_fd) as r:
            for line in r:
                lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        train_timed(writer, tmp_path / "run", monkeypatch, tty=False)
    finally:
        reader.join()
    text = "\n".join(f"{t - lines[0][0]:6.2f} {x}" for t, x in lines)
    time.sleep(0.1)  # end_epoch stopped the heartbeat thread: it returns from its wait at once
    assert not [t for t in threading.enumerate() if t.name == "torchsprint-heartbeat"], (
        "a heartbeat thread outlived its epoch"
    )
    train_starts = [t for t, training in CLOCK if training]
    ends = {int(m.group(1)): t for t, line in lines if (m := re.match(r"^epoch (\d+): train loss", line))}
    beats = [(t, m) for t, line in lines if (m := HEARTBEAT.match(line))]
    firsts = [(t, m) for t, line in lines if (m := FIRST.match(line))]
    assert {int(m.group(1)) for _, m in beats} == {1, 2}, text

    # A line comes while the first step (its 0.6 s warm-up) is still running: the heartbeat is a timer, not a check
    # after each step (which printed nothing before the first step ended).
    # epoch 1's first step takes 0.75 s: lines at 0.25 s and 0.75 s into it; epoch 2's is quicker than first_s
    assert [int(m.group(1)) for _, m in firsts] in ([1], [1, 1]), text
    t_first = firsts[0][0]
    assert train_starts[0] < t_first < train_starts[1], text
    assert abs(float(firsts[0][1].group(4)) - first_s) < 0.06, text  # its own clock, printed to 0.1 s
    assert t_first - train_starts[0] < first_s + 0.05, (t_first - train_starts[0], text)
    # measured: 0.245-0.249 s after the first forward (3 runs, one beside 2 busy processes); the epoch's clock starts
    # a little before it (the loader's first batch)

    # Images/s on the line against the model's own step period: 128 images per step.
    period = statistics.median(b - a for a, b in zip(train_starts, train_starts[1:]))  # the warm-up is one of 21
    steady = [(t, m) for t, m in beats if not m.group(8)]  # a line after the first step only says its rate is rough
    assert all(m.group(3) == "1" for _, m in beats if m.group(8))
    for _, m in steady:
        assert abs(float(m.group(5)) - batch / period) / (batch / period) < 0.10, (m.group(0), batch / period, text)
        # measured: within 1.5% of batch / period on a loaded 2-core machine (2 runs), 5.2% once in the full -n 2 suite
        # on an AVX-512 EPYC (2026-12-02); 10% still catches the warm-up step counted in the window (36% off here)

    for epoch in (1, 2):
        mine = [(t, m.group(0)) for t, m in firsts + beats if int(m.group(1)) == epoch]
        mine.sort()
        # Printed by a timer thread on a fixed schedule (line k due at its first + k * hb_s, whatever the step does):
        # each line's lateness against that grid, the grid placed at the earliest line's. A thread woken late on a
        # loaded machine is late once (the next line is due on the grid again); a check after each step (a line
        # every 4 steps of 0.15 s = 0.6 s) drifts 0.1 s a line, and lines held in a pipe's buffer arrive together.
        late = [t - k * hb_s for k, (t, _) in enumerate(mine)]
        late = [x - min(late) for x in late]
        assert len(mine) >= 3 and max(late) < 0.08, (epoch, late, text)
        # measured: within 0.001 s of the grid (3 runs, one beside 2 busy processes); one line 0.025 s late in CI's
        # -n 2 run on a 2-core Xeon (2026-12-02), its neighbours on the grid. 0.08 is under the step-check's drift.
        for t, m in [b for b in beats if b in steady and int(b[1].group(1)) == epoch]:
            true_left = ends[epoch] - t  # when the epoch really ended, as the reading end of the pipe saw it
            assert abs(float(m.group(7)) - true_left) < 0.2, (m.group(0), true_left, text)
            # measured: |ETA - true| <= 0.064 s (the end-of-epoch work after the last step, and jitter); 3x

    est = [(t, m) for t, line in lines if (m := ESTIMATE.match(line))]
    assert len(est) == 1, text
    t_est, m = est[0]
    epoch_s, run_s = float(m.group(1)), float(m.group(4))
    assert (int(m.group(2)), int(m.group(5)), int(m.group(6)), int(m.group(7)), m.group(8)) == (11, 2, 11, 2, "360")
    assert t_est < ends[1], "the estimate comes during the first epoch"
    epoch1 = ends[1] - train_starts[0]  # the first forward to the end of epoch 1
    # What the estimate covers: each epoch's training (its first forward to its end) and each evaluation (its first
    # forward to the end of its last); not one-time costs between them (the first evaluation imports torchmetrics,
    # seconds here; checkpoint writes).
    evals = [
        [t for t, training in CLOCK[i:j] if not training]
        for i, j in ((0, len(CLOCK) // 2 + 1), (len(CLOCK) // 2 + 1, len(CLOCK)))
    ]
    eval_spans = [ts[-1] - ts[0] + step_s / batch * (360 - 256) / 3 for ts in evals if ts]
    run = epoch1 + (ends[2] - [t for t, training in CLOCK if training][11]) + sum(eval_spans)
    assert abs(epoch_s - epoch1) < 0.22, (epoch_s, epoch1, text)
    # The estimate is a prediction from the steps before it: against what the model's clock measured over those steps
    # (its step period after the warm-up step, the 11 + 11 steps of the run, the evaluations at a third of a training
    # image's time), it must agree closely; against the run as it later went, within what later load can change.
    seen = [t for t in train_starts if t < t_est]
    period = (seen[-1] - seen[1]) / (len(seen) - 2)  # steady step period the estimate could know (warm-up excluded)
    known = (train_starts[1] - train_starts[0]) + 21 * period + 2 * 360 * period / batch / 3
    assert abs(run_s - known) / known < 0.04, (run_s, known, seen, text)
    # measured: within 1.3% (3 runs, one beside 2 busy processes; the line rounds to 0.1 s, 1.2% of 4.2 s); 3x
    assert abs(run_s - run) / run < 0.10, (run_s, run, eval_spans, text)
    # measured: within 0.94% on a quiet machine, 3.2% in CI (2 test processes on 2 cores: the second epoch ran slower
    # than the steps the estimate saw); 3x the CI figure


class Sleeper(nn.Module):
    def __init__(self, num_classes, in_channels=3):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        if self.training:
            time.sleep(0.1)
        return self.fc(x.flatten(1).float())


MODELS.register("test_sleeper", override=True)(lambda num_classes, in_channels=3: Sleeper(num_classes, in_channels))


def test_a_long_run_gets_concrete_advice(tmp_path, capsys, monkeypatch):
    """2,000 epochs of 11 steps at ~0.1 s: ~37 min, over the 30 min threshold: the estimate says
    how to shorten it, with the run.epochs that fits in 30 minutes at the measured rate (the run pauses after 8
    steps: the estimate is about the run as configured)."""
    monkeypatch.setattr(tprog, "ESTIMATE_AFTER_SECONDS", 0.3)  # the shipped 5 s would make the test 5 s longer
    cfg = config.load(
        None,
        [
            "model.name=test_sleeper",
            "run.epochs=2000",
            "data.batch_size=128",
            "run.stop_after_steps=8",
            "log.tensorboard=false",
            f"run.dir={tmp_path / 'r'}",
        ],
    )
    t0 = time.perf_counter()
    train(cfg)
    out = capsys.readouterr().out
    m = re.search(
        r"estimate: epoch 1 takes ~([\d.]+) s \(11 steps at ([\d.]+) img/s\); the run ~([\d:]+) \(2000 epoch", out
    )
    assert m, out
    epoch_s, images_s = float(m.group(1)), float(m.group(2))
    assert 11 * 0.1 - 0.05 <= epoch_s < 11 * 0.1 * 1.5, epoch_s  # 11 sleeps of 0.1 s, plus the steps' own work
    advice = re.search(r"over 30 min; to shorten it: (.*)", out)
    assert advice, out
    fit = int(re.search(r"fewer epochs: run\.epochs=(\d+)", advice.group(1)).group(1))
    # An epoch and its evaluation (360 validation images at a third of a training image's time) in 30 minutes
    expected = 1800 / (epoch_s + 360 / images_s / 3)
    assert abs(fit - expected) <= 0.05 * fit, (fit, expected)  # the printed epoch_s is rounded to 0.1 s (<5%)
    assert "a GPU (run.device=cuda" in advice.group(1) and "run.max_time=30m" in advice.group(1)
    assert time.perf_counter() - t0 < 30


def test_no_line_before_the_first_step_and_none_with_progress_off(tmp_path, capsys, monkeypatch):
    """log.progress=false: no heartbeat and no estimate, however long the steps."""
    monkeypatch.setattr(tprog, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(tprog, "ESTIMATE_AFTER_SECONDS", 0.05)
    cfg = config.load(
        None,
        [
            "model.name=test_sleeper",
            "run.epochs=1",
            "data.batch_size=256",
            "log.progress=false",
            "log.tensorboard=false",
            f"run.dir={tmp_path / 'r'}",
            "run.stop_after_steps=4",
        ],
    )
    train(cfg)
    out = capsys.readouterr().out
    assert "ETA" not in out and "estimate:" not in out


class SlowEval(nn.Module):
    """Training forward at once; each evaluation forward sleeps 0.25 s (an evaluation of 3 batches: 0.75 s)."""

    def __init__(self, num_classes, in_channels=3):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        if not self.training:
            time.sleep(0.25)
        return self.fc(x.flatten(1).float())


MODELS.register("test_slow_eval", override=True)(lambda num_classes, in_channels=3: SlowEval(num_classes, in_channels))


def test_a_long_evaluation_gets_lines_too(tmp_path, capsys, monkeypatch):
    """An evaluation is no step of the epoch's clock: while it lasts, a line every HEARTBEAT_SECONDS says so (a
    validation of 400 300x300 images took 18.5 s with no line on the 2-core CPU); none after it ended."""
    monkeypatch.setattr(tprog, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(tprog, "FIRST_HEARTBEAT_SECONDS", 30.0)  # no training lines: the epoch takes well under 30 s
    cfg = config.load(
        None,
        [
            "model.name=test_slow_eval",
            "run.epochs=1",
            "data.batch_size=128",
            "log.tensorboard=false",
            "eval.per_class=false",
            f"run.dir={tmp_path / 'r'}",
        ],
    )
    train(cfg)
    time.sleep(0.3)  # a thread left running would print again by now
    out = capsys.readouterr().out.splitlines()
    beats = [i for i, line in enumerate(out) if re.match(r"^epoch 1/1: evaluating: elapsed [\d.]+ s$", line)]
    val = [i for i, line in enumerate(out) if line.startswith("epoch 1/1  ")]  # the validation's result line
    train_end = [i for i, line in enumerate(out) if line.startswith("epoch 1: train loss")]
    # 360 images in 3 batches of 128: 0.75 s of sleeps, lines at 0.2, 0.4 and 0.6 s
    assert len(beats) >= 2 and len(val) == 1 and train_end[0] < beats[0] and beats[-1] < val[0], "\n".join(out)
    elapsed = [float(re.search(r"elapsed ([\d.]+)", out[i]).group(1)) for i in beats]
    assert elapsed == sorted(elapsed) and abs(elapsed[0] - 0.2) <= 0.051, elapsed  # printed to 0.1 s


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = re.compile(r"^epoch (\d+)/2 .*? (\d+)/11 .*?(?:([\d.]+) img/s\s+ETA ([\d.]+) s)?\s+\d:\d\d:\d\d\s*$")


def test_a_terminal_gets_a_bar_with_rate_and_eta_from_the_first_steps(tmp_path, monkeypatch, figure):
    """stdout is a real pseudo-terminal (os.openpty: isatty() is true, as in an interactive shell), read by a thread
    that notes when each chunk arrives. Digits at batch 128, the timed model (0.15 s a step): each epoch draws a bar
    (rich) whose frames show the steps done of 11, the images/s (the rate the model's own clock gives, its
    warm-up step left out) and the epoch's ETA (against when the epoch really ended); no heartbeat lines (they are
    for pipes), and the bar's first rate comes within the epoch's first steps."""
    import fcntl
    import struct
    import termios

    batch = PLAN["batch"]
    monkeypatch.setenv("TERM", "xterm-256color")  # rich draws live bars on a terminal that is not "dumb"
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setattr(tprog, "FIRST_HEARTBEAT_SECONDS", 0.1)  # were a heartbeat started on a terminal, it would print
    monkeypatch.setattr(tprog, "HEARTBEAT_SECONDS", 0.2)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    writer = os.fdopen(slave, "w")
    chunks: list[tuple[float, str]] = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end closed
                return
            if not data:
                return
            chunks.append((time.time(), data.decode("utf-8", "replace")))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        train_timed(writer, tmp_path / "run", monkeypatch, tty=True)
    finally:
        reader.join(timeout=10)
        os.close(master)
    # Frames: what the terminal shows between carriage returns and newlines, cursor and colour codes removed.
    pieces = [(t, p.strip()) for t, c in chunks for p in re.split(r"[\r\n]+", ANSI.sub("", c)) if p.strip()]
    text = "\n".join(f"{t - pieces[0][0]:6.2f} {p}" for t, p in pieces)
    frames = [(t, m) for t, p in pieces if (m := BAR.match(p))]
    assert {int(m.group(1)) for _, m in frames} == {1, 2}, text
    assert not any(re.match(r"^epoch \d+/2: step", p) for _, p in pieces), "heartbeat lines on a terminal:\n" + text
    train_starts = [t for t, training in CLOCK if training]
    ends = {int(m.group(1)): t for t, p in pieces if (m := re.match(r"^epoch (\d+): train loss", p))}
    period = statistics.median(b - a for a, b in zip(train_starts, train_starts[1:]))
    for epoch in (1, 2):
        mine = [(t, m) for t, m in frames if int(m.group(1)) == epoch]
        assert max(int(m.group(2)) for _, m in mine) == 11, text  # the bar reaches the epoch's end
        rated = [(t, m) for t, m in mine if m.group(3)]
        # from the first steps: a rate and an ETA on the bar before the epoch's 4th step begins
        assert rated and rated[0][0] < train_starts[11 * (epoch - 1) + 3], text
        for t, m in rated:
            if int(m.group(2)) < 3:  # rates over one or two steps after the warm-up one: rough, not checked
                continue
            figure("bar rate error", abs(float(m.group(3)) - batch / period) / (batch / period))
            assert abs(float(m.group(3)) - batch / period) / (batch / period) < 0.045, (
                m.group(0),
                batch / period,
                text,
            )
            # the same bound as the heartbeat's (measured there within 1.5%)
            if int(m.group(2)) < 11:
                true_left = ends[epoch] - t
                figure("bar ETA - true", float(m.group(4)) - true_left)
                assert abs(float(m.group(4)) - true_left) < 0.5, (m.group(0), true_left, text)
                # the bar shows the ETA of its latest update (pushed at most every 0.1 s, redrawn 4 times a second):
                # up to ~0.35 s old when the frame arrives; measured -0.02 to 0.19 s (rates within 0.8%); ~2.7x

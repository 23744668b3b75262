"""Early stopping: the epoch it stops at equals a plain loop's over the same metric sequence, and survives a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.run import train

# digits, 7 steps per epoch; val/top1 climbs to ~0.95 by epoch 6 and then by less than 0.03 per epoch.
BASE = ["model.args={width: 8}", "log.tensorboard=false", "log.progress=false", "eval.per_class=false", "run.epochs=10",
        "data.batch_size=128", "data.val_fraction=0.5", "early_stop.patience=2", "early_stop.min_delta=0.03"]


def run(d: Path, *over: str) -> dict:
    return train(config.load(None, [*BASE, f"run.dir={d}", *over]), quiet=True)


def lines(d: Path, kind: str) -> list[dict]:
    return [x for x in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if x["kind"] == kind]


def plain_early_stop(values: list[float], patience: int, min_delta: float) -> int | None:
    """Keras' EarlyStopping (mode max), written out: the 1-based index of the evaluation that stops, or None."""
    best, wait = -float("inf"), 0
    for i, v in enumerate(values, 1):
        if v - min_delta > best:
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                return i
    return None


def test_early_stop_stops_where_a_plain_loop_does(tmp_path):
    summary = run(tmp_path / "r")
    top1 = [e["val/top1"] for e in lines(tmp_path / "r", "eval")]
    # The plain loop sees the same sequence: it must stop at the last evaluation the run made, and before the end.
    want = plain_early_stop(top1, 2, 0.03)
    assert want is not None and want == len(top1) < 10, top1
    es = summary["early_stop"]
    assert es["stopped_epoch"] == want and es["best"] == max(top1[: want - 2]) and es["wait"] == 2
    assert summary["global_step"] == 7 * want and not summary["paused"]
    assert (tmp_path / "r" / "last.safetensors").is_file()
    recorded = lines(tmp_path / "r", "early_stop")
    assert [x["early_stop/stopped"] for x in recorded] == [False] * (want - 1) + [True]
    # Resuming a run that stopped early does nothing more.
    again = run(tmp_path / "r", "checkpoint.resume=auto")
    assert again["already_finished"] and again["early_stop"] == es


def test_early_stop_resumes_across_the_patience_count(tmp_path):
    """Paused mid-epoch after an evaluation that did not improve (the count at 1), then resumed == uninterrupted."""
    full = run(tmp_path / "full")
    stop = full["early_stop"]["stopped_epoch"]
    pause_step = 7 * (stop - 1) + 3  # inside the epoch after the first non-improving evaluation
    paused = run(tmp_path / "r", f"run.stop_after_steps={pause_step}", "log.every_steps=1")
    assert paused["paused"] and paused["early_stop"]["wait"] == 1 and paused["early_stop"]["stopped_epoch"] is None
    resumed = run(tmp_path / "r", "checkpoint.resume=auto", "log.every_steps=1")
    assert resumed["early_stop"] == full["early_stop"] and resumed["global_step"] == full["global_step"]
    lines = [json.loads(x) for x in ((tmp_path / "r") / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, full["global_step"] + 1))  # resumed, not started over
    assert resumed["final"] == full["final"]


def test_min_delta_without_patience_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no effect without early_stop.patience"):
        train(config.load(None, ["early_stop.min_delta=0.1", f"run.dir={tmp_path / 'x'}"]), quiet=True)

"""Early stopping: the epoch it stops at equals a plain loop's over the same metric sequence, and survives a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.train.run import train

# digits, 7 steps per epoch.
BASE = [
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "run.epochs=10",
    "data.batch_size=128",
    "data.val_fraction=0.5",
    "early_stop.patience=2",
    "early_stop.min_delta=0.03",
]
# Where a learning run stops depends on the CPU: val/top1 of small_cnn (width 8) climbed past 0.95 by epoch 6 and then
# by less than 0.03 an epoch on an Intel Xeon (AVX2), so it stopped at epoch 8; on an AMD EPYC (AVX2 or AVX-512, and
# with ATEN_CPU_CAPABILITY=default) it climbed slower (0.099, 0.264, 0.277, 0.560, 0.791, 0.943, ...) and never
# stopped within 10. So the learning case checks what holds for any trajectory (it stops exactly where the plain rule
# does on its own sequence, or runs to the end where the rule never fires), and the plateau case forces the sequence:
# a linear model at lr 1e-30 never changes its weights (an update of 1e-30 x grad is below fp32's resolution of
# weights ~1e-2) and has no BatchNorm statistics, so every evaluation scores the same and the rule must stop at the
# third (the first sets the best, two more do not beat it).
LEARNING = ["model.args={width: 8}"]
PLATEAU = ["model.name=linear", "optim.lr=1e-30"]


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


@pytest.mark.parametrize("case", ["learning", "plateau"])
def test_early_stop_stops_where_a_plain_loop_does(tmp_path, case):
    summary = run(tmp_path / "r", *(LEARNING if case == "learning" else PLATEAU))
    top1 = [e["val/top1"] for e in lines(tmp_path / "r", "eval")]
    # The plain loop sees the same sequence: it must stop at the last evaluation the run made.
    want = plain_early_stop(top1, 2, 0.03)
    if case == "plateau":
        assert len(set(top1)) == 1 and want == 3, top1  # the forced sequence
    elif want is None:  # this CPU's trajectory never met the rule: the run must have gone to the end, unstopped
        assert len(top1) == 10 and summary["early_stop"]["stopped_epoch"] is None and summary["global_step"] == 70
        return
    assert want == len(top1), top1  # (the rule may fire at the tenth evaluation itself)
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
    """Paused mid-epoch after an evaluation that did not improve (the count at 1), then resumed == uninterrupted.
    The plateau forces the stop at epoch 3 on any CPU (see LEARNING/PLATEAU)."""
    full = run(tmp_path / "full", *PLATEAU)
    stop = full["early_stop"]["stopped_epoch"]
    assert stop == 3, full["early_stop"]
    pause_step = 7 * (stop - 1) + 3  # inside the epoch after the first non-improving evaluation
    paused = run(tmp_path / "r", *PLATEAU, f"run.stop_after_steps={pause_step}", "log.every_steps=1")
    assert paused["paused"] and paused["early_stop"]["wait"] == 1 and paused["early_stop"]["stopped_epoch"] is None
    resumed = run(tmp_path / "r", *PLATEAU, "checkpoint.resume=auto", "log.every_steps=1")
    assert resumed["early_stop"] == full["early_stop"] and resumed["global_step"] == full["global_step"]
    lines = [json.loads(x) for x in ((tmp_path / "r") / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(
        range(1, full["global_step"] + 1)
    )  # resumed, not started over
    assert resumed["final"] == full["final"]


def test_min_delta_without_patience_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no effect without early_stop.patience"):
        train(config.load(None, ["early_stop.min_delta=0.1", f"run.dir={tmp_path / 'x'}"]), quiet=True)

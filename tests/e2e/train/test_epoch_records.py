"""Per-epoch training loss and accuracy, and one 1-based epoch numbering everywhere.

References: the mean of the per-step losses the same run logs at every step; the top-1 accuracy of
the same weights computed by a plain loop; an uninterrupted run for a run paused mid-epoch.
"""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from torchsprint import config
from torchsprint.state.resume import find_checkpoints
from torchsprint.train.run import train

FAST = [
    "model.args={width: 8}",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "data.batch_size=128",
    "data.val_fraction=0.5",
]  # 898 training images: 7 steps per epoch


def run(tmp_path, name, *overrides):
    summary = train(config.load(None, [*FAST, *overrides, f"run.dir={tmp_path / name}"]), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_epoch_loss_is_the_mean_of_the_step_losses_and_epochs_count_from_one(tmp_path):
    summary, rows = run(
        tmp_path, "a", "run.epochs=2", "log.every_steps=1", "checkpoint.every_steps=3", "checkpoint.keep_last=10"
    )
    steps = [r for r in rows if r["kind"] == "train"]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["epoch"] for r in rows if r["kind"] == "eval"] == [1, 2]
    assert sorted({r["epoch"] for r in steps}) == [1, 2] and len(steps) == 14
    for e in epochs:
        losses = [r["train/loss"] for r in steps if r["epoch"] == e["epoch"]]
        # Both sum the same float32 step losses, in float64 here and there: measured difference 0.
        assert math.isclose(e["train/epoch_loss"], sum(losses) / len(losses), rel_tol=1e-12)
        # hits over the 7 x 128 = 896 images trained on (drop_last leaves out 2 of the 898): a whole number of hits
        hits = e["train/epoch_top1"] * 896
        assert abs(hits - round(hits)) < 1e-9 and 0 < round(hits) < 896, hits
    assert (
        epochs[1]["train/epoch_loss"] < epochs[0]["train/epoch_loss"]
    )  # it learns: means are per epoch, not cumulative
    # best: the first evaluation with the highest val/top1 (checkpoint.monitor's default, mode max)
    top1 = [r["val/top1"] for r in rows if r["kind"] == "eval"]
    assert (summary["best_epoch"], summary["best_metric"]) == (top1.index(max(top1)) + 1, max(top1)), top1
    names = sorted(p.name for p in find_checkpoints(tmp_path / "a"))
    # Steps 3 and 6 fall in epoch 1, 9 and 12 in epoch 2, the epoch ends at 7 and 14.
    assert names == [
        "ckpt-e001-s0000003.pt",
        "ckpt-e001-s0000006.pt",
        "ckpt-e001-s0000007.pt",
        "ckpt-e002-s0000009.pt",
        "ckpt-e002-s0000012.pt",
        "ckpt-e002-s0000014.pt",
    ]


def test_epoch_accuracy_counts_the_hits_a_plain_loop_counts(tmp_path):
    """With a learning rate of 1e-30 the weights never change (w - 1e-30 * g rounds to w in float32), so the
    training accuracy of the epoch is the accuracy of the saved weights over the training set; a batch of
    449 divides the 898 training images, so no image is dropped."""
    _, rows = run(
        tmp_path,
        "a",
        "model.name=linear",
        "model.args={}",
        "optim.lr=1e-30",
        "optim.weight_decay=0",
        "data.batch_size=449",
        "run.epochs=1",
    )
    (epoch,) = [r for r in rows if r["kind"] == "epoch"]
    from torchsprint.data import DATASETS

    cfg = config.load(None, ["data.val_fraction=0.5"])
    train_set = DATASETS.get("digits")(cfg.data).train
    weights = load_file(str(tmp_path / "a" / "last.safetensors"))
    x = train_set.images.float().div(255).flatten(1)  # no transforms: the data arrive as x / 255
    logits = x @ weights["1.weight"].T + weights["1.bias"]
    want = int((logits.argmax(1) == train_set.labels).sum()) / len(train_set.labels)
    assert epoch["train/epoch_top1"] == want and 0.02 < want < 0.5  # an untrained model: near chance, not 0 or 1


def test_a_run_paused_mid_epoch_reports_the_same_epoch_means(tmp_path):
    _, ref = run(tmp_path, "ref", "run.epochs=2", "log.every_steps=1")
    run(tmp_path, "b", "run.epochs=2", "run.stop_after_steps=3", "checkpoint.every_steps=3", "log.every_steps=1")
    _, got = run(
        tmp_path, "b", "run.epochs=2", "checkpoint.resume=auto", "checkpoint.every_steps=3", "log.every_steps=1"
    )
    # resumed, not started over: each of the 14 steps logged once over both invocations
    assert [r["step"] for r in got if r["kind"] == "train"] == list(range(1, 15))
    keys = ("epoch", "train/epoch_loss", "train/epoch_top1")
    # Sums of a few float32 losses in float64 are exact whatever the grouping: equal, not close.
    assert [[r[k] for k in keys] for r in got if r["kind"] == "epoch"][-2:] == [
        [r[k] for k in keys] for r in ref if r["kind"] == "epoch"
    ]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_sigkill_after_an_epoch_line_at_a_checkpoint_step_then_resume_logs_each_record_once(tmp_path):
    """2 steps per epoch and a checkpoint every 2 steps: the step-2 checkpoint is saved before epoch 1's row and its
    evaluation (logged at the same step), then the epoch's own checkpoint. A real SIGKILL after the epoch line, while
    that checkpoint is being written (a slow disk), and a resume from the step-2 checkpoint: every (kind, step) record
    is in metrics.jsonl once, as in an uninterrupted run. Records were cut back by step only, so epoch 1's row and
    evaluation, at the checkpoint's step, stayed and were logged again: twice."""
    import os
    import subprocess
    import sys
    from collections import Counter

    from test_resume import _temp_files, _wait

    from fault_env import fault_env
    from torchsprint.state.checkpoint import load_checkpoint

    over = ["run.epochs=2", "data.batch_size=449", "checkpoint.every_steps=2", "log.every_steps=1"]  # 2 steps per epoch
    _, ref = run(tmp_path, "ref", *over)
    run_dir = tmp_path / "run"
    # a slow disk: torch.save writes a checkpoint in ~220 calls here, so ~1 s per checkpoint, the time to see the write
    env = fault_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), slow_write_s="0.005")
    with open(tmp_path / "out.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchsprint", "train", *FAST, *over, f"run.dir={run_dir}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:
        assert _wait(lambda: "epoch 1: train" in (tmp_path / "out.log").read_text(), proc, timeout=120)
        # the step-2 checkpoint is on disk by now: a temp file is the epoch's own checkpoint being written
        assert _wait(lambda: bool(_temp_files(run_dir, proc.pid)), proc, timeout=120), (
            tmp_path / "out.log"
        ).read_text()
        proc.kill()
    finally:
        proc.wait()
    (ckpt,) = find_checkpoints(run_dir)
    state = load_checkpoint(ckpt)["train_state"]
    assert (state["epoch"], state["step_in_epoch"]) == (0, 2)  # the step-2 one, saved mid-epoch (the epoch's was cut)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {(r["kind"], r["step"]) for r in rows} >= {("epoch", 2), ("eval", 2)}  # logged after the checkpoint
    _, got = run(tmp_path, "run", *over, "checkpoint.resume=auto")
    assert Counter((r["kind"], r["step"]) for r in got) == Counter((r["kind"], r["step"]) for r in ref), [
        (r["kind"], r["step"]) for r in got
    ]

"""What a run records is what it did: the loader backend that ran (after `auto` and data.fallback), and which
weights every per-class file, confusion matrix and evaluation describes. Real short runs, no mocks."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from torchsprint import config
from torchsprint.cli import main
from torchsprint.data.core import DATASETS
from torchsprint.train.run import train


class SlowReads(torch.utils.data.Dataset):
    """A split whose samples take 5 ms each to read: the loader is the bottleneck, so the input-bound hint shows."""

    def __init__(self, raw):
        self.raw = raw

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, i):
        time.sleep(0.005)
        return self.raw[i]


@DATASETS.register("test_slow_read_digits", override=True)
def slow_read_digits(data_cfg):
    splits = DATASETS.get("digits")(data_cfg)
    splits.train = SlowReads(splits.train)
    return splits


def test_a_fallback_run_names_the_backend_that_ran_everywhere(tmp_path, capsys):
    """data.backend=gpu with data.fallback=cpu on a machine without CUDA: the cpu backend runs, and decisions.json,
    the start-up line and the input-bound hint say cpu (with gpu as the configured one and the reason)."""
    cfg = config.load(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.max_steps=4",
            "data.dataset=test_slow_read_digits",
            "data.backend=gpu",
            "data.fallback=cpu",
            "data.batch_size=16",
            "model.args={width: 4}",
            "log.tensorboard=false",
            "log.progress=false",
            "eval.per_class=false",
        ],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's own warning (tested in test_data_backends)
        train(cfg)
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert d["backend"] == "cpu" and d["backend_config"] == "gpu"
    assert "no CUDA device" in d["backend_fallback"] and "data.fallback=cpu" in d["backend_why"]
    assert (
        "loader: data.backend=cpu (data.fallback=cpu: data.backend=gpu cannot run here (needs a CUDA GPU: this machine "
        "has no CUDA device))" in out
    )
    assert "input-bound: the loader (cpu) is the bottleneck" in out  # 80 ms of reading per step of < 5 ms
    assert "data.backend=gpu (" not in out and "loader (gpu)" not in out


def test_a_run_whose_backend_ran_as_configured_records_no_fallback(tmp_path):
    cfg = config.load(
        None,
        [
            f"run.dir={tmp_path / 'run'}",
            "run.max_steps=2",
            "model.args={width: 4}",
            "log.tensorboard=false",
            "log.progress=false",
            "eval.per_class=false",
        ],
    )
    train(cfg, quiet=True)
    d = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert (d["backend"], d["backend_config"], d["backend_fallback"]) == ("memory", "auto", None)


def test_data_check_names_the_backend_auto_chose(tmp_path, capsys):
    """digits are decoded in memory already: `auto` picks the memory backend, and the check says so, not `auto`."""
    assert main(["data", "check", "--batches", "1", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "loader (memory) train: 1/" in out and "loader (auto)" not in out
    assert "loader: data.backend=memory (the dataset is decoded in memory already" in out
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert (report["backend"], report["backend_config"]) == ("memory", "auto")


@pytest.mark.filterwarnings("ignore:data.backend=gpu cannot run")
def test_data_check_after_a_fallback_names_the_backend_that_ran(tmp_path, capsys):
    assert (
        main(
            ["data", "check", "data.backend=gpu", "data.fallback=cpu", "--batches", "1", "--out", str(tmp_path / "out")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "loader (cpu) train: 1/" in out and "loader (gpu)" not in out
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert (report["backend"], report["backend_config"]) == ("cpu", "gpu") and "no CUDA device" in report["backend_why"]


def reference_evaluation(weights_path, width: int) -> tuple[list[list[int]], list[tuple]]:
    """The confusion matrix and per-class (precision, recall, F1, support) of a weights file on the digits
    validation split, computed without torchsprint's evaluator: the model in plain torch, the split and the
    scores from scikit-learn (the split as the digits source documents it: stratified 20%, seed 0)."""
    import numpy as np
    from safetensors.torch import load_file
    from sklearn.datasets import load_digits
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support
    from sklearn.model_selection import train_test_split

    from torchsprint.models.nets import small_cnn

    d = load_digits()
    _, va = train_test_split(np.arange(len(d.target)), test_size=0.2, random_state=0, stratify=d.target)
    va = np.sort(va)
    x = torch.from_numpy(np.rint(d.images[va] * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1).float() * (1 / 255.0)
    model = small_cnn(num_classes=10, in_channels=1, width=width)
    model.load_state_dict(load_file(str(weights_path)))
    with torch.no_grad():
        pred = model.eval()(x).argmax(1).numpy()
    y = d.target[va]
    prf = precision_recall_fscore_support(y, pred, labels=range(10), zero_division=0)
    return confusion_matrix(y, pred, labels=range(10)).tolist(), list(zip(*prf))


def read_csv(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_per_class_and_confusion_files_name_the_weights_they_describe(tmp_path, capsys):
    """Best and last weights differ (the monitor picks the worst-accuracy epoch on purpose: checkpoint.mode=min);
    per_class.csv / confusion_matrix.* describe best.safetensors and per_class_last.csv / confusion_matrix_last.*
    last.safetensors, each file says which, summary.json maps every file to its weights, and `eval` names them."""
    width = 4
    run_dir = tmp_path / "run"
    cfg = config.load(
        None,
        [
            f"run.dir={run_dir}",
            "run.epochs=2",
            f"model.args={{width: {width}}}",
            "checkpoint.mode=min",
            "log.tensorboard=false",
            "log.progress=false",
            "speed.channels_last=false",
        ],
    )
    summary = train(cfg, quiet=True)
    assert summary["best_epoch"] == 1  # the lower top-1 of two epochs: the first
    steps_per_epoch = summary["global_step"] // 2
    files = {"best": ("per_class.csv", "confusion_matrix"), "last": ("per_class_last.csv", "confusion_matrix_last")}
    at = {"best": (1, steps_per_epoch), "last": (2, 2 * steps_per_epoch)}
    seen = {}
    for which, (per_class, matrix) in files.items():
        confusion, prf = reference_evaluation(run_dir / f"{which}.safetensors", width)
        seen[which] = confusion
        rows = read_csv(run_dir / f"{matrix}.csv")
        assert [[int(v) for v in r[1:]] for r in rows[1:]] == confusion, which
        assert (run_dir / f"{matrix}.png").stat().st_size > 1000
        rows = read_csv(run_dir / per_class)
        assert rows[0] == ["class", "precision", "recall", "f1", "support", "weights", "epoch"]
        for row, want in zip(rows[1:], prf):
            # The file keeps 6 decimals; the evaluator's float32 counts give the same ratios to ~1e-7.
            assert [float(v) for v in row[1:4]] == pytest.approx(want[:3], abs=2e-6), (which, row)
            assert (int(row[4]), row[5], int(row[6])) == (want[3], f"{which}.safetensors", at[which][0])
        for name in (per_class, f"{matrix}.csv", f"{matrix}.png"):
            assert summary["artifacts"][name] == {
                "weights": which,
                "file": f"{which}.safetensors",
                "epoch": at[which][0],
                "step": at[which][1],
            }, name
    assert seen["best"] != seen["last"]  # two epochs of training apart: the files must differ to tell them apart
    assert json.loads((run_dir / "summary.json").read_text())["artifacts"] == summary["artifacts"]
    for which in ("best", "last"):
        assert main(["eval", "-r", str(run_dir), "--weights", which]) == 0
        epoch, step = at[which]
        assert (
            f"val split, {which} weights ({which}.safetensors, epoch {epoch}, step {step}):" in capsys.readouterr().out
        )

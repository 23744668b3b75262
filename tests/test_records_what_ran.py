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
from torchsprint.run import train


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
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "run.max_steps=4", "data.dataset=test_slow_read_digits",
                             "data.backend=gpu", "data.fallback=cpu", "data.batch_size=16", "model.args={width: 4}",
                             "log.tensorboard=false", "log.progress=false", "eval.per_class=false"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's own warning (tested in test_data_backends)
        train(cfg)
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert d["backend"] == "cpu" and d["backend_config"] == "gpu"
    assert "no CUDA device" in d["backend_fallback"] and "data.fallback=cpu" in d["backend_why"]
    assert "loader: data.backend=cpu (data.fallback=cpu: data.backend=gpu cannot run here (this machine has no CUDA " \
           "device))" in out
    assert "input-bound: the loader (cpu) is the bottleneck" in out  # 80 ms of reading per step of < 5 ms
    assert "data.backend=gpu (" not in out and "loader (gpu)" not in out


def test_a_run_whose_backend_ran_as_configured_records_no_fallback(tmp_path):
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "run.max_steps=2", "model.args={width: 4}",
                             "log.tensorboard=false", "log.progress=false", "eval.per_class=false"])
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
    assert main(["data", "check", "data.backend=gpu", "data.fallback=cpu", "--batches", "1",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "loader (cpu) train: 1/" in out and "loader (gpu)" not in out
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert (report["backend"], report["backend_config"]) == ("cpu", "gpu") and "no CUDA device" in report["backend_why"]

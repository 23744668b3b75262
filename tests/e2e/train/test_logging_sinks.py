"""The optional sinks against the real libraries: CSV files, a real MLflow store read back with MLflow's own
client, and a real W&B offline run file read back record by record. Each must hold exactly what
metrics.jsonl holds (the reference every sink is fed from)."""

from __future__ import annotations

import csv
import json
import struct

import pytest

from torchsprint import config
from torchsprint.train.run import train

BASE = ["model.args={width: 8}", "log.tensorboard=false", "log.progress=false", "run.epochs=2", "log.every_steps=5"]


def jsonl(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_csv_rows_equal_the_jsonl_records(tmp_path):
    run = tmp_path / "r"
    train(config.load(None, [*BASE, "log.csv=true", f"run.dir={run}"]), quiet=True)
    records = jsonl(run)
    for kind in ("train", "epoch", "eval"):
        with open(run / f"metrics_{kind}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        want = [r for r in records if r["kind"] == kind]
        assert len(rows) == len(want) > 0, kind
        for row, rec in zip(rows, want):
            assert int(row["step"]) == rec["step"]
            for k, v in rec.items():
                if isinstance(v, float):
                    assert float(row[k]) == v, (kind, k)  # written as repr: measured difference 0.0 on every value


def test_mlflow_store_holds_params_and_every_metric_and_resume_continues_the_run(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow-skinny is optional; the dev extra installs it")
    from mlflow.tracking import MlflowClient

    run = tmp_path / "r"
    over = [*BASE, "log.mlflow=true", f"run.out_dir={tmp_path}", f"run.dir={run}"]
    summary = train(config.load(None, [*over, "run.stop_after_steps=30"]), quiet=True)
    assert summary["paused"]
    train(config.load(None, [*over, "checkpoint.resume=auto"]), quiet=True)
    state = json.loads((run / "mlflow.json").read_text())
    assert state["uri"] == (tmp_path / "mlruns").resolve().as_uri()  # the documented default: <out_dir>/mlruns
    client = MlflowClient(tracking_uri=state["uri"])
    mrun = client.get_run(state["run_id"])  # one MLflow run for the paused and resumed halves
    assert mrun.info.status == "FINISHED"
    assert mrun.data.params["optim.lr"] == "0.1" and mrun.data.params["model.name"] == "small_cnn"
    records = jsonl(run)
    for key in ("train/loss", "val/top1"):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(state["run_id"], key))
        want = sorted((r["step"], r[key]) for r in records if key in r)
        assert [s for s, _ in hist] == [s for s, _ in want]
        assert [v for _, v in hist] == [v for _, v in want]  # float64 in the store: measured difference 0.0


def read_wandb_history(path) -> list[dict]:
    """History rows of a W&B run file, read independently of wandb's writer: the file is a LevelDB-style log
    (7-byte header ':W&B' + magic + version, 32 KiB blocks of records with a crc32/length/type header) of
    protobuf `Record` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block = path.read_bytes(), 7, 32768
    assert data[:4] == b":W&B"
    payloads, buf = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            payloads.append(buf + chunk)
    rows = []
    for p in payloads:
        rec = pb.Record()
        rec.ParseFromString(p)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_run_holds_every_metric(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional; the dev extra installs it")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "r"
    train(config.load(None, [*BASE, "log.wandb=true", "log.wandb_mode=offline", f"run.dir={run}"]), quiet=True)
    # run.finish() returns before the wandb-core service has flushed the run's transaction log: under load (a CI
    # run with -n 2) the file was read with no history rows in it yet, and held all of them a minute later.
    # teardown waits for the service to exit, as the atexit hook does when a CLI process ends.
    import wandb

    wandb.teardown()
    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = read_wandb_history(files[0])
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(r["_step"], {}).update(r)
    for rec in jsonl(run):
        for k, v in rec.items():
            if isinstance(v, float) and k != "time":
                assert by_step[rec["step"]][k] == v, (rec["step"], k)  # JSON in the file: measured difference 0.0
    assert json.loads((run / "wandb.json").read_text())["id"] in files[0].name


def test_a_missing_sink_library_is_refused_before_anything_is_created(tmp_path, monkeypatch, capsys):
    import importlib.util

    from torchsprint import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert cli.main(["train", *BASE, "log.mlflow=true", f"run.dir={tmp_path / 'r'}"]) == 2
    assert "pip install 'torchsprint[mlflow]'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_resume_cuts_metrics_back_to_the_checkpoint_step(tmp_path):
    """What a crash leaves in metrics.jsonl / metrics_<kind>.csv, cut back for a resume from the checkpoint of step 3:
    later steps, a line cut off mid-write and a junk line go; the test record of step 3 goes too (it follows the
    last checkpoint, and a finishing resumed run writes its own); the rest stays, byte for byte, in order."""
    from torchsprint.observe.logging import CsvSink, cut_back_jsonl

    keep = [
        {"kind": "train", "step": 1, "train/loss": 2.0},
        {"kind": "train", "step": 3, "train/loss": 1.5},
        {"kind": "eval", "step": 3, "val/top1": 0.5},
    ]
    drop = [{"kind": "test", "step": 3, "test/top1": 0.4}, {"kind": "train", "step": 4, "train/loss": 1.4}]
    lines = [json.dumps(r) + "\n" for r in keep[:2]] + ["not json\n", json.dumps(keep[2]) + "\n"]
    lines += [json.dumps(r) + "\n" for r in drop] + ['{"kind": "train", "step": 5, "train/lo']
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(lines))
    assert cut_back_jsonl(path, 3) == (3, 4, {"train": 2, "eval": 1})
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in keep)
    assert cut_back_jsonl(path, 3) == (3, 0, {"train": 2, "eval": 1})  # nothing left to cut: the file is not rewritten
    assert cut_back_jsonl(tmp_path / "missing.jsonl", 3) == (0, 0, {})
    # With the checkpoint's record counts the cut is by count, not by step: its step-3 checkpoint was saved before the
    # evaluation of step 3 (an epoch's last step), so that record goes, though its step is the checkpoint's.
    assert cut_back_jsonl(path, 3, {"train": 2}) == (2, 1, {"train": 2})
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in keep[:2])

    (tmp_path / "metrics_train.csv").write_text(
        "step,time,train/loss\r\n1,10.0,2.0\r\n3,11.0,1.5\r\n4,12.0,1.4\r\n5,13"
    )
    (tmp_path / "metrics_test.csv").write_text("step,time,test/top1\r\n3,14.0,0.4\r\n")
    sink = CsvSink(tmp_path, resumed_step=3)
    sink.scalars(4, {"train/loss": 1.3}, "train", now=15.0)
    with open(tmp_path / "metrics_train.csv", newline="") as f:
        assert [(r["step"], r["train/loss"]) for r in csv.DictReader(f)] == [("1", "2.0"), ("3", "1.5"), ("4", "1.3")]
    with open(tmp_path / "metrics_test.csv", newline="") as f:
        assert list(csv.DictReader(f)) == []


def test_tensorboard_shows_each_record_of_the_checkpoint_step_once_after_a_resume(tmp_path):
    """A step checkpoint at an epoch's last step (3), then that epoch's row and evaluation logged at the same step,
    then a crash before the epoch's own checkpoint: the resumed run logs the row and evaluation of step 3 again.
    Before: purge_step = 4 kept the first file's step-3 events, and TensorBoard's reader showed the epoch's loss and
    the evaluation's top-1 at step 3 twice; hiding step 3 wholesale would lose the training loss logged before the
    checkpoint, which the resumed run does not log again. Read with TensorBoard's own reader."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torchsprint.observe.logging import RunLogger

    cfg = config.load(None, ["log.tensorboard=true"]).log
    first = RunLogger(tmp_path, cfg, console=False)
    for step in (1, 2, 3):
        first.scalars(step, {"train/loss": 3.0 - step / 2}, "train")
    counts = dict(first.counts)  # what the step-3 checkpoint saves (train: 3)
    first.scalars(3, {"epoch/loss": 2.0}, "epoch")
    first.scalars(3, {"val/top1": 0.5}, "eval")
    first.tb.flush()  # the crash: the files stay as written, nothing closes them
    time.sleep(1.1)  # the event file's name holds the second: the resumed run's sorts after it

    second = RunLogger(None, cfg, console=False)
    second.open_files(tmp_path, resumed_step=3, resumed_counts=counts)
    second.scalars(3, {"epoch/loss": 2.1}, "epoch")
    second.scalars(3, {"val/top1": 0.6}, "eval")
    second.scalars(4, {"train/loss": 1.2}, "train")
    second.close(finished=True)

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    seen = {
        tag: ([e.step for e in tb.Scalars(tag)], [e.value for e in tb.Scalars(tag)])
        for tag in ("train/loss", "epoch/loss", "val/top1")
    }
    assert seen["train/loss"][0] == [1, 2, 3, 4] and seen["train/loss"][1] == pytest.approx([2.5, 2.0, 1.5, 1.2])
    assert seen["epoch/loss"][0] == [3] and seen["epoch/loss"][1] == pytest.approx([2.1])  # float32 in the file
    assert seen["val/top1"][0] == [3] and seen["val/top1"][1] == pytest.approx([0.6])
    assert [json.loads(x)["kind"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ["train"] * 3 + [
        "epoch",
        "eval",
        "train",
    ]


def test_a_step_checkpoint_before_anything_was_logged_still_cuts_the_epoch_row_logged_after_it(tmp_path):
    """kill -9 between an epoch's row and its own checkpoint, where the step checkpoint at that epoch's last step came
    before any record (checkpoint.every_steps=2 on the default run: the first train record is at step 50, the first
    epoch ends at 22). The checkpoint's record count is then {} and must be kept as a count. Before, `{}` was left out
    of the checkpoint as if unknown, the resume cut by step, kept the epoch row and evaluation of step 22, logged
    them again, and metrics.jsonl held both twice. The real RunLogger and Saver (flush_logs=logger.flush)."""
    import torch
    from torch import nn

    from torchsprint.observe.logging import RunLogger
    from torchsprint.runtime.core import Runtime
    from torchsprint.state.checkpoint import Saver, TrainState, data_geometry
    from torchsprint.state.precision import Precision

    cfg = config.load(None, ["log.tensorboard=false", "checkpoint.every_steps=2"])
    rt = Runtime(device=torch.device("cpu"))
    first = RunLogger(None, cfg.log, console=False)
    first.open_files(tmp_path)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    saver = Saver(
        tmp_path,
        cfg.checkpoint,
        rt,
        {"classes": ["a", "b"]},
        geometry=data_geometry(cfg, 1),
        log=lambda m: None,
        flush_logs=first.flush,
    )
    saver.save(
        TrainState(epoch=0, step_in_epoch=22, global_step=22),
        model,
        opt,
        sched,
        Precision("fp32", rt.device),
        metric=None,
    )
    first.scalars(22, {"train/epoch_loss": 1.0}, "epoch")
    first.scalars(22, {"val/top1": 0.5}, "eval")
    first.flush()  # the crash: the records are on disk, the epoch's own checkpoint never written

    ckpt = torch.load(sorted((tmp_path / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=False)
    assert ckpt["log_records"] == {}
    second = RunLogger(None, cfg.log, console=False)
    second.open_files(tmp_path, resumed_step=22, resumed_counts=ckpt.get("log_records"))
    second.scalars(22, {"train/epoch_loss": 1.1}, "epoch")  # the resumed run ends the epoch again
    second.scalars(22, {"val/top1": 0.6}, "eval")
    second.close(finished=True)
    assert [(r["kind"], r["step"]) for r in jsonl(tmp_path)] == [("epoch", 22), ("eval", 22)]
    assert jsonl(tmp_path)[0]["train/epoch_loss"] == 1.1

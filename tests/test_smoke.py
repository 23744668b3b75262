"""The default run end to end: digits + small CNN reaches the promised accuracy on CPU."""

import json

from torchsprint import config
from torchsprint.run import train


def test_default_run_reaches_98_percent(tmp_path):
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "log.tensorboard=true"])
    summary = train(cfg, quiet=True)
    assert summary["final"]["val/top1"] >= 0.98
    run = tmp_path / "run"
    for name in ("config.yaml", "env.json", "metrics.jsonl", "summary.json", "best.safetensors", "last.safetensors",
                 "confusion_matrix.csv", "confusion_matrix.png"):
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "eval", "epoch"} <= {x["kind"] for x in lines}
    env = json.loads((run / "env.json").read_text())
    assert env["seed"] == 0 and env["torch"]

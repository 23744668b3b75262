"""The default run end to end: digits + small CNN reaches the promised accuracy on CPU."""

import json

from torchsprint import config
from torchsprint.train.run import train


def test_default_run_reaches_98_percent(tmp_path):
    cfg = config.load(None, [f"run.dir={tmp_path / 'run'}", "log.tensorboard=true"])
    summary = train(cfg, quiet=True)
    assert summary["final"]["val/top1"] >= 0.98
    run = tmp_path / "run"
    for name in (
        "config.yaml",
        "env.json",
        "metrics.jsonl",
        "summary.json",
        "best.safetensors",
        "last.safetensors",
        "confusion_matrix.csv",
        "confusion_matrix.png",
    ):
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.out.tfevents.*"))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "eval", "epoch"} <= {x["kind"] for x in lines}
    env = json.loads((run / "env.json").read_text())
    assert env["seed"] == 0 and env["torch"]


def test_import_sets_the_deterministic_cublas_workspace_unless_the_user_did():
    """PyTorch reads CUBLAS_WORKSPACE_CONFIG once, at a process's first cuBLAS call, so torchsprint sets it when
    imported, not when a deterministic run starts (tests/e2e/gpu/test_gpu.py has the CUDA consequence); a user's own
    value stays."""
    import os
    import subprocess
    import sys

    probe = "import os, torchsprint; print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'))"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}

    def seen(e):
        return subprocess.run(
            [sys.executable, "-c", probe], env=e, capture_output=True, text=True, timeout=120
        ).stdout.strip()

    assert seen(env) == ":4096:8"
    assert seen(env | {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == ":16:8"

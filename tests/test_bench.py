"""`torchsprint bench` on the digits default: every output file, the right columns, honest skips, true ratios."""

import csv
import json

import pytest

from torchsprint.bench import COLUMNS, best_combination


def test_bench_cli_writes_every_output(run_cli, tmp_path):
    r = run_cli("bench", "--steps", "8", "--warmup", "2", "--repeats", "2", "--out", "b",
                "--variants", "+ tuned cpu loader,+ memory loader,+ gpu loader,+ amp_bf16,+ ddp x2,your config",
                "data.num_workers=0", "model.args={width: 8}", timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "b"
    for name in ("bench.md", "bench.csv", "bench.json", "bench.png"):
        assert (out / name).is_file(), name
    rows = json.loads((out / "bench.json").read_text())["rows"]
    with open(out / "bench.csv") as f:
        assert csv.DictReader(f).fieldnames == COLUMNS
    by = {row["variant"]: row for row in rows}
    base = by["baseline (seeds)"]
    assert base["status"] == "ok" and base["speedup"] == pytest.approx(1.0)
    gpu = by["+ gpu loader"]
    assert gpu["status"] == "skipped" and "GPU" in gpu["reason"]
    for name in ("+ tuned cpu loader", "+ memory loader", "+ amp_bf16", "your config"):
        row = by[name]
        assert row["status"] == "ok", row
        # the speedup column is the ratio of the measured throughputs
        assert row["speedup"] == pytest.approx(row["images_per_s"] / base["images_per_s"], rel=1e-9)
        assert row["bottleneck"] in ("input-bound", "compute-bound")
        assert row["images_per_s_min"] <= row["images_per_s"] <= row["images_per_s_max"]
    assert "+ ddp x2" in by and by["+ ddp x2"]["status"] in ("ok", "skipped")
    meta = json.loads((out / "bench.json").read_text())["meta"]
    assert meta["device"] and meta["torch"] and meta["repeats"] == 2
    assert "skipped:" in (out / "bench.md").read_text()


def test_best_combination_picks_fastest_backend_and_winning_switches():
    rows = [
        {"variant": "baseline (seeds)", "status": "ok", "overrides": [], "speedup": 1.0},
        {"variant": "+ tuned cpu loader", "status": "ok", "overrides": ["data.decoder=auto"], "speedup": 1.5},
        {"variant": "+ memory loader", "status": "ok", "overrides": ["data.backend=memory"], "speedup": 3.0},
        {"variant": "+ channels_last", "status": "ok", "overrides": ["speed.channels_last=true"], "speedup": 0.9},
        {"variant": "+ amp_bf16", "status": "ok", "overrides": ["precision.mode=amp_bf16"], "speedup": 1.2},
        {"variant": "+ amp_fp16", "status": "ok", "overrides": ["precision.mode=amp_fp16"], "speedup": 1.4},
        {"variant": "+ compile", "status": "skipped", "overrides": ["speed.compile=true"], "speedup": None},
    ]
    assert best_combination(rows) == ["data.backend=memory", "precision.mode=amp_fp16"]

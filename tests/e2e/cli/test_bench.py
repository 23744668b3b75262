"""`torchsprint bench` on the digits default: every output file, the right columns, honest skips, true ratios."""

import csv
import json
import os
import statistics

import pytest

from torchsprint.commands.bench.main import slug
from torchsprint.commands.bench.report import COLUMNS, INPUT_BOUND, best_combination, summarize
from torchsprint.commands.bench.variants import Variant


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
def test_bench_cli_writes_every_output(cli_in_process, tmp_path):
    """The bench command through cli.main in this process (a `python -m torchsprint` costs ~3 s of imports); the
    variants still run in processes of their own, as bench always measures them (isolate)."""
    r = cli_in_process(
        "bench",
        "--steps",
        "8",
        "--warmup",
        "2",
        "--repeats",
        "2",
        "--out",
        "b",
        "--variants",
        "+ tuned cpu loader,+ memory loader,+ gpu loader,+ amp_bf16,+ ddp x2,your config",
        "data.num_workers=0",
        "model.args={width: 8}",
    )
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
    raw_base = json.loads((out / "variants" / ".baseline__seeds.json").read_text())
    for name in ("+ tuned cpu loader", "+ memory loader", "+ amp_bf16", "your config"):
        row = by[name]
        assert row["status"] == "ok", row
        # The table is the summary of what each variant's own process measured (its per-repeat results
        # file): median, min, max, the median data-wait share's label, and the ratio of medians.
        raw = json.loads((out / "variants" / f".{slug(name)}.json").read_text())
        assert len(raw) == 2  # --repeats 2
        ips = [r["images_per_s"] for r in raw]
        assert (row["images_per_s"], row["images_per_s_min"], row["images_per_s_max"]) == (
            statistics.median(ips),
            min(ips),
            max(ips),
        )
        assert row["speedup"] == statistics.median(ips) / statistics.median(r["images_per_s"] for r in raw_base)
        share = statistics.median(r["data_wait_share"] for r in raw)
        assert row["bottleneck"] == ("input-bound" if share > INPUT_BOUND else "compute-bound")
        for r in raw:  # images/s and step time measure the same steps: their product is the batch (64 images)
            assert r["images_per_s"] * r["step_ms"] / 1000 == pytest.approx(64, rel=1e-9)
            assert 0 <= r["data_wait_share"] < 1
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


def test_best_combination_captures_the_model_one_way_only():
    """torch.compile and a CUDA graph of the step are refused together (parallel.check_speed): the faster
    one goes in, whichever it is."""

    def rows(compile_speedup, graphs_speedup):
        return [
            {"variant": "baseline (seeds)", "status": "ok", "overrides": [], "speedup": 1.0},
            {"variant": "+ compile", "status": "ok", "overrides": ["speed.compile=true"], "speedup": compile_speedup},
            {
                "variant": "+ cuda graphs",
                "status": "ok",
                "overrides": ["speed.cuda_graphs=true"],
                "speedup": graphs_speedup,
            },
            {"variant": "+ amp_bf16", "status": "ok", "overrides": ["precision.mode=amp_bf16"], "speedup": 1.5},
        ]

    assert best_combination(rows(1.3, 1.6)) == ["speed.cuda_graphs=true", "precision.mode=amp_bf16"]
    assert best_combination(rows(1.7, 1.6)) == ["speed.compile=true", "precision.mode=amp_bf16"]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_crashing_variant_says_why_in_its_row(tmp_path, monkeypatch):
    """A variant's process that crashes (not a usage error) is a skipped row whose reason holds the exception's
    last line: the log beside it may not travel with bench.json (the GPU job keeps only the JSON)."""
    from torchsprint.commands.bench.measure import measure_variant

    (tmp_path / "boom_model.py").write_text(
        "from torch import nn\nfrom torchsprint.models.core import MODELS\n\n"
        "@MODELS.register('boom')\ndef boom(num_classes, in_channels=3):\n"
        "    class Boom(nn.Linear):\n"
        "        def forward(self, x):\n"
        "            raise RuntimeError('boom in forward')\n"
        "    return Boom(1, num_classes)\n"
    )
    cfg = tmp_path / "v.yaml"
    cfg.write_text("imports: [boom_model]\nmodel: {name: boom}\nlog: {tensorboard: false}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(RuntimeError, match=r"exit code 1: RuntimeError: boom in forward \(full log: "):
        measure_variant(cfg, steps=1, warmup=0, repeats=1, processes=1, out=tmp_path / ".v.json")


def test_bench_json_keeps_the_variants_measured_before_a_stop(tmp_path, monkeypatch):
    """bench.json is rewritten after every variant: a bench stopped midway (the GPU job's time limit kills it)
    still holds the rows it measured."""
    import torchsprint.commands.bench.main as bench_mod

    real = bench_mod.measure
    calls = []

    def measure_then_stop(cfg, steps, warmup):
        calls.append(cfg.speed.channels_last)
        if len(calls) > 1:
            raise KeyboardInterrupt  # the second variant: stopped from outside
        return real(cfg, steps, warmup)

    monkeypatch.setattr(bench_mod, "measure", measure_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bench_mod.bench(
            None, [], steps=2, warmup=1, repeats=1, only=["+ channels_last"], out=tmp_path / "b", isolate=False
        )
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert saved["meta"]["partial"] is True
    assert [r["variant"] for r in saved["rows"]] == ["baseline (seeds)"] and saved["rows"][0]["images_per_s"] > 0


def test_summarize_reports_median_min_max_ratio_and_bottleneck():
    """Known per-repeat figures, chosen so median != mean and the two wait shares fall either side of the
    input-bound threshold: each column must be the statistic it claims."""

    def results(ips, shares):
        return [
            {"images_per_s": i, "step_ms": 1000 * 128 / i, "data_wait_share": s, "peak_mem_mb": None}
            for i, s in zip(ips, shares)
        ]

    lo, hi = INPUT_BOUND - 0.05, INPUT_BOUND + 0.05
    v = Variant("+ memory loader", ["data.backend=memory"], "memory", results=results([100, 110, 400], [hi, lo, lo]))
    row = summarize(v, baseline_ips=55.0)
    assert (row["images_per_s"], row["images_per_s_min"], row["images_per_s_max"]) == (110, 100, 400)  # mean: 203
    assert row["speedup"] == 2.0 and row["step_ms"] == 1000 * 128 / 110
    assert row["data_wait_share"] == lo and row["bottleneck"] == "compute-bound"
    v = Variant("baseline (seeds)", [], "seeds", results=results([50, 60, 55], [hi, hi, lo]))
    row = summarize(v, baseline_ips=None)
    assert row["bottleneck"] == "input-bound" and row["speedup"] is None and row["images_per_s"] == 55
    assert summarize(Variant("+ gpu loader", [], "gpu", skip="needs a GPU"), 55.0)["status"] == "skipped"

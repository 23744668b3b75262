"""`export --benchmark`: every format and precision side by side. References: each file's own evaluation
(eval_export.evaluate_file; the run's evaluate_run for torch fp32), a stub clock (int8_gate.timed) that decides
which format is fastest, and the files read back."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from conftest import train_digits_fp32
from torchsprint.commands import export_bench, int8_gate
from torchsprint.commands.eval_export import evaluate_file
from torchsprint.train.evaluation import evaluate_run

SLOW, FAST = 0.01, 0.001  # the stub clock's seconds per call


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default digits run (8x8 grey images, small CNN), 2 epochs, fp32 (so eval and export agree on any CPU)."""
    return train_digits_fp32(tmp_path_factory.mktemp("bench"))


def stub_clock(mp, fastest: str) -> list[str]:
    """int8_gate.timed replaced: `fastest` takes FAST seconds a call, every other label SLOW; the int8 gate's own
    labels (fp32, int8) as onnx-fp32 and onnx-int8. Each run still runs (a broken model fails). Returns the
    labels asked, in order."""
    asked = []
    fastest = {"onnx-int8": ("onnx-int8", "int8"), "onnx-fp32": ("onnx-fp32", "fp32")}.get(fastest, (fastest,))

    def timed(label, run):
        asked.append(label)
        run()
        return FAST if label in fastest else SLOW

    mp.setattr(int8_gate, "timed", timed)
    return asked


def bench(run, out, fastest: str, bf16: bool):
    with pytest.MonkeyPatch.context() as mp:
        asked = stub_clock(mp, fastest)
        mp.setattr("torchsprint.runtime.machine.native_bf16", lambda flags=None: bf16)
        return export_bench.export_benchmark(run, out=out), asked


@pytest.fixture(scope="module")
def report(digits_run, tmp_path_factory):
    """A benchmark with bf16 measured (whatever this CPU has) and onnx-int8 made the fastest by the clock."""
    return bench(digits_run, tmp_path_factory.mktemp("out") / "bench", "onnx-int8", bf16=True)


def test_every_rows_top1_is_its_files_own_evaluation(digits_run, report):
    """Bug caught: a row's accuracy taken from another file or precision (e.g. the int8 row showing the fp32
    graph's, bf16 evaluated in fp32), metrics re-implemented, or another split. The references: evaluate_file of
    each file (bf16: the same file with precision.mode=amp_bf16) and the run's own evaluate_run for torch fp32."""
    rows = {r["label"]: r for r in report[0]["rows"]}
    assert set(rows) == set(export_bench.ROWS) and all(r["status"] == "ok" for r in rows.values())
    ref = evaluate_run(digits_run)
    assert rows["torch-fp32"]["top1"] == ref["top1"] and rows["torch-fp32"]["balanced_acc"] == ref["balanced_acc"]
    for label, row in rows.items():
        overrides = ["precision.mode=amp_bf16"] if label == "torch-bf16" else []
        got = evaluate_file(row["file"], overrides=overrides)
        assert (row["top1"], row["balanced_acc"]) == (got["top1"], got["balanced_acc"]), label
        assert row["bytes"] > 0
    assert rows["onnx-int8"]["note"].startswith("int8 gate passed")  # the stub makes int8 faster than fp32


def test_the_stub_clocks_fastest_is_recommended_and_timing_is_interleaved(report):
    """Bug caught: the recommendation not from the measured serving-batch speed (e.g. batch 1, or a fixed
    preference), the clock bypassed (a second timer the tests cannot stub), or the formats timed one after the
    other instead of interleaved."""
    r, asked = report
    assert r["recommendation"]["label"] == "onnx-int8"
    rows = {row["label"]: row for row in r["rows"]}
    assert rows["onnx-int8"]["img_s_serve"] == pytest.approx(r["serve_batch"] / FAST)
    assert rows["onnx-fp32"]["img_s_serve"] == pytest.approx(r["serve_batch"] / SLOW)
    assert rows["onnx-int8"]["p50_ms"] == pytest.approx(1000 * FAST) and rows["torch-fp32"]["p99_ms"] == pytest.approx(
        1000 * SLOW
    )
    labels = list(export_bench.ROWS)
    ours = [a for a in asked if a in labels]
    assert len(ours) == len(labels) * (export_bench.LATENCY_ROUNDS + int8_gate.ROUNDS)
    n = len(labels)
    rounds = [ours[i : i + n] for i in range(0, len(ours), n)]
    assert all(sorted(rd) == sorted(labels) for rd in rounds)  # every format in every round
    assert rounds[0] == rounds[1][::-1]  # alternating order


def test_a_format_more_than_a_point_below_torch_fp32_is_never_recommended():
    """Bug caught: the fastest row recommended whatever its accuracy, or the 1-point rule measured against the
    wrong reference (the best row instead of torch fp32), or an exact 1-point drop refused."""

    def row(label, top1, speed):
        return {"label": label, "status": "ok", "top1": top1, "img_s_serve": speed}

    rows = [
        row("torch-fp32", 0.90, 100),
        row("onnx-int8", 0.8899, 900),
        row("onnx-fp32", 0.89, 200),
        row("torchscript-fp32", 0.95, 150),
        {"label": "torch-bf16", "status": "skipped"},
    ]
    rec = export_bench.recommend(rows, 32)
    assert rec["label"] == "onnx-fp32" and "onnx-int8" in rec["why"]


def test_bf16_skipped_with_why_and_another_fastest(digits_run, tmp_path):
    """Bug caught: a bf16 row measured on a CPU without native bf16 (or silently missing), or the recommendation
    stuck on one format whatever the clock says."""
    r, _ = bench(digits_run, tmp_path / "b", "torchscript-fp32", bf16=False)
    rows = {row["label"]: row for row in r["rows"]}
    assert rows["torch-bf16"]["status"] == "skipped" and "no native bf16" in rows["torch-bf16"]["note"]
    assert r["recommendation"]["label"] == "torchscript-fp32"


def test_files_are_written_and_the_csv_rows_are_the_jsons(report):
    """Bug caught: a results file missing, or the CSV written from other figures than the JSON (rounded,
    reordered, a row dropped)."""
    out = Path(report[0]["out"])
    for name in export_bench.RESULTS:
        assert (out / name).stat().st_size > 0, name
    assert (out / "export_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "export_bench.json").read_text())
    with open(out / "export_bench.csv", newline="") as f:
        got = list(csv.DictReader(f))
    want = [{k: "" if row.get(k) is None else str(row[k]) for k in export_bench.COLUMNS} for row in saved["rows"]]
    assert got == want
    md = (out / "export_bench.md").read_text()
    assert export_bench.table(saved["rows"], saved["serve_batch"]) in md and saved["recommendation"]["label"] in md


@pytest.mark.parametrize(
    "args, says",
    [
        (["--benchmark", "--int8"], "--benchmark with --int8"),
        (["--benchmark", "--format", "onnx"], "--benchmark with --format"),
        (["--benchmark", "--out", "m.onnx"], "--benchmark with --out"),
        (["--benchmark", "--uint8-input"], "--benchmark with --uint8-input"),
    ],
)
def test_refusals_are_one_line(digits_run, cli_in_process, args, says):
    """Bug caught: --benchmark silently ignoring a flag that asks for one file (--int8, --format, --out)."""
    r = cli_in_process("export", "-r", digits_run, *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_earlier_results_are_kept_without_overwrite(digits_run, cli_in_process, tmp_path):
    """Bug caught: a second benchmark into the same folder replacing the first's results without --overwrite
    (or refusing only after the exports ran: the model files there changed)."""
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "export_bench.json").write_text("{}")
    r = cli_in_process("export", "-r", digits_run, "--benchmark", out)
    assert r.returncode == 2 and "already exists; add --overwrite" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and sorted(p.name for p in out.iterdir()) == ["export_bench.json"]
    assert export_bench.check_out(out, overwrite=True) == out

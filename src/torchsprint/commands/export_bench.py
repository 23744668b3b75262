"""`torchsprint export --benchmark`: every export format and precision that runs on this machine, side by side on
the run's validation split: file size, top-1 and balanced accuracy (commands/eval_export.py's evaluation, one
pass over the split for all of them), images/s at batch 1 and at the serving batch (serve.max_batch), and the
p50/p99 latency of one image.

The rows: torch fp32 (the run's own weights and model code, through its evaluation: the .safetensors export),
torch bf16 (autocast; only where the CPU computes bf16 natively, runtime/machine.native_bf16, else a row saying
why not), ONNX fp32, ONNX int8 (commands/quantize.py's export_int8 with force: the row exists when its gate
refuses, and says whether it passed) and TorchScript.

The speed is measured as commands/int8_gate.py measures it (interleaved_times: warm-ups, then the formats in
alternating order in one process, medians), on its clock `timed`, which tests replace. The figures are this
machine's: a format's rank can differ on the one that serves it.

The recommendation: the fastest format at the serving batch among those whose top-1 is within 1 point
(int8_gate.MAX_DROP) of torch fp32's.
"""

from __future__ import annotations

import csv
import json
import statistics
import warnings
from pathlib import Path

import torch

from torchsprint.errors import UsageError

RESULTS = ("export_bench.json", "export_bench.csv", "export_bench.md", "export_bench.png")
# label -> (format, precision, the file it is measured from, beside the results)
ROWS = {
    "torch-fp32": ("torch", "fp32", "model.safetensors"),
    "torch-bf16": ("torch", "bf16", "model.safetensors"),
    "onnx-fp32": ("onnx", "fp32", "model.onnx"),
    "onnx-int8": ("onnx", "int8", "model-int8.onnx"),
    "torchscript-fp32": ("torchscript", "fp32", "model.pt"),
}
LATENCY_ROUNDS = 50  # timed single-image runs of each format (p99 of 50: close to the slowest)
COLUMNS = (
    "label",
    "format",
    "precision",
    "status",
    "bytes",
    "top1",
    "balanced_acc",
    "img_s_b1",
    "img_s_serve",
    "p50_ms",
    "p99_ms",
    "note",
)


def default_bench_out(run_dir) -> Path:
    return Path(run_dir) / "export" / "bench"


def check_out(out: Path, overwrite: bool) -> Path:
    """Before any work: the folder is writable and holds no earlier results (or models) unless `overwrite`."""
    from torchsprint.state.rundir import writable_file

    out = writable_file(out, "--benchmark", folder=True)
    for name in (*RESULTS, *{f for _, _, f in ROWS.values()}):
        writable_file(out / name, "--benchmark", overwrite=overwrite)
    return out


def write_files(run_dir, out: Path, weights: str, opset, tolerance: float, tta) -> tuple[dict, object]:
    """The export of each format into `out` (parity-checked by export; the int8 one forced). Returns (the int8
    export's result, its gate's check)."""
    from torchsprint.commands.export import export
    from torchsprint.commands.quantize import export_int8

    kw = dict(weights=weights, opset=opset, tolerance=tolerance, tta=tta, overwrite=True)
    with (
        warnings.catch_warnings()
    ):  # TorchScript's deprecation FutureWarnings (trace, save, load): it is one format here
        warnings.simplefilter("ignore", FutureWarning)
        export(run_dir, "torchscript", out=out / "model.pt", **kw)
    export(run_dir, "safetensors", out=out / "model.safetensors", **kw)
    export(run_dir, "onnx", out=out / "model.onnx", **kw)
    int8 = export_int8(run_dir, out=out / "model-int8.onnx", force=True, **kw)
    return int8, int8["check"]


def open_models(out: Path, bf16: bool) -> dict:
    """Each row's model (eval_export.Exported), the torch ones at their precision."""
    from torchsprint.commands.eval_export import open_exported

    models = {"torch-fp32": open_exported(out / "model.safetensors", ["precision.mode=fp32"])}
    if bf16:
        models["torch-bf16"] = open_exported(out / "model.safetensors", ["precision.mode=amp_bf16"])
    for label in ("onnx-fp32", "onnx-int8", "torchscript-fp32"):
        models[label] = open_exported(out / ROWS[label][2])
    return models


def runner(model, x: torch.Tensor):
    """One forward of `model` on `x` as its evaluation runs it (no grad, its autocast)."""

    def run():
        with torch.no_grad(), model.autocast():
            return model.forward(x)

    return run


def measure(models: dict, trained, batch: int) -> dict[str, dict]:
    """Images/s at batch 1 and at `batch`, p50/p99 latency (ms) at batch 1: every model in each interleaved session."""
    from torchsprint.commands import int8_gate

    one = int8_gate.speed_batch(trained, 1, uint8_input=False)
    many = int8_gate.speed_batch(trained, batch, uint8_input=False)
    t1 = int8_gate.interleaved_times({k: runner(m, one) for k, m in models.items()}, rounds=LATENCY_ROUNDS)
    tb = int8_gate.interleaved_times({k: runner(m, many) for k, m in models.items()})
    out = {}
    for label in models:
        ms = sorted(1000 * t for t in t1[label])
        out[label] = {
            "img_s_b1": 1 / max(statistics.median(t1[label]), 1e-12),
            "img_s_serve": batch / max(statistics.median(tb[label]), 1e-12),
            "p50_ms": statistics.median(ms),
            "p99_ms": percentile(ms, 99),
        }
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation between the closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def make_rows(out: Path, metrics: dict, speed: dict, check, bf16_skip: str | None) -> list[dict]:
    rows = []
    for label, (fmt, precision, file) in ROWS.items():
        row = {"label": label, "format": fmt, "precision": precision}
        if label not in metrics:
            rows.append(row | {"status": "skipped", "note": bf16_skip})
            continue
        m = metrics[label]
        note = {
            "torch-fp32": "the run's weights through its evaluation",
            "torch-bf16": "autocast bf16",
            "onnx-fp32": "onnxruntime CPU",
            "torchscript-fp32": "traced",
            "onnx-int8": (
                "int8 gate passed"
                if check.passed
                else f"int8 gate FAILED ({'; '.join(check.refusals)}); written with force"
            ),
        }[label]
        rows.append(
            row
            | {
                "status": "ok",
                "file": str(out / file),
                "bytes": (out / file).stat().st_size,
                "top1": m["top1"],
                "balanced_acc": m.get("balanced_acc"),
                **speed[label],
                "note": note,
            }
        )
    return rows


def recommend(rows: list[dict], batch: int) -> dict:
    """The fastest row at the serving batch among those within int8_gate.MAX_DROP of torch fp32's top-1, and why."""
    from torchsprint.commands.int8_gate import MAX_DROP

    ok = [r for r in rows if r["status"] == "ok"]
    ref = next(r for r in ok if r["label"] == "torch-fp32")
    close = [r for r in ok if ref["top1"] - r["top1"] <= MAX_DROP + 1e-12]
    best = max(close, key=lambda r: r["img_s_serve"])
    left_out = [r["label"] for r in ok if r not in close]
    why = (
        f"{best['img_s_serve']:.0f} img/s at batch {batch}, {best['img_s_serve'] / ref['img_s_serve']:.2f}x torch "
        f"fp32, top-1 {best['top1']:.4f} ({100 * (best['top1'] - ref['top1']):+.2f} points vs torch fp32)"
    )
    if left_out:
        why += f"; not considered (top-1 more than {100 * MAX_DROP:g} point below torch fp32): {', '.join(left_out)}"
    return {"label": best["label"], "why": why}


def fmt_cell(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if key in ("top1", "balanced_acc"):
        return f"{v:.4f}"
    if key in ("img_s_b1", "img_s_serve"):
        return f"{v:.0f}"
    if key in ("p50_ms", "p99_ms"):
        return f"{v:.3f}"
    return str(v)


def table(rows: list[dict], batch: int) -> str:
    """The markdown table (also what is printed)."""
    heads = {"img_s_serve": f"img_s_b{batch}"}
    cols = [c for c in COLUMNS if c not in ("format", "precision")]
    lines = ["| " + " | ".join(heads.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt_cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def write_png(rows: list[dict], batch: int, path: Path) -> None:
    """A bar per measured row: images/s at the serving batch, its top-1 written above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([r["label"] for r in ok], [r["img_s_serve"] for r in ok], color="#4c72b0")
    for bar, r in zip(bars, ok):
        ax.annotate(
            f"top-1 {r['top1']:.4f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel(f"images/s at batch {batch}")
    ax.set_title("export formats on this machine (validation top-1 above each bar)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_results(out: Path, report: dict) -> None:
    rows, batch = report["rows"], report["serve_batch"]
    (out / "export_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    with open(out / "export_bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    rec = report["recommendation"]
    (out / "export_bench.md").write_text(
        f"# Export benchmark\n\n{table(rows, batch)}\n\nRecommended: **{rec['label']}**: {rec['why']}\n"
    )
    write_png(rows, batch, out / "export_bench.png")


def export_benchmark(
    run_dir, *, out=None, overwrite: bool = False, weights: str = "best", opset=None, tolerance: float = 1e-3, tta=None
) -> dict:
    """Export the run in every format and precision that runs here, evaluate and time them side by side, and
    write export_bench.{json,csv,md,png} into `out` (default <run>/export/bench/). Returns the report:
    {"rows", "serve_batch", "recommendation", "out", "machine"}."""
    from torchsprint.commands.eval_export import evaluate_exported
    from torchsprint.commands.trained import load_run
    from torchsprint.config.saved import naming_imports
    from torchsprint.runtime.machine import cpu_info, native_bf16

    out = check_out(Path(out) if out is not None else default_bench_out(run_dir), overwrite)
    trained = load_run(run_dir, weights)
    if trained.cfg.task != "classification":
        raise UsageError(
            f"export --benchmark: task={trained.cfg.task} is not benchmarked (its rows compare "
            "classification top-1 and the int8 export); export its formats one by one."
        )
    trained.cfg.eval.tta = tta or trained.cfg.eval.tta
    _, check = write_files(run_dir, out, weights, opset, tolerance, tta)
    bf16 = native_bf16()
    bf16_skip = (
        None
        if bf16
        else (
            "skipped: this CPU has no native bf16 (AVX-512 BF16 or AMX-BF16); bf16 autocast "
            "would convert to fp32 and back, slower than fp32"
        )
    )
    models = open_models(out, bf16)
    metrics = evaluate_exported(models, "val")
    batch = trained.cfg.serve.max_batch
    with naming_imports(trained.cfg.imports, run_dir):
        speed = measure(models, trained, batch)
    rows = make_rows(out, metrics, speed, check, bf16_skip)
    report = {
        "rows": rows,
        "serve_batch": batch,
        "recommendation": recommend(rows, batch),
        "out": str(out),
        "machine": cpu_info(),
        "split": "val",
        "count": metrics["torch-fp32"]["count"],
        "int8_check": check.as_dict(),
    }
    write_results(out, report)
    return report


def check_benchmark_flags(args) -> None:
    """Refuse flags --benchmark cannot honour, in one line, before the run is loaded."""
    for flag, given in (
        ("--int8", getattr(args, "int8", False)),
        ("--format", args.format is not None),
        ("--out", args.out is not None),
        ("--uint8-input", args.uint8_input),
    ):
        if given:
            where = (
                "give the folder as --benchmark DIR"
                if flag == "--out"
                else "it measures every format and precision itself"
            )
            raise UsageError(f"--benchmark with {flag}: {where}; leave {flag} out.")


def benchmark_cli(args) -> int:
    check_benchmark_flags(args)
    out = None if args.benchmark is True else args.benchmark
    r = export_benchmark(
        args.run,
        out=out,
        overwrite=args.overwrite,
        weights=args.weights,
        opset=args.opset,
        tolerance=args.tolerance,
        tta=getattr(args, "tta", None),
    )
    print(
        f"export benchmark of {args.run} on the {r['split']} split ({r['count']} images), this machine "
        f"({r['machine'].get('model', 'CPU')}):\n{table(r['rows'], r['serve_batch'])}\n"
        f"recommended: {r['recommendation']['label']}: {r['recommendation']['why']}\n"
        f"written: {Path(r['out']) / 'export_bench.json'} (.csv, .md, .png)"
    )
    return 0

"""`torchsprint bench`'s report: a variant's row (median, min-max, ratio, bottleneck), the best combination, and
the outputs: bench.json, bench.csv, bench.md, bench.png and the table on the terminal."""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import sys
from pathlib import Path

from torchsprint.commands.bench.variants import Variant

INPUT_BOUND = 0.20  # data-wait share above which a variant is input-bound (same threshold as the training log)


def summarize(v: Variant, baseline_ips: float | None) -> dict:
    if v.skip:
        return {"variant": v.name, "what": v.what, "status": "skipped", "reason": v.skip}
    ips = [r["images_per_s"] for r in v.results]
    med = statistics.median(ips)
    share = statistics.median(r["data_wait_share"] for r in v.results)
    mem = [r["peak_mem_mb"] for r in v.results if r.get("peak_mem_mb") is not None]
    tree = [r["peak_tree_mb"] for r in v.results if r.get("peak_tree_mb") is not None]
    row = {
        "variant": v.name,
        "what": v.what,
        "status": "ok",
        "images_per_s": med,
        "images_per_s_min": min(ips),
        "images_per_s_max": max(ips),
        "step_ms": statistics.median(r["step_ms"] for r in v.results),
        "data_wait_share": share,
        "peak_mem_mb": max(mem) if mem else None,
        "peak_tree_mb": max(tree) if tree else None,
        "bottleneck": "input-bound" if share > INPUT_BOUND else "compute-bound",
        "speedup": med / baseline_ips if baseline_ips else None,
        "overrides": v.overrides,
    }
    tta = [r["time_to_accuracy_s"] for r in v.results if "time_to_accuracy_s" in r]
    if tta:
        row["time_to_accuracy_s"] = tta[0]
    return row


COLUMNS = [
    "variant",
    "status",
    "images_per_s",
    "images_per_s_min",
    "images_per_s_max",
    "speedup",
    "step_ms",
    "data_wait_share",
    "bottleneck",
    "peak_tree_mb",
    "peak_mem_mb",
    "time_to_accuracy_s",
    "reason",
    "what",
]


def _mb(value) -> str:
    return f"{value:.0f}" if value is not None else "-"


def markdown_table(rows: list[dict], meta: dict) -> list[str]:
    """bench.md's lines: what ran where, then one row per variant (plain text, readable in any log)."""
    lines = [
        f"# torchsprint bench: {meta['config']}",
        "",
        f"device: {meta['device']}; torch {meta['torch']}; {meta['steps']} timed steps after {meta['warmup']} warm-up, "
        f"{meta['repeats']} repeats (median, min-max); {meta['date']}. Peak tree MB: resident memory of the "
        "variant's whole process tree (workers included); peak MB: CUDA memory allocated (GPU) or the main process.",
        "",
        "| variant | images/s | speedup | step ms | data wait | bottleneck | peak tree MB | peak MB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | - | - | - | - | - | - | - | skipped: {r.get('reason', '')} |")
            continue
        note = f"to-accuracy {r['time_to_accuracy_s']:.1f} s" if r.get("time_to_accuracy_s") is not None else ""
        if r["variant"] == "best combination":
            note = (note + "; " if note else "") + r.get("what", "")
        lines.append(
            f"| {r['variant']} | {r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}) | "
            f"{r['speedup']:.2f}x | {r['step_ms']:.2f} | {r['data_wait_share']:.0%} | {r['bottleneck']} | "
            f"{_mb(r.get('peak_tree_mb'))} | {_mb(r.get('peak_mem_mb'))} | {note} |"
        )
    return lines


def write_outputs(rows: list[dict], out: Path, meta: dict) -> None:
    """bench.json (everything), bench.csv, bench.md and bench.png (speedup over the baseline)."""
    from torchsprint.observe.logging import replace_file
    from torchsprint.observe.plots import save

    replace_file(out / "bench.json", json.dumps({"meta": meta, "rows": rows}, indent=1))  # each whole or not at all
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    replace_file(out / "bench.csv", f.getvalue())
    replace_file(out / "bench.md", "\n".join(markdown_table(rows, meta)) + "\n")
    save(bench_figure(rows, meta), out / "bench.png", dpi=110)


def bench_figure(rows: list[dict], meta: dict):
    """bench.png: each measured variant's speedup over the baseline, the machine and config named below."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchsprint.observe.plots import fit_text

    ok = [r for r in rows if r["status"] == "ok" and r.get("speedup")][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(ok) + 1.6))
    # a variant that combines several switches has a long name: wrapped, so the bars keep their width
    bars = ax.barh(
        [textwrap.fill(r["variant"], 40) for r in ok],
        [r["speedup"] for r in ok],
        color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in ok],
    )
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}x  ({r['images_per_s']:.0f}/s)" for r in ok], padding=3, fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, max([r["speedup"] for r in ok] + [1.0]) * 1.35)  # room for the labels
    ax.set_xlabel("speedup over the seeds' baseline (images/s ratio)")
    ax.set_title("torchsprint bench: training throughput by variant", fontsize=11)
    # The footnote (a config path can be long) wrapped to the canvas's width (~150 characters of 7 pt in 8 inches),
    # and room kept for its lines below the axes.
    note = textwrap.fill(f"{meta['device']}, torch {meta['torch']}, {meta['date']}; config: {meta['config']}", 150)
    fig.text(0.01, 0.005, note, fontsize=7, color="0.35", ha="left", va="bottom")
    fit_text(fig, rect=(0, min(0.3, (0.12 * (note.count(chr(10)) + 1) + 0.03) / fig.get_figheight()), 1, 1))
    return fig


def print_table(rows: list[dict], meta: dict | None = None) -> None:
    """A rich table on a terminal; the markdown table when stdout is a file or a pipe (a rich table there is
    cut to 80 columns and folds every cell)."""
    if not sys.stdout.isatty():
        print(
            "\n".join(
                markdown_table(
                    rows,
                    meta
                    or {"config": "", "device": "", "torch": "", "steps": "", "warmup": "", "repeats": "", "date": ""},
                )
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="torchsprint bench")
    for c in (
        "variant",
        "images/s (min-max)",
        "speedup",
        "step ms",
        "data wait",
        "bottleneck",
        "peak tree MB",
        "peak MB",
    ):
        t.add_column(c)
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["variant"], f"[dim]skipped: {r['reason']}[/]", "", "", "", "", "", "")
            continue
        t.add_row(
            r["variant"],
            f"{r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f})",
            f"{r['speedup']:.2f}x",
            f"{r['step_ms']:.2f}",
            f"{r['data_wait_share']:.0%}",
            r["bottleneck"],
            _mb(r.get("peak_tree_mb")),
            _mb(r.get("peak_mem_mb")),
        )
    Console(soft_wrap=True).print(t)


def keep_the_faster(combined: dict, rows: list[dict]) -> dict:
    """The best combination's row, unless one single change measured faster: then that change's own row,
    relabelled, with the combination's figure in its description. Switches that each help do not always
    add up (e.g. compile on top of a memory-bound loader); a "best" slower than a single change is not."""
    singles = [
        r
        for r in rows
        if r["status"] == "ok"
        and r.get("overrides")
        and r["variant"] != "baseline (seeds)"
        and not any(o.startswith("strategy.") for o in r["overrides"])
    ]
    if combined["status"] != "ok" or not singles:
        return combined
    fastest = max(singles, key=lambda r: r["images_per_s"])
    if combined["images_per_s"] >= fastest["images_per_s"]:
        return combined
    return fastest | {
        "variant": "best combination",
        "what": f"{fastest['variant'][2:]} alone: the measured combination "
        f"({combined['what']}) ran at {combined['images_per_s']:.0f} images/s, slower",
    }


def best_combination(rows: list[dict]) -> list[str]:
    """The fastest data backend plus every non-data switch that beat the baseline by more than 3%."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("overrides") and r["speedup"] is not None]
    data = [r for r in ok if any(o.startswith("data.") for o in r["overrides"])]
    other = [
        r
        for r in ok
        if r not in data and r["speedup"] > 1.03 and not any(o.startswith("strategy.") for o in r["overrides"])
    ]
    chosen = []
    if data:
        top = max(data, key=lambda r: r["speedup"])
        if top["speedup"] > 1.03:
            chosen += top["overrides"]
    precisions = [r for r in other if any(o.startswith("precision.") for o in r["overrides"])]
    # torch.compile and a CUDA graph both capture the model: refused together (parallel.check_speed)
    captures = [r for r in other if {"speed.compile=true", "speed.cuda_graphs=true"} & set(r["overrides"])]
    for r in other:
        if r in precisions and r is not max(precisions, key=lambda r: r["speedup"]):
            continue  # one precision mode only
        if r in captures and r is not max(captures, key=lambda r: r["speedup"]):
            continue  # one way of capturing the model only
        chosen += r["overrides"]
    return chosen


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"

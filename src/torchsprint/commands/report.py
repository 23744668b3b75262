"""`torchsprint report RUN`: a run folder -> one self-contained HTML page of what happened, and its plots as PNGs.

The page holds: the run's settings and results; loss, metric, learning-rate, throughput and data-wait
curves from metrics.jsonl; and, for classification, a fresh pass of the saved weights over the validation
set giving the confusion matrix, per-class precision/recall/F1 with class names, and the validation
images the model got wrong most confidently (shown as the model saw them, after the eval preprocessing).
Images are embedded (base64), so the page can be mailed or attached as one file.
"""

from __future__ import annotations

import base64
import heapq
import html
import json
import sys
import time
from pathlib import Path

import torch

from torchsprint.errors import UsageError
from torchsprint.observe.logging import replace_file


def read_records(run_dir: Path) -> tuple[list[dict], list[str]]:
    """The rows of <run>/metrics.jsonl and the notes on what was skipped.

    A last line without its newline that does not parse is a row cut off by a run killed while writing
    it: skipped, with a note naming it. Any other line that is not a JSON object (junk, a damaged file)
    is a UsageError naming the file and line.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl: not a torchsprint run folder, or it never trained a step.")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}.") from None
    lines = raw.split(b"\n")
    records, notes = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            if n == len(lines):  # no newline after it: the write was cut off
                notes.append(f"{path}: line {n} is cut off (the run stopped while writing it); skipped.")
                continue
            raise UsageError(
                f"{path}: line {n} is not a JSON row ({type(e).__name__}: {str(e)[:80]}); the file is "
                "damaged. Remove or repair that line."
            ) from None
        if not isinstance(row, dict):
            raise UsageError(
                f"{path}: line {n} is a JSON {type(row).__name__}, not a row of metrics; the file is "
                "damaged. Remove or repair that line."
            )
        records.append(row)
    return records, notes


def read_json_object(path: Path) -> dict:
    """A run's summary.json / env.json as a dict ({} when absent); a damaged one is a UsageError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
        raise UsageError(
            f"{path} is damaged ({type(e).__name__}: {str(e)[:80]}). Restore it, or delete it to report without it."
        ) from None
    if not isinstance(data, dict):
        raise UsageError(
            f"{path} is damaged (a JSON {type(data).__name__}, not an object). Restore it, or delete it "
            "to report without it."
        )
    return data


def series(records: list[dict], kind: str, key: str) -> tuple[list, list]:
    rows = [
        (r["step"], r[key])
        for r in records
        if r.get("kind") == kind and isinstance(r.get(key), int | float) and isinstance(r.get("step"), int | float)
    ]
    return [s for s, _ in rows], [v for _, v in rows]


def curve_panels(records: list[dict], monitor: str) -> list[dict]:
    """The four panels: loss, validation metrics, learning rate, throughput with the data-wait share."""
    val_keys = sorted(
        {
            k
            for r in records
            if r.get("kind") == "eval"
            for k, v in r.items()
            if k.startswith("val/") and k not in ("val/loss", "val/count") and isinstance(v, int | float)
        }
    )
    metric_series = [(k, *series(records, "eval", k), "o-") for k in val_keys]
    for key in ("train/epoch_top1",):
        if any(key in r for r in records):
            metric_series.append((key, *series(records, "epoch", key), "s--"))
    return [
        {
            "title": "loss",
            "ylabel": "loss",
            "series": [
                ("train (log steps)", *series(records, "train", "train/loss"), "-"),
                ("train (epoch mean)", *series(records, "epoch", "train/epoch_loss"), "s--"),
                ("validation", *series(records, "eval", "val/loss"), "o-"),
            ],
        },
        {"title": f"validation metrics (best by {monitor})", "ylabel": "value", "series": metric_series},
        {"title": "learning rate", "ylabel": "lr", "series": [("lr", *series(records, "train", "train/lr"), "-")]},
        {
            "title": "throughput per epoch",
            "ylabel": "images/s",
            "series": [("images/s", *series(records, "epoch", "train/epoch_images_per_s"), "o-")],
            "right": ("data-wait share", [("data wait", *series(records, "epoch", "train/data_wait_share"), "x:")]),
        },
    ]


def predictions(trained, wrong: int) -> dict:
    """One pass of the model over the validation set (the cpu backend's reference path): predicted and true
    classes, and the `wrong` most confident mistakes with the uint8 images the model saw. With the run's
    eval.tta, as its validation ran (the images shown are then the loaded ones the views come from)."""
    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.data.preprocess.normalize import DeviceNormalize
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import plan_tta, with_loading_spec, wrap_tta

    cfg = trained.cfg.model_copy(deep=True)
    cfg.data.backend, cfg.data.num_workers = "cpu", 0
    cfg.data.cpu_fraction, cfg.data.fallback = 0.0, None
    model = wrap_tta(trained.model, plan_tta(cfg.eval.tta, get_task(cfg.task), cfg.data.eval.transforms))
    loaders = build_loaders(
        with_loading_spec(cfg.data, cfg.eval.tta),
        runtime.Runtime(torch.device("cpu")),
        seed=cfg.run.seed,
        allowed=("cpu",),
    )
    norm = DeviceNormalize(loaders.info.mean, loaders.info.std, torch.device("cpu"))
    loaders.val.set_epoch(0)
    preds, targets, heap, n = [], [], [], 0
    with torch.inference_mode():
        for images, target, _skipped in loaders.val.loader:
            probs = torch.softmax(model(norm(images)).float(), dim=1)
            conf, pred = probs.max(dim=1)
            preds += pred.tolist()
            targets += target.tolist()
            for i in torch.nonzero(pred != target).flatten().tolist():
                item = (float(conf[i]), n + i, images[i].clone(), int(target[i]), int(pred[i]))
                (heapq.heappush if len(heap) < wrong else heapq.heappushpop)(heap, item)
            n += len(target)
    return {"preds": preds, "targets": targets, "wrong": sorted(heap, reverse=True)}


def per_class(preds: list[int], targets: list[int], classes: list[str]) -> tuple[list[list[int]], list[dict]]:
    k = len(classes)
    m = [[0] * k for _ in range(k)]
    for p, t in zip(preds, targets):
        m[t][p] += 1
    rows = []
    for c in range(k):
        tp, predicted, actual = m[c][c], sum(m[r][c] for r in range(k)), sum(m[c])
        prec = tp / predicted if predicted else 0.0
        rec = tp / actual if actual else 0.0
        rows.append(
            {
                "class": classes[c],
                "precision": prec,
                "recall": rec,
                "f1": 2 * prec * rec / (prec + rec) if prec + rec else 0.0,
                "support": actual,
            }
        )
    return m, rows


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }}
h1 {{ font-size: 1.5em; }} h2 {{ font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }} img {{ max-width: 100%; }} .note {{ color: #666; }}
</style></head>
<body data-report="torchsprint">
<h1>{title}</h1>
{body}
<p class="note">Written by torchsprint report on {date}. The same plots are PNG files beside this page.</p>
<script>
// Marks the page once every figure has decoded (read by tests/e2e/cli/test_report.py in a headless browser).
window.addEventListener("load", () => {{
  const imgs = Array.from(document.images);
  document.body.dataset.imagesDecoded = imgs.filter(i => i.complete && i.naturalWidth > 0).length + "/" + imgs.length;
}});
</script>
</body></html>
"""  # noqa: E501


def report(
    run_dir: str | Path, weights: str = "best", out: str | Path | None = None, wrong: int = 24, overwrite: bool = False
) -> Path:
    """Write <out>/report.html (default <run>/report/) and its PNGs; returns the HTML path.

    Args:
        run_dir: a run folder.
        weights: which saved weights the validation pass uses (best or last).
        out: the folder for report.html and the PNG files.
        wrong: how many confidently wrong validation images to show.
    """
    from torchsprint.commands.trained import load_run
    from torchsprint.config.saved import naming_imports
    from torchsprint.observe import plots
    from torchsprint.state.rundir import writable_file

    run_dir = Path(run_dir)
    # The default <run>/report is this command's own (a report is made again after more training); a folder given
    # with --out keeps an earlier report's files unless --overwrite. --out <run>: its confusion_matrix.png is the
    # run's own, refused either way.
    replace = overwrite or not out
    out = Path(out) if out else run_dir / "report"
    for target in (out, *(out / n for n in ("report.html", "curves.png", "confusion_matrix.png", "wrong.png"))):
        writable_file(target, "--out", folder=target == out, overwrite=replace)
    records, notes = read_records(run_dir)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    trained = load_run(run_dir, weights)
    cfg = trained.cfg
    summary, env = read_json_object(run_dir / "summary.json"), read_json_object(run_dir / "env.json")
    sections = [f'<p class="note">{html.escape(n)}</p>' for n in notes]
    final = summary.get("final") if isinstance(summary.get("final"), dict) else {}
    facts = [
        {"": k, "value": v}
        for k, v in (
            ("run folder", str(run_dir)),
            ("task", cfg.task),
            ("dataset", f"{cfg.data.dataset} {cfg.data.root or ''}"),
            (
                "classes",
                f"{len(trained.classes)}: "
                f"{', '.join(trained.classes[:12])}{' ...' if len(trained.classes) > 12 else ''}",
            ),
            ("model", f"{cfg.model.name} {cfg.model.args or ''}"),
            ("optimizer", f"{cfg.optim.name}, lr {cfg.optim.lr}"),
            ("precision", cfg.precision.mode),
            ("device", env.get("device", "?")),
            ("epochs", cfg.run.epochs),
            (
                "best " + cfg.checkpoint.monitor,
                f"{summary['best_metric']:.4f} (epoch {summary.get('best_epoch')})"
                if isinstance(summary.get("best_metric"), int | float)
                else "-",
            ),
            *(((k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in final.items())),
            (
                "train images/s",
                f"{summary['train_images_per_s']:.0f}"
                if isinstance(summary.get("train_images_per_s"), int | float)
                else "-",
            ),
        )
    ]
    sections.append("<h2>Run</h2>" + _table(facts, ["", "value"]))
    png = plots.curves(
        curve_panels(records, cfg.checkpoint.monitor), f"training curves: {run_dir.name}", out / "curves.png"
    )
    sections.append("<h2>Curves</h2>" + _img(png, "training curves"))
    if cfg.task == "classification":
        try:
            with naming_imports(cfg.imports, run_dir):  # the run's dataset may come from a module it lists
                pred = predictions(trained, wrong)
        except UsageError as e:
            sections.append(f'<h2>Validation pass</h2><p class="note">Not available: {html.escape(str(e))}</p>')
        else:
            from torchsprint.state.checkpoint import read_safetensors_metadata

            matrix, rows = per_class(pred["preds"], pred["targets"], trained.classes)
            saved = read_safetensors_metadata(trained.weights_path).get("epoch")
            which = f"{trained.weights_path.name}{f', epoch {saved}' if saved else ''}"  # the weights both describe
            png = plots.confusion(
                matrix,
                trained.classes,
                out / "confusion_matrix.png",
                title=f"Confusion matrix ({weights} weights: {which})",
            )
            note = f'<p class="note">The {html.escape(weights)} weights: {html.escape(which)}.</p>'
            sections.append(f"<h2>Confusion matrix</h2>{note}{_img(png, 'confusion matrix')}")
            sections.append(
                "<h2>Per class</h2>" + note + _table(rows, ["class", "precision", "recall", "f1", "support"])
            )
            if pred["wrong"]:
                cols = 6
                tiles = [
                    (img, f"true {trained.classes[t]}\npred {trained.classes[p]} ({c:.0%})")
                    for c, _, img, t, p in pred["wrong"]
                ]
                grid = [tiles[i : i + cols] for i in range(0, len(tiles), cols)]
                png = plots.tile_grid(
                    grid, f"The {len(tiles)} most confidently wrong validation images", path=out / "wrong.png"
                )
                sections.append(f"<h2>Most confidently wrong</h2>{_img(png, 'wrong predictions')}")
            else:
                sections.append(
                    '<h2>Most confidently wrong</h2><p class="note">No validation image was misclassified.</p>'
                )
    else:
        sections.append(
            f'<p class="note">task={cfg.task}: the validation-pass sections (confusion matrix, per-class '
            "table, wrong images) apply to classification.</p>"
        )
    page = PAGE.format(
        title=html.escape(f"torchsprint report: {run_dir.name}"),
        body="\n".join(sections),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
    replace_file(out / "report.html", page)  # whole or not at all
    return out / "report.html"


def report_cli(args) -> int:
    path = report(args.run, args.weights, args.out, args.wrong, overwrite=args.overwrite)
    print(f"wrote {path} (and its plots as PNG beside it)")
    return 0

"""Every figure torchsprint writes keeps its text inside its canvas. Each figure kind is rendered with the long names
real runs produce (a timestamped run folder and its weights in a title, long class names, a long config path), and
every drawn text's window extent (matplotlib's own, with the figure's renderer) must lie within the figure's box.
The figures are the ones the product saves: plots.py's (the run's confusion matrices, report's curves and wrong
images, data check's samples), lr-find's plot and bench's chart."""

from __future__ import annotations

import pytest
import torch

from torchsprint.commands.bench.report import bench_figure
from torchsprint.commands.lr_find import plot_figure
from torchsprint.observe import plots

RUN = "20261127-210539"


def texts_off_canvas(fig) -> list[str]:
    """Each drawn text of `fig` that is not wholly inside the canvas, with its extent. Drawn: visible, not empty, and
    not the label of a tick outside its axis's view (made, but not drawn: worked out here from the locator's
    positions and the view limits, independently of plots.drawn_texts)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = 1e-9 * max(abs(lo), abs(hi), 1.0)
            for locs, ticks in (
                (axis.get_majorticklocs(), axis.majorTicks),
                (axis.get_minorticklocs(), axis.minorTicks),
            ):
                for i, tick in enumerate(ticks):
                    if i >= len(locs) or not lo - slack <= locs[i] <= hi + slack:
                        hidden |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if id(t) in hidden or not t.get_visible() or not t.get_text().strip():
            continue
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 0.5 or e.y0 < box.y0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y1 > box.y1 + 0.5:
            out.append(
                f"{t.get_text()!r}: {e.x0:.0f}..{e.x1:.0f} x {e.y0:.0f}..{e.y1:.0f} in {box.width:.0f}x{box.height:.0f}"
            )
    return out


def tiles(n: int, caption) -> list[tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(n)
    return [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), caption(i)) for i in range(n)]


def matrix(n: int) -> list[list[int]]:
    return [[30 + 5 * i if i == j else (i + j) % 3 for j in range(n)] for i in range(n)]


FIGURES = {
    # metrics.write_confusion's title for a run's last weights (its run folder, the file, epoch and step): 4 classes
    # give a narrow canvas, and the title ran off both of its sides
    "confusion-4-classes": lambda: plots.confusion_figure(
        matrix(4),
        ["cat", "dog", "bird", "fish"],
        title=f"Confusion matrix: {RUN}, last.safetensors, epoch 10 (step 320)",
    ),
    "confusion-60-long-names": lambda: plots.confusion_figure(
        matrix(60),
        [f"a_rather_long_class_name_{i}" for i in range(60)],
        title="Confusion matrix (best weights: best.safetensors, epoch 12)",
    ),
    # one panel (a run without evaluations) and report's title, which names the run folder: it can be long
    "report-curves": lambda: plots.curves_figure(
        [
            {
                "title": "training loss at every step, with the learning rate on the right axis",
                "series": [("train/loss", [1, 2, 3], [1.0, 0.8, 0.6], "-")],
                "right": ("learning rate", [("train/lr", [1, 2, 3], [0.1, 0.05, 0.01], "--")]),
            }
        ],
        f"training curves: {RUN}-imagenet-subset-resnet50-channels-last-bf16-ema-swa-progressive-resizing",
    ),
    "report-wrong-images": lambda: plots.tile_grid_figure(
        [tiles(6, lambda i: f"true american_staffordshire_terrier_{i}\npred staffordshire_bullterrier ({90 + i}%)")]
        * 2,
        "The 12 most confidently wrong validation images",
    ),
    "data-check-samples": lambda: plots.tile_grid_figure(
        [tiles(4, lambda i: "train") + tiles(4, lambda i: "eval") for _ in range(3)],
        "image_folder: train preprocessing (left) and eval preprocessing (right), one row per class",
        row_labels=["an_uncommonly_long_class_folder_name", "Great Pyrenees mountain dog", "x"],
    ),
    "lr-find": lambda: plot_figure(
        {
            "lrs": [10 ** (-6 + k / 10) for k in range(61)],
            "losses": [2.3 - 0.02 * k if k < 50 else 3.0 for k in range(61)],
            "smoothed": [2.3 - 0.02 * k if k < 50 else 2.5 for k in range(61)],
            "suggestion_index": 30,
            "suggestion": 1e-3,
        }
    ),
    "bench": lambda: bench_figure(
        [
            {"status": "ok", "variant": v, "speedup": s, "images_per_s": 1000 * s}
            for v, s in (
                ("seeds' baseline", 1.0),
                ("data.backend=memory + speed.channels_last + precision.mode=bf16", 2.4),
                ("best combination", 3.1),
            )
        ],
        {
            "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0+cu130",
            "date": "2026-11-27",
            "config": "/home/someone/projects/a-long-project-name/configs/experiments/2026-11/resnet50-imagenet-"
            "subset-with-every-acceleration.yaml",
        },
    ),
}


@pytest.mark.parametrize("kind", list(FIGURES))
def test_every_text_of_every_figure_is_inside_its_canvas(kind):
    """Titles that name a run, its weights and its numbers were cut off at both sides of a small figure; long class
    names, captions and footnotes likewise. The figure writers now wrap, shrink or shorten them (plots.fit_text)."""
    import matplotlib.pyplot as plt

    fig = FIGURES[kind]()
    try:
        assert texts_off_canvas(fig) == []
        texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
        if kind == "confusion-4-classes":  # the whole title is there, wrapped, not shortened
            title = next(t for t in texts if t.startswith("Confusion matrix"))
            assert "\n" in title and " ".join(title.split()).startswith(
                f"Confusion matrix: {RUN}, last.safetensors, epoch 10 "
                f"(step 320) ({sum(map(sum, matrix(4)))} images, accuracy"
            )
    finally:
        plt.close(fig)

"""Pictures people read instead of numbers: labelled image grids, the confusion matrix, training curves.

Every function takes plain data (tensors, lists, dicts) and writes or returns a PNG, with matplotlib's
Agg backend (no display needed); each `*_figure` builds the figure the function of its name saves. Layout
choices are for reading: tiles of at least 128 px (small images upscaled with nearest-neighbour, so pixels
stay pixels), a title on every figure, class names on axes, and every text inside the canvas (fit_text).
"""

from __future__ import annotations

import io
from pathlib import Path

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path | None, dpi: int = 100) -> bytes:
    """Write the figure to `path` (if given, atomically) and return its PNG bytes; closes it."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    data = buf.getvalue()
    if path is not None:
        from torchsprint.observe.logging import replace_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        replace_file(Path(path), data)  # whole or not at all: a full disk left a 0-byte PNG
    return data


def drawn_texts(fig) -> list:
    """The texts a draw of `fig` shows: its visible, non-empty Text artists, less the labels of ticks outside their
    axis's view (matplotlib makes those, positioned off the axes, but does not draw them)."""
    from matplotlib.text import Text

    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            shown = set(axis._update_ticks())  # the ticks Axis.draw draws (what get_tightbbox measures too)
            hidden |= {
                id(lab)
                for tick in [*axis.majorTicks, *axis.minorTicks]
                if tick not in shown
                for lab in (tick.label1, tick.label2)
            }
    return [t for t in fig.findobj(Text) if id(t) not in hidden and t.get_visible() and t.get_text().strip()]


def outside(fig) -> list:
    """(text, its window extent) of every drawn text of `fig` that is not wholly inside the canvas (half a pixel of
    slack for rounding)."""
    fig.draw_without_rendering()  # tick labels get their text and place in a draw (nothing is rasterised here)
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    out = []
    for t in drawn_texts(fig):
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 0.5 or e.y0 < box.y0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y1 > box.y1 + 0.5:
            out.append((t, e))
    return out


def fit_text(fig, rect=(0, 0, 1, 1), tries: int = 10) -> None:
    """Lay `fig` out (tight_layout within `rect`, a share of the canvas) with every text inside the canvas: a text
    that runs off it is wrapped at its spaces to the width it has there, else made smaller (down to 6 pt), else
    shortened with '…'; then laid out again. A 4-class confusion matrix's title, which names the run and its
    weights, ran off both sides of its canvas
    ("rix: 20261127-210539, last.safetensors, epoch 10 (step 320) (525 in")."""
    import warnings

    for _ in range(tries):
        with (
            warnings.catch_warnings()
        ):  # "not compatible with tight_layout" for a crowded grid: the check below decides
            warnings.simplefilter("ignore")
            fig.tight_layout(rect=rect)
        off = outside(fig)
        if not off:
            return
        ticks = {
            id(lab): axis
            for ax in fig.axes
            for axis in (ax.xaxis, ax.yaxis)
            for tick in [*axis.majorTicks, *axis.minorTicks]
            for lab in (tick.label1, tick.label2)
        }
        for t, extent in off:
            if id(t) in ticks:  # the formatter rewrites a tick label at every draw: its axis's label size instead
                axis = ticks[id(t)]
                axis.set_tick_params(labelsize=max(5.0, t.get_fontsize() * 0.85))
            else:
                _bring_in(t, extent, fig.bbox)


def _bring_in(t, e, box) -> None:
    """One step of fit_text for the text `t` whose extent `e` leaves the canvas `box`."""
    import textwrap

    text, ha = t.get_text(), t.get_horizontalalignment()
    if t.get_rotation() % 180 == 0 and e.width > 0 and (e.x0 < box.x0 or e.x1 > box.x1) and " " in text.strip():
        mid = (e.x0 + e.x1) / 2
        room = {"left": box.x1 - e.x0, "right": e.x1 - box.x0}.get(ha, 2 * min(mid - box.x0, box.x1 - mid))
        longest = max(len(line) for line in text.split("\n"))
        width = max(6, int(longest * max(room, 1) / e.width * 0.95))  # characters per line that fit
        wrapped = "\n".join(textwrap.fill(line, width, break_long_words=False) for line in text.split("\n"))
        if wrapped != text:
            t.set_text(wrapped)
            return
    if t.get_fontsize() > 6:
        t.set_fontsize(max(6.0, t.get_fontsize() * 0.85))
    else:  # no smaller: shorter
        lines = text.split("\n")
        t.set_text("\n".join(line if len(line) < 4 else line[: max(2, int(len(line) * 0.8))] + "…" for line in lines))


def upscale(img: torch.Tensor, min_side: int = 128) -> torch.Tensor:
    """uint8 CHW -> HWC numpy, enlarged by an integer factor with nearest-neighbour until the shorter side
    reaches `min_side` (an 8x8 digit becomes 128x128 blocks, not a blur)."""
    c, h, w = img.shape
    k = max(1, -(-min_side // min(h, w)))
    x = img.repeat_interleave(k, dim=1).repeat_interleave(k, dim=2) if k > 1 else img
    x = x.permute(1, 2, 0).cpu().numpy()
    return x[..., 0] if c == 1 else x


def tile_grid(
    rows: list[list[tuple[torch.Tensor, str]]],
    title: str,
    row_labels: list[str] | None = None,
    path: Path | None = None,
    min_side: int = 128,
    col_labels: list[str] | None = None,
) -> bytes:
    """tile_grid_figure's PNG, written to `path` when given."""
    return save(tile_grid_figure(rows, title, row_labels, min_side, col_labels), path)


def tile_grid_figure(
    rows: list[list[tuple[torch.Tensor, str]]],
    title: str,
    row_labels: list[str] | None = None,
    min_side: int = 128,
    col_labels: list[str] | None = None,
):
    """A grid of labelled tiles: `rows[i][j] = (uint8 CHW image, caption)`. Empty cells stay blank.

    Args:
        rows: the tiles, row by row (rows may differ in length; None leaves a cell blank).
        title: the figure title.
        row_labels: a label left of each row (e.g. the class name).
        min_side: the shorter side of each tile in pixels after nearest-neighbour upscaling.
        col_labels: a label above each column (e.g. 'train' / 'eval').
    """
    import textwrap

    plt = _plt()
    n_rows, n_cols = len(rows), max((len(r) for r in rows), default=1)
    # A column as wide as its longest caption line (8 pt: ~0.07 in a character), 3 in at most, the captions wrapped
    # to it: long class names neither run into the next tile's caption nor off the canvas.
    lines = [ln for r in rows for cell in r if cell is not None for ln in str(cell[1]).split("\n")]
    col = min(max(min_side / 100, 0.07 * max(map(len, lines), default=0)), 3.0)
    rows = [
        [
            None
            if cell is None
            else (cell[0], "\n".join(textwrap.fill(ln, int(col / 0.07)) or ln for ln in str(cell[1]).split("\n")))
            for cell in r
        ]
        for r in rows
    ]
    caption_lines = max((cell[1].count("\n") + 1 for r in rows for cell in r if cell is not None), default=1)
    row_labels = [textwrap.fill(str(label), 20) for label in row_labels] if row_labels else row_labels
    width, height = col + 0.35, min_side / 100 + 0.15 * caption_lines + 0.2  # a tile and its caption at dpi 100
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(n_cols * width + (1.6 if row_labels else 0.2), n_rows * height + 0.8), squeeze=False
    )
    for i, row in enumerate(rows):
        for j in range(n_cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if j < len(row) and row[j] is not None:
                img, caption = row[j]
                arr = upscale(img, min_side)
                ax.imshow(arr, cmap="gray" if arr.ndim == 2 else None, vmin=0, vmax=255, interpolation="nearest")
                ax.set_xlabel(caption, fontsize=8)
            if j == 0 and row_labels:
                ax.set_ylabel(row_labels[i], fontsize=9, rotation=0, ha="right", va="center", labelpad=8)
            if i == 0 and col_labels and j < len(col_labels):
                ax.set_title(col_labels[j], fontsize=9)
    fig.suptitle(title, fontsize=11)
    fit_text(fig)
    return fig


def confusion(
    matrix: list[list[int]], classes: list[str], path: Path | None = None, title: str = "Confusion matrix"
) -> bytes:
    """confusion_figure's PNG, written to `path` when given."""
    return save(confusion_figure(matrix, classes, title), path)


def confusion_figure(matrix: list[list[int]], classes: list[str], title: str = "Confusion matrix"):
    """The confusion matrix, rows = true class, columns = predicted: shades are row-normalised (each true
    class's share, so a small class reads as clearly as a large one), cells show counts when there is room
    (up to 30 classes), class names on both axes (up to 100; smaller text as the count grows)."""
    import numpy as np

    plt = _plt()
    m = np.asarray(matrix, dtype=float)
    n = len(classes)
    share = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    side = min(max(4.0, 0.38 * n + 2.5), 24.0)
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    font = max(5.0, min(9.0, 220 / max(n, 1)))
    if n <= 100:
        names = [c if len(c) <= 18 else c[:17] + "…" for c in classes]
        ax.set_xticks(range(n), names, rotation=90, fontsize=font)
        ax.set_yticks(range(n), names, fontsize=font)
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(
                        j,
                        i,
                        f"{int(m[i, j])}",
                        ha="center",
                        va="center",
                        fontsize=font,
                        color="white" if share[i, j] > 0.5 else "black",
                    )
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    acc = np.trace(m) / max(m.sum(), 1)
    ax.set_title(f"{title} ({int(m.sum())} images, accuracy {acc:.1%})", fontsize=11 if n <= 30 else 14)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fit_text(fig)
    return fig


def curves(panels: list[dict], title: str, path: Path | None = None) -> bytes:
    """curves_figure's PNG, written to `path` when given."""
    return save(curves_figure(panels, title), path)


def curves_figure(panels: list[dict], title: str):
    """Line plots side by side. Each panel: {"title", "xlabel", "ylabel", "series": [(label, xs, ys, style)],
    optional "right": (ylabel, [(label, xs, ys, style)]) for a second y axis}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, p in zip(axes[0], panels):
        handles = []
        for label, xs, ys, style in p["series"]:
            if xs:
                handles += ax.plot(xs, ys, style, label=label, markersize=3)
        if p.get("right"):
            ax2 = ax.twinx()
            ax2.set_ylabel(p["right"][0])
            for label, xs, ys, style in p["right"][1]:
                if xs:
                    handles += ax2.plot(xs, ys, style, label=label, markersize=3)
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel(p.get("xlabel", "step"))
        ax.set_ylabel(p.get("ylabel", ""))
        ax.grid(alpha=0.3)
        if handles:
            ax.legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle(title, fontsize=11)
    fit_text(fig)
    return fig

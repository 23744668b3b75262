"""Pictures people read instead of numbers: labelled image grids, the confusion matrix, training curves.

Every function takes plain data (tensors, lists, dicts) and writes or returns a PNG, with matplotlib's
Agg backend (no display needed). Layout choices are for reading: tiles of at least 128 px (small images
upscaled with nearest-neighbour, so pixels stay pixels), a title on every figure, class names on axes.
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
    """Write the figure to `path` (if given) and return its PNG bytes; closes it."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    data = buf.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return data


def upscale(img: torch.Tensor, min_side: int = 128) -> torch.Tensor:
    """uint8 CHW -> HWC numpy, enlarged by an integer factor with nearest-neighbour until the shorter side
    reaches `min_side` (an 8x8 digit becomes 128x128 blocks, not a blur)."""
    c, h, w = img.shape
    k = max(1, -(-min_side // min(h, w)))
    x = img.repeat_interleave(k, dim=1).repeat_interleave(k, dim=2) if k > 1 else img
    x = x.permute(1, 2, 0).cpu().numpy()
    return x[..., 0] if c == 1 else x


def tile_grid(rows: list[list[tuple[torch.Tensor, str]]], title: str, row_labels: list[str] | None = None,
              path: Path | None = None, min_side: int = 128, col_labels: list[str] | None = None) -> bytes:
    """A grid of labelled tiles: `rows[i][j] = (uint8 CHW image, caption)`. Empty cells stay blank.

    Args:
        rows: the tiles, row by row (rows may differ in length; None leaves a cell blank).
        title: the figure title.
        row_labels: a label left of each row (e.g. the class name).
        path: where to write the PNG (also returned as bytes).
        min_side: the shorter side of each tile in pixels after nearest-neighbour upscaling.
        col_labels: a label above each column (e.g. 'train' / 'eval').
    """
    plt = _plt()
    n_rows, n_cols = len(rows), max((len(r) for r in rows), default=1)
    inch = min_side / 100 + 0.35  # tile plus its caption at dpi 100
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(n_cols * inch + (1.6 if row_labels else 0.2), n_rows * inch + 0.8),
                             squeeze=False)
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
    fig.tight_layout()
    return save(fig, path)


def confusion(matrix: list[list[int]], classes: list[str], path: Path | None = None, title: str = "Confusion matrix") -> bytes:
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
                    ax.text(j, i, f"{int(m[i, j])}", ha="center", va="center", fontsize=font,
                            color="white" if share[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    acc = np.trace(m) / max(m.sum(), 1)
    ax.set_title(f"{title} ({int(m.sum())} images, accuracy {acc:.1%})", fontsize=11 if n <= 30 else 14)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fig.tight_layout()
    return save(fig, path)


def curves(panels: list[dict], title: str, path: Path | None = None) -> bytes:
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
    fig.tight_layout()
    return save(fig, path)

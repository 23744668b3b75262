"""Metrics on torchmetrics, one class per task (classification, multilabel, restoration), and writers."""

from __future__ import annotations

import csv
from pathlib import Path

import torch


class ClassificationMetrics:
    """Accumulates on the device; `compute()` syncs across DDP ranks (torchmetrics) and returns floats.

    Args:
        num_classes: number of classes.
        topk: also report top-k accuracy when num_classes > k.
        per_class: also compute per-class precision/recall/F1 and the confusion matrix.
        device: where the metric states live.
    """

    def __init__(self, num_classes: int, topk: int, per_class: bool, device: torch.device):
        from torchmetrics import MetricCollection
        from torchmetrics.classification import (
            MulticlassAccuracy,
            MulticlassConfusionMatrix,
            MulticlassF1Score,
            MulticlassPrecision,
            MulticlassRecall,
        )

        m = {"top1": MulticlassAccuracy(num_classes, top_k=1, average="micro")}
        if num_classes > topk:
            m[f"top{topk}"] = MulticlassAccuracy(num_classes, top_k=topk, average="micro")
        if per_class:
            m["precision"] = MulticlassPrecision(num_classes, average=None)
            m["recall"] = MulticlassRecall(num_classes, average=None)
            m["f1"] = MulticlassF1Score(num_classes, average=None)
            m["confusion"] = MulticlassConfusionMatrix(num_classes)
        self.metrics = MetricCollection(m).to(device)
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)

    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        self.metrics.update(logits.float(), target)
        self.loss_sum += loss.double() * target.shape[0]
        self.count += target.shape[0]

    def compute(self) -> dict:
        """{'top1': float, 'loss': float, 'count': int, 'precision': [..], ..., 'confusion': [[..]]} over all ranks."""
        from torchsprint.parallel import all_reduce_sum

        out = {}
        for k, v in self.metrics.compute().items():  # note: a CPU-GPU sync point, once per evaluation
            out[k] = v.item() if v.ndim == 0 else v.cpu().tolist()
        loss_count = torch.stack([self.loss_sum, self.count.double()])
        all_reduce_sum(loss_count)
        out["loss"] = (loss_count[0] / loss_count[1].clamp(min=1)).item()
        out["count"] = int(loss_count[1].item())
        return out


def _compute(metrics, loss_sum: torch.Tensor, count: torch.Tensor) -> dict:
    """metrics.compute() as floats/lists plus the mean loss and sample count, all reduced over DDP ranks."""
    from torchsprint.parallel import all_reduce_sum

    out = {}
    for k, v in metrics.compute().items():  # note: a CPU-GPU sync point, once per evaluation
        out[k] = v.item() if v.ndim == 0 else v.cpu().tolist()
    loss_count = torch.stack([loss_sum, count.double()])
    all_reduce_sum(loss_count)
    out["loss"] = (loss_count[0] / loss_count[1].clamp(min=1)).item()
    out["count"] = int(loss_count[1].item())
    return out


class MultilabelMetrics:
    """task=multilabel: mean average precision over labels (threshold-free) and F1 at `threshold`.

    Returns mAP (macro mean of per-label AP), f1_macro, and per-label f1/precision/recall lists.
    Outputs are logits; a label counts as predicted when sigmoid(logit) >= threshold.
    """

    def __init__(self, num_labels: int, threshold: float, device: torch.device):
        from torchmetrics import MetricCollection
        from torchmetrics.classification import (
            MultilabelAveragePrecision,
            MultilabelF1Score,
            MultilabelPrecision,
            MultilabelRecall,
        )

        kw = dict(num_labels=num_labels, threshold=threshold)
        self.metrics = MetricCollection({
            "mAP": MultilabelAveragePrecision(num_labels, average="macro"),
            "f1_macro": MultilabelF1Score(average="macro", **kw),
            "f1": MultilabelF1Score(average=None, **kw),
            "precision": MultilabelPrecision(average=None, **kw),
            "recall": MultilabelRecall(average=None, **kw),
        }).to(device)
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)

    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        # torchmetrics applies the sigmoid itself when the inputs are outside [0, 1] (logits).
        self.metrics.update(logits.float(), target.int())
        self.loss_sum += loss.double() * target.shape[0]
        self.count += target.shape[0]

    def compute(self) -> dict:
        return _compute(self.metrics, self.loss_sum, self.count)


class RestorationMetrics:
    """task=image_to_image: PSNR (dB) and SSIM of outputs vs targets, both in [0, 1] units (pixels / 255).

    Outputs are clamped to [0, 1] first, as they are when written as pixels. PSNR is the mean of
    per-image PSNRs (the usual restoration convention), SSIM the mean over images (11x11 Gaussian window).
    """

    def __init__(self, device: torch.device):
        from torchmetrics import MetricCollection
        from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

        self.metrics = MetricCollection({
            "psnr": PeakSignalNoiseRatio(data_range=1.0, reduction="elementwise_mean", dim=(1, 2, 3)),
            "ssim": StructuralSimilarityIndexMeasure(data_range=1.0),
        }).to(device)
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)

    def update(self, output: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        self.metrics.update(output.float().clamp(0, 1), target.float())
        self.loss_sum += loss.double() * target.shape[0]
        self.count += target.shape[0]

    def compute(self) -> dict:
        return _compute(self.metrics, self.loss_sum, self.count)


def weights_text(weights: dict | None) -> str:
    """Which weights a file describes, in words: 'best.safetensors, epoch 6 (step 60)'."""
    if not weights:
        return ""
    return f"{weights['file']}, epoch {weights['epoch']} (step {weights['step']})"


def write_confusion(path_stem: Path, confusion: list[list[int]], classes: list[str], weights: dict | None = None) -> None:
    """Write the confusion matrix as CSV (rows: true class, columns: predicted) and as a PNG (plots.confusion).

    `weights` (tasks.Task.write_artifacts): which weights it describes, named in the PNG's title."""
    from torchsprint.plots import confusion as plot_confusion

    with open(path_stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["true\\pred", *classes])
        for c, row in zip(classes, confusion):
            w.writerow([c, *row])
    which = f", {weights_text(weights)}" if weights else ""
    plot_confusion(confusion, classes, path_stem.with_suffix(".png"), title=f"Confusion matrix: {path_stem.parent.name}{which}")


def write_per_class(path: Path, metrics: dict, classes: list[str], weights: dict | None = None) -> None:
    """per_class.csv: class name, precision, recall, F1 and support (true images) from an evaluation's metrics
    (keys precision/recall/f1/confusion, with or without a 'val/' prefix). With `weights`
    (tasks.Task.write_artifacts), two more columns name them on every row: weights (the file) and epoch."""
    get = lambda k: metrics.get(k, metrics.get(f"val/{k}"))  # noqa: E731
    support = [sum(row) for row in get("confusion")] if get("confusion") else [None] * len(classes)
    named = [weights["file"], weights["epoch"]] if weights else []
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "precision", "recall", "f1", "support", *(["weights", "epoch"] if weights else [])])
        for i, c in enumerate(classes):
            w.writerow([c, *(f"{get(k)[i]:.6f}" if get(k) else "" for k in ("precision", "recall", "f1")), support[i],
                        *named])

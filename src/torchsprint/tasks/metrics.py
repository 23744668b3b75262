"""Metrics, one class per task: classification counted here, multilabel and restoration on torchmetrics; and writers."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import torch

from torchsprint.observe.logging import replace_file


class ClassificationMetrics:
    """Accumulates on the device; `compute()` sums over DDP ranks and returns floats.

    Args:
        num_classes: number of classes.
        topk: also report top-k accuracy when num_classes > k.
        per_class: also report per-class precision/recall/F1 and the confusion matrix.
        device: where the counts live.
        classes: class names, for naming the weakest class (indices when not given).

    Every figure is a count: the (true, predicted) confusion matrix (one bincount per batch) and the number of
    samples whose class is among the k highest logits. top1 is the matrix's diagonal over its sum; precision, recall
    and F1 per class are TP / predicted, TP / support and 2 TP / (support + predicted), 0 where the denominator is
    (scikit-learn's zero_division=0). Hand-counted rather than torchmetrics' Multiclass* metrics: importing
    torchmetrics (scipy with it) cost every run ~70 MB of resident memory and ~1 s of start-up (BENCHMARKS.md
    "torchsprint beside timm's train.py"); tests/e2e/train/test_metrics_reference.py checks these counts against
    scikit-learn in any batch composition.

    Always reported beside top-1, from the confusion matrix: balanced_acc (the mean recall over the classes present in
    the targets, scikit-learn's balanced_accuracy_score), f1_macro (the mean F1 over the classes present in targets
    or predictions, scikit-learn's f1_score(average="macro")), min_recall and min_recall_class (the weakest class
    present), and class_imbalance (largest / smallest class count among the targets). On imbalanced data top-1 hides
    a model that answers the majority class; these do not (a user's run on an imbalanced folder: 65% top-1, two
    classes never predicted).
    """

    def __init__(
        self, num_classes: int, topk: int, per_class: bool, device: torch.device, classes: list[str] | None = None
    ):
        self.num_classes, self.per_class = num_classes, per_class
        self.topk = topk if num_classes > topk else None  # top-k of k or fewer classes is always 1: not reported
        self.classes = classes or [str(i) for i in range(num_classes)]
        self.confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.int64)
        self.topk_hits = torch.zeros((), device=device, dtype=torch.int64)
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)

    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        logits, target = logits.float(), target.long()  # half logits are ranked in fp32
        c = self.num_classes
        self.confusion += torch.bincount(target * c + logits.argmax(1), minlength=c * c)
        if self.topk is not None:
            self.topk_hits += (logits.topk(self.topk, dim=1).indices == target[:, None]).any(1).sum()
        self.loss_sum += loss.double() * target.shape[0]
        self.count += target.shape[0]

    def compute(self) -> dict:
        """{'top1': float, 'loss': float, 'count': int, 'balanced_acc': float, ..., 'precision': [..], ...,
        'confusion': [[..]]} over all ranks."""
        from torchsprint.runtime.collectives import all_reduce_sum

        c = self.num_classes
        # One reduction, in float64 (counts stay exact below 2^53): the matrix, top-k hits, loss sum and count.
        sums = torch.cat(
            [
                self.confusion.double(),
                self.topk_hits.double().view(1),
                self.loss_sum.view(1),
                self.count.double().view(1),
            ]
        )
        all_reduce_sum(sums)  # note: a device sync point, once per evaluation
        sums = sums.cpu()
        confusion = sums[: c * c].view(c, c)
        total = confusion.sum().item()
        hits, support, predicted = confusion.diagonal(), confusion.sum(1), confusion.sum(0)
        out = {"top1": hits.sum().item() / total if total else 0.0}
        if self.topk is not None:
            out[f"top{self.topk}"] = sums[c * c].item() / total if total else 0.0
        if self.per_class:
            ratio = lambda num, den: torch.where(den > 0, num / den.clamp(min=1), torch.zeros_like(num)).tolist()  # noqa: E731
            out["precision"], out["recall"] = ratio(hits, predicted), ratio(hits, support)
            out["f1"] = ratio(2 * hits, support + predicted)
            out["confusion"] = confusion.long().tolist()
        count = int(sums[-1].item())
        out["loss"] = sums[-2].item() / max(count, 1)
        out["count"] = count
        out.update(balanced_figures(confusion, self.classes))
        return out


def balanced_figures(confusion: torch.Tensor, classes: list[str]) -> dict:
    """Class-balanced figures from a (true, predicted) confusion matrix of counts: see ClassificationMetrics."""
    support, predicted, hits = confusion.sum(1), confusion.sum(0), confusion.diagonal()
    present = support > 0
    if not present.any():
        return {}
    recall = hits[present] / support[present]
    used = present | (predicted > 0)
    f1 = 2 * hits[used] / (support[used] + predicted[used])  # = 2PR / (P + R); 0 where a class is never right
    weakest = int(torch.nonzero(present).flatten()[recall.argmin()])
    return {
        "balanced_acc": recall.mean().item(),
        "f1_macro": f1.mean().item(),
        "min_recall": recall.min().item(),
        "min_recall_class": classes[weakest],
        "class_imbalance": (support[present].max() / support[present].min()).item(),
    }


def _compute(metrics, loss_sum: torch.Tensor, count: torch.Tensor) -> dict:
    """metrics.compute() as floats/lists plus the mean loss and sample count, all reduced over DDP ranks."""
    from torchsprint.runtime.collectives import all_reduce_sum

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
        from torchmetrics import classification as tm

        # One label is a binary problem: torchmetrics' Multilabel* refuse num_labels=1, its Binary* take it.
        self.single = num_labels == 1
        if self.single:
            kw = dict(threshold=threshold)
            m = {
                "mAP": tm.BinaryAveragePrecision(),
                "f1": tm.BinaryF1Score(**kw),
                "precision": tm.BinaryPrecision(**kw),
                "recall": tm.BinaryRecall(**kw),
            }
        else:
            kw = dict(num_labels=num_labels, threshold=threshold)
            m = {
                "mAP": tm.MultilabelAveragePrecision(num_labels, average="macro"),
                "f1_macro": tm.MultilabelF1Score(average="macro", **kw),
                "f1": tm.MultilabelF1Score(average=None, **kw),
                "precision": tm.MultilabelPrecision(average=None, **kw),
                "recall": tm.MultilabelRecall(average=None, **kw),
            }
        # Compute groups named, never inferred: torchmetrics' default (compute_groups=True) merges metrics whose states
        # are equal after the first update, which once computed top-5 from top-1's counts for the rest of an
        # evaluation (top-5 printed 67.2% = top-1, true 98.6%). The F1/precision/recall share one state by construction.
        groups = [["mAP"], [k for k in m if k != "mAP"]]
        self.metrics = MetricCollection(m, compute_groups=groups).to(device)
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)

    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        # The sigmoid here, not torchmetrics': it decides per batch whether inputs are logits (any value
        # outside [0, 1]) or probabilities, so a batch whose logits all fall in [0, 1] went unsquashed.
        probs = torch.sigmoid(logits.float())
        if self.single:
            probs, target = probs.flatten(), target.flatten()
        self.metrics.update(probs, target.int())
        self.loss_sum += loss.double() * target.shape[0]
        self.count += target.shape[0]

    def compute(self) -> dict:
        out = _compute(self.metrics, self.loss_sum, self.count)
        if self.single:  # the same keys and shapes as for several labels
            out["f1_macro"] = out["f1"]
            for k in ("f1", "precision", "recall"):
                out[k] = [out[k]]
        return out


class RestorationMetrics:
    """task=image_to_image: PSNR (dB) and SSIM of outputs vs targets, both in [0, 1] units (pixels / 255).

    Outputs are clamped to [0, 1] first, as they are when written as pixels. PSNR is the mean of
    per-image PSNRs (the usual restoration convention), SSIM the mean over images (11x11 Gaussian window).
    """

    def __init__(self, device: torch.device):
        from torchmetrics import MetricCollection
        from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

        self.metrics = MetricCollection(
            {
                "psnr": PeakSignalNoiseRatio(data_range=1.0, reduction="elementwise_mean", dim=(1, 2, 3)),
                "ssim": StructuralSimilarityIndexMeasure(data_range=1.0),
            },
            compute_groups=False,
        ).to(device)  # never inferred: see MultilabelMetrics
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


def write_confusion(
    path_stem: Path, confusion: list[list[int]], classes: list[str], weights: dict | None = None
) -> None:
    """Write the confusion matrix as CSV (rows: true class, columns: predicted) and as a PNG (plots.confusion).

    `weights` (tasks.Task.write_artifacts): which weights it describes, named in the PNG's title."""
    from torchsprint.observe.plots import confusion as plot_confusion

    f = io.StringIO(newline="")  # written whole, atomically (logging.replace_file): a full disk leaves no cut file
    w = csv.writer(f)
    w.writerow(["true\\pred", *classes])
    for c, row in zip(classes, confusion):
        w.writerow([c, *row])
    replace_file(path_stem.with_suffix(".csv"), f.getvalue())
    which = f", {weights_text(weights)}" if weights else ""
    plot_confusion(
        confusion, classes, path_stem.with_suffix(".png"), title=f"Confusion matrix: {path_stem.parent.name}{which}"
    )


def write_per_class(path: Path, metrics: dict, classes: list[str], weights: dict | None = None) -> None:
    """per_class.csv: class name, precision, recall, F1 and support (true images) from an evaluation's metrics
    (keys precision/recall/f1/confusion, with or without a 'val/' prefix). With `weights`
    (tasks.Task.write_artifacts), two more columns name them on every row: weights (the file) and epoch."""
    get = lambda k: metrics.get(k, metrics.get(f"val/{k}"))  # noqa: E731
    support = [sum(row) for row in get("confusion")] if get("confusion") else [None] * len(classes)
    named = [weights["file"], weights["epoch"]] if weights else []
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow(["class", "precision", "recall", "f1", "support", *(["weights", "epoch"] if weights else [])])
    for i, c in enumerate(classes):
        w.writerow(
            [c, *(f"{get(k)[i]:.6f}" if get(k) else "" for k in ("precision", "recall", "f1")), support[i], *named]
        )
    replace_file(path, f.getvalue())

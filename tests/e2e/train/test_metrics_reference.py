"""Every figure the evaluator reports, fed through validation.evaluate in random batch compositions, against an
independent computation on the concatenated outputs (scikit-learn, plain torch, torchmetrics' functional
form on the whole set). Degenerate first batches (one class, all correct, all-zero labels, identical images)
are drawn on purpose: they are what made torchmetrics merge top-5 into top-1's counts.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm
from torch import nn
from torch.nn import functional as F

from torchsprint.config.training import EvalConfig, LossConfig
from torchsprint.data.core import DataInfo
from torchsprint.optim import build_loss
from torchsprint.state.precision import Precision
from torchsprint.tasks.core import get_task
from torchsprint.tasks.metrics import MultilabelMetrics
from torchsprint.train.validation import evaluate

CPU = torch.device("cpu")
# Float rounding only: the product accumulates in float32/float64, the references in float64 (numpy).
# Ratios (accuracy, P/R/F1, AP) differ by < 1e-7 (float32 division); bound 1e-6. The loss is the model's
# float32 loss: relative differences up to 1.2e-7 measured (one float32 ulp); bound LOSS_REL = 3.6e-7.
TOL = 1e-6
LOSS_REL = 3.6e-7


class Replay(nn.Module):
    """A "model" whose output is its input: the batches carry the logits, so the evaluator's whole path
    (loader, autocast, loss, metrics update and compute) runs on outputs the test chose."""

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # evaluate() reads the device from the parameters

    def forward(self, x):
        return x


class Batches(list):
    """The loader protocol evaluate() uses: an iterable with set_epoch."""

    def set_epoch(self, epoch: int) -> None:
        pass


def run_evaluator(task_name: str, batches, num_classes: int, **eval_kw) -> dict:
    task = get_task(task_name)
    info = DataInfo(
        classes=[f"c{i}" for i in range(num_classes)], in_channels=3, mean=(0.5,), std=(0.5,), task=task_name
    )
    metrics = task.make_metrics(info, EvalConfig(**eval_kw), CPU)
    loss_fn = build_loss(LossConfig(name=task.loss), task.targets)
    return evaluate(Replay(), Batches(batches), loss_fn, Precision("fp32", CPU), metrics)


def split(n: int, sizes: list[int]) -> list[slice]:
    """Cut range(n) into consecutive slices of the given sizes (the last takes the rest)."""
    out, start = [], 0
    for s in sizes:
        if start >= n:
            break
        out.append(slice(start, min(n, start + s)))
        start += s
    if start < n:
        out.append(slice(start, n))
    return out


def classification_case(seed: int, num_classes: int, n: int, first: str):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, num_classes, generator=g) * 3  # continuous: no ties for top-k to break differently
    y = torch.randint(0, num_classes, (n,), generator=g)
    m = min(n, 8)
    if first in ("one_class", "one_class_all_correct"):
        y[:m] = int(y[0])
    if first in ("all_correct", "one_class_all_correct"):
        logits[torch.arange(m), y[:m]] = logits[:m].max(1).values + 1.0
    return logits, y


def check_classification(out: dict, logits: torch.Tensor, y: torch.Tensor, num_classes: int, topk: int) -> None:
    lg, yy = logits.double().numpy(), y.numpy()
    pred = lg.argmax(1)
    labels = list(range(num_classes))
    assert out["count"] == len(yy)
    assert out["top1"] == pytest.approx(skm.accuracy_score(yy, pred), abs=TOL)
    if num_classes > topk:
        assert out[f"top{topk}"] == pytest.approx(skm.top_k_accuracy_score(yy, lg, k=topk, labels=labels), abs=TOL)
    else:
        assert f"top{topk}" not in out  # top-k of k or fewer classes is always 1: not reported
    p, r, f, _ = skm.precision_recall_fscore_support(yy, pred, labels=labels, zero_division=0)
    np.testing.assert_allclose(out["precision"], p, atol=TOL)
    np.testing.assert_allclose(out["recall"], r, atol=TOL)
    np.testing.assert_allclose(out["f1"], f, atol=TOL)
    assert out["confusion"] == skm.confusion_matrix(yy, pred, labels=labels).tolist()
    check_balanced(out, yy, pred)
    assert out["loss"] == pytest.approx(F.cross_entropy(logits.double(), y).item(), rel=LOSS_REL, abs=TOL)


def check_balanced(out: dict, yy: np.ndarray, pred: np.ndarray) -> None:
    """The class-balanced figures against scikit-learn (its default labels: classes in targets or predictions)."""
    with warnings.catch_warnings():  # "y_pred contains classes not in y_true": sklearn leaves those out, as we do
        warnings.simplefilter("ignore")
        assert out["balanced_acc"] == pytest.approx(skm.balanced_accuracy_score(yy, pred), abs=TOL)
    assert out["f1_macro"] == pytest.approx(skm.f1_score(yy, pred, average="macro", zero_division=0), abs=TOL)
    present = np.unique(yy)
    recalls = skm.recall_score(yy, pred, labels=present, average=None, zero_division=0)
    assert out["min_recall"] == pytest.approx(recalls.min(), abs=TOL)
    assert out["min_recall_class"] == f"c{present[recalls.argmin()]}"
    support = np.bincount(yy)[present]
    assert out["class_imbalance"] == pytest.approx(support.max() / support.min())


def test_majority_class_model_is_exposed_beside_top1():
    """A user's report: 57% of val in one class, a model that always answers it. top-1 says 0.57; the epoch line
    must show what exposes it."""
    y = torch.tensor([0] * 57 + [1] * 30 + [2] * 10 + [3] * 3)
    logits = torch.zeros(100, 4)
    logits[:, 0] = 1.0
    out = run_evaluator("classification", [(logits[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)], 4)
    assert out["top1"] == pytest.approx(0.57) and out["balanced_acc"] == pytest.approx(0.25)
    assert out["min_recall"] == 0.0 and out["class_imbalance"] == pytest.approx(19.0)
    line = get_task("classification").summary({f"val/{k}": v for k, v in out.items()})
    assert "balanced acc 0.2500" in line and "recall 0.0000" in line and "macro-F1 0.1815" in line  # 2*57/(57+100)/4
    balanced = {**{f"val/{k}": v for k, v in out.items()}, "val/class_imbalance": 1.2}
    assert "balanced acc" not in get_task("classification").summary(balanced)  # nearly balanced: the short line


def test_topk_is_right_when_the_first_batch_is_one_class_all_correct():
    """The reported case: eval batches sorted by class, the first batch all right. Today's bug: top-5 = top-1."""
    g = torch.Generator().manual_seed(0)
    c = 10
    y = torch.cat([torch.zeros(32, dtype=torch.long), torch.arange(1, c).repeat_interleave(8)])  # sorted by class
    n = len(y)  # 104: class 0 fills the first batch of 32, as in an image folder's val split
    logits = torch.randn(n, c, generator=g)
    logits[:32, 0] = 10.0  # first batch: class 0, all correct
    out = run_evaluator("classification", [(logits[i : i + 32], y[i : i + 32]) for i in range(0, n, 32)], c)
    want5 = skm.top_k_accuracy_score(y.numpy(), logits.numpy(), k=5, labels=range(c))
    assert out["top5"] == pytest.approx(want5, abs=TOL)
    assert out["top5"] > out["top1"] + 0.1  # random logits for the rest: top-5 well above top-1 (0.63 vs 0.40 here)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    num_classes=st.integers(2, 12),
    n=st.integers(1, 70),
    sizes=st.lists(st.integers(1, 17), min_size=1, max_size=8),
    topk=st.integers(2, 6),
    first=st.sampled_from(["random", "one_class", "all_correct", "one_class_all_correct"]),
)
def test_classification_figures_match_sklearn_in_any_batch_composition(seed, num_classes, n, sizes, topk, first):
    logits, y = classification_case(seed, num_classes, n, first)
    batches = [(logits[s], y[s]) for s in split(n, sizes)]
    out = run_evaluator("classification", batches, num_classes, topk=topk, per_class=True)
    check_classification(out, logits, y, num_classes, topk)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 40),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    first=st.sampled_from(["random", "one_class_all_correct"]),
)
def test_top_k_without_per_class_matches_sklearn(seed, n, sizes, first):
    """per_class=false leaves top-1 and top-k alone in the collection: no group may form there either."""
    logits, y = classification_case(seed, 7, n, first)
    out = run_evaluator("classification", [(logits[s], y[s]) for s in split(n, sizes)], 7, topk=3, per_class=False)
    lg = logits.double().numpy()
    assert set(out) == {
        "top1",
        "top3",
        "loss",
        "count",
        "balanced_acc",
        "f1_macro",
        "min_recall",
        "min_recall_class",
        "class_imbalance",
    }
    check_balanced(out, y.numpy(), lg.argmax(1))
    assert out["top1"] == pytest.approx(skm.accuracy_score(y.numpy(), lg.argmax(1)), abs=TOL)
    assert out["top3"] == pytest.approx(skm.top_k_accuracy_score(y.numpy(), lg, k=3, labels=range(7)), abs=TOL)


def multilabel_reference(logits: torch.Tensor, y: torch.Tensor, threshold: float) -> dict:
    """Label by label with scikit-learn's binary metrics (a (N, 1) array would be read as one binary target with
    two classes, so no multilabel call), then the macro means."""
    prob = torch.sigmoid(logits.double()).numpy()
    yy = y.int().numpy()
    pred = (prob >= threshold).astype(int)
    cols = range(yy.shape[1])
    with warnings.catch_warnings():  # a label with no positive: sklearn warns, and scores its AP 0 (as torchmetrics)
        warnings.simplefilter("ignore")
        ap = [skm.average_precision_score(yy[:, i], prob[:, i]) if yy[:, i].any() else 0.0 for i in cols]
    f1 = [skm.f1_score(yy[:, i], pred[:, i], zero_division=0) for i in cols]
    return {
        "mAP": float(np.mean(ap)),
        "f1_macro": float(np.mean(f1)),
        "f1": f1,
        "precision": [skm.precision_score(yy[:, i], pred[:, i], zero_division=0) for i in cols],
        "recall": [skm.recall_score(yy[:, i], pred[:, i], zero_division=0) for i in cols],
        "loss": F.binary_cross_entropy_with_logits(logits.double(), y.double()).item(),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    labels=st.integers(1, 6),
    n=st.integers(2, 50),
    sizes=st.lists(st.integers(1, 13), min_size=1, max_size=6),
    threshold=st.sampled_from([0.3, 0.5, 0.8]),
    first=st.sampled_from(["random", "all_zero", "all_correct"]),
)
def test_multilabel_figures_match_sklearn_in_any_batch_composition(seed, labels, n, sizes, threshold, first):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, labels, generator=g) * 2
    y = (torch.rand(n, labels, generator=g) < 0.4).float()
    m = min(n, 6)
    if first == "all_zero":
        y[:m] = 0
    if first == "all_correct":
        logits[:m] = torch.where(y[:m] > 0, 5.0, -5.0)
    batches = [(logits[s], y[s]) for s in split(n, sizes)]
    out = run_evaluator("multilabel", batches, labels, threshold=threshold)
    ref = multilabel_reference(logits, y, threshold)
    assert out["count"] == n
    for key in ("mAP", "f1_macro"):
        assert out[key] == pytest.approx(ref[key], abs=TOL), key
    assert out["loss"] == pytest.approx(ref["loss"], rel=LOSS_REL, abs=TOL)
    for key in ("f1", "precision", "recall"):
        np.testing.assert_allclose(out[key], ref[key], atol=TOL, err_msg=key)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 12),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    first=st.sampled_from(["random", "identical", "constant"]),
)
def test_restoration_figures_match_an_independent_computation(seed, n, sizes, first):
    """PSNR: the mean of per-image PSNRs of clamped outputs, in plain torch. SSIM: torchmetrics' functional
    SSIM on the whole concatenated set (11x11 Gaussian window), so only the accumulation over batches is the
    product's. 'identical': the first images are one image repeated; 'constant': flat grey (zero variance)."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    g = torch.Generator().manual_seed(seed)
    target = torch.rand(n, 3, 24, 24, generator=g)
    m = min(n, 4)
    if first == "identical":
        target[:m] = target[0]
    if first == "constant":
        target[:m] = 0.5
    output = target + 0.2 * torch.randn(n, 3, 24, 24, generator=g)  # some outside [0, 1]: the clamp is part of the spec
    batches = [(output[s], target[s]) for s in split(n, sizes)]
    out = run_evaluator("image_to_image", batches, 1)
    o, t = output.double().clamp(0, 1), target.double()
    mse = ((o - t) ** 2).flatten(1).mean(1)
    assert out["psnr"] == pytest.approx(
        (10 * torch.log10(1 / mse)).mean().item(), abs=1e-4
    )  # float32 log10: 2e-5 dB seen
    assert out["ssim"] == pytest.approx(float(ssim(output.clamp(0, 1), target, data_range=1.0)), abs=1e-5)  # 1e-6 seen
    assert out["loss"] == pytest.approx(F.mse_loss(output.double(), t).item(), rel=LOSS_REL, abs=TOL)
    assert out["count"] == n


def test_video_accuracy_is_the_mean_of_each_videos_clip_logits():
    """Video: with multi_clip the reported top-1/top-k are video accuracy (the K clips' logits averaged,
    models.core's wrapper); single clips give clip accuracy. Both against a clip-by-clip loop in plain torch."""
    from torchsprint.models.core import FramesFirst

    torch.manual_seed(0)
    n, k, t, c, classes = 13, 3, 2, 3, 6
    net = nn.Sequential(nn.Flatten(), nn.Linear(c * t * 4 * 4, classes))  # (N, C, T, H, W) -> logits
    model = FramesFirst(net)
    clips = torch.randn(n, k, t, c, 4, 4)
    y = torch.randint(0, classes, (n,))
    y[:5] = 2  # a first batch of one class
    with torch.no_grad():
        per_clip = torch.stack([net(clips[:, j].transpose(1, 2)) for j in range(k)], 1)  # (N, K, classes)
    video_logits = per_clip.mean(1)
    info = DataInfo(classes=[f"c{i}" for i in range(classes)], in_channels=c, mean=(0.5,), std=(0.5,), task="video")
    metrics = get_task("video").make_metrics(info, EvalConfig(topk=3), CPU)
    loss_fn = build_loss(LossConfig(name="cross_entropy"), "class_index")
    batches = Batches([(clips[s], y[s]) for s in split(n, [5, 4, 4])])
    out = evaluate(model, batches, loss_fn, Precision("fp32", CPU), metrics)
    check_classification(out, video_logits, y, classes, 3)
    # single clips: clip accuracy
    metrics = get_task("video").make_metrics(info, EvalConfig(topk=3), CPU)
    out = evaluate(
        model, Batches([(clips[s, 0], y[s]) for s in split(n, [5, 8])]), loss_fn, Precision("fp32", CPU), metrics
    )
    check_classification(out, per_clip[:, 0], y, classes, 3)


def test_metrics_collection_never_infers_compute_groups():
    """Structural guard beside the property tests: only groups that share a state by construction."""
    m = MultilabelMetrics(4, 0.5, CPU)
    assert sorted(sorted(g) for g in m.metrics.compute_groups.values()) == [
        ["f1", "f1_macro", "precision", "recall"],
        ["mAP"],
    ]


def test_classification_metrics_do_not_import_torchmetrics():
    # Catches: the classification evaluator pulling torchmetrics (and scipy) back into every run: ~70 MB of resident
    # memory and ~1 s of start-up (BENCHMARKS.md "torchsprint beside timm's train.py").
    import subprocess
    import sys

    code = (
        "import sys, torch; from torchsprint.tasks.metrics import ClassificationMetrics as M; "
        "m = M(3, 5, True, torch.device('cpu')); m.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), "
        "torch.tensor(1.0)); m.compute(); print('torchmetrics' in sys.modules, 'scipy' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False",
        "False",
    ]


def test_multilabel_logits_inside_zero_one_are_still_logits():
    """torchmetrics guesses per batch: inputs all within [0, 1] are taken as probabilities. A batch of small
    positive logits must still go through the sigmoid: logit 0.8 is probability 0.69, below threshold 0.7."""
    logits = torch.tensor([[0.8, 0.1], [0.9, 0.75]])
    y = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    out = run_evaluator("multilabel", [(logits, y)], 2, threshold=0.7)
    ref = multilabel_reference(logits, y, 0.7)
    assert out["precision"] == pytest.approx(ref["precision"]) and out["recall"] == pytest.approx(ref["recall"])
    assert out["recall"] == pytest.approx([1.0, 0.0])  # sigmoid(0.9) = 0.711 >= 0.7; sigmoid(0.75) = 0.679 < 0.7

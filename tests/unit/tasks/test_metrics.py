"""tasks/metrics.py against scikit-learn and numpy (independent references), over unequal batches; the CSV writers."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from sklearn import metrics as skm
from torch import nn

from torchsprint.tasks.metrics import (
    ClassificationMetrics,
    MultilabelMetrics,
    RestorationMetrics,
    write_confusion,
    write_per_class,
)

CPU = torch.device("cpu")
BALANCED = {"balanced_acc", "f1_macro", "min_recall", "min_recall_class", "class_imbalance"}


def batches(n_per_batch, make):
    g = torch.Generator().manual_seed(0)
    return [make(n, g) for n in n_per_batch]


def test_classification_matches_sklearn_over_unequal_batches():
    data = batches([16, 16, 7], lambda n, g: (torch.randn(n, 4, generator=g), torch.randint(0, 4, (n,), generator=g)))
    losses = [torch.tensor(0.5), torch.tensor(1.0), torch.tensor(2.0)]
    m = ClassificationMetrics(4, topk=2, per_class=True, device=CPU)
    for (x, y), loss in zip(data, losses):
        m.update(x.to(torch.bfloat16), y, loss)  # half logits are scored in fp32
    out = m.compute()
    logits = torch.cat([x.to(torch.bfloat16).float() for x, _ in data]).numpy()
    y = torch.cat([y for _, y in data]).numpy()
    pred = logits.argmax(1)
    assert out["top1"] == pytest.approx(skm.accuracy_score(y, pred), abs=1e-7)
    assert out["top2"] == pytest.approx(skm.top_k_accuracy_score(y, logits, k=2, labels=range(4)), abs=1e-7)
    p, r, f, _ = skm.precision_recall_fscore_support(y, pred, labels=range(4), zero_division=0)
    for key, ref in (("precision", p), ("recall", r), ("f1", f)):
        np.testing.assert_allclose(out[key], ref, atol=1e-6)
    assert out["confusion"] == skm.confusion_matrix(y, pred, labels=range(4)).tolist()
    assert out["count"] == 39 and isinstance(out["count"], int)
    assert out["loss"] == pytest.approx((0.5 * 16 + 1.0 * 16 + 2.0 * 7) / 39, rel=1e-12)  # sample-weighted mean
    assert set(out) == {"top1", "top2", "precision", "recall", "f1", "confusion", "loss", "count", *BALANCED}


def test_classification_reports_topk_only_when_it_means_something_and_per_class_on_request():
    m = ClassificationMetrics(5, topk=5, per_class=False, device=CPU)
    m.update(torch.eye(5), torch.arange(5), torch.tensor(0.0))
    out = m.compute()
    assert set(out) == {"top1", "loss", "count", *BALANCED} and out["top1"] == 1.0 and out["count"] == 5
    m = ClassificationMetrics(6, topk=5, per_class=False, device=CPU)
    y = torch.tensor([1, 2, 3, 4, 5, 0])
    logits = torch.eye(6) + 0.5 * nn.functional.one_hot(y, 6)  # the true class ranks 2nd: in the top 5...
    logits[5] = torch.tensor([-1.0, 0.1, 0.2, 0.3, 0.4, 2.0])  # ...except the last sample's, ranked 6th
    m.update(logits, y, torch.tensor(0.0))
    out = m.compute()
    assert out["top1"] == 0.0 and out["top5"] == pytest.approx(5 / 6)


def test_empty_evaluation_has_zero_loss_and_count():
    m = MultilabelMetrics(2, 0.5, CPU)
    m.loss_sum.zero_()
    assert (m.loss_sum.dtype, m.count.dtype) == (torch.float64, torch.int64)
    r = RestorationMetrics(CPU)
    assert (r.loss_sum.dtype, r.count.dtype) == (torch.float64, torch.int64)


def test_multilabel_matches_sklearn_at_a_non_default_threshold():
    data = batches(
        [10, 10, 5], lambda n, g: (torch.randn(n, 3, generator=g) * 2, (torch.rand(n, 3, generator=g) < 0.5).float())
    )
    losses = [torch.tensor(0.25), torch.tensor(0.5), torch.tensor(1.0)]
    m = MultilabelMetrics(3, threshold=0.7, device=CPU)
    for (x, y), loss in zip(data, losses):
        m.update(x, y, loss)
    out = m.compute()
    logits = torch.cat([x for x, _ in data])
    y = torch.cat([y for _, y in data]).int().numpy()
    prob = torch.sigmoid(logits).numpy()
    pred = (prob >= 0.7).astype(int)
    ap = [skm.average_precision_score(y[:, i], prob[:, i]) for i in range(3)]
    assert out["mAP"] == pytest.approx(float(np.mean(ap)), abs=1e-6)
    assert out["f1_macro"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0), abs=1e-6)
    np.testing.assert_allclose(out["f1"], skm.f1_score(y, pred, average=None, zero_division=0), atol=1e-6)
    np.testing.assert_allclose(out["precision"], skm.precision_score(y, pred, average=None, zero_division=0), atol=1e-6)
    np.testing.assert_allclose(out["recall"], skm.recall_score(y, pred, average=None, zero_division=0), atol=1e-6)
    assert out["count"] == 25 and out["loss"] == pytest.approx((0.25 * 10 + 0.5 * 10 + 1.0 * 5) / 25, rel=1e-12)


def test_restoration_psnr_is_the_mean_of_per_image_psnr_of_clamped_outputs():
    g = torch.Generator().manual_seed(0)
    target = 0.25 + 0.5 * torch.rand(5, 3, 16, 16, generator=g)  # not spanning [0, 1]: SSIM's data_range must be given
    output = target + 0.1 * torch.randn(5, 3, 16, 16, generator=g) * torch.arange(1, 6).view(5, 1, 1, 1)
    m = RestorationMetrics(CPU)
    m.update(output[:3].to(torch.bfloat16), target[:3], torch.tensor(1.0))
    m.update(output[3:].to(torch.bfloat16), target[3:], torch.tensor(4.0))
    out = m.compute()
    o = output.to(torch.bfloat16).double().clamp(0, 1).numpy()
    t = target.double().numpy()
    per_image = [10 * np.log10(1 / np.mean((o[i] - t[i]) ** 2)) for i in range(5)]
    assert out["psnr"] == pytest.approx(float(np.mean(per_image)), abs=1e-4)
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    want = float(ssim(output.to(torch.bfloat16).float().clamp(0, 1), target, data_range=1.0))
    assert out["ssim"] == pytest.approx(want, abs=1e-6) and 0 < out["ssim"] < 1
    assert out["count"] == 5 and out["loss"] == pytest.approx((1.0 * 3 + 4.0 * 2) / 5)


def test_confusion_and_per_class_csv(tmp_path):
    write_confusion(tmp_path / "confusion_matrix", [[3, 1], [0, 2]], ["cat", "dog"])
    rows = list(csv.reader(open(tmp_path / "confusion_matrix.csv")))
    assert rows == [["true\\pred", "cat", "dog"], ["cat", "3", "1"], ["dog", "0", "2"]]
    assert (tmp_path / "confusion_matrix.png").stat().st_size > 1000
    metrics = {
        "val/precision": [1.0, 2 / 3],
        "val/recall": [0.75, 1.0],
        "val/f1": [6 / 7, 0.8],
        "val/confusion": [[3, 1], [0, 2]],
    }
    write_per_class(tmp_path / "per_class.csv", metrics, ["cat", "dog"])
    want = [
        ["class", "precision", "recall", "f1", "support"],
        ["cat", "1.000000", "0.750000", "0.857143", "4"],
        ["dog", "0.666667", "1.000000", "0.800000", "2"],
    ]
    assert list(csv.reader(open(tmp_path / "per_class.csv"))) == want
    bare = {k.removeprefix("val/"): v for k, v in metrics.items() if k != "val/confusion"}  # no prefix, no confusion
    write_per_class(tmp_path / "bare.csv", bare, ["cat", "dog"])
    assert list(csv.reader(open(tmp_path / "bare.csv")))[1:] == [r[:4] + [""] for r in want[1:]]
    write_per_class(tmp_path / "no_f1.csv", {k: v for k, v in bare.items() if k != "f1"}, ["cat", "dog"])
    assert list(csv.reader(open(tmp_path / "no_f1.csv")))[1] == ["cat", "1.000000", "0.750000", "", ""]


def test_one_sample_evaluation_loss_is_that_samples_loss():
    m = ClassificationMetrics(3, topk=5, per_class=False, device=CPU)
    m.update(torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([1]), torch.tensor(0.75))
    assert {k: v for k, v in m.compute().items() if k not in BALANCED} == {"top1": 1.0, "loss": 0.75, "count": 1}
    r = RestorationMetrics(CPU)
    r.update(torch.zeros(1, 3, 16, 16), torch.full((1, 3, 16, 16), 0.5), torch.tensor(0.25))
    assert r.compute()["loss"] == 0.25

"""eval.tta: test-time augmentation gives the independent plain-torch figures on every path.

Validation during training, `torchsprint eval`, `predict` (torch and ONNX Runtime) and the exported ONNX graph
are compared with a reference written here without tasks/tta.py: the model on the image and its mirror
(torch.flip), or torchvision's ten_crop of the image loaded through a hand-written spec, probabilities
averaged (softmax), as eval.tta's description says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchsprint import config, runtime
from torchsprint.commands.export import export, normalize, onnx_logits
from torchsprint.commands.predict import Predictor
from torchsprint.commands.trained import load_run
from torchsprint.errors import UsageError
from torchsprint.train.evaluation import evaluate_run
from torchsprint.train.run import train

FAST = ["log.tensorboard=false", "log.progress=false", "data.backend=cpu", "data.num_workers=0"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """Digits trained one epoch with eval.tta=hflip: validation during training ran with it."""
    run = tmp_path_factory.mktemp("tta_digits") / "run"
    cfg = config.load(
        None, [f"run.dir={run}", "run.epochs=1", "model.args={width: 8}", "eval.tta=hflip", "data.batch_size=32", *FAST]
    )
    summary = train(cfg, quiet=True)
    return run, summary


def val_batch(run: Path, *over: str):
    """The val split as uint8 (after the eval spec, or `over`'s) with labels, through the reference cpu loader."""
    from torchsprint.data import build_loaders

    cfg = config.load(run / "config.yaml", ["data.backend=cpu", "data.num_workers=0", *over])
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)
    loaders.val.set_epoch(0)
    xs, ys = zip(*[(b[0], b[1]) for b in loaders.val.loader])
    return torch.cat(xs), torch.cat(ys)


def mean_probs_log(model, views: list[torch.Tensor]) -> torch.Tensor:
    """log of the views' averaged softmax probabilities: the reference of what eval.tta outputs."""
    with torch.no_grad():
        return torch.stack([F.softmax(model(v).double(), 1) for v in views]).mean(0).log()


def test_hflip_equals_plain_torch_on_eval_predict_and_onnx(digits_run):
    """(a) eval, predict (torch) and the exported ONNX graph: log(mean(softmax(m(x)), softmax(m(x.flip(-1)))))."""
    run, _ = digits_run
    trained = load_run(run, "last")
    x8, y = val_batch(run)
    x = normalize(x8, trained.pipeline)
    ref = mean_probs_log(trained.model, [x, x.flip(-1)])
    # eval: the loss is the NLL of the averaged probabilities and top-1 their argmax, over the 360 images
    ev = evaluate_run(run, "last")
    assert ev["tta"] == "hflip"  # the run's own setting, said in the result (and by `torchsprint eval`)
    # measured 2.2e-8 (2 threads), 3.8e-9 (1 thread); loss 1.19 (0.86 without TTA)
    assert ev["loss"] == pytest.approx(F.nll_loss(ref, y).item(), abs=6e-8)
    # float32 top-1 (torchmetrics) against the float64 ratio: measured 1.2e-8; one image would be 1/360 = 2.8e-3
    assert ev["top1"] == pytest.approx((ref.argmax(1) == y).double().mean().item(), abs=3.6e-8)
    # the report's confusion matrix and worst mistakes: the same predictions
    from torchsprint.commands.report import predictions

    assert predictions(trained, 0)["preds"] == ref.argmax(1).tolist()
    # predict: the run's eval.tta by default; logits on the same uint8 batch and the reported probabilities
    pred = Predictor.from_run(run, "last")
    got = pred.logits(x8)
    assert (got.double() - ref).abs().max().item() < 2.1e-6  # measured 7.9e-7 (float32 log-probabilities, |.| < 9)
    top = pred.predict(list(x8[:5]), topk=1)
    assert [r["top"][0]["prob"] for r in top] == pytest.approx(
        ref[:5].exp().max(1).values.tolist(), abs=1.4e-7
    )  # 4.8e-8
    # the ONNX graph holds the views and the combination: ONNX Runtime on the normalised batch
    r = export(run, "onnx", weights="last")  # the default file of the setting (test_bad_tta_... reads it too)
    assert (
        r["path"] == str(run / "export" / "model-tta-hflip.onnx") and r["tta"] == "hflip" and r["max_abs_diff"] < 2.8e-6
    )  # parity against the torch wrapper, measured 9.5e-7
    got_onnx = onnx_logits(Path(r["path"]), x)
    assert (got_onnx.double() - ref).abs().max().item() < 4e-6  # measured 1.36e-6
    import onnx

    meta = {p.key: p.value for p in onnx.load(r["path"]).metadata_props}
    assert meta["tta"] == "hflip" and json.loads(meta["config"])["eval"]["tta"] == "hflip"


def test_validation_during_training_uses_tta_and_tta_changes_the_figures(digits_run):
    """(c) the run's own validation (final val/loss) is the eval path's with hflip, not without it."""
    run, summary = digits_run
    with_tta, without = evaluate_run(run, "last"), evaluate_run(run, "last", ["eval.tta=none"])
    # same weights, same path: measured 2.1e-8 (2 threads), 0 (1 thread)
    assert summary["final"]["val/loss"] == pytest.approx(with_tta["loss"], abs=6e-8)
    # digits are not mirror-symmetric: the mirror views move the loss a lot (measured 1.19 with, 0.86 without)
    assert abs(with_tta["loss"] - without["loss"]) > 0.1, (with_tta["loss"], without["loss"])


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """Real JPEGs (24x20), eval spec resize 19 -> center_crop 16, trained one epoch with eval.tta=ten_crop."""
    from conftest import make_image_folder

    root = make_image_folder(tmp_path_factory.mktemp("tta_imgs"), per_class=8)
    run = tmp_path_factory.mktemp("tta_folder") / "run"
    cfg = config.load(
        None,
        [
            f"run.dir={run}",
            "data.dataset=image_folder",
            f"data.root={root}",
            "run.epochs=1",
            "model.name=small_cnn",
            "model.args={width: 8}",
            "data.batch_size=8",
            "data.train.transforms=[resize: [16, 16], hflip]",
            "data.eval.transforms=[resize: 19, center_crop: 16]",
            "eval.tta=ten_crop",
            *FAST,
        ],
    )
    train(cfg, quiet=True)
    return run, root


def test_ten_crop_same_on_eval_predict_and_onnx_and_equals_torchvision(folder_run, tmp_path):
    """(a, b) ten_crop: torchvision's TenCrop(16) of the centre 19x19 of the image resized to 19, probabilities
    averaged, on eval; the same figures from predict on the JPEG files (torch and ONNX Runtime)."""
    from torchvision.transforms.v2 import functional as TF

    run, root = folder_run
    trained = load_run(run, "best")
    # the reference loads the 19x19 squares with a spec written here (not tta.loading_spec) and crops with torchvision
    x8, y = val_batch(run, "data.eval.transforms=[resize: 19, center_crop: 19]", "eval.tta=none")
    assert x8.shape[-2:] == (19, 19)
    x = normalize(x8, trained.pipeline)
    ref = mean_probs_log(trained.model, list(TF.ten_crop(x, [16, 16])))
    ev = evaluate_run(run)
    nll = F.nll_loss(ref, y).item()
    assert ev["loss"] == pytest.approx(nll, abs=6e-8)  # measured 2.1e-8
    # predict on the files: each file's probability of its own class -> the same mean NLL as eval
    files = sorted((root / "val").rglob("*.jpg"))
    classes = trained.classes

    def files_nll(pred) -> float:
        res = {r["input"]: r for r in pred.predict([str(root / "val")], topk=len(classes))}
        probs = [next(t["prob"] for t in res[str(f)]["top"] if t["class"] == f.parent.name) for f in files]
        return -torch.tensor(probs, dtype=torch.float64).log().mean().item()

    torch_pred = Predictor.from_run(run)
    assert torch_pred.pipeline.out_size == (19, 19)  # loaded at the resize's size for the crops
    assert files_nll(torch_pred) == pytest.approx(nll, abs=3.3e-8)  # measured 1.1e-8 (probabilities are float32)
    r = export(run, "onnx", out=tmp_path / "m.onnx")
    assert r["tta"] == "ten_crop" and r["max_abs_diff"] < 7e-7  # measured 2.4e-7
    assert (onnx_logits(Path(r["path"]), x).double() - ref).abs().max().item() < 5.7e-7  # measured 1.9e-7
    assert files_nll(Predictor.from_file(r["path"])) == pytest.approx(nll, abs=3.5e-8)  # measured 1.2e-8


def test_combination_per_target_kind():
    """Multilabel: sigmoid of the output is the views' mean sigmoid; image outputs: mirrored back and averaged."""
    from torchsprint.tasks.tta import TtaModel, TtaPlan

    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 3, 3, padding=1)  # image to image, not mirror-symmetric
    x = torch.randn(2, 3, 8, 10)
    out = TtaModel(net, TtaPlan("hflip", True, None, "image"))(x)
    with torch.no_grad():
        torch.testing.assert_close(out, (net(x) + net(x.flip(-1)).flip(-1)) / 2)
    head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 10, 4))
    z = TtaModel(head, TtaPlan("hflip", True, None, "multi_hot"))(x * 20)  # large logits: the logsumexp form holds
    with torch.no_grad():
        want = (torch.sigmoid(head(x * 20).double()) + torch.sigmoid(head((x * 20).flip(-1)).double())) / 2
    torch.testing.assert_close(torch.sigmoid(z.double()), want, atol=1e-6, rtol=0)  # float32 logits: measured 6e-8


@pytest.mark.parametrize(
    "over, match",
    [
        (["eval.tta=five_crop"], "must end with center_crop"),  # digits: no resize/center_crop in the eval spec
        (["eval.tta=ten_crop", "data.eval.transforms=[resize: 16, center_crop: 16]"], "no resize larger than the crop"),
        (["eval.tta=five_crop", "task=image_to_image", "data.dataset=synthetic_blur"], "outputs images"),
        (["eval.tta=hflip", "task=video", "data.dataset=synthetic_video"], "does not support test-time augmentation"),
    ],
)
def test_meaningless_tta_is_refused_with_the_fix(over, match):
    """(d) at start-up (Task.check, before any data is read), naming the setting and what to do."""
    from torchsprint.tasks.core import get_task

    cfg = config.load(None, over)
    with pytest.raises(UsageError, match=match) as e:
        get_task(cfg.task).check(cfg)
    assert "eval.tta=" in str(e.value) and "\n" not in str(e.value)


def test_bad_tta_exits_2_with_one_line(digits_run, tmp_path, cli_in_process):
    """(d) the CLI: eval with multi-crop on an eval spec without a crop, predict with an unknown name or with a TTA
    the exported graph does not hold."""
    run, _ = digits_run
    img = tmp_path / "a.png"
    from PIL import Image

    Image.new("L", (8, 8), 100).save(img)
    for args, words in [
        (["eval", "-r", str(run), "eval.tta=five_crop"], "center_crop"),
        (["predict", "-r", str(run), str(img), "--tta", "flip"], "unknown; choose one of none, hflip"),
    ]:
        p = cli_in_process(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in p.stderr, p.stderr
    onnx_file = run / "export" / "model-tta-hflip.onnx"
    if not onnx_file.is_file():  # exported by test_hflip_equals_... unless run alone
        export(run, "onnx", weights="last", out=onnx_file)
    with pytest.raises(UsageError, match="holds eval.tta=hflip in its graph, not none"):
        Predictor.from_file(onnx_file, tta="none")

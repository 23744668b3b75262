"""`torchsprint eval` on an exported file against an independent reference: the run folder's own `eval`
(train/evaluation.py's evaluate_run, the PyTorch model on the same split)."""

from __future__ import annotations

import json

import pytest

from conftest import make_image_folder, train_digits_fp32
from torchsprint import config
from torchsprint.commands.eval_export import evaluate_file
from torchsprint.commands.export import export
from torchsprint.errors import UsageError
from torchsprint.train.evaluation import evaluate_run
from torchsprint.train.run import train


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default digits run, 2 epochs, fp32: ONNX runs in fp32, so the run's eval is fp32 on any CPU too."""
    return train_digits_fp32(tmp_path_factory.mktemp("eval-exported"))


@pytest.mark.parametrize("uint8_input", [False, True])
def test_fp32_onnx_eval_equals_the_runs_eval(digits_run, tmp_path, uint8_input):
    """Bugs caught: the file evaluated on another split or another preprocessing (e.g. the training spec, a uint8
    graph fed normalised floats), another loss (not the run's), metrics computed by hand. Top-1 and the count are
    counts: equal. The loss: measured 8.6e-09 off (onnxruntime's logits differ from PyTorch's by ~1e-6), bound 2e-7."""
    path = export(digits_run, "onnx", out=tmp_path / "m.onnx", uint8_input=uint8_input)["path"]
    ref, got = evaluate_run(digits_run), evaluate_file(path)
    assert got["count"] == ref["count"] == 360
    assert round(got["top1"] * got["count"]) == round(ref["top1"] * ref["count"])
    assert got["top5"] == ref["top5"] and got["balanced_acc"] == ref["balanced_acc"]
    assert got["loss"] == pytest.approx(ref["loss"], abs=2e-7)
    assert got["runtime"] == "onnxruntime" and got["quantization"] is None and got["split"] == "val"


@pytest.mark.parametrize("fmt", ["safetensors", "torchscript"])
def test_torch_exports_eval_equals_the_runs_eval(digits_run, tmp_path, fmt):
    """The .safetensors export runs the run's own model code, memory format and precision: every figure equal
    (measured 0.0; bug caught in writing it: NCHW where the run's eval is channels_last, loss 1.1e-8 off). The
    traced TorchScript graph is NCHW: measured 1.06e-08 on the loss, bound 2e-7; its counts equal."""
    path = export(digits_run, fmt, out=tmp_path / ("m.pt" if fmt == "torchscript" else "m.safetensors"))["path"]
    ref, got = evaluate_run(digits_run), evaluate_file(path)
    assert got["confusion"] == ref["confusion"] and got["count"] == ref["count"]
    if fmt == "safetensors":
        assert {k: got[k] for k in ref if k not in ("weights", "epoch", "step")} == {
            k: ref[k] for k in ref if k not in ("weights", "epoch", "step")
        }
    else:
        assert got["loss"] == pytest.approx(ref["loss"], abs=2e-7)


def test_test_split_of_an_image_folder_run(tmp_path):
    """Bug caught: `--split test` ignored for a file (the val split evaluated instead); the reference is the run's
    own eval of its test/ folder (JPEGs decoded through the eval spec)."""
    data = make_image_folder(tmp_path / "images", per_class=6, splits=("train", "val", "test"))
    for f in sorted((data / "test" / "circle").glob("*.jpg"))[:3]:  # a test split of another size than val's
        f.unlink()
    run = tmp_path / "run"
    train(
        config.load(
            None,
            [
                f"run.dir={run}",
                f"data.root={data}",
                "model.name=small_cnn",
                "model.args={width: 8}",
                "run.epochs=2",
                "data.eval.transforms=[resize: [20, 24]]",
                "precision.mode=fp32",
                "log.tensorboard=false",
                "log.progress=false",
            ],
        ),
        quiet=True,
    )
    path = export(run, "onnx", out=tmp_path / "m.onnx")["path"]
    ref, got = evaluate_run(run, split="test"), evaluate_file(path, split="test")
    assert got["count"] == ref["count"] == 9 and got["split"] == "test"
    assert got["confusion"] == ref["confusion"] and got["loss"] == pytest.approx(ref["loss"], abs=2e-7)


def test_eval_cli_on_a_file(digits_run, tmp_path, cli_in_process):
    """The CLI takes the file where it took a run folder: --json gives evaluate_file's dict; --weights (a run
    folder's choice) and an eval.tta the graph does not hold are refused in one line, exit 2."""
    path = export(digits_run, "onnx", out=tmp_path / "m.onnx")["path"]
    r = cli_in_process("eval", "-r", path, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["count"] == 360
    r = cli_in_process("eval", "-r", path)
    assert r.returncode == 0 and "m.onnx (onnxruntime)" in r.stdout and "balanced_acc" in r.stdout, r.stdout
    for args, says in ((["--weights", "last"], "one model file"), (["eval.tta=hflip"], "holds eval.tta=none")):
        r = cli_in_process("eval", "-r", path, *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(UsageError, match="model file not found"):
        evaluate_file(tmp_path / "missing.onnx")

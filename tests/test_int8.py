"""`export --int8`: onnxruntime's static quantization of a run's ONNX graph, calibrated on its own training images.

References: the training split's images read straight from the dataset (not through the loader under test), a
second export of the same run (bytes), and the refusals' one line."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from torchsprint import config
from torchsprint.commands import quantize
from torchsprint.errors import UsageError
from torchsprint.train.run import train


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default digits run (8x8 grey images, small CNN), 2 epochs, fp32 (so eval and export agree on any CPU)."""
    run = tmp_path_factory.mktemp("int8") / "run"
    train(config.load(None, [f"run.dir={run}", "run.epochs=2", "log.tensorboard=false", "log.progress=false",
                             "model.args={width: 8}", "precision.mode=fp32"]), quiet=True)
    return run


def meta_of(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_calibration_images_are_the_seeded_training_sample_through_the_eval_spec(digits_run):
    """Bug caught: calibrating on the validation split (export's parity loader), on augmented or shuffled training
    batches, or on a sample that ignores the seed; the reference is the dataset's own training tensors."""
    from torchsprint.commands.trained import load_run
    from torchsprint.data.core import DATASETS

    trained = load_run(digits_run)
    batches = quantize.calibration_batches(trained, 100, seed=0, uint8_input=True, tta="none")
    got = torch.cat([torch.from_numpy(b) for b in batches])
    train_images = DATASETS.get("digits")(trained.cfg.data).train.images
    idx = quantize.calibration_indices(len(train_images), 100, seed=0)
    assert len(set(idx)) == 100 and idx != list(range(100))  # a sample, not the first 100
    assert torch.equal(got, train_images[idx])
    assert quantize.calibration_indices(len(train_images), 100, seed=1) != idx


def test_int8_export_is_bit_identical_for_the_same_run_and_n_and_records_how(digits_run, tmp_path):
    """Bug caught: anything unseeded or timed in the file (a sample drawn from the global RNG, a timestamp or a
    temp path in the metadata): the two files differ. A different N must change the file (else N is ignored)."""
    a = quantize.export_int8(digits_run, out=tmp_path / "a.onnx", calibration=64)
    quantize.export_int8(digits_run, out=tmp_path / "b.onnx", calibration=64)
    c = quantize.export_int8(digits_run, out=tmp_path / "c.onnx", calibration=32)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "c.onnx").read_bytes()
    q = json.loads(meta_of(a["path"])["quantization"])
    assert q == a["quantization"]
    assert {k: q[k] for k in ("type", "format", "activations", "weights", "per_channel", "calibration_images",
                              "calibration_split", "seed")} == {
        "type": "static", "format": "QDQ", "activations": "uint8", "weights": "int8", "per_channel": True,
        "calibration_images": 64, "calibration_split": "train", "seed": 0}
    assert json.loads(meta_of(c["path"])["quantization"])["calibration_images"] == 32
    # the fp32 export's metadata travels with it (classes, eval spec: what predict and serve read)
    assert json.loads(meta_of(a["path"])["classes"]) == [str(i) for i in range(10)]
    ops = {n.op_type for n in onnx.load(a["path"]).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ: the graph really is quantized


def test_activation_type_is_honoured(digits_run, tmp_path):
    """Bug caught: --int8-activations s8 recorded but not passed to quantize_static (the graph's activation
    zero points stay uint8)."""
    r = quantize.export_int8(digits_run, out=tmp_path / "s8.onnx", calibration=32, activations="s8")
    model = onnx.load(r["path"])
    quantized = {n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    types = {init.data_type for init in model.graph.initializer if init.name in quantized}
    assert types == {onnx.TensorProto.INT8} and r["quantization"]["activations"] == "int8"
    r = quantize.export_int8(digits_run, out=tmp_path / "u8.onnx", calibration=32)
    model = onnx.load(r["path"])
    quantized = {n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert {i.data_type for i in model.graph.initializer if i.name in quantized} == {onnx.TensorProto.UINT8}


@pytest.mark.parametrize("args, says", [
    (["--int8", "--format", "torchscript"], "--int8 quantizes an ONNX graph"),
    (["--int8", "--format", "safetensors"], "--int8 quantizes an ONNX graph"),
    (["--int8", "--calibration", "0"], "argument --calibration: must be >= 1"),
    (["--calibration", "64"], "--int8 is not given"),
    (["--int8-activations", "s8"], "--int8 is not given"),
])
def test_int8_settings_are_refused_in_one_line(digits_run, cli_in_process, args, says):
    """Bug caught: a setting silently ignored (--int8 with another format writes an fp32 file; --calibration
    without --int8 does nothing)."""
    r = cli_in_process("export", "-r", digits_run, *args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (digits_run / "export").exists() or not list((digits_run / "export").glob("*int8*"))


def test_calibration_zero_is_refused_by_the_function_too(digits_run, tmp_path):
    with pytest.raises(UsageError, match="at least 1 training image"):
        quantize.export_int8(digits_run, out=tmp_path / "m.onnx", calibration=0)

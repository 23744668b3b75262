"""`export --int8`: onnxruntime's static quantization of a run's ONNX graph, calibrated on its own training images.

References: the training split's images read straight from the dataset (not through the loader under test), a
second export of the same run (bytes), and the refusals' one line."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from conftest import train_digits_fp32
from torchsprint import config
from torchsprint.commands import int8_gate, quantize
from torchsprint.errors import UsageError


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The default digits run (8x8 grey images, small CNN), 2 epochs, fp32 (so eval and export agree on any CPU)."""
    return train_digits_fp32(tmp_path_factory.mktemp("int8"))


@pytest.fixture
def int8_faster(monkeypatch):
    """A stub clock (int8_gate.timed) that times the int8 graph at half fp32's time, whatever this CPU does: the
    tests that are not about speed must not depend on a timing. Returns the labels it was asked for, in order."""
    asked = []

    def timed(label, run):
        asked.append(label)
        run()  # the graph still runs: a broken session fails here
        return {"fp32": 0.02, "int8": 0.01}[label]

    monkeypatch.setattr(int8_gate, "timed", timed)
    return asked


@pytest.fixture
def int8_slower(monkeypatch):
    """The stub clock the other way: int8 takes 1.25x fp32's time."""
    monkeypatch.setattr(int8_gate, "timed", lambda label, run: {"fp32": 0.02, "int8": 0.025}[label])


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


def test_int8_export_is_bit_identical_for_the_same_run_and_n_and_records_how(digits_run, tmp_path, int8_faster):
    """Bug caught: anything unseeded or timed in the file (a sample drawn from the global RNG, a timestamp or a
    temp path in the metadata): the two files differ. A different N must change the file (else N is ignored)."""
    a = quantize.export_int8(digits_run, out=tmp_path / "a.onnx", calibration=64)
    quantize.export_int8(digits_run, out=tmp_path / "b.onnx", calibration=64)
    c = quantize.export_int8(digits_run, out=tmp_path / "c.onnx", calibration=32)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert (tmp_path / "a.onnx").read_bytes() != (tmp_path / "c.onnx").read_bytes()
    q = json.loads(meta_of(a["path"])["quantization"])
    assert q == a["quantization"]
    assert {
        k: q[k]
        for k in (
            "type",
            "format",
            "activations",
            "weights",
            "per_channel",
            "calibration_images",
            "calibration_split",
            "seed",
        )
    } == {
        "type": "static",
        "format": "QDQ",
        "activations": "uint8",
        "weights": "int8",
        "per_channel": True,
        "calibration_images": 64,
        "calibration_split": "train",
        "seed": 0,
    }
    assert json.loads(meta_of(c["path"])["quantization"])["calibration_images"] == 32
    # the fp32 export's metadata travels with it (classes, eval spec: what predict and serve read)
    assert json.loads(meta_of(a["path"])["classes"]) == [str(i) for i in range(10)]
    ops = {n.op_type for n in onnx.load(a["path"]).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ: the graph really is quantized


def test_activation_type_is_honoured(digits_run, tmp_path, int8_faster):
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


@pytest.mark.parametrize(
    "args, says",
    [
        (["--int8", "--format", "torchscript"], "--int8 quantizes an ONNX graph"),
        (["--int8", "--format", "safetensors"], "--int8 quantizes an ONNX graph"),
        (["--int8", "--calibration", "0"], "argument --calibration: must be >= 1"),
        (["--calibration", "64"], "--int8 is not given"),
        (["--int8-activations", "s8"], "--int8 is not given"),
    ],
)
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


def test_the_gate_refuses_a_model_damaged_on_purpose_and_force_writes_it(
    digits_run, tmp_path, monkeypatch, int8_faster
):
    """Calibrated on blank images (every activation's range measured on a constant grey image: the real ranges
    clip), the int8 graph loses ~22 points of top-1 here (0.66 vs 0.88). Bug caught: a gate that compares the
    int8 graph with itself, checks only speed, or reads the figures of the fp32 graph for both: it would write
    the file. The damage is checked independently: `eval` of the forced file against the run's own eval."""
    from torchsprint.commands.eval_export import evaluate_file
    from torchsprint.train.evaluation import evaluate_run

    real = quantize.calibration_batches
    monkeypatch.setattr(
        quantize, "calibration_batches", lambda *a, **k: [b * 0 for b in real(*a, **k)]
    )  # same shapes and dtype, blank
    out = tmp_path / "damaged.onnx"
    with pytest.raises(UsageError, match=r"refused, .*damaged.onnx not written: its top-1 is [\d.]+ points below") as e:
        quantize.export_int8(digits_run, out=out, calibration=64)
    assert "not faster" not in str(e.value) and "\n" not in str(e.value)  # the stub clock made it faster
    assert not out.exists()
    r = quantize.export_int8(digits_run, out=out, calibration=64, force=True)
    assert out.exists() and r["forced"] and not r["check"].passed
    fp32_top1 = evaluate_run(digits_run)["top1"]
    assert evaluate_file(out)["top1"] < fp32_top1 - 0.05  # the damage is real, not a gate artefact
    assert r["check"].fp32["top1"] == pytest.approx(fp32_top1, abs=1.5 / 360)  # the fp32 side is the run's model


def test_the_gate_refuses_an_int8_graph_that_is_not_faster_and_force_says_the_figures(
    digits_run, tmp_path, int8_slower, cli_in_process
):
    """The stub clock makes int8 1.25x slower. Bug caught: a gate that checks accuracy only, or compares the
    speeds the wrong way round (int8 0.80x fp32's images/s written). --force writes it and prints the figures."""
    out = tmp_path / "slow.onnx"
    r = cli_in_process("export", "-r", digits_run, "--int8", "--calibration", "64", "--out", out)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "it is not faster (0.80x fp32's images/s)" in line, line
    assert "top-1 int8" in line and "img/s at batch 32" in line and "--force" in line
    assert not out.exists()
    r = cli_in_process("export", "-r", digits_run, "--int8", "--calibration", "64", "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert out.exists()
    assert "int8 check FAILED (it is not faster (0.80x fp32's images/s)), written anyway" in r.stdout, r.stdout
    assert "(0.80x; medians of 15 interleaved runs after 3 warm-ups)" in r.stdout


def test_speed_is_measured_interleaved_after_warm_ups_at_the_serving_batch(
    digits_run, tmp_path, int8_faster, monkeypatch
):
    """Bug caught: one graph timed after the other (a machine that warms up or slows down favours one), no
    warm-up, or a batch other than the run's serve.max_batch. The stub clock records which graph each timing was."""
    calls = {"fp32": 0, "int8": 0}
    real = int8_gate.measure_speed

    def counting(runs, images, **kw):
        assert images == 32  # serve.max_batch's default: the batch serve runs
        counted = {k: (lambda k=k, f=f: (calls.__setitem__(k, calls[k] + 1), f())) for k, f in runs.items()}
        return real(counted, images, **kw)

    monkeypatch.setattr(int8_gate, "measure_speed", counting)
    r = quantize.export_int8(digits_run, out=tmp_path / "m.onnx", calibration=32)
    rounds = int8_gate.ROUNDS
    assert int8_faster == ["fp32", "int8", "int8", "fp32"] * (rounds // 2) + ["fp32", "int8"] * (rounds % 2)
    assert calls == {"fp32": rounds + int8_gate.WARMUP, "int8": rounds + int8_gate.WARMUP}
    assert r["check"].ratio == pytest.approx(2.0) and r["check"].passed


@pytest.mark.parametrize(
    "int8, balanced, refused",
    [
        ({"top1": 0.90, "balanced_acc": 0.90}, False, []),  # exactly 1 point: accepted
        ({"top1": 0.8999, "balanced_acc": 0.90}, False, ["top-1"]),
        ({"top1": 0.91, "balanced_acc": 0.85}, False, []),  # balanced accuracy not monitored: not held
        ({"top1": 0.91, "balanced_acc": 0.85}, True, ["balanced accuracy"]),
    ],
)
def test_judge_holds_top1_and_monitored_balanced_accuracy_to_one_point(int8, balanced, refused):
    """Bug caught: balanced accuracy ignored where the run monitors it (a majority-class model passes on top-1),
    a drop of exactly 1 point refused (float rounding of 0.91 - 0.90), or the fraction read as points."""
    fp32 = {"top1": 0.91, "balanced_acc": 0.91}
    got = int8_gate.judge(fp32, int8, {"fp32": 100.0, "int8": 200.0}, balanced)
    assert [next(n for n in ("balanced accuracy", "top-1") if n in r) for r in got] == refused
    assert int8_gate.judge(fp32, fp32, {"fp32": 100.0, "int8": 100.0}, balanced) == [
        "it is not faster (1.00x fp32's images/s)"
    ]  # equal speed is not faster


@pytest.fixture(scope="module")
def val_pngs(digits_run, tmp_path_factory):
    """The digits validation split as lossless PNGs in class folders: [(path, label)] in the split's order."""
    from PIL import Image

    from torchsprint import runtime
    from torchsprint.data import build_loaders

    cfg = config.load(digits_run / "config.yaml", ["data.backend=cpu"])
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)
    loaders.val.set_epoch(0)
    folder, out = tmp_path_factory.mktemp("val-png"), []
    for images, labels, _ in loaders.val.loader:
        for img, label in zip(images, labels.tolist()):
            p = folder / str(label) / f"{len(out)}.png"
            p.parent.mkdir(exist_ok=True)
            Image.fromarray(img[0].numpy()).save(p)
            out.append((p, label))
    return out


@pytest.mark.parametrize("uint8_input", [False, True])
def test_predict_on_an_int8_file_equals_eval_of_it(digits_run, tmp_path, val_pngs, int8_faster, uint8_input):
    """predict reads image files through its own decoder and batching, eval reads the split through the loader:
    the same int8 graph must give the same class for every image, so the confusion matrices are equal. Bugs
    caught: predict ranking tied logits by topk (the higher class index; eval's argmax takes the lower: 2 of these
    360 images differed, int8 logits tie on their quantization grid), predict running the file's fp32 neighbour
    or another preprocessing (normalised twice for a --uint8-input graph), or its note still saying fp32."""
    from torchsprint.commands.eval_export import evaluate_file
    from torchsprint.commands.predict import Predictor

    path = quantize.export_int8(digits_run, out=tmp_path / "m.onnx", calibration=64, uint8_input=uint8_input)["path"]
    ev = evaluate_file(path)
    predictor = Predictor.from_file(path)
    assert predictor.inference.precision == "int8" and "uint8 activations" in predictor.inference.note
    results = predictor.predict([str(val_pngs[0][0].parent.parent)], topk=1)
    by_path = {r["input"]: int(r["top"][0]["class"]) for r in results}
    confusion = [[0] * 10 for _ in range(10)]
    for p, label in val_pngs:
        confusion[label][by_path[str(p)]] += 1
    assert len(by_path) == ev["count"] == 360
    assert confusion == ev["confusion"]
    with pytest.raises(UsageError, match="is an int8 graph"):
        Predictor.from_file(path, precision="fp32")


def test_serve_answers_with_the_int8_file_as_predict_does(digits_run, tmp_path, val_pngs, int8_faster):
    """serve takes the int8 file as any .onnx (onnxruntime runtime): its answers equal predict's on the same file,
    /ready says int8. Bug caught: serve refusing the file or running another model than predict."""
    import httpx

    from serve_helpers import TOL, ThreadServer
    from torchsprint.commands.predict import Predictor

    path = quantize.export_int8(digits_run, out=tmp_path / "m.onnx", calibration=64)["path"]
    paths = [p for p, _ in val_pngs[:4]]
    ref = Predictor.from_file(path).predict([str(p) for p in paths], topk=10)
    server = ThreadServer(path)
    try:
        assert httpx.get(server.url + "/ready", timeout=30).json()["precision"] == "int8"
        for p, r in zip(paths, ref):
            answer = httpx.post(
                server.url + "/predict",
                content=p.read_bytes(),
                params={"topk": 10},
                timeout=60,
                headers={"content-type": "application/octet-stream"},
            ).json()["predictions"][0]
            got, want = ({t["class"]: t["prob"] for t in x["top"]} for x in (answer, r))
            assert got.keys() == want.keys() and max(abs(got[c] - want[c]) for c in got) <= TOL
    finally:
        server.close()


def test_predict_breaks_tied_logits_as_the_metrics_argmax_does():
    """The tie rule on its own (the int8 test above meets ties only where training lands on some): equal logits go
    to the lower class index, as the metrics' argmax. Bug caught: softmax(...).topk, which answered class 3 here."""
    from torchsprint.tasks.core import get_task

    logits = torch.tensor([[0.1, 0.5, 0.75, 0.75, 0.2], [0.9, 0.0, 0.9, 0.9, 0.9]])
    top = get_task("classification").postprocess(logits, list("abcde"), {"topk": 3})
    assert [[t["class"] for t in r["top"]] for r in top] == [["c", "d", "b"], ["a", "c", "d"]]
    assert [r["top"][0]["class"] for r in top] == [list("abcde")[i] for i in logits.argmax(1).tolist()]

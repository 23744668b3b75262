"""Export and predict against independent references: the PyTorch model before export and `torchsprint eval`."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchsprint import cli, config
from torchsprint.commands.export import export, onnx_logits
from torchsprint.commands.predict import Predictor
from torchsprint.commands.trained import load_run
from torchsprint.errors import UsageError
from torchsprint.train.evaluation import evaluate_run
from torchsprint.train.run import train


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("digits") / "run"
    # "best" = the highest val loss, i.e. epoch 1: best.safetensors (what export and predict use by default) is
    # not last.safetensors, so reading the wrong one shows
    cfg = config.load(
        None,
        [
            f"run.dir={run}",
            "run.epochs=3",
            "log.tensorboard=false",
            "model.args={width: 16}",
            "checkpoint.monitor=val/loss",
            "checkpoint.mode=max",
        ],
    )
    assert train(cfg, quiet=True)["best_epoch"] == 1
    return run


def val_tensors(run: Path):
    """The digits validation split as the eval loader sees it (uint8) and its labels."""
    from torchsprint import runtime
    from torchsprint.data import build_loaders

    cfg = config.load(run / "config.yaml", ["data.backend=cpu"])
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)
    loaders.val.set_epoch(0)
    xs, ys = zip(*[(b[0], b[1]) for b in loaders.val.loader])
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("uint8_input", [False, True])
def test_onnx_top1_equals_eval_on_whole_val_set(digits_run, tmp_path, uint8_input):
    r = export(digits_run, "onnx", out=tmp_path / "m.onnx", uint8_input=uint8_input)
    assert r["max_abs_diff"] < 1.8e-6  # measured 6.0e-07 (logits up to 3.5)
    x, y = val_tensors(digits_run)
    trained = load_run(digits_run)
    with torch.no_grad():
        from torchsprint.commands.export import normalize

        ref = trained.model(normalize(x, trained.pipeline))
    got = onnx_logits(Path(r["path"]), x if uint8_input else normalize(x, trained.pipeline))
    assert got.shape == (len(y), 10)  # dynamic batch: the whole split in one call
    assert (got - ref).abs().max().item() < 2.9e-6  # measured 9.5e-07 over the 360 images
    ev = evaluate_run(digits_run)
    assert (got.argmax(1) == y).float().mean().item() == pytest.approx(ev["top1"], abs=1e-6)
    import onnx

    meta = {p.key: p.value for p in onnx.load(r["path"]).metadata_props}
    assert json.loads(meta["classes"]) == [str(i) for i in range(10)]
    assert meta["input_dtype"] == ("uint8" if uint8_input else "float32")
    assert "eval_transforms" in meta and json.loads(meta["mean"])


def test_predict_on_files_matches_eval(digits_run, tmp_path):
    """Write the val split as lossless PNGs in class folders, predict them, compare with `eval`."""
    x, y = val_tensors(digits_run)
    paths, labels = [], []
    for i, (img, label) in enumerate(zip(x, y)):
        p = tmp_path / "val" / str(int(label)) / f"{i}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img[0].numpy()).save(p)
        paths.append(str(p))
        labels.append(str(int(label)))
    ev = evaluate_run(digits_run)
    for backend in ("torch", "onnx"):
        results = Predictor.from_run(digits_run, backend=backend).predict([str(tmp_path / "val")], topk=3)
        by_path = {r["input"]: r for r in results}
        acc = np.mean([by_path[p]["top"][0]["class"] == lab for p, lab in zip(paths, labels)])
        assert acc == pytest.approx(ev["top1"], abs=1e-6), backend
        assert all(len(r["top"]) == 3 for r in results)


def test_bad_inputs_get_error_entries_and_others_still_predict(digits_run, tmp_path, capsys):
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(good)
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("not an image at all")
    jpg = tmp_path / "trunc.jpg"
    Image.fromarray(np.full((8, 8), 128, dtype=np.uint8)).save(jpg)
    jpg.write_bytes(jpg.read_bytes()[:40])
    (tmp_path / "nothing").mkdir()
    inputs = [
        str(good),
        str(tmp_path / "missing.png"),
        str(tmp_path / "empty.png"),
        str(tmp_path / "notes.jpg"),
        str(jpg),
        str(tmp_path / "nothing"),
    ]
    results = Predictor.from_run(digits_run).predict(inputs)
    assert "top" in results[0]
    assert [("error" in r) for r in results] == [False, True, True, True, True, True]
    assert cli.main(["predict", "-r", str(digits_run), *inputs, "--out", str(tmp_path / "out.jsonl")]) == 0, (
        capsys.readouterr().err
    )
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and sum("error" in x for x in lines) == 5
    assert cli.main(["predict", "-r", str(digits_run), *inputs, "--strict"]) == 1
    assert cli.main(["predict", "-r", str(digits_run), inputs[1], inputs[2]]) == 1  # nothing predicted


@pytest.mark.parametrize("fmt", ["safetensors", "torchscript"])
def test_other_formats_round_trip(digits_run, tmp_path, fmt):
    """Read back with the format's own loader, not torchsprint's: the safetensors file holds the run's best weights
    bit for bit; the TorchScript module gives the PyTorch model's logits on the whole val split (measured 0.0)."""
    from safetensors.torch import load_file

    from torchsprint.commands.export import normalize

    r = export(digits_run, fmt, out=tmp_path / f"m.{fmt}")
    assert r["max_abs_diff"] == 0.0  # its own parity check: measured 0.0 for both
    if fmt == "safetensors":
        best, got = load_file(str(digits_run / "best.safetensors")), load_file(r["path"])
        assert got.keys() == best.keys() and all(torch.equal(got[k], best[k]) for k in best)
    else:
        x, _ = val_tensors(digits_run)
        trained = load_run(digits_run)
        with torch.no_grad():
            xn = normalize(x, trained.pipeline)
            assert torch.equal(torch.jit.load(r["path"])(xn), trained.model(xn))


def test_exported_safetensors_predicts_without_the_run_folder(digits_run, tmp_path):
    r = export(digits_run, "safetensors", out=tmp_path / "m.safetensors")
    x, _ = val_tensors(digits_run)
    a = Predictor.from_file(r["path"]).logits(x[:16])
    b = Predictor.from_run(digits_run).logits(x[:16])
    assert torch.equal(a, b)


def test_tensorrt_says_what_is_missing(digits_run, tmp_path):
    with pytest.raises(UsageError, match="TensorRT"):
        export(digits_run, "tensorrt", out=tmp_path / "m.engine")


def test_tensorrt_parity_tolerates_near_ties_only(digits_run, monkeypatch):
    """The engine check's logic (TensorRT itself does not run here; tensorrt_logits stands in for the engine's
    output): a swap of two classes within 1% of the image's logit range passes, a swap of a clear top-1 fails,
    TF32-sized noise passes."""
    import torchsprint.commands.export as ex
    from torchsprint.commands.trained import load_run

    trained = load_run(digits_run, "best")
    model = trained.model

    def with_near_tie(x):  # image 0's runner-up 0.1% of its logit range below its top-1
        y = model(x).clone()
        top, other = int(y[0].argmax()), int(y[0].argmin())
        y[0, other] = y[0, top] - 1e-3 * (y[0].max() - y[0].min())
        return y

    monkeypatch.setattr(trained, "model", with_near_tie)
    example = ex.sample_batch(trained)
    with torch.no_grad():
        ref = with_near_tie(ex.normalize(example, trained.pipeline))
    top2 = ref.topk(2, dim=-1)
    margin = (top2.values[:, 0] - top2.values[:, 1]) / (ref.max(-1).values - ref.min(-1).values)
    clear = int(margin[1:].argmax()) + 1
    assert margin[0] < 0.01 < margin[clear]

    def swapped(i):  # the engine's logits with image i's top-1 and runner-up exchanged
        got = ref.clone()
        a, b = top2.indices[i]
        got[i, a], got[i, b] = ref[i, b], ref[i, a]
        return got

    monkeypatch.setattr(ex, "tensorrt_logits", lambda path, x: swapped(0))
    assert ex.parity("tensorrt", Path("m.engine"), trained, example, False) > 0
    monkeypatch.setattr(ex, "tensorrt_logits", lambda path, x: swapped(clear))
    with pytest.raises(UsageError, match="top-1 class differs from PyTorch's on 1 of"):
        ex.parity("tensorrt", Path("m.engine"), trained, example, False)
    monkeypatch.setattr(ex, "tensorrt_logits", lambda path, x: ref + 1e-4)
    assert ex.parity("tensorrt", Path("m.engine"), trained, example, False) == pytest.approx(1e-4, rel=1e-2)


def test_parity_failure_fails_the_export(digits_run, tmp_path):
    with pytest.raises(UsageError, match="parity check failed"):
        export(digits_run, "onnx", out=tmp_path / "m.onnx", tolerance=-1.0)


@pytest.mark.gpu
def test_gpu_decode_predict_agrees_with_cpu_path(tmp_path):
    """nvJPEG + GPU eval preprocessing vs the CPU decoder path: top-1 agreement >= 99.5% on real JPEGs."""
    run = tmp_path / "run"
    cfg = config.load(
        None,
        [
            f"run.dir={run}",
            "data.dataset=synthetic_jpeg",
            f"data.root={tmp_path / 'data'}",
            "data.options={num_images: 400, size: [96, 72]}",
            "run.epochs=2",
            "log.tensorboard=false",
            "data.train.transforms=[random_resized_crop: {size: 64}, hflip, normalize: imagenet]",
            "data.eval.transforms=[resize: 72, center_crop: 64, normalize: imagenet]",
            "model.args={width: 8}",
            "run.device=cpu",
        ],
    )
    train(cfg, quiet=True)
    files = sorted(str(p) for p in (tmp_path / "data").rglob("*.jpg"))
    cpu = Predictor.from_run(run, device="cpu").predict(files, topk=1)
    gpu = Predictor.from_run(run, device="cuda").predict(files, topk=1)
    agree = np.mean([a["top"][0]["class"] == b["top"][0]["class"] for a, b in zip(cpu, gpu)])
    assert agree >= 0.995, agree


def test_predict_on_a_fixed_size_onnx_gives_an_image_of_another_size_one_error_row(digits_run, tmp_path, capsys):
    """The ONNX graph of a run whose eval spec keeps each file's size is fixed at the validation images' 8x8 (export
    fixes H and W): a 10x12 file gets one row `error: ...` naming the graph's input and the image's size after the
    eval preprocessing and the resize to add; the 8x8 files around it are predicted; the CLI exits 0 without a
    traceback. Bug caught: onnxruntime's InvalidArgument escaping predict as a traceback (every file lost)."""
    path = export(digits_run, "onnx", out=tmp_path / "m.onnx")["path"]
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(good)
    wide = tmp_path / "wide.png"
    Image.fromarray(np.zeros((10, 12), dtype=np.uint8)).save(wide)
    rows = Predictor.from_file(path).predict([str(good), str(wide), str(good)])
    assert ["top" in r for r in rows] == [True, False, True], rows
    error = rows[1]["error"]
    assert "Nx1x8x8" in error and "1x10x12" in error and "data.eval.transforms" in error and "\n" not in error, error
    assert cli.main(["predict", "-r", path, str(good), str(wide)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "1 predicted, 1 failed" in out.out, out


def test_the_format_flag_offers_exactly_the_registered_exporters():
    """`export --format` names its choices without importing torch (commands/args.py EXPORT_FORMATS); fails when a
    format is registered in EXPORTERS and not offered, or offered and gone."""
    from torchsprint.commands.args import EXPORT_FORMATS
    from torchsprint.commands.export import EXPORTERS

    assert sorted(EXPORT_FORMATS) == sorted(EXPORTERS.names())

"""task=image_to_image end to end on real PNGs: pairing, shared crops/flips, PSNR gain over the blurred input, predict,
ONNX."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchsprint import cli, config
from torchsprint.errors import UsageError
from torchsprint.train.run import train

BASE = [
    "task=image_to_image",
    "data.dataset=synthetic_blur",
    "log.tensorboard=false",
    "log.progress=false",
    "model.name=unet_small",
    "model.args={width: 16}",
    "data.batch_size=8",
    "optim.name=adam",
    "optim.lr=0.003",
    "optim.weight_decay=0",
    "data.options={num_images: 48, val_images: 12}",
    "data.train.transforms=[{random_crop: 24}, hflip]",
]


def psnr_of_files(folder: Path) -> float:
    """Mean per-image PSNR (dB, [0, 1] units) of val/input vs val/target, computed with numpy from the files."""
    out = []
    for p in sorted((folder / "val" / "input").glob("*.png")):
        x = np.asarray(Image.open(p), dtype=np.float64) / 255
        y = np.asarray(Image.open(folder / "val" / "target" / p.name), dtype=np.float64) / 255
        out.append(10 * np.log10(1 / np.mean((x - y) ** 2)))
    return float(np.mean(out))


@pytest.fixture(scope="module")
def deblur_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("deblur")
    cfg = config.load(None, BASE + [f"data.root={root / 'data'}", f"run.dir={root / 'run'}", "run.epochs=25"])
    summary = train(cfg, quiet=True)
    return root / "run", summary, next((root / "data").glob("synthetic_blur-*"))


def test_improves_psnr_over_blurred_input(deblur_run):
    run, summary, data = deblur_run
    baseline = psnr_of_files(data)  # the identity map's PSNR: what the blur leaves
    assert 20 < baseline < 30
    assert summary["final"]["val/psnr"] > baseline + 0.5, (summary["final"], baseline)
    assert 0 < summary["final"]["val/ssim"] <= 1
    assert not (run / "confusion_matrix.csv").exists()


def test_predict_writes_images_and_onnx_matches(deblur_run, tmp_path, capsys):
    from torchsprint.commands.export import export
    from torchsprint.commands.trained import load_run
    from torchsprint.tasks.core import to_pixels

    run, _, data = deblur_run
    files = sorted((data / "val" / "input").glob("*.png"))[:3]
    assert cli.main(["predict", "-r", str(run), *map(str, files), "--out-dir", str(tmp_path / "out")]) == 0, (
        capsys.readouterr().err
    )
    model = load_run(run).model
    for f in files:
        x = torch.from_numpy(np.array(Image.open(f))).permute(2, 0, 1)[None].float() / 255
        with torch.no_grad():
            ref = to_pixels(model(x))[0].permute(1, 2, 0).numpy()  # the model before export, fed by hand
        got = np.asarray(Image.open(tmp_path / "out" / f.name))
        assert got.shape == (32, 32, 3) and np.abs(got.astype(int) - ref).max() <= 1
    e = export(run, "onnx", out=tmp_path / "m.onnx")
    assert e["max_abs_diff"] < 1e-4
    from torchsprint.commands.predict import Predictor

    onnx_out = Predictor.from_file(tmp_path / "m.onnx").predict([str(files[0])])[0]["image"]
    torch_out = Predictor.from_run(run).predict([str(files[0])])[0]["image"]
    assert (onnx_out.int() - torch_out.int()).abs().max() <= 1


def make_identity_pairs(root: Path, n: int = 6, missing: str | None = None):
    """input == target (random noise PNGs): any crop or flip drawn separately for the two would differ."""
    g = np.random.default_rng(0)
    for side in ("input", "target"):
        (root / side / "sub").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        arr = g.integers(0, 256, (20, 20, 3), dtype=np.uint8)
        for side in ("input", "target"):
            if side == "target" and f"sub/{i}" == missing:
                continue
            Image.fromarray(arr).save(root / side / "sub" / f"{i}.png")
    return root


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_crop_and_flip_drawn_once_per_pair(tmp_path, backend):
    from torchsprint import runtime
    from torchsprint.data import build_loaders

    make_identity_pairs(tmp_path / "pairs")
    cfg = config.load(
        None,
        [
            "task=image_to_image",
            "data.dataset=paired_folder",
            f"data.root={tmp_path / 'pairs'}",
            f"data.backend={backend}",
            "data.batch_size=4",
            "data.val_fraction=0.34",
            "data.train.transforms=[{random_crop: 12}, hflip, vflip]",
        ],
    )
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=3)
    assert loaders.info.in_channels == 3 and loaders.info.num_classes == 3
    for epoch in range(3):
        loaders.train.set_epoch(epoch)
        for x, y in loaders.train:
            assert x.shape == y.shape == (4, 3, 12, 12)
            assert torch.equal(x, y)
    # the crops really vary (so equality above is not trivial)
    loaders.train.set_epoch(0)
    a = next(iter(loaders.train))[0]
    loaders.train.set_epoch(1)
    assert not torch.equal(a, next(iter(loaders.train))[0])


def test_missing_partner_and_bad_specs_are_named(tmp_path):
    make_identity_pairs(tmp_path / "pairs", missing="sub/2")
    cfg = config.load(
        None,
        [
            "task=image_to_image",
            "data.dataset=paired_folder",
            f"data.root={tmp_path / 'pairs'}",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(UsageError, match=r"sub/2\.png has no target partner"):
        train(cfg, quiet=True)
    (tmp_path / "pairs" / "target" / "sub" / "2.png").write_bytes(
        (tmp_path / "pairs" / "input" / "sub" / "2.png").read_bytes()
    )
    for spec, msg in (("[color_jitter: {brightness: 0.2}]", "geometric"), ("[normalize: imagenet]", "normalize: none")):
        bad = config.load(
            None,
            [
                "task=image_to_image",
                "data.dataset=paired_folder",
                f"data.root={tmp_path / 'pairs'}",
                f"run.dir={tmp_path / 'run'}",
                f"data.train.transforms={spec}",
            ],
        )
        with pytest.raises(UsageError, match=msg):
            train(bad, quiet=True)

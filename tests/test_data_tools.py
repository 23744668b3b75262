"""`torchsprint data check` and `data compare` through the CLI entry point, on real JPEG files."""

import torch
from PIL import Image

from torchsprint.cli import main


def write_cfg(tmp_path, backend="cpu"):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""
data:
  dataset: synthetic_jpeg
  root: {tmp_path / 'data'}
  options: {{num_images: 12, val_images: 6, size: [48, 36], classes: 3}}
  backend: {backend}
  batch_size: 4
  train: {{transforms: [{{random_resized_crop: {{size: 24}}}}, hflip, {{normalize: imagenet}}]}}
  eval: {{transforms: [{{resize: 28}}, {{center_crop: 24}}, {{normalize: imagenet}}]}}
""")
    return cfg


def test_data_check_reports_and_writes_a_grid(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    assert main(["data", "check", "-c", str(cfg), "--batches", "2", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "train: 2/3 batches, 8 images, shape [(3, 24, 24)]" in out and "unreadable 0" in out and "images/s" in out
    assert "class_00_disc" in out and out.strip().endswith("ok")
    with Image.open(tmp_path / "out" / "train_samples.png") as im:
        assert im.size[0] > 24 * 4


def test_data_check_counts_unreadable_files(tmp_path, capsys):
    cfg = write_cfg(tmp_path, "memory")
    main(["data", "check", "-c", str(cfg), "--batches", "1", "--out", str(tmp_path / "o")])
    first = sorted((tmp_path / "data").glob("*/train/class_00_disc/*.jpg"))[0]
    first.write_bytes(b"")
    capsys.readouterr()
    main(["data", "check", "-c", str(cfg), "data.on_bad_sample=skip", "--batches", "1", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "unreadable 1" in out and first.name in out and "empty file" in out


def test_data_compare_says_what_it_compared(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    assert main(["data", "compare", "-c", str(cfg), "--images", "6"]) == 0
    out = capsys.readouterr().out
    assert "cpu: pil decode + torchvision v2" in out and "max |diff|   0" in out
    assert "gpu-backend ops on CPU (torchvision decode)" in out
    if not torch.cuda.is_available():
        assert "GPU paths unavailable" in out

"""`torchsprint data check` and `data compare` through the CLI entry point, on real JPEG files."""

import json

import torch
from PIL import Image

from torchsprint.cli import main


def write_cfg(tmp_path, backend="cpu"):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"""
data:
  dataset: synthetic_jpeg
  root: {tmp_path / "data"}
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
    assert "train: 12 samples, unreadable 0, sizes 48x36 to 48x36" in out
    assert "loader (cpu) train: 2/3 batches, shape [(3, 24, 24)]" in out and "images/s" in out
    assert "class_00_disc" in out and out.strip().endswith("ok")
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert report["splits"]["val"]["class_counts"] == {"class_00_disc": 2, "class_01_square": 2, "class_02_triangle": 2}
    with Image.open(tmp_path / "out" / "samples.png") as im:
        # 3 class rows of 2 train + 2 eval tiles of >= 128 px each (24 px images upscaled x6 = 144 px)
        assert im.size[0] >= 4 * 144 and im.size[1] >= 3 * 144


def test_data_check_reads_every_file_and_names_every_problem(tmp_path, capsys):
    """Two unreadable files (not just the first), a train/val leak and a duplicate, whatever on_bad_sample says."""
    import shutil

    cfg = write_cfg(tmp_path, "memory")
    main(["data", "check", "-c", str(cfg), "--batches", "1", "--out", str(tmp_path / "o")])  # generates the data
    train = sorted((tmp_path / "data").glob("*/train/class_00_disc/*.jpg"))
    val = sorted((tmp_path / "data").glob("*/val/class_00_disc/*.jpg"))
    train[0].write_bytes(b"")
    train[1].write_text("not a picture")
    shutil.copy(train[2], val[0])  # the same bytes in both splits
    shutil.copy(train[3], train[3].with_name("copy.jpg"))
    capsys.readouterr()
    for policy in ("error", "skip"):
        assert (
            main(
                [
                    "data",
                    "check",
                    "-c",
                    str(cfg),
                    f"data.on_bad_sample={policy}",
                    "--batches",
                    "1",
                    "--out",
                    str(tmp_path / "o"),
                ]
            )
            == 1
        )
        out = capsys.readouterr().out
        assert f"{train[0].name}: empty file" in out and f"{train[1].name}: not an image: text starting" in out
        assert "in more than one split" in out and val[0].name in out
        assert "identical files" in out and "copy.jpg" in out
        assert "problem: 2 unreadable file(s)" in out


def test_data_check_warns_about_few_images_and_refuses_one_class(tmp_path, capsys):
    from conftest import make_image_folder

    root = make_image_folder(tmp_path / "imgs", classes=("a", "b"), per_class=6)
    for f in sorted((root / "train" / "b").iterdir())[:4]:
        f.unlink()
    resize = ["data.train.transforms=[resize: [16, 16]]", "data.eval.transforms=[resize: [16, 16]]"]
    assert (
        main(["data", "check", "data.dataset=image_folder", f"data.root={root}", *resize, "--out", str(tmp_path / "o")])
        == 0
    )
    assert "warning: class(es) with fewer than 5 training images: b (2)" in capsys.readouterr().out
    one = make_image_folder(tmp_path / "one", classes=("only",), per_class=4)
    assert (
        main(["data", "check", "data.dataset=image_folder", f"data.root={one}", *resize, "--out", str(tmp_path / "p")])
        == 1
    )
    assert "problem: 1 class (only): nothing to tell apart" in capsys.readouterr().out


def test_data_compare_says_what_it_compared(tmp_path, capsys):
    cfg = write_cfg(tmp_path)
    assert main(["data", "compare", "-c", str(cfg), "--images", "6"]) == 0
    out = capsys.readouterr().out
    assert "cpu: pil decode + torchvision v2" in out and "max |diff|   0" in out
    assert "gpu-backend ops on CPU (torchvision decode)" in out
    if not torch.cuda.is_available():
        assert "GPU paths unavailable" in out

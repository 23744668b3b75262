"""The value mistakes that need a real run to show (the rest are refused before anything is built:
tests/unit/config/test_value_mistakes.py): a progressive start the model cannot take, a class too small for a
validation image."""

from __future__ import annotations

import json

from test_value_mistakes import FAST, refused

from conftest import make_image_folder


def test_a_progressive_start_below_what_the_model_takes_names_the_setting(tmp_path, cli_in_process):
    """Before: 'small_cnn needs inputs of at least 2x2 pixels, but the batches are 8x8' (the eval batches)."""
    refused(
        cli_in_process(
            "train",
            *FAST,
            "run.epochs=2",
            "data.train.transforms=[random_resized_crop: 8]",
            "data.progressive.start_size=1",
            "data.progressive.step=1",
            "data.progressive.end_epoch=2",
            f"run.dir={tmp_path / 'r'}",
        ),
        "data.progressive.start_size=1: the first epochs train on 1x1 crops",
        "at least 2x2",
    )


def test_a_class_too_small_for_a_validation_image_is_said(tmp_path, cli_in_process):
    """100 images of one class and 2 of another at val_fraction 0.2: the stratified split gives the small class
    no validation image (21 of 102: 20.6 and 0.4 share out as 21 and 0)."""
    root = tmp_path / "imgs"
    make_image_folder(root, classes=("many",), per_class=100, size=(8, 8), splits=("train",))
    make_image_folder(root, classes=("two",), per_class=2, size=(8, 8), splits=("train",))
    r = cli_in_process("train", *FAST, "data.dataset=image_folder", f"data.root={root}", f"run.dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr
    note = (
        "1 class(es) too small for a validation image at "
        "data.val_fraction=0.2 (two: 2 images): trained on, not validated"
    )
    assert note in r.stdout, r.stdout
    assert any(note in n for n in json.loads((tmp_path / "r" / "decisions.json").read_text())["notes"])

"""image_folder reads the usual folder layouts and refuses the ones it would misread, showing what it found."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_image_folder
from torchsprint import cli, config
from torchsprint.data import DATASETS
from torchsprint.errors import UsageError

FAST = [
    "data.dataset=image_folder",
    "run.epochs=1",
    "model.args={width: 8}",
    "log.tensorboard=false",
    "log.progress=false",
    "data.batch_size=4",
    "eval.per_class=false",
]


def splits_of(root, *overrides):
    return DATASETS.get("image_folder")(
        config.load(None, ["data.dataset=image_folder", f"data.root={root}", *overrides]).data
    )


@pytest.mark.parametrize("val_name", ["val", "valid", "validation", "VAL"])
@pytest.mark.parametrize("train_name", ["train", "training"])
def test_split_folder_names(tmp_path, train_name, val_name):
    make_image_folder(tmp_path, per_class=3, splits=(train_name, val_name))
    s = splits_of(tmp_path)
    assert (len(s.train), len(s.val), s.test, s.classes) == (6, 6, None, ["circle", "square"])
    assert f"val from {val_name}/" in s.source


def test_train_val_test_and_train_alone_and_one_folder_of_classes(tmp_path):
    make_image_folder(tmp_path / "three", per_class=3, splits=("train", "val", "test"))
    s = splits_of(tmp_path / "three")
    assert (len(s.train), len(s.val), len(s.test)) == (6, 6, 6) and "test from test/" in s.source
    assert {p for p, _ in s.test.samples} == {str(p) for p in (tmp_path / "three" / "test").rglob("*.jpg")}
    make_image_folder(tmp_path / "alone", per_class=10, splits=("train",))
    s = splits_of(tmp_path / "alone", "data.val_fraction=0.2")
    assert (len(s.train), len(s.val)) == (16, 4) and "20% of train/" in s.source
    make_image_folder(tmp_path / "flat", per_class=10, splits=("",))
    s = splits_of(tmp_path / "flat", "data.val_fraction=0.3")
    assert (len(s.train), len(s.val), s.classes) == (
        14,
        6,
        ["circle", "square"],
    ) and "one folder of class folders" in s.source


@pytest.mark.parametrize(
    "layout, message",
    [
        (("train", "val", "dogs"), r"besides the split folders \(train, val\) it has other folders \(dogs\)"),
        (("train", "val", "valid"), r"val/ and valid/ both look like the val split"),
        (("val", "test"), r"there is test/, val/ but no train/ folder"),
    ],
)
def test_misread_layouts_are_refused_showing_what_was_found(tmp_path, layout, message):
    make_image_folder(tmp_path, per_class=1, splits=layout)
    with pytest.raises(UsageError, match=message) as e:
        splits_of(tmp_path)
    text = str(e.value)
    assert f"data.root={tmp_path} holds: " in text and "Expected: <root>/train/<class>/*" in text
    assert all(f"{name}/ (2 folders)" in text for name in layout)  # the listing of what is there


def test_a_wrapper_folder_around_a_split_layout_names_the_root_to_use(tmp_path):
    make_image_folder(tmp_path / "dataset", per_class=1)
    with pytest.raises(UsageError, match=f"so set data.root={tmp_path / 'dataset'}"):
        splits_of(tmp_path)


def test_val_and_test_classes_must_be_training_classes(tmp_path):
    make_image_folder(tmp_path, per_class=1, splits=("train",))
    make_image_folder(tmp_path, classes=("circle", "triangle"), per_class=1, splits=("val",))
    with pytest.raises(UsageError, match=r"class folder\(s\) \['triangle'\] are not in train/"):
        splits_of(tmp_path)
    shutil.rmtree(tmp_path / "val" / "triangle")
    with pytest.warns(UserWarning, match=r"no images of class\(es\) \['square'\]"):
        s = splits_of(tmp_path)
    assert [label for _, label in s.val.samples] == [0]  # circle keeps its training index


def test_test_split_end_to_end(tmp_path, capsys):
    """eval.test_at_end evaluates the best weights on test/, and `eval --split test` gives the same numbers."""
    root = make_image_folder(tmp_path / "img", per_class=4, splits=("train", "val", "test"))
    run_dir = tmp_path / "run"
    # 2 epochs, "best" = the highest val loss: epoch 1, so the best weights are not the last ones
    assert (
        cli.main(
            [
                "train",
                *FAST,
                f"data.root={root}",
                "eval.test_at_end=true",
                f"run.dir={run_dir}",
                "run.epochs=2",
                "checkpoint.monitor=val/loss",
                "checkpoint.mode=max",
            ]
        )
        == 0
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test"]["test/count"] == 8 and summary["best_epoch"] == 1
    capsys.readouterr()
    assert cli.main(["eval", "-r", str(run_dir), "--split", "test", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["split"] == "test" and out["count"] == 8
    # the same weights and images: measured loss difference 6.0e-08 (float32; 0.0 when best = last)
    assert out["top1"] == summary["test"]["test/top1"] and abs(out["loss"] - summary["test"]["test/loss"]) < 1.8e-7
    decided = json.loads((run_dir / "decisions.json").read_text())
    assert decided["images"] == {"train": 8, "val": 8, "test": 8}


def test_no_test_split_is_refused_before_anything_is_made(tmp_path, capsys):
    root = make_image_folder(tmp_path / "img", per_class=2)
    assert cli.main(["train", *FAST, f"data.root={root}", "eval.test_at_end=true", f"run.dir={tmp_path / 'r'}"]) == 2
    assert "has no test split" in capsys.readouterr().err and not (tmp_path / "r").exists()

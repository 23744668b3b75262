"""Every user mistake found so far ends in one line on stderr, exit code 2, and no traceback; nothing is
silently dropped or accepted and ignored. Each case runs the real CLI (in-process: the same main() the
console script calls) on real files."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from conftest import make_image_folder
from torchsprint import cli

FAST = ["run.epochs=1", "log.tensorboard=false", "model.args={width: 8}"]
RESIZE = ["data.train.transforms=[resize: [16, 16]]", "data.eval.transforms=[resize: [16, 16]]"]


def fails_cleanly(capsys, argv, fragment) -> str:
    """main(argv) exits 2 with one 'error: ...' line containing `fragment` and no traceback."""
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "\n" not in lines[0], err
    assert fragment in lines[0], err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def folder(tmp_path):
    return make_image_folder(tmp_path / "imgs")


def test_bad_sample_inside_a_dataloader_worker(tmp_path, folder, capsys):
    (folder / "train" / "circle" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0truncated")
    line = fails_cleanly(
        capsys,
        [
            "train",
            *FAST,
            *RESIZE,
            "data.dataset=image_folder",
            f"data.root={folder}",
            "data.num_workers=2",
            f"run.dir={tmp_path / 'r'}",
        ],
        "unreadable sample",
    )
    assert "bad.jpg" in line and "on_bad_sample=skip" in line and "DataLoader worker" not in line


def test_override_that_replaces_a_section_by_a_value(tmp_path, capsys):
    fails_cleanly(capsys, ["train", "run=5", f"run.dir={tmp_path}"], "run is a section")
    fails_cleanly(capsys, ["config", "show", "optim=3"], "optim: Input should be a valid dictionary")


@pytest.mark.parametrize("lr", ["inf", "nan", "-inf"])
def test_non_finite_settings_are_refused(capsys, lr):
    fails_cleanly(capsys, ["config", "show", f"optim.lr={lr}"], "optim.lr")


def test_a_diverging_run_says_at_which_step_and_what_to_try(tmp_path, capsys):
    line = fails_cleanly(
        capsys,
        ["train", *FAST, "optim.lr=1e30", "log.every_steps=5", f"run.dir={tmp_path / 'r'}"],
        "training diverged: the loss became non-finite",
    )
    # lr 1e30 blows the weights up at step 1, so step 2's loss is the first non-finite one (measured).
    assert "at step 2" in line and "optim.lr" in line and "precision=fp32" in line
    assert "fp16" not in line  # an fp32 run is not told to leave fp16


def test_single_class_dataset(tmp_path, capsys):
    root = make_image_folder(tmp_path / "one", classes=("only",))
    fails_cleanly(
        capsys,
        ["train", *FAST, *RESIZE, "data.dataset=image_folder", f"data.root={root}", f"run.dir={tmp_path / 'r'}"],
        "has 1 class (only)",
    )
    assert not (tmp_path / "r").exists()


def test_images_too_small_for_the_model_name_the_minimum(tmp_path, capsys):
    line = fails_cleanly(
        capsys,
        ["train", *FAST, "model.name=alexnet", "model.args={}", f"run.dir={tmp_path / 'r'}"],
        "needs inputs of at least 63x63 pixels, but the batches are 8x8",
    )
    assert "resize" in line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("t") / "run"
    assert cli.main(["train", *FAST, f"run.dir={run}"]) == 0
    return run


@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "safetensors"])
def test_export_to_an_impossible_path(tmp_path, trained, capsys, fmt):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a folder cannot be made below a file, even by root
    fails_cleanly(
        capsys, ["export", "-r", str(trained), "--format", fmt, "--out", str(blocker / "m.x")], "cannot write there"
    )


def test_predict_out_is_checked_before_predicting(tmp_path, trained, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    img = tmp_path / "a.png"
    from PIL import Image

    Image.new("L", (8, 8), 100).save(img)
    fails_cleanly(capsys, ["predict", "-r", str(trained), str(img), "--out", str(blocker / "r.jsonl")], "cannot write")
    fails_cleanly(
        capsys, ["predict", "-r", str(trained), str(img), "--out", str(tmp_path / "r.xyz")], "unknown format '.xyz'"
    )
    assert not (tmp_path / "r.xyz").exists()


def test_predict_reports_what_a_non_image_is_and_the_true_k(tmp_path, trained, capsys):
    (tmp_path / "notes.jpg").write_text("shopping list: milk, eggs")
    out = tmp_path / "r.jsonl"
    assert cli.main(["predict", "-r", str(trained), str(tmp_path / "notes.jpg"), "--out", str(out)]) == 1
    import json

    error = json.loads(out.read_text())["error"]
    assert error.startswith("not an image: text starting 'shopping list"), error
    assert "avif" not in error.lower() and "heic" not in error.lower()


def test_predict_header_says_top_k_that_exists(tmp_path, capsys):
    root = make_image_folder(tmp_path / "imgs")  # 2 classes
    run = tmp_path / "run"
    assert cli.main(["train", *FAST, *RESIZE, "data.dataset=image_folder", f"data.root={root}", f"run.dir={run}"]) == 0
    capsys.readouterr()
    assert cli.main(["predict", "-r", str(run), str(root / "val"), "--topk", "5"]) == 0
    out = capsys.readouterr().out
    assert "top-2" in out and "top-5" not in out


def test_eval_with_a_corrupt_weights_file(tmp_path, trained, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(trained, run)
    data = (run / "best.safetensors").read_bytes()
    (run / "best.safetensors").write_bytes(data[: len(data) // 2])
    fails_cleanly(capsys, ["eval", "-r", str(run)], "best.safetensors")


def test_malformed_cifar(tmp_path, capsys):
    root = tmp_path / "data" / "cifar-10-batches-py"  # the run folder goes beside data.root, never inside it
    root.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (root / name).write_bytes(pickle.dumps({b"data": b"x" * 10, b"labels": [0]})[:-3])  # truncated
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}))
    fails_cleanly(
        capsys,
        ["train", "data.dataset=cifar10", f"data.root={root.parent}", f"run.dir={tmp_path / 'r'}"],
        "is not a CIFAR python batch",
    )


def test_empty_class_folder_is_left_out_with_a_warning(tmp_path, capsys):
    root = make_image_folder(tmp_path / "imgs", classes=("a", "b", "c"))
    for split in ("train", "val"):
        for f in (root / split / "b").iterdir():
            f.unlink()
    with pytest.warns(UserWarning, match=r"class folder\(s\) \['b'\] hold no images"):
        assert (
            cli.main(
                ["train", *FAST, *RESIZE, "data.dataset=image_folder", f"data.root={root}", f"run.dir={tmp_path / 'r'}"]
            )
            == 0
        )
    import json

    import yaml

    classes = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert classes["final"]["val/count"] == 12  # a and c's 6 val images each; b never became an empty class
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["data"]["root"] == str(root)


def test_digits_refuses_a_root_it_would_ignore(tmp_path, capsys):
    (tmp_path / "d").mkdir()  # the run folder goes beside data.root, never inside it (refused first)
    fails_cleanly(
        capsys,
        ["train", *FAST, "data.dataset=digits", f"data.root={tmp_path / 'd'}", f"run.dir={tmp_path / 'r'}"],
        "takes no data.root",
    )


def test_a_root_alone_without_images_says_what_it_holds(tmp_path, capsys):
    (tmp_path / "notes.txt.bak").write_text("x")
    fails_cleanly(
        capsys,
        ["train", *FAST, f"data.root={tmp_path}", f"run.dir={tmp_path / 'r'}"],
        f"data.root={tmp_path} holds 1 loose file(s), no class folders",
    )
    fails_cleanly(capsys, ["train", *FAST, f"data.root={tmp_path / 'nothing'}"], "does not exist")


def test_resume_folder_without_config(tmp_path, capsys):
    fails_cleanly(capsys, ["train", "--resume", str(tmp_path)], "not a torchsprint run folder")


def test_unknown_task_for_model_file_needs_import_hint(tmp_path, trained, capsys):
    """Covered in test_untrusted_files; here: predict on a missing file is one line."""
    fails_cleanly(capsys, ["predict", "-r", str(tmp_path / "nope.onnx"), str(tmp_path)], "model file not found")
    assert Path(tmp_path).exists()


def test_class_folders_added_or_removed_since_training_are_named(tmp_path, capsys):
    """A run on 3 class folders, then a fourth folder added: `train --resume` (and checkpoint.resume=auto, the same
    path) says the data's classes changed, naming the one added and what to do; with one removed instead, `eval`
    names the one removed. Both blamed the model or the file: "size mismatch for ...weight" while loading."""
    import shutil

    root = make_image_folder(tmp_path / "imgs", classes=("circle", "square", "star"), per_class=4)
    run = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                *FAST,
                *RESIZE,
                "data.dataset=image_folder",
                f"data.root={root}",
                f"run.dir={run}",
                "run.epochs=2",
                "run.stop_after_steps=1",
                "checkpoint.every_steps=1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    make_image_folder(tmp_path / "more", classes=("disc",), per_class=4)
    for split in ("train", "val"):
        shutil.copytree(tmp_path / "more" / split / "disc", root / split / "disc")
    line = fails_cleanly(capsys, ["train", "--resume", str(run)], "the data's classes changed since")
    assert "(3 classes then, 4 now; added: disc)" in line and "restore the data's class folders" in line, line
    assert f"model.pretrained={run}/best.safetensors" in line and "size mismatch" not in line, line
    for split in ("train", "val"):
        shutil.rmtree(root / split / "disc")
        shutil.rmtree(root / split / "star")
    assert cli.main(["train", "--resume", str(run), "run.stop_after_steps=null"]) == 2  # removed: refused too
    assert "(3 classes then, 2 now; removed: star)" in capsys.readouterr().err
    line = fails_cleanly(capsys, ["eval", "-r", str(run), "--weights", "best"], f"{run / 'best.safetensors'} was saved")
    assert "(3 classes then, 2 now; removed: star)" in line and "evaluate on the data the run trained on" in line, line

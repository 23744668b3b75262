"""A user's own folder of images: what is left out and why, odd modes and depths, the decoder per format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import load_resolved
from torchsprint import cli
from torchsprint.data import DATASETS
from torchsprint.data.build import describe_data
from torchsprint.data.sources import folders

FAST = ["run.epochs=1", "log.progress=false", "log.tensorboard=false", "eval.per_class=false", "data.batch_size=4"]
SMALL = [
    "data.train.transforms=[{resize: 24}, {center_crop: 24}]",
    "data.eval.transforms=[{resize: 24}, {center_crop: 24}]",
]


def save(path: Path, size, mode: str, seed: int) -> Path:
    """A generated image file of `size` (w, h) in Pillow `mode` (I;16: a 16-bit grey PNG)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "I;16":
        im = Image.fromarray(rng.integers(0, 65535, (size[1], size[0])).astype(np.uint16))
    else:
        im = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
    im.save(path)
    return path


def bad_folder(tmp: Path) -> tuple[Path, set[str], dict[str, set[str]]]:
    """One folder of class folders holding every kind of odd entry a real download has. Returns (root, the
    image files that must be samples, {reason: the entries that must be left out for it})."""
    root, elsewhere = tmp / "photos", tmp / "elsewhere"
    images = set()
    for i, mode in enumerate(["RGB", "L", "RGBA", "P", "I;16", "RGB"]):  # mixed modes, bit depths and sizes
        images.add(str(save(root / "cat" / f"c{i}.png", (40 + i, 30), mode, i)))
        images.add(str(save(root / "dog" / f"d{i}.jpg", (36, 36 + i), "RGB", 10 + i)))
        save(elsewhere / f"b{i}.jpg", (36, 36), "RGB", 20 + i)
    images.add(str(save(root / "one" / "only.jpg", (32, 32), "RGB", 30)))  # a class of one image
    (root / "cat" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "cat" / "._c0.png").write_bytes(b"\0\5\26\7" + b"\0" * 60)  # macOS AppleDouble: not a PNG
    (root / ".hidden_class").mkdir()
    save(root / ".hidden_class" / "x.jpg", (32, 32), "RGB", 31)
    (root / "dog" / "README.txt").write_text("dogs\n")
    (root / "dog" / "labels.csv").write_text("a,b\n")
    (root / "notes.md").write_text("my photos\n")
    os.symlink(root / "cat" / "c0.png", root / "dog" / "link_to_cat.png")  # a link to a file: used
    images.add(str(root / "dog" / "link_to_cat.png"))
    os.symlink(root / "nowhere.jpg", root / "dog" / "broken.jpg")
    os.symlink(root / "dog", root / "dog" / "loop")  # a loop
    os.symlink(elsewhere, root / "bird")  # a class folder that is a link: used
    images |= {str(root / "bird" / f"b{i}.jpg") for i in range(6)}
    os.symlink(root / "gone", root / "ghost")
    skipped = {
        folders.HIDDEN: {str(root / "cat" / ".DS_Store"), str(root / "cat" / "._c0.png"), str(root / ".hidden_class")},
        folders.NOT_IMAGE: {str(root / "dog" / "README.txt"), str(root / "dog" / "labels.csv")},
        folders.LOOSE: {str(root / "notes.md")},
        folders.BROKEN_LINK: {str(root / "dog" / "broken.jpg"), str(root / "ghost")},
        folders.LINK_LOOP: {str(root / "dog" / "loop")},
    }
    return root, images, skipped


def splits_of(root, *overrides):
    return DATASETS.get("image_folder")(
        load_resolved(None, ["data.dataset=image_folder", f"data.root={root}", *overrides]).data
    )


def test_every_entry_is_a_sample_or_counted_with_its_reason(tmp_path):
    root, images, skipped = bad_folder(tmp_path)
    s = splits_of(root, "data.val_fraction=0.3")
    got = [p for p, _ in s.train.samples + s.val.samples]
    assert sorted(got) == sorted(images)  # each image once: the loop lists dog/ once, the linked class is read
    assert {k: set(v) for k, v in s.skipped.items()} == skipped
    assert s.classes == ["bird", "cat", "dog", "one"]
    # The one-image class is trained on, not validated, and said (sklearn's stratified split refused it before).
    assert [p for p, c in s.train.samples if c == 3] == [str(root / "one" / "only.jpg")]
    assert not [c for _, c in s.val.samples if c == 3]
    assert any("1 class(es) with one image (one)" in n for n in s.notes)
    assert any("7 image(s) reached through symbolic links" in n for n in s.notes)  # 6 in bird/, 1 link in dog/
    facts = describe_data(s)
    assert {k: v["count"] for k, v in facts["skipped"].items()} == {k: len(v) for k, v in skipped.items()}


def test_one_image_classes_leave_the_other_classes_split_as_before(tmp_path):
    """The split of the classes with 2+ images is sklearn's stratified split of those alone (the reference)."""
    from torchsprint.data.core import stratified_split

    for c, n in (("a", 10), ("b", 10), ("c", 1)):
        for i in range(n):
            save(tmp_path / c / f"{i}.png", (8, 8), "RGB", i)
    s = splits_of(tmp_path, "data.val_fraction=0.2")
    rest = [(p, c) for p, c in sorted(s.train.samples + s.val.samples) if c != 2]
    rest.sort(key=lambda pc: (pc[1], pc[0]))
    tr, va = stratified_split(np.array([c for _, c in rest]), 0.2, 0)
    assert sorted(s.val.samples) == sorted(rest[i] for i in va)
    assert (str(tmp_path / "c" / "0.png"), 2) in s.train.samples


def test_too_few_validation_images_for_the_classes_is_one_line(tmp_path):
    from torchsprint.errors import UsageError

    for c in "abcdef":
        for i in range(2):
            save(tmp_path / c / f"{i}.png", (8, 8), "RGB", i)
    with pytest.raises(
        UsageError, match=r"data.val_fraction=0.2 of 12 images is too few to give each of the 6 classes"
    ):
        splits_of(tmp_path, "data.val_fraction=0.2")


def test_the_decoder_is_named_per_format(tmp_path):
    """A folder mixing PNG, JPEG and BMP: each format's decoder, counted over every file (not one name for all)."""
    from torchsprint.data.preprocess.decode import resolve_decoder

    for i in range(3):
        save(tmp_path / "a" / f"{i}.png", (16, 16), "RGB", i)
        save(tmp_path / "b" / f"{i}.jpg", (16, 16), "RGB", i)
    save(tmp_path / "b" / "x.bmp", (16, 16), "RGB", 9)
    facts = describe_data(splits_of(tmp_path, "data.val_fraction=0.4"))
    jpeg = resolve_decoder("auto")  # simplejpeg where installed, else torchvision
    assert facts["decoders"] == {
        "PNG": {"decoder": "torchvision", "files": 3},
        "JPEG": {"decoder": jpeg, "files": 3},
        "BMP": {"decoder": "pil", "files": 1},
    }
    facts = describe_data(splits_of(tmp_path, "data.val_fraction=0.4", "data.decoder=pil"))
    assert facts["decoders"]["JPEG"]["decoder"] == "pil" and facts["decoders"]["PNG"]["decoder"] == "torchvision"


def test_the_named_decoder_is_the_one_that_runs(tmp_path, monkeypatch):
    """decoder_for agrees with decode_bytes: record which library each file actually goes through."""
    import io

    from torchsprint.data.preprocess import decode

    calls = []
    real_generic, real_pil = decode._generic, decode._pil
    monkeypatch.setattr(decode, "_generic", lambda data, ch: calls.append("torchvision") or real_generic(data, ch))
    monkeypatch.setattr(decode, "_pil", lambda data, ch, m: calls.append("pil") or real_pil(data, ch, m))
    for fmt, suffix in (("PNG", ".png"), ("JPEG", ".jpg"), ("BMP", ".bmp"), ("GIF", ".gif"), ("WEBP", ".webp")):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, fmt)
        for name in decode.DECODERS.names():
            calls.clear()
            decode.decode_bytes(buf.getvalue(), decoder=name)
            named = decode.decoder_for(name, decode.FORMAT_OF_SUFFIX[suffix])
            # _generic falls back to _pil for what torchvision cannot read; a JPEG decoder records no call.
            ran = calls[-1] if calls else name
            assert ran == named, (fmt, name, calls)


def test_cli_start_up_summary_counts_what_was_left_out(tmp_path, capsys):
    root, _, skipped = bad_folder(tmp_path)
    code = cli.main(
        [
            "train",
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.val_fraction=0.3",
            f"run.dir={tmp_path / 'run'}",
            *FAST,
            *SMALL,
        ]
    )
    r = capsys.readouterr()
    assert code == 0, r.err
    out = r.out + r.err
    assert "left out 9 file(s) below data.root that are not samples:" in out
    for why, paths in skipped.items():
        assert f"    {len(paths)} {why}, e.g. " in out
    assert "1 class(es) with one image (one): trained on, not validated" in out
    # The training images sampled include the grey and 16-bit PNGs (split_seed=0); each mode says what it becomes.
    assert "L 1 (grey repeated to 3 channels)" in out and "I;16 1 (16-bit: the top 8 bits kept" in out
    assert "decoder" in out and "(PNG: 7 files)" in out and "(JPEG: 13 files)" in out  # the linked PNG in dog/ counts
    decided = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert decided["skipped"][folders.HIDDEN]["count"] == 3
    assert decided["decoders"]["PNG"] == {"decoder": "torchvision", "files": 7}


# ---------------------------------------------------------------- data.root given alone


def detected(root, *over):
    cfg = load_resolved(None, [f"data.root={root}", *over])
    return cfg.data.dataset, [c["why"] for c in cfg.chosen()]


def test_a_root_alone_is_detected_from_its_files(tmp_path):
    from conftest import make_image_folder

    make_image_folder(tmp_path / "split", per_class=1)
    assert detected(tmp_path / "split") == (
        "image_folder",
        [f"detected: class folders under {tmp_path}/split/train and {tmp_path}/split/val"],
    )
    make_image_folder(tmp_path / "flat", per_class=1, splits=("",))
    assert detected(tmp_path / "flat") == (
        "image_folder",
        [f"detected: class folders under {tmp_path}/flat (split by data.val_fraction)"],
    )
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train-000000.tar").write_bytes(b"")
    assert detected(tmp_path / "shards")[0] == "webdataset"
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "train.csv").write_text("a.jpg,cat\n")
    assert detected(tmp_path / "lists")[0] == "file_list"
    assert detected(tmp_path / "lists", "task=multilabel")[0] == "multilabel_csv"
    assert detected(tmp_path / "lists" / "train.csv")[0] == "file_list"
    # An explicit data.dataset always wins, and chooses nothing; no data.root is the default digits run.
    assert detected(tmp_path / "flat", "data.dataset=file_list") == ("file_list", [])
    assert (load_resolved(None, []).data.dataset, load_resolved(None, []).chosen()) == ("digits", [])


def test_cli_trains_and_evaluates_a_folder_given_alone(tmp_path, capsys):
    """`train data.root=DIR` (no data.dataset) trains on the folder; config.yaml keeps the detected dataset, so
    `eval RUN` (which reads only config.yaml) evaluates the same data."""
    import yaml

    from conftest import make_image_folder

    root = make_image_folder(tmp_path / "photos", per_class=3)
    code = cli.main(["train", f"data.root={root}", f"run.dir={tmp_path / 'run'}", *FAST])
    r = capsys.readouterr()
    assert code == 0, r.err
    assert (
        f"data.dataset: image_folder (detected: class folders under {root}/train and {root}/val; to choose "
        "otherwise: set data.dataset)"
    ) in r.out
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["dataset"] == "image_folder"
    decided = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert decided["dataset"] == "image_folder" and decided["chosen"][0]["setting"] == "data.dataset"
    code = cli.main(["eval", "-r", str(tmp_path / "run"), "--json"])
    r = capsys.readouterr()
    assert code == 0 and json.loads(r.out)["count"] == 6, r.out + r.err


# ---------------------------------------------------------------- defaults that fit the images


@pytest.mark.parametrize(
    "shorts, device, size",
    [
        ([300] * 5, "cpu", 128),
        ([300] * 5, "cuda", 224),
        ([375, 375, 500], "cuda", 224),
        ([100, 90, 120], "cpu", 96),
        ([40, 45, 300], "cpu", 32),
        ([20, 28, 30], "cuda", 32),
        ([110, 120, 130], "cpu", 96),
        ([100, 200], "cuda", 96),
        ([191, 200, 250], "cuda", 192),
        ([63, 64, 65], "cpu", 64),
    ],
)
def test_the_size_rule(shorts, device, size):
    """The stated rule, worked by hand: the median (lower) short side, capped (224 GPU, 128 CPU), floored to
    32s, >= 32."""
    from torchsprint.data.detect import training_size

    assert training_size(shorts, device) == size


def photo_folder(root: Path, size=(100, 80), mode="RGB", per_class=3) -> Path:
    for c in ("a", "b"):
        for i in range(per_class):
            save(root / "train" / c / f"{i}.png", size, mode, i)
            save(root / "val" / c / f"{i}.png", size, mode, 10 + i)
    return root


def test_larger_images_get_a_training_size_and_a_photo_model(tmp_path):
    root = photo_folder(tmp_path / "p")  # 100x80: median short side 80 -> 64
    cfg = load_resolved(None, [f"data.root={root}", "run.device=cpu"])
    assert cfg.data.train.transforms == [{"random_resized_crop": {"size": 64, "scale": [0.35, 1.0]}}, "hflip"]
    assert cfg.data.eval.transforms == [{"resize": 72}, {"center_crop": 64}]
    assert cfg.model.name == "resnet18"
    assert [c["setting"] for c in cfg.chosen()] == [
        "data.dataset",
        "data.train.transforms",
        "data.eval.transforms",
        "model.name",
        "data.batch_size",
        "model.pretrained",
        "optim.lr",
        "sched.warmup_epochs",
    ]
    # Offline (tests/conftest.py) and nothing cached: from scratch, saying how to get the weights (models/start.py).
    assert cfg.model.pretrained is None and "weights get" in cfg.chosen()[5]["override"]
    assert all(c["why"] and c["override"] for c in cfg.chosen())
    # 6 training images: the tiny-folder batch (test_a_tiny_photo_folder_trains_at_a_batch_that_gives_steps), and the
    # photo model's lr: 0.1 per 256 images of the batch (torchvision's rule), worked by hand; a warm-up epoch.
    assert cfg.data.batch_size == 8
    assert (cfg.optim.lr, cfg.sched.warmup_epochs) == (0.1 * 8 / 256, 1.0)
    for extra, lr in (
        (["data.batch_size=32", "optim.accum_steps=4"], 0.05),
        (["data.effective_batch_size=512"], 0.2),
        (["data.batch_size=auto"], 0.025),
    ):
        assert load_resolved(None, [f"data.root={root}", "run.device=cpu", *extra]).optim.lr == pytest.approx(lr), extra
    # Under DDP one optimizer step sees every process's batch: read from WORLD_SIZE, as each torchrun worker has it
    # when it reads the config (`torchsprint train --nproc-per-node 2` starts such workers).
    with pytest.MonkeyPatch.context() as m:
        m.setenv("WORLD_SIZE", "2")
        ddp = load_resolved(None, [f"data.root={root}", "run.device=cpu", "strategy.name=ddp"])
        assert ddp.optim.lr == pytest.approx(0.1 * 64 * 2 / 256)
        assert "x 128 (data.batch_size x optim.accum_steps x 2 processes)" in next(
            c["why"] for c in ddp.chosen() if c["setting"] == "optim.lr"
        )
        assert load_resolved(
            None, [f"data.root={root}", "run.device=cpu", "strategy.name=ddp", "data.effective_batch_size=256"]
        ).optim.lr == pytest.approx(0.1)  # global already
        assert load_resolved(None, [f"data.root={root}", "run.device=cpu"]).optim.lr == pytest.approx(
            0.1 * 8 / 256
        )  # not ddp
    # The user's optimizer, lr or warm-up wins (and the project's 0.1 stays for small_cnn and digits).
    assert load_resolved(None, [f"data.root={root}", "run.device=cpu", "optim.lr=0.3"]).optim.lr == 0.3
    theirs = load_resolved(None, [f"data.root={root}", "run.device=cpu", "optim.name=adamw"])
    assert theirs.optim.lr == 0.1 and "optim.lr" not in [c["setting"] for c in theirs.chosen()]
    assert (
        load_resolved(None, [f"data.root={root}", "run.device=cpu", "sched.warmup_epochs=0"]).sched.warmup_epochs == 0
    )
    assert load_resolved(None, []).optim.lr == 0.1
    # What the user sets wins: their transforms keep everything (and small_cnn); their model keeps the chosen size.
    mine = load_resolved(None, [f"data.root={root}", "data.train.transforms=[{resize: 40}]"])
    assert (mine.data.train.transforms, mine.data.eval.transforms, mine.model.name) == (
        [{"resize": 40}],
        [],
        "small_cnn",
    )
    assert mine.optim.lr == pytest.approx(0.1 * 8 / 256)  # the images are photo-sized: the photos' lr rule
    mine = load_resolved(None, [f"data.root={root}", "run.device=cpu", "model.name=mobilenet_v3_small"])
    assert mine.model.name == "mobilenet_v3_small" and mine.data.eval.transforms == [
        {"resize": 72},
        {"center_crop": 64},
    ]
    # ... and the photos' lr rule, as the picked model gets it (it applied only to the picked model before: a named
    # resnet50 on photos trained at digits' 0.1 and stayed at the majority class), with the user's transforms too.
    assert mine.optim.lr == pytest.approx(0.1 * 8 / 256) and mine.sched.warmup_epochs == 1.0
    assert "optim.lr" in [c["setting"] for c in mine.chosen()]
    mine = load_resolved(
        None, [f"data.root={root}", "run.device=cpu", "model.name=resnet34", "data.train.transforms=[{resize: 40}]"]
    )
    assert mine.optim.lr == pytest.approx(0.1 * 8 / 256)
    assert load_resolved(None, [f"data.root={root}", "model.name=resnet34", "optim.lr=0.5"]).optim.lr == 0.5
    # Digits-sized images of one size keep the native size and small_cnn (the fixture's 24x20 JPEGs).
    from conftest import make_image_folder

    small = load_resolved(None, [f"data.root={make_image_folder(tmp_path / 's', per_class=2)}"])
    assert (small.data.train.transforms, small.model.name, len(small.chosen())) == ([], "small_cnn", 1)


def test_a_tiny_photo_folder_trains_at_a_batch_that_gives_steps(tmp_path):
    """20 photos per class (3 classes, 80/20 split: 48 training images) trained at the default batch of 64 made one
    optimizer step an epoch. The batch now gives about 8 steps (a power of two, at least 8): 48 -> 8 (6 steps), and
    the lr rule follows it; said as a choice. A set batch, a DDP run or a folder of 512+ training images keeps its
    batch. Bugs caught: no rule (64), the lr worked out from 64, the rule over a batch the user set."""
    root = tmp_path / "tiny"
    for c in ("a", "b", "c"):
        for i in range(20):
            save(root / c / f"{i}.png", (100, 80), "RGB", i)
    cfg = load_resolved(None, [f"data.root={root}", "run.device=cpu"])
    assert cfg.data.batch_size == 8 and cfg.optim.lr == pytest.approx(0.1 * 8 / 256)
    (why,) = [c["why"] for c in cfg.chosen() if c["setting"] == "data.batch_size"]
    assert why.startswith("48 training images: at the default 64 an epoch would be 1 optimizer step(s); 8 gives 6")
    assert load_resolved(None, [f"data.root={root}", "data.batch_size=64"]).data.batch_size == 64
    assert load_resolved(None, [f"data.root={root}", "data.val_fraction=0.5"]).data.batch_size == 8  # 30 -> 3 -> 8
    for i in range(20, 220):  # 660 images, 528 for training: the default batch gives 8 steps already
        for c in ("a", "b", "c"):
            save(root / c / f"{i}.png", (100, 80), "RGB", i)
    big = load_resolved(None, [f"data.root={root}", "run.device=cpu"])
    assert big.data.batch_size == 64 and "data.batch_size" not in [c["setting"] for c in big.chosen()]


def test_grey_images_are_read_as_three_equal_channels_and_said_so(tmp_path):
    root = photo_folder(tmp_path / "g", size=(40, 40), mode="L")
    cfg = load_resolved(None, [f"data.root={root}"])
    grey = [c for c in cfg.chosen() if c["setting"] == "data.options.mode"]
    assert grey and grey[0]["value"] == "RGB" and "3 identical channels" in grey[0]["why"]
    s = DATASETS.get(cfg.data.dataset)(cfg.data)
    image = s.train[0][0]
    reference = torch.from_numpy(np.array(Image.open(s.train.samples[0][0])))  # Pillow's own grey pixels
    assert image.shape[0] == 3 and all(torch.equal(image[c], reference) for c in range(3))
    # data.options.mode=GRAY keeps one channel, and then nothing is said about it.
    cfg = load_resolved(None, [f"data.root={root}", "data.options={mode: GRAY}"])
    assert not [c for c in cfg.chosen() if c["setting"] == "data.options.mode"]
    assert DATASETS.get(cfg.data.dataset)(cfg.data).train[0][0].shape[0] == 1


def test_cli_photo_defaults_are_in_the_summary_and_the_run_folder(tmp_path, capsys):
    """A real run on mixed-size photos (which broke batching without a resize): the chosen size, model and why."""
    import yaml

    root = tmp_path / "mixed"
    for c in ("a", "b"):
        for i in range(4):
            save(root / c / f"{i}.jpg", (70 + 10 * i, 64), "RGB", i)
    code = cli.main(
        ["train", f"data.root={root}", f"run.dir={tmp_path / 'run'}", "run.device=cpu", "data.val_fraction=0.5", *FAST]
    )
    r = capsys.readouterr()
    assert code == 0, r.err
    assert "data.train.transforms: [{'random_resized_crop': {'size': 64" in r.out
    assert "model.name: resnet18 (images of 64x64 px" in r.out and "to choose otherwise: set model.name" in r.out
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"]["name"] == "resnet18" and saved["data"]["eval"]["transforms"][-1] == {"center_crop": 64}
    decided = json.loads((tmp_path / "run" / "decisions.json").read_text())
    assert [c["setting"] for c in decided["chosen"]][-4:] == [
        "model.name",
        "model.pretrained",
        "optim.lr",
        "sched.warmup_epochs",
    ]
    # The optimizer that ran used the chosen peak lr (0.1 x batch 4 / 256), recorded in config.yaml for resume/eval
    assert saved["optim"]["lr"] == pytest.approx(0.1 * 4 / 256) and saved["sched"]["warmup_epochs"] == 1.0

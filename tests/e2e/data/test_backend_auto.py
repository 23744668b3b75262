"""data.backend=auto (the default) picks the fastest backend that fits, and says which and why."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import make_image_folder
from torchsprint import cli, config
from torchsprint.data import auto, build_loaders, core
from torchsprint.runtime.core import Runtime

FAST = ["run.epochs=1", "model.args={width: 8}", "log.tensorboard=false", "log.progress=false", "eval.per_class=false"]


def loaders(*overrides, allowed=None, epochs=1):
    import torch

    cfg = config.load(None, list(overrides))
    return build_loaders(cfg.data, Runtime(torch.device("cpu")), seed=0, allowed=allowed, epochs=epochs)


def test_digits_go_to_memory_and_the_run_says_why(tmp_path, capsys):
    assert config.load(None, []).data.backend == "auto"
    assert cli.main(["train", *FAST, f"run.dir={tmp_path / 'r'}"]) == 0
    out = capsys.readouterr().out
    assert "loader: data.backend=memory (the dataset is decoded in memory already (1,797 images" in out
    d = json.loads((tmp_path / "r" / "decisions.json").read_text())
    assert d["backend"] == "memory" and "25% of the" in d["backend_why"]
    assert d["images"] == {"train": 1437, "val": 360} and d["classes"] == 10 and d["effective_batch_size"] == 64


def test_same_size_jpegs_are_decoded_once_into_memory_when_the_epochs_pay_for_it(tmp_path):
    """Tiny same-size JPEGs over 50 epochs: decoding them once beats decoding them every epoch (auto measures both;
    tests/e2e/data/test_backend_measured.py checks such choices against a direct measurement)."""
    root = make_image_folder(tmp_path, per_class=3)
    info = loaders("data.dataset=image_folder", f"data.root={root}", epochs=50).info
    assert (
        info.backend == "memory" and "12 cached images of one size a split (24x20 for training)" in info.backend_why
    ), info.backend_why
    # ...and from the files themselves (no decoded-image cache), the file headers say the same
    files = loaders("data.dataset=image_folder", f"data.root={root}", "data.cache=off", epochs=50).info
    assert files.backend == "memory" and "12 files of one size (24x20)" in files.backend_why, files.backend_why
    assert info.backend_why.startswith("measured on") and info.backend_measured["chosen"] == "memory"


def test_the_backends_are_measured_once_per_machine_data_and_settings(tmp_path, monkeypatch):
    """A second build of the same folder with the same settings reads what the first measured (said: "measured
    before") and picks the same backend; a file added, or another batch size, is measured again. Bugs caught: the
    measurement repeated at every start (a second of each backend), figures of another folder or batch reused."""
    calls = []
    real = auto.measure_backends
    monkeypatch.setattr(auto, "measure_backends", lambda *a, **k: calls.append(1) or real(*a, **k))
    root = make_image_folder(tmp_path, per_class=3)
    over = ("data.dataset=image_folder", f"data.root={root}")
    first = loaders(*over, epochs=50).info
    second = loaders(*over, epochs=50).info
    assert len(calls) == 1 and second.backend == first.backend
    assert second.backend_why.startswith("measured before, ") and not first.backend_why.startswith("measured before")
    assert second.backend_measured["backends"] == first.backend_measured["backends"]
    loaders(*over, "data.batch_size=8", epochs=50)
    assert len(calls) == 2
    Image.new("RGB", (24, 20)).save(root / "train" / "circle" / "new.jpg")
    loaders(*over, epochs=50)
    assert len(calls) == 3


def test_files_of_several_sizes_stream_through_the_cpu_backend(tmp_path):
    root = make_image_folder(tmp_path, per_class=3)
    Image.new("RGB", (30, 30)).save(root / "train" / "circle" / "big.jpg")
    info = loaders(
        "data.dataset=image_folder",
        f"data.root={root}",
        "data.train.transforms=[resize: [16, 16]]",
        "data.eval.transforms=[resize: [16, 16]]",
        "data.cache=off",
    ).info  # the decoded-image cache would store them resized, at one size
    assert info.backend == "cpu" and "memory: the images have different sizes" in info.backend_why
    assert "gpu: needs a CUDA GPU: this machine has no CUDA device" in info.backend_why


def test_a_step_the_batched_ops_lack_keeps_the_cpu_backend():
    info = loaders("data.train.transforms=[random_rotation: 10]").info
    assert info.backend == "cpu" and "memory: the preprocessing has a step batched ops lack" in info.backend_why


def test_a_dataset_over_the_memory_budget_streams(monkeypatch):
    monkeypatch.setattr(core, "MEMORY_SHARE_RAM", 1e-9)  # a budget of a few bytes: digits (115 KiB) no longer fits
    info = loaders().info
    assert info.backend == "cpu" and "memory: 112.3 KiB > 0% of the" in info.backend_why


def test_data_memory_budget_gib_sets_the_budget():
    """digits decode to 112.3 KiB: a budget just under it streams, just over it keeps the memory backend."""
    under, over = 112 / 2**20, 113 / 2**20  # GiB
    info = loaders(f"data.memory_budget_gib={under}").info
    assert info.backend == "cpu" and f"memory: 112.3 KiB > data.memory_budget_gib={under:g}" in info.backend_why
    info = loaders(f"data.memory_budget_gib={over}").info
    assert info.backend == "memory" and f"112.3 KiB <= data.memory_budget_gib={over:g})" in info.backend_why


def test_only_backends_the_task_supports_are_considered():
    info = loaders(allowed=("cpu",)).info
    assert info.backend == "cpu"


def test_an_explicit_backend_is_kept_and_said_so():
    info = loaders("data.backend=cpu").info
    assert (info.backend, info.backend_why) == ("cpu", "set in the config (data.backend)")


@pytest.mark.parametrize("backend", ["memory", "cpu"])
def test_auto_trains_what_the_backend_it_picks_trains(tmp_path, backend):
    """auto is a choice, not a new pipeline: its run equals the run with the chosen backend named."""
    a = cli.main(
        [
            "train",
            *FAST,
            f"run.dir={tmp_path / 'a'}",
            *(["data.train.transforms=[random_rotation: 10]"] if backend == "cpu" else []),
        ]
    )
    b = cli.main(
        [
            "train",
            *FAST,
            f"run.dir={tmp_path / 'b'}",
            f"data.backend={backend}",
            *(["data.train.transforms=[random_rotation: 10]"] if backend == "cpu" else []),
        ]
    )
    assert a == b == 0
    sa, sb = (json.loads((tmp_path / x / "summary.json").read_text()) for x in "ab")
    assert sa["final"] == sb["final"]


def test_a_frame_header_after_a_large_metadata_segment_is_found(tmp_path):
    """auto reads 4 KiB of a file first; a JPEG whose frame header follows a 20 KB segment (a big EXIF
    thumbnail or ICC profile) is read further rather than called unknown."""
    import io

    buf = io.BytesIO()
    Image.new("RGB", (30, 20)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    padded = jpeg[:2] + b"\xff\xe2" + (20_002).to_bytes(2, "big") + bytes(20_000) + jpeg[2:]
    (tmp_path / "big.jpg").write_bytes(padded)
    assert auto.file_size(str(tmp_path / "big.jpg")) == (20, 30)
    assert Image.open(tmp_path / "big.jpg").size == (30, 20)  # still a valid JPEG

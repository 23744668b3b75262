"""data.backend=auto on image files measures its candidates on the user's own files, weighs the memory
backend's up-front decode against what it saves per epoch, and picks the one a direct measurement says is faster.

The reference: each backend built by name (data.backend=cpu / memory) over the same folder and timed over the run's
epochs of its training loader, building (the memory backend's decode) included, on the wall clock: with
data.num_workers=0 the batches are made between the training steps, so their wall time is what the run pays (and
what the measurement uses there).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from torchsprint import cli, config
from torchsprint.data import auto, build_loaders
from torchsprint.runtime.core import Runtime

CPU = Runtime(torch.device("cpu"))


def photos(root, n: int, size: int, fmt: str, classes=("a", "b")):
    """`n` images per class of size x size: smooth random colour fields with a little noise (photo-like: they
    compress as photos do, not as flat colour)."""
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            small = Image.fromarray(rng.integers(0, 255, (max(size // 16, 2),) * 2 + (3,), dtype=np.uint8))
            arr = np.asarray(small.resize((size, size), Image.BICUBIC)).astype(np.int16)
            arr = arr + rng.integers(-6, 6, arr.shape)
            Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(root / c / f"{i}.{fmt}", quality=90)
    return root


def direct(overrides: list[str], backend: str, epochs: int) -> float:
    """Wall seconds of building `backend` by name and iterating its training loader `epochs` times."""
    cfg = config.load(None, [*overrides, f"data.backend={backend}"])
    t0 = time.perf_counter()
    loaders = build_loaders(cfg.data, CPU, seed=0)
    for e in range(epochs):
        loaders.train.set_epoch(e)
        for _ in loaders.train:
            pass
    return time.perf_counter() - t0


def chosen(overrides: list[str], epochs: int):
    cfg = config.load(None, overrides)
    return build_loaders(cfg.data, CPU, seed=0, epochs=epochs).info


CASES = {
    # Large JPEGs trained at 48 px, one epoch: the cpu backend's decoder scales in the DCT (1/8 of 768 px), the memory
    # backend decodes every file at full size up front and crops from 768 px images.
    "large jpegs, 1 epoch": (
        lambda root: photos(root, 5, 768, "jpg"),
        1,
        "cpu",
        ["data.train.transforms=[random_resized_crop: 48]", "data.eval.transforms=[resize: 48, center_crop: 48]"],
    ),
    # A user's photos as reported (300x300 PNG, the default preprocessing for them: a random crop resized to 128 px), 1
    # epoch: the memory backend's batches are faster than the cpu backend's, but not by enough to pay for its decode up
    # front (ignoring that decode picks the memory backend here).
    "photo pngs, 1 epoch": (lambda root: photos(root, 20, 300, "png"), 1, "cpu", []),
    # Small PNGs at their own size, 15 epochs: the cpu backend decodes every file every epoch, the memory backend once.
    "small pngs, 15 epochs": (
        lambda root: photos(root, 60, 32, "png"),
        15,
        "memory",
        ["data.train.transforms=[hflip]", "data.eval.transforms=[]"],
    ),
    # The user's photos read from the decoded-image cache (data.cache=auto, the default): no decode on either side,
    # so the memory backend's batched gather wins over the cpu backend's call per image.
    "photo pngs from the cache, 3 epochs": (
        lambda root: photos(root, 20, 300, "png"),
        3,
        "memory",
        ["data.cache=auto"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_picks_the_backend_a_direct_measurement_finds_faster(tmp_path, case, figure):
    make, epochs, expected, transforms = CASES[case]
    root = make(tmp_path / "photos")
    # the files decoded as they are (data.cache=off), unless the case reads them from the decoded-image cache
    overrides = ["data.dataset=image_folder", f"data.root={root}", "data.batch_size=16", "data.cache=off", *transforms]
    info = chosen(overrides, epochs)
    cpu_s, memory_s = direct(overrides, "cpu", epochs), direct(overrides, "memory", epochs)
    faster = "cpu" if cpu_s < memory_s else "memory"
    ratio = max(cpu_s, memory_s) / min(cpu_s, memory_s)
    figure("slower / faster backend, direct wall seconds", ratio)
    m = info.backend_measured
    assert set(m["backends"]) == {"cpu", "memory"} and m["epochs"] == epochs
    # The choice follows the figures it records: memory where its estimated loading time for the run is
    # MEMORY_MARGIN under cpu's (it also holds every image decoded), else cpu.
    est = {name: b["estimate_s"] for name, b in m["backends"].items()}
    rule = "memory" if est["memory"] < (1 - auto.MEMORY_MARGIN) * est["cpu"] else "cpu"
    assert m["chosen"] == info.backend == rule, (est, info.backend_why)
    # Against the direct measurement only where one backend is clearly faster on this machine: the ratio is a
    # property of the CPU, not of the code (measured 8.6x, 1.9x and 4.6x in CASES' order on an AVX-512 EPYC in
    # 2026-11, and 1.0x for the photo pngs on another EPYC in 2026-12: a tie, where either choice is right). 2x
    # keeps a loaded machine's noise (the estimates' 75% error below) from deciding.
    if ratio > 2:
        assert faster == expected, (case, cpu_s, memory_s)
        assert info.backend == faster, (info.backend_why, cpu_s, memory_s)
    assert m["files"] <= auto.MEASURE_FILES
    assert all(b["images"] > 0 and b["images_per_s"] > 0 for b in m["backends"].values())
    assert "decode_images_per_s" in m["backends"]["memory"]
    # Each backend's estimated loading time for the run, from a few batches, against the direct measurement of the
    # whole run: est/direct 1.12-1.24 over the cases on a quiet machine, 0.57-1.60 with two busy processes beside it
    # (2 cores: the estimate's few batches and the direct run meet different moments of the load), 4.2x for the
    # memory backend's 0.04 s of small PNGs under AVX2 kernels with two busy processes. The bound, 10x, still catches
    # an estimate that forgets the epochs (15x in the last case).
    for name, direct_s in (("cpu", cpu_s), ("memory", memory_s)):
        figure(f"{name} estimate / direct", m["backends"][name]["estimate_s"] / direct_s)
        assert 1 / 10 < m["backends"][name]["estimate_s"] / direct_s < 10, (name, m, direct_s)
    assert info.backend_why.startswith(f"measured on {m['files']} of the training files")
    n = info.facts["images"]["train"] + info.facts["images"]["val"]
    assert f"for {epochs} epoch(s) of {n:,} images" in info.backend_why


def test_nothing_is_measured_where_the_choice_is_forced(tmp_path):
    """data.backend set, one candidate (a task or command that allows only cpu), a dataset already in memory."""
    root = photos(tmp_path / "p", 4, 32, "png")
    base = [
        "data.dataset=image_folder",
        f"data.root={root}",
        "data.train.transforms=[hflip]",
        "data.eval.transforms=[]",
    ]
    assert chosen([*base, "data.backend=memory"], 5).backend_measured == {}
    cfg = config.load(None, base)
    info = build_loaders(cfg.data, CPU, seed=0, allowed=("cpu",), epochs=5).info
    assert (info.backend, info.backend_measured) == ("cpu", {})
    info = chosen([], 5)  # digits: decoded in memory already: the cost model, no measurement
    assert (info.backend, info.backend_measured) == ("memory", {})


def test_the_run_records_the_figures_and_a_resume_keeps_the_backend(tmp_path, capsys):
    """decisions.json has backend_measured; the start-up line says the figures; a resumed run keeps the backend the
    run started with, whatever a new measurement would say (another backend augments differently)."""
    root = photos(tmp_path / "p", 12, 32, "png")
    run = [
        "train",
        "data.dataset=image_folder",
        f"data.root={root}",
        "data.train.transforms=[hflip]",
        "data.eval.transforms=[]",
        "model.name=small_cnn",
        "run.epochs=2",
        "log.tensorboard=false",
        "eval.per_class=false",
        f"run.dir={tmp_path / 'r'}",
    ]
    assert cli.main([*run, "run.stop_after_steps=1"]) == 0
    d = json.loads((tmp_path / "r" / "decisions.json").read_text())
    assert d["backend_measured"]["chosen"] == d["backend"] and set(d["backend_measured"]["backends"]) == {
        "cpu",
        "memory",
    }
    assert f"loader: data.backend={d['backend']} (measured on" in capsys.readouterr().out
    other = "cpu" if d["backend"] == "memory" else "memory"
    # A resume with a folder that would now measure otherwise: the decisions.json of the start is what counts.
    d["backend"] = other
    (tmp_path / "r" / "decisions.json").write_text(json.dumps(d))
    assert cli.main([*run, "checkpoint.resume=auto"]) == 0
    out = capsys.readouterr().out
    assert f"loader: data.backend={other} (data.backend=auto: the backend this run chose when it started" in out


def test_the_measuring_batch_is_the_runs(tmp_path):
    """A backend's cost per image depends on the batch (the memory backend's batched ops have a cost per batch): the
    candidates are measured at data.batch_size where the training split holds two such batches (the measurement
    once capped it at 32 and a third of a 64-file sample: 21 images for a run of 64)."""
    root = photos(tmp_path / "p", 80, 32, "png")
    base = [
        "data.dataset=image_folder",
        f"data.root={root}",
        "data.train.transforms=[hflip]",
        "data.eval.transforms=[]",
    ]
    m = chosen([*base, "data.batch_size=64"], 3).backend_measured
    assert m["batch_size"] == 64 and m["files"] >= 128, m
    assert m["clock"] == "wall clock"
    # A split too small for two batches of the run's size: as large a batch as the split allows for two.
    m = chosen([*base, "data.batch_size=200"], 3).backend_measured
    assert m["batch_size"] == m["files"] // 2 and m["files"] == round(160 * (1 - 0.2)), m


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_a_slow_disk_counts(tmp_path, monkeypatch, figure):
    """Files on slow storage (a network disk): every read waits, which the run pays on the training thread
    (data.num_workers=0) but which costs no CPU time. The cpu backend reads every file every epoch, the memory
    backend once: over 3 epochs memory is faster, as a direct wall-clock measurement says; a measurement in CPU
    time (as auto's once was) does not see the waits: its estimates of the run's loading time were 30x short."""
    from torchsprint.data.preprocess import decode

    root = photos(tmp_path / "p", 40, 48, "png")
    real = decode.read_bytes

    def slow_read(path, *limit):  # read_bytes(path, max_bytes): the file size limit passes through
        time.sleep(0.01)  # 10 ms a file, a slow network disk
        return real(path, *limit)

    monkeypatch.setattr(decode, "read_bytes", slow_read)
    # data.cache=off: the files read every epoch (with the decoded-image cache the disk is read once, by its build)
    overrides = [
        "data.dataset=image_folder",
        f"data.root={root}",
        "data.batch_size=16",
        "data.train.transforms=[hflip]",
        "data.eval.transforms=[]",
        "data.cache=off",
    ]
    info = chosen(overrides, 3)
    cpu_s, memory_s = direct(overrides, "cpu", 3), direct(overrides, "memory", 3)
    # memory reads the 80 files once, cpu 3 x 64 training reads at 10 ms each
    assert cpu_s > 1.5 * memory_s, (cpu_s, memory_s)
    assert info.backend == "memory", info.backend_why
    for name, direct_s in (("cpu", cpu_s), ("memory", memory_s)):
        ratio = info.backend_measured["backends"][name]["estimate_s"] / direct_s
        figure(f"slow disk: {name} estimate / direct", ratio)
        assert 0.5 < ratio < 2, (name, info.backend_measured, direct_s)  # 1.0-1.25 measured, 0.075 in CPU time

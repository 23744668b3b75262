"""Recipe switches together under speed.compile and across pause/resume: Mixup/CutMix, batched
TrivialAugmentWide/RandAugment (memory backend), torchvision's AutoAugment/RandAugment (cpu backend),
label smoothing and EMA. Compiled runs are compared with the same run in eager mode; resumed runs with
an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchsprint import config
from torchsprint.train.run import train

BASE = [
    "model.args={width: 8}",
    "data.batch_size=64",
    "data.val_fraction=0.5",
    "optim.lr=0.05",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "loss.label_smoothing=0.1",
    "mix.mixup_alpha=0.2",
    "mix.cutmix_alpha=1.0",
    "ema.enabled=true",
    "ema.decay=0.9",
    "run.max_steps=8",
    "checkpoint.every_steps=3",
]
AUG = {
    "memory": "data.train.transforms=[trivial_augment_wide, {rand_augment: {num_ops: 2, magnitude: 9}}]",
    "cpu": "data.train.transforms=[auto_augment, {rand_augment: {num_ops: 2, magnitude: 9}}]",
}


def run(d: Path, backend: str, *extra):
    return train(
        config.load(None, [*BASE, AUG[backend], f"data.backend={backend}", f"run.dir={d}", *extra]), quiet=True
    )


def weights(d: Path, name: str = "last.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(d / name))


@pytest.mark.parametrize("backend", ["memory", "cpu"])
def test_mixing_and_auto_augmentation_train_the_same_under_compile(tmp_path, backend):
    """dynamo + AOT autograd (aot_eager: no C++ build) over a model fed mixed, auto-augmented batches: the
    model really compiled (no silent eager fallback, no graph break) and trains the eager run's weights."""
    from test_parallel import assert_ran_compiled, compiled_frames
    from torch._dynamo.utils import counters

    eager = run(tmp_path / "eager", backend)
    torch._dynamo.reset()  # forget frames compiled by earlier tests in this process: they would not be counted again
    counters.clear()
    compiled = run(tmp_path / "compiled", backend, "speed.compile=true", "speed.compile_backend=aot_eager")
    assert_ran_compiled(compiled_frames())
    assert compiled["global_step"] == eager["global_step"] == 8
    for name in ("last.safetensors", "ema.safetensors"):
        a, b = weights(tmp_path / "eager", name), weights(tmp_path / "compiled", name)
        assert a.keys() == b.keys()
        for k in a:  # measured max |diff| 0 on both backends (aot_eager runs the same kernels): bit-identical
            assert torch.equal(b[k], a[k]), (name, k)
    # and the switches acted: without mixing the same run ends elsewhere
    plain = run(tmp_path / "plain", backend, "mix.mixup_alpha=0", "mix.cutmix_alpha=0")
    c = weights(tmp_path / "plain")
    assert any(not torch.equal(weights(tmp_path / "eager")[k], c[k]) for k in c) and plain["final"] != eager["final"]


@pytest.mark.parametrize("backend", ["memory", "cpu"])
def test_pause_and_resume_with_auto_augmentation_is_bit_identical(tmp_path, backend):
    """Paused after step 5 (a mid-epoch checkpoint) and resumed: the augmentation and mixing draws of steps
    6-8 continue where they were, so the weights, the EMA and the final metrics equal the uninterrupted run's."""
    ref = run(tmp_path / "ref", backend)
    first = run(tmp_path / "b", backend, "run.stop_after_steps=5", "log.every_steps=1")
    assert first["paused"]
    done = run(tmp_path / "b", backend, "checkpoint.resume=auto", "log.every_steps=1")
    # resumed, not started over (a fresh start would also end with the reference's weights): each step logged once
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, ref["global_step"] + 1))
    for name in ("last.safetensors", "ema.safetensors"):
        a, b = weights(tmp_path / "ref", name), weights(tmp_path / "b", name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert done["final"] == ref["final"]
    # the augmentation is part of what was replayed: the same run without it trains other weights
    noaug = run(tmp_path / "noaug", backend, "data.train.transforms=[]")
    c = weights(tmp_path / "noaug")
    assert any(not torch.equal(weights(tmp_path / "ref")[k], c[k]) for k in c) and noaug["final"] != ref["final"]

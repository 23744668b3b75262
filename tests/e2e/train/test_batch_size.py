"""data.batch_size: auto and data.effective_batch_size (train/batch_size.py), and a mid-run out-of-memory.

The out-of-memory cases use a small CNN that raises torch.cuda.OutOfMemoryError the way CUDA does (above a
number of images per training forward, or at a given training step): the CPU has no such failure to give.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.state.checkpoint import load_checkpoint
from torchsprint.state.resume import find_checkpoints
from torchsprint.train.batch_size import (
    binsearch,
    check_batch_settings,
    cpu_bound,
    power_of_two_floor,
    step_peak_bytes,
)
from torchsprint.train.run import train

OOM_MODULE = "batchauto_oom_net"
OOM_SOURCE = '''
import os

import torch
from torch import nn

from torchsprint.models import MODELS
from torchsprint.models.nets import small_cnn


class OomNet(nn.Module):
    """small_cnn (dropout and BatchNorm: RNG and running statistics a search could disturb) that runs out of
    memory like CUDA: above `limit` images in a training forward, or at training forward $BATCHAUTO_OOM_AT."""

    def __init__(self, num_classes, in_channels=3, limit=None):
        super().__init__()
        self.net = small_cnn(num_classes, in_channels, width=8, dropout=0.2)
        self.limit, self.calls = limit, 0

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            at = os.environ.get("BATCHAUTO_OOM_AT")
            if (self.limit is not None and x.shape[0] > self.limit) or (at and self.calls == int(at)):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return self.net(x)


MODELS.register("oom_net", override=True)(OomNet)
'''

BASE = [
    "run.epochs=1",
    "data.val_fraction=0.5",  # 898 training images: auto's data cap is 898, so 512 on the CPU (a power of two)
    "data.train.transforms=[random_crop: {size: 8, padding: 1}, hflip]",
    "optim.lr=0.05",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "log.every_steps=1",
]


@pytest.fixture
def oom_net(tmp_path, monkeypatch):
    """The module defining `oom_net`, importable here (imports:) and by a CLI started in tmp_path."""
    (tmp_path / f"{OOM_MODULE}.py").write_text(OOM_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("BATCHAUTO_OOM_AT", raising=False)
    sys.modules.pop(OOM_MODULE, None)
    return [f"imports=[{OOM_MODULE}]", "model.name=oom_net"]


def run(run_dir: Path, *extra: str) -> dict:
    return train(config.load(None, [*BASE, f"run.dir={run_dir}", *extra]), quiet=True)


def decisions(run_dir: Path) -> dict:
    return json.loads((run_dir / "decisions.json").read_text())


# ---------------------------------------------------------------- the search itself


@pytest.mark.parametrize(
    "limit, start, cap, good",
    [
        (limit, start, cap, good)
        for limit in (1, 2, 3, 37, 64, 100, 511, 512, 1000)
        for start, cap, good in ((2, 512, 0), (512, 512, 8), (1, 700, 0))
        if good <= limit  # `good` is known to fit
    ],
)
def test_binsearch_finds_the_largest_size_that_fits(limit, start, cap, good):
    """Against brute force over every size, in at most 2 x log2(cap) + 2 trials; never tries above cap."""
    found, trials = binsearch(lambda n: n <= limit, start, cap, good=good)
    assert found == max(n for n in range(0, cap + 1) if n <= limit)
    assert all(1 <= n <= cap for n, _ in trials)
    assert len(trials) <= 2 * cap.bit_length() + 2


def test_cpu_bound_rule():
    """(free x 50% - fixed) / per image, per image and fixed from two measured steps (worked by hand)."""
    mib = 2**20
    # 10 MiB fixed + 3 MiB per image: steps of 2 and 8 images peak at 16 and 34 MiB; 1000 MiB free -> 500 MiB budget.
    b = cpu_bound(16 * mib, 34 * mib, (2, 8), 1000 * mib)
    assert (b["per_image_bytes"], b["fixed_bytes"], b["bound"]) == (3 * mib, 10 * mib, 163)  # (500 - 10) / 3
    assert cpu_bound(16 * mib, 34 * mib, (2, 8), 1000 * mib, processes=2)["bound"] == 80  # (250 - 10) / 3
    assert cpu_bound(16 * mib, 34 * mib, (2, 8), 10 * mib)["bound"] == 0  # nothing fits
    assert [power_of_two_floor(n) for n in (0, 1, 2, 3, 163, 512, 898)] == [0, 1, 2, 2, 128, 512, 512]


def test_step_peak_bytes_sees_torch_allocations():
    """A 64 MiB tensor that lives only inside the function: its peak is seen although it is freed (tracemalloc
    would see nothing: torch allocates outside Python's allocator)."""
    size = 64 * 2**20

    def step():
        t = torch.ones(size // 4)  # 4-byte floats, written: resident
        del t

    peak = step_peak_bytes(step)
    if peak is None:
        pytest.skip("/proc/self/clear_refs is not writable here")
    # Measured 64.0 MiB, up to 65.0 on a process's first call (first-use allocations beside the tensor), and
    # 63.8 after other tests in the same process (part of the tensor landed on pages still resident from freed
    # memory); 3x that 1 MiB either way is the slack. tracemalloc would report ~0 here.
    assert size - 3 * 2**20 <= peak <= size + 3 * 2**20, peak / 2**20


# ---------------------------------------------------------------- auto in a run


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_auto_backs_off_on_oom_and_equals_the_explicit_size_bit_for_bit(tmp_path, oom_net):
    """The CPU bound proposes 512; the model runs out of memory above 100 images, so the search bisects down to
    exactly 100. The run then equals a run with data.batch_size=100 written in, bit for bit: the search's model,
    optimizer, dropout draws and BatchNorm statistics left no trace (weights, per-step losses, metrics)."""
    auto = run(tmp_path / "auto", *oom_net, "model.args={limit: 100}", "data.batch_size=auto")
    d = decisions(tmp_path / "auto")
    assert d["batch_size"] == 100 and d["accum_steps"] == 1 and d["effective_batch_size"] == 100
    assert d["batch_size_why"].startswith("auto: the largest that trains here")
    trials = d["batch_size_search"]["trials"]
    assert trials[0] == [512, False] and [100, True] in trials and [101, False] in trials
    saved = config.read_file(tmp_path / "auto" / "config.yaml")
    assert saved["data"]["batch_size"] == 100  # resuming from the folder trains with the size found

    ref = run(tmp_path / "explicit", *oom_net, "model.args={limit: 100}", "data.batch_size=100")
    a, b = (
        load_file(str(tmp_path / "auto" / "last.safetensors")),
        load_file(str(tmp_path / "explicit" / "last.safetensors")),
    )
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # BatchNorm running statistics included
    assert auto["final"] == ref["final"] and auto["global_step"] == ref["global_step"] == 898 // 100
    rows = lambda p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines() if '"train"' in x]  # noqa: E731
    assert [r["train/loss"] for r in rows(tmp_path / "auto")] == [r["train/loss"] for r in rows(tmp_path / "explicit")]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_auto_keeps_the_effective_batch_through_accumulation(tmp_path, oom_net):
    """Found 100 (out of memory above), effective batch 600: 100 x accum 6; 450: 90 (its largest divisor <= 100) x 5."""
    for effective, batch, accum in ((600, 100, 6), (450, 90, 5)):
        out = tmp_path / str(effective)
        run(
            out,
            *oom_net,
            "model.args={limit: 100}",
            "data.batch_size=auto",
            f"data.effective_batch_size={effective}",
            "run.max_steps=1",
        )
        d = decisions(out)
        assert (d["batch_size"], d["accum_steps"], d["effective_batch_size"]) == (batch, accum, effective)
        assert f"optim.accum_steps={accum} keeps data.effective_batch_size={effective}" in d["batch_size_why"]


def test_auto_on_the_cpu_follows_the_memory_rule(tmp_path):
    """digits + small_cnn: the bound from free memory is far above the data, so the cap decides: the largest power
    of two <= 898 training images. The record holds the measured per-image memory the bound came from."""
    run(tmp_path, "data.batch_size=auto", "run.max_steps=1")
    d = decisions(tmp_path)
    s = d["batch_size_search"]
    assert s["cap"] == 898 and s["per_image_bytes"] >= 1 and s["available_bytes"] > 0
    assert d["batch_size"] == power_of_two_floor(min(s["bound"], s["cap"])) == 512
    assert s["trials"] == [[512, True]]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_resuming_an_auto_run_keeps_the_size_it_found(tmp_path, oom_net):
    """A pause, then resume with the original `auto` config (not the folder's): no new search (a different
    answer would move the mid-epoch data position); the checkpoint's size is used and said so."""
    run(tmp_path, *oom_net, "model.args={limit: 100}", "data.batch_size=auto", "run.stop_after_steps=3")
    # Now out of memory above 150 only: a new search would find 150.
    done = run(tmp_path, *oom_net, "model.args={limit: 150}", "data.batch_size=auto", "checkpoint.resume=auto")
    d = decisions(tmp_path)
    assert d["batch_size"] == 100 and "kept from the checkpoint" in d["batch_size_why"]
    assert not done["paused"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ["0", "-3", "abc", "2.5", "true", "''"])
def test_bad_batch_size_is_one_line(value):
    with pytest.raises(UsageError, match=r"data\.batch_size: .*whole number of images >= 1 per process, or 'auto'"):
        config.load(None, [f"data.batch_size={value}"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["data.batch_size=30", "data.effective_batch_size=100"],
            r"not a whole number of batches .* divisor of 100 \(e\.g\. 25\)",
        ),
        (
            ["data.batch_size=auto", "data.effective_batch_size=100", "optim.accum_steps=2"],
            "remove optim.accum_steps=2",
        ),
        (
            ["data.batch_size=25", "data.effective_batch_size=100", "optim.accum_steps=3"],
            "needs optim.accum_steps=4, but it is 3",
        ),
        (["data.batch_size=auto", "strategy=dp"], "data.batch_size=auto with strategy=dp"),
    ],
)
def test_bad_combinations_are_refused(tmp_path, overrides, says):
    with pytest.raises(UsageError, match=says):
        run(tmp_path, *overrides)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before the run folder is written


def test_effective_batch_not_divisible_by_processes():
    cfg = config.load(None, ["data.batch_size=auto", "data.effective_batch_size=101"])
    with pytest.raises(UsageError, match="not divisible by the 2 processes.*e.g. 100"):
        check_batch_settings(cfg, world_size=2)
    check_batch_settings(cfg, world_size=1)


def test_cli_bad_batch_size_exits_2_in_one_line(cli_in_process):
    p = cli_in_process("train", "data.batch_size=0")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "data.batch_size" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- out of memory in the middle of training


def test_oom_mid_run_ends_in_one_line_and_the_checkpoint_resumes_exactly(tmp_path, oom_net, cli_in_process):
    """Out of memory at step 5 (checkpoints every 3 steps): exit 2, one line naming the batch size, what to lower
    and the checkpoint; that checkpoint (step 3) resumes to the same weights as a run that never failed."""
    args = [*BASE, *oom_net, "data.batch_size=64", "checkpoint.every_steps=3", "run.dir=oom"]
    p = cli_in_process("train", *args, env={"BATCHAUTO_OOM_AT": "5"})
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("error: out of memory on cpu at step 5 while training (data.batch_size=64 per process")
    ckpts = find_checkpoints(tmp_path / "oom")
    assert (
        "lower data.batch_size (e.g. 32" in line
        and f"the last checkpoint, checkpoints/{ckpts[0].name}, is intact" in line
    )
    assert load_checkpoint(ckpts[0])["train_state"]["global_step"] == 3  # the last one written before the failure

    done = run(tmp_path / "oom", *oom_net, "data.batch_size=64", "checkpoint.every_steps=3", "checkpoint.resume=auto")
    ref = run(tmp_path / "ref", *oom_net, "data.batch_size=64", "checkpoint.every_steps=3")
    a, b = load_file(str(tmp_path / "oom" / "last.safetensors")), load_file(str(tmp_path / "ref" / "last.safetensors"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert done["global_step"] == ref["global_step"] == 898 // 64


@pytest.mark.parametrize("setting", ["auto", "true", "false"])
def test_the_probe_feeds_batches_in_the_format_the_run_plans(setting, tmp_path):
    """data.batch_size=auto measures a step's memory on batches as the run's loaders will deliver them: the plan's
    channels_last_inputs (under speed.channels_last=auto the model is NHWC and the batches stay NCHW; the probe once
    converted them to NHWC itself, measuring a copy the run never makes)."""
    from conftest import make_image_folder
    from torchsprint import runtime
    from torchsprint.train.batch_size import probe_trial
    from torchsprint.train.build import build_training

    make_image_folder(tmp_path / "imgs")  # RGB: with one channel (digits) NCHW and NHWC are the same memory
    cfg = config.load(
        None,
        [
            f"speed.channels_last={setting}",
            "log.tensorboard=false",
            "model.name=resnet18",
            "data.dataset=image_folder",
            f"data.root={tmp_path / 'imgs'}",
            "data.backend=cpu",
            "data.batch_size=4",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        trial, _ = probe_trial(cfg, rt)
        x, _ = trial.batch(4)
        plan = build_training(cfg, rt, lambda m: None).plan
    finally:
        runtime.teardown(rt)
    nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert nhwc == plan.channels_last_inputs == (setting == "true"), (setting, x.stride())

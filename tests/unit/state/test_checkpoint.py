"""state/checkpoint.py function by function: names, atomic writes, safe loading, weights files, the saver's status
file, retention and set-aside. Real files, torch.save and safetensors; no training runs (each test takes well under
a second), so that mutation testing (benchmarks/tools/mutation.sh checkpoint) can run them for every mutant."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import resource
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from fault_env import faults
from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime
from torchsprint.state import checkpoint as ckpt_mod
from torchsprint.state.checkpoint import (
    FORMAT,
    TEMP_RE,
    Saver,
    TrainState,
    atomic_write,
    data_geometry,
    epoch_number,
    load_checkpoint,
    parse_checkpoint_name,
    save_weights,
    strip_prefixes,
)
from torchsprint.state.ema import ModelEma, NoEma
from torchsprint.state.precision import Precision

CPU = Runtime(torch.device("cpu"))


# ---------------------------------------------------------------- names


def test_strip_prefixes_removes_every_wrapper_prefix_at_the_front_only():
    t = [torch.full((1,), float(i)) for i in range(5)]
    state = {
        "module._orig_mod.conv.weight": t[0],
        "_orig_mod.module.fc.bias": t[1],
        "module.module.x": t[2],
        "encoder.module.y": t[3],
        "module_z._orig_mod": t[4],
    }
    out = strip_prefixes(state)
    assert list(out) == ["conv.weight", "fc.bias", "x", "encoder.module.y", "module_z._orig_mod"]
    assert all(out[k] is v for k, v in zip(out, t))  # the same tensors, no copies


@pytest.mark.parametrize(
    "epoch, step_in_epoch, number", [(0, 0, 1), (0, 5, 1), (1, 0, 1), (1, 5, 2), (3, 0, 3), (2, 1, 3)]
)
def test_epoch_number_is_1_based_and_an_epoch_end_belongs_to_the_finished_epoch(epoch, step_in_epoch, number):
    assert epoch_number(TrainState(epoch=epoch, step_in_epoch=step_in_epoch)) == number


def test_parse_checkpoint_name():
    assert parse_checkpoint_name("ckpt-e003-s0000022.pt") == (3, 22)
    assert parse_checkpoint_name("ckpt-e12-s7.pt") == (12, 7)
    for other in (
        "status.json",
        "ckpt-e003-s0000022.pt.tmp-12",
        ".ckpt-e003-s0000022.pt.tmp-12",
        "ckpt-e3.pt",
        "best.safetensors",
    ):
        assert parse_checkpoint_name(other) is None


def test_data_geometry_lists_what_fixes_a_data_position():
    cfg = config.load(
        None,
        ["data.batch_size=48", "optim.accum_steps=3", "run.seed=11", "data.repeated_aug=2", "data.sampler=shuffle"],
    )
    assert data_geometry(cfg, 4) == {
        "batch_size": 48,
        "accum_steps": 3,
        "world_size": 4,
        "seed": 11,
        "repeated_aug": 2,
        "data_sampler": "shuffle",
        "data_sampler_from_epoch": 1,
    }


# ---------------------------------------------------------------- atomic writes


class Recorder(io.BytesIO):
    """An in-memory file that records each write's size and each flush, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def write(self, data) -> int:
        self.calls.append(len(memoryview(data).cast("B")))
        return super().write(data)

    def flush(self) -> None:
        self.calls.append("flush")
        super().flush()


def test_normal_writes_pass_through_in_one_call():
    f = Recorder()
    g = ckpt_mod._GuardedFile(f)
    data = bytes(range(256)) * 40  # 10 KiB: more than one slow-disk chunk
    assert g.write(data) == len(data)
    assert f.calls == [len(data)] and f.getvalue() == data  # no 4 KiB chunking, no flushes off the slow-disk hook
    g.flush()
    assert f.calls[-1] == "flush"


def test_slow_disk_fault_writes_4_kib_chunks_each_flushed_then_sleeps(monkeypatch):
    """The fault the kill-inside-a-write tests inject (tests/faults/sitecustomize.py slow_writes): it must really leave
    a partly written file during its sleeps, or those tests kill between writes and prove nothing."""
    faults().slow_writes(0.001, patch=monkeypatch.setattr)
    f = Recorder()
    g = ckpt_mod._GuardedFile(f)
    data = bytes(range(256)) * 40 + b"tail!"  # 2 full chunks of 4096, then 2053 bytes
    t0 = time.perf_counter()
    assert g.write(data) == len(data)
    assert time.perf_counter() - t0 >= 3 * 0.001  # one sleep per chunk
    assert f.calls == [4096, "flush", 4096, "flush", 2053, "flush"]
    assert f.getvalue() == data


def test_atomic_write_under_the_slow_disk_fault_writes_the_same_bytes(tmp_path, monkeypatch):
    faults().slow_writes(0.002, patch=monkeypatch.setattr)
    assert atomic_write(tmp_path / "f.bin", lambda f: f.write(b"x" * 9000)) == 9000
    assert (tmp_path / "f.bin").read_bytes() == b"x" * 9000


def test_guarded_file_remembers_the_first_write_error():
    class Failing(io.BytesIO):
        def __init__(self):
            super().__init__()
            self.errors = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EIO, "I/O error")]

        def write(self, data):
            raise self.errors.pop(0)

    g = ckpt_mod._GuardedFile(Failing())
    assert g.error is None
    for expected in (errno.ENOSPC, errno.EIO):
        with pytest.raises(OSError) as info:
            g.write(b"abc")
        assert info.value.errno == expected  # each write's own error propagates
    assert g.error.errno == errno.ENOSPC  # the first one is kept


def test_atomic_write_renames_a_complete_temp_file_over_the_target(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    seen = {}

    def write(f):
        f.write(b"new contents")
        seen["files"] = sorted(p.name for p in tmp_path.iterdir())
        seen["old"] = path.read_bytes()

    assert atomic_write(path, write) == len(b"new contents")
    assert path.read_bytes() == b"new contents"
    tmp_name = f".model.bin.tmp-{os.getpid()}"
    assert seen == {"files": [tmp_name, "model.bin"], "old": b"old"}  # written next to the target, old file untouched
    assert TEMP_RE.match(tmp_name)  # the name Saver sweeps away after a crash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]
    assert atomic_write(str(tmp_path / "s.bin"), lambda f: f.write(b"12345")) == 5  # a str path works too


def test_a_serializer_that_hides_a_write_error_gets_the_write_error_back(tmp_path):
    # torch.save reports a failed write as a RuntimeError while closing its archive; the OSError is what happened.
    def write(f):
        real = f.f
        f.f = _FailingFile(real)
        try:
            f.write(b"partial")
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from None

    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "f.bin", write)
    assert info.value.errno == errno.ENOSPC
    assert isinstance(info.value.__cause__, RuntimeError)
    assert list(tmp_path.iterdir()) == []  # the temp file is gone, no target was created

    def plain_failure(f):
        f.write(b"fine")
        raise ValueError("serializer bug")

    with pytest.raises(ValueError, match="serializer bug"):  # no write failed: the error itself
        atomic_write(tmp_path / "f.bin", plain_failure)
    assert list(tmp_path.iterdir()) == []

    def direct(f):
        f.f = _FailingFile(f.f)
        f.write(b"x")

    with pytest.raises(OSError) as info:  # the write error itself, raised once (not chained to itself)
        atomic_write(tmp_path / "f.bin", direct)
    assert info.value.errno == errno.ENOSPC and info.value.__cause__ is None
    assert list(tmp_path.iterdir()) == []


class _FailingFile:
    """A real file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        self.f.flush()


def test_out_of_file_descriptors_is_reported_as_such(tmp_path):
    # open() fails before the temp file exists: the cleanup must not replace EMFILE with "no such file".
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # every descriptor below the limit is taken
    try:
        with pytest.raises(OSError) as info:
            atomic_write(tmp_path / "f.bin", lambda f: f.write(b"x"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert info.value.errno == errno.EMFILE, info.value
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_into_a_missing_folder_raises_the_open_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        atomic_write(tmp_path / "missing" / "f.bin", lambda f: f.write(b"x"))
    assert info.value.filename == str(tmp_path / "missing" / f".f.bin.tmp-{os.getpid()}")
    assert not (tmp_path / "missing").exists()


# ---------------------------------------------------------------- loading


def full_checkpoint(**extra) -> dict:
    return {
        "format": FORMAT,
        "version": 1,
        "model": {"w": torch.ones(2)},
        "optimizer": {},
        "scheduler": {},
        "train_state": {"step_in_epoch": 0},
        "rng": [],
        **extra,
    }


def test_load_checkpoint_returns_the_saved_dict(tmp_path):
    saved = full_checkpoint(metric=0.5, classes=["a"])
    torch.save(saved, tmp_path / "c.pt")
    got = load_checkpoint(str(tmp_path / "c.pt"))
    assert got.keys() == saved.keys() and torch.equal(got["model"]["w"], saved["model"]["w"])
    assert got["model"]["w"].device.type == "cpu" and got["metric"] == 0.5


def test_a_checkpoint_saved_on_a_gpu_loads_on_a_cpu_only_machine(tmp_path):
    # torch.save records each storage's device; rewrite "cpu" to "cuda:0" in a real file, as a GPU run saves it.
    buf = io.BytesIO()
    torch.save(full_checkpoint(), buf)
    path = tmp_path / "gpu.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(path, "w") as zout:
        for n in zin.namelist():
            data = zin.read(n)
            if n.endswith("/data.pkl"):
                assert data.count(b"X\x03\x00\x00\x00cpu") == 1  # the one storage's location, a pickled str
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            zout.writestr(n, data)
    with pytest.raises(RuntimeError, match="CUDA"):  # the file really names a CUDA device (no GPU visible here)
        torch.load(path, weights_only=True)
    w = load_checkpoint(path)["model"]["w"]
    assert w.device.type == "cpu" and torch.equal(w, torch.ones(2))


def test_loading_never_runs_code_even_when_torch_is_told_to_allow_it(tmp_path, monkeypatch):
    # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (a common workaround for old pickles) turns weights_only off wherever
    # torch.load is called without it: load_checkpoint must pass weights_only=True itself.
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "evil.pt"
    torch.save(full_checkpoint(model=Payload()), path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


def test_load_checkpoint_refusals_name_the_file_and_the_reason(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    for missing in (tmp_path / "nope.pt", folder):  # a folder is not a checkpoint file either
        with pytest.raises(UsageError) as info:
            load_checkpoint(missing)
        assert str(info.value) == f"checkpoint not found: {missing}. Pass an existing ckpt-*.pt file or a run folder."

    def refusal(obj) -> str:
        p = tmp_path / "x.pt"
        torch.save(obj, p)
        with pytest.raises(UsageError) as info:
            load_checkpoint(p)
        return str(info.value).removeprefix(f"{p} ")

    not_ours = "is not a torchsprint checkpoint (no 'torchsprint-checkpoint' format marker)."
    hint = " It looks like a weights file: start from it with model.pretrained=<file> instead."
    assert refusal({"w": torch.zeros(1), "b": torch.zeros(1)}) == not_ours + hint
    assert refusal({"w": torch.zeros(1), "step": 3}) == not_ours  # not only tensors: no hint
    assert refusal({}) == not_ours
    assert refusal([torch.zeros(1)]) == not_ours
    assert refusal({"format": "other", "w": torch.zeros(1)}) == not_ours
    assert refusal({"format": FORMAT}) == (
        "is an incomplete torchsprint checkpoint: missing ['model', 'optimizer', 'scheduler', 'train_state', 'rng']."
    )
    ck = full_checkpoint()
    del ck["scheduler"], ck["rng"]
    assert refusal(ck) == "is an incomplete torchsprint checkpoint: missing ['scheduler', 'rng']."


def test_unreadable_files_report_the_loader_error_first_line_cut_at_200_characters(tmp_path):
    prefix = "is not a readable checkpoint (truncated, corrupt or another format): "

    def message(p: Path) -> str:
        with pytest.raises(UsageError) as info:
            load_checkpoint(p)
        return str(info.value).removeprefix(f"{p} ")

    empty = tmp_path / "empty.pt"  # e.g. created, never written
    empty.touch()
    assert message(empty) == prefix + "EOFError: "
    # A torch zip archive without its pickle: torch's error is one 322-character line and more.
    broken = tmp_path / "broken.pt"
    with zipfile.ZipFile(broken, "w") as z:
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")
    with pytest.raises(Exception) as direct:
        torch.load(broken, map_location="cpu", weights_only=True)
    first = str(direct.value).splitlines()[0]
    assert len(first) > 200
    assert message(broken) == prefix + f"{type(direct.value).__name__}: {first[:200]}"

    # Several lines (weights_only refusing a class): only the first.
    class Payload:
        def __reduce__(self):
            return (print, ("never",))

    code = tmp_path / "code.pt"
    torch.save({"format": FORMAT, "model": Payload()}, code)
    with pytest.raises(Exception) as direct:
        torch.load(code, weights_only=True)
    lines = str(direct.value).splitlines()
    assert len(lines) > 1 and len(lines[0]) <= 200
    assert message(code) == prefix + f"UnpicklingError: {lines[0]}"


# ---------------------------------------------------------------- weights files


def test_save_weights_writes_plain_safetensors_with_metadata_and_no_wrapper_prefixes(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    wrapped = nn.DataParallel(model)  # names "module.0.weight", ...
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # a non-contiguous parameter
    path = tmp_path / "best.safetensors"
    size = save_weights(path, wrapped, {"classes": '["a", "b"]', "model": "tiny"})
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    expected = model.state_dict()
    assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"classes": '["a", "b"]', "model": "tiny"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.safetensors"]


def test_save_weights_failure_is_a_usage_error_and_keeps_the_previous_file(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError) as info:
        save_weights(blocker / "best.safetensors", nn.Linear(2, 2), {})
    assert str(info.value) == (
        f"could not write {blocker / 'best.safetensors'}: Not a directory. The previous best.safetensors, "
        "if any, is intact; free disk space or fix permissions, then resume the run."
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ---------------------------------------------------------------- the saver


def make_saver(run_dir: Path, *overrides: str, log=None, ema=None, resumed_step=None, rt: Runtime = CPU):
    cfg = config.load(None, list(overrides))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    saver = Saver(
        run_dir,
        cfg.checkpoint,
        rt,
        {"config": config.to_dict(cfg), "classes": ["a", "b"]},
        geometry=data_geometry(cfg, rt.world_size),
        resumed_step=resumed_step,
        log=log if log is not None else (lambda m: None),
        ema=ema,
    )
    return saver, (model, opt, sched, Precision("fp32", CPU.device))


def state(step: int, epoch: int = 0, step_in_epoch: int | None = None) -> TrainState:
    return TrainState(epoch=epoch, step_in_epoch=step if step_in_epoch is None else step_in_epoch, global_step=step)


def read_status(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / "status.json").read_text())


def name(step: int, epoch: int = 1) -> str:
    return f"ckpt-e{epoch:03d}-s{step:07d}.pt"


def test_saver_creates_the_nested_checkpoint_folder_and_reopens_it(tmp_path):
    run = tmp_path / "a" / "b"
    saver, objs = make_saver(run)
    assert (
        saver.dir == run / "checkpoints"
        and saver.dir.is_dir()
        and saver.status_path == run / "checkpoints" / "status.json"
    )
    assert saver.status == {"checkpoints": [], "history": []}
    saver.save(state(1), *objs, metric=None)
    again, _ = make_saver(run, resumed_step=1)  # the folder exists now
    assert [e["file"] for e in again.status["checkpoints"]] == [name(1)]


def test_saver_on_an_unusable_folder_is_a_usage_error(tmp_path):
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(UsageError) as info:
        make_saver(tmp_path)
    assert str(info.value) == (
        f"cannot use the checkpoint folder {tmp_path / 'checkpoints'}: File exists. Make the run "
        "folder writable or set run.dir."
    )


def test_a_non_main_rank_does_not_touch_the_folder(tmp_path):
    # world_size=1 with rank=1 never happens in training; it isolates the rank-0-only branch without processes.
    rt = Runtime(torch.device("cpu"), rank=1, world_size=1)
    saver, objs = make_saver(tmp_path / "run", rt=rt)
    assert not (tmp_path / "run").exists() and saver.status == {}
    assert saver.save(state(1), *objs, metric=None) == tmp_path / "run" / "checkpoints" / name(1)
    assert not (tmp_path / "run").exists()


def test_save_writes_the_full_checkpoint_and_status(tmp_path):
    saver, (model, opt, sched, prec) = make_saver(
        tmp_path,
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=min",
        "optim.accum_steps=3",
        "data.batch_size=16",
        "run.seed=5",
        "data.sampler=shuffle",
    )  # a run resolves auto before saving
    t0 = time.time()
    path = saver.save(TrainState(epoch=2, step_in_epoch=4, global_step=30), model, opt, sched, prec, metric=0.25)
    t1 = time.time()
    assert path == tmp_path / "checkpoints" / "ckpt-e003-s0000030.pt"
    ck = load_checkpoint(path)
    assert ck["format"] == FORMAT and ck["version"] == 1 and ck["metric"] == 0.25
    assert ck["sampler"] == {
        "epoch": 2,
        "batches_done": 12,
        "batch_size": 16,
        "accum_steps": 3,
        "world_size": 1,
        "seed": 5,
        "repeated_aug": 1,
        "data_sampler": "shuffle",
        "data_sampler_from_epoch": 1,
    }
    assert ck["scaler"] == prec.state_dict() and ck["classes"] == ["a", "b"] and "ema" not in ck
    assert ck["config"]["checkpoint"]["monitor"] == "val/loss"
    raw = (tmp_path / "checkpoints" / "status.json").read_text()
    assert raw == json.dumps(json.loads(raw), indent=1)  # readable: one entry field per line
    status = read_status(tmp_path)
    t = status["history"][0]["time"]
    assert t == round(t, 3)  # milliseconds
    entry = status["checkpoints"][0]
    assert t0 - 0.001 <= entry.pop("time") <= t1 + 0.001
    assert entry == {
        "file": path.name,
        "epoch": 3,
        "step_in_epoch": 4,
        "step": 30,
        "metric": 0.25,
        "bytes": path.stat().st_size,
    }
    assert status["monitor"] == "val/loss" and status["mode"] == "min"
    assert status["latest"] == status["best"] == path.name
    assert list(status) == ["checkpoints", "history", "monitor", "mode", "latest", "best"]
    assert status["history"][0]["file"] == path.name


def test_save_of_unchanged_state_is_skipped_and_a_changed_one_overwrites(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=5")
    p1 = saver.save(state(3), *objs, metric=None)
    assert saver.save(state(3), *objs, metric=None) == p1  # e.g. a pause right after a step checkpoint
    assert len(read_status(tmp_path)["history"]) == 1
    # The end of epoch 1 at the same step (epoch counter advanced, scored): the same file name, rewritten.
    p2 = saver.save(TrainState(epoch=1, step_in_epoch=0, global_step=3), *objs, metric=0.7)
    assert p2 == p1
    status = read_status(tmp_path)
    assert [e["metric"] for e in status["history"]] == [None, 0.7]
    assert [(e["file"], e["metric"]) for e in status["checkpoints"]] == [(p1.name, 0.7)]
    assert load_checkpoint(p1)["metric"] == 0.7
    saver.save(state(4), *objs, metric=None)
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [p1.name, name(4)]


def test_failed_save_names_the_errno_keeps_the_old_checkpoints_and_can_be_retried(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=5")
    saver.save(state(1), *objs, metric=None)
    before = read_status(tmp_path)
    saver.dir.rename(tmp_path / "moved")  # the folder vanished (unmounted, deleted): writes fail with ENOENT
    with pytest.raises(UsageError) as info:
        saver.save(state(2), *objs, metric=None)
    assert str(info.value) == (
        f"could not save checkpoint {saver.dir / name(2)}: No such file or directory (ENOENT). Nothing saved before "
        f"was lost: the previous checkpoints in {saver.dir} are intact. Free disk space or fix permissions, then "
        f"continue with `torchsprint train --resume {tmp_path}`."
    )
    (tmp_path / "moved").rename(saver.dir)
    assert read_status(tmp_path) == before
    saver.save(state(2), *objs, metric=None)  # the same state again: written now (the failed save did not count)
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(1), name(2)]


def test_ema_is_saved_when_enabled_and_omitted_for_the_no_op_ema(tmp_path):
    cfg = config.load(None, ["ema.enabled=true"])
    source = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEma(source, cfg.ema, torch.device("cpu"))
    ema.updates = 7
    saver, objs = make_saver(tmp_path / "a", ema=ema)
    ck = load_checkpoint(saver.save(state(1), *objs, metric=None))
    assert ck["ema"]["updates"] == 7
    assert ck["ema"]["module"].keys() == ema.module.state_dict().keys()
    assert all(torch.equal(ck["ema"]["module"][k], v) for k, v in ema.module.state_dict().items())
    saver, objs = make_saver(tmp_path / "b", ema=NoEma())
    assert "ema" not in load_checkpoint(saver.save(state(1), *objs, metric=None))


@pytest.mark.parametrize("mode, best", [("max", 0.9), ("min", 0.1)])
def test_keep_last_and_best_with_ties_going_to_the_first(tmp_path, mode, best):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=1", "checkpoint.keep_best=2", f"checkpoint.mode={mode}")
    metrics = [0.5, best, 0.5, best, 0.3 if mode == "max" else 0.7, None]  # steps 1..6
    for i, m in enumerate(metrics):
        saver.save(state(i + 1), *objs, metric=m)
    # last 1: step 6; best 2: the first `best` (step 2), then its tie at step 4 (before the 0.5s).
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(2), name(4), name(6)]
    assert read_status(tmp_path)["best"] == name(2)
    assert sorted(p.name for p in saver.dir.glob("ckpt-*.pt")) == [name(2), name(4), name(6)]


def test_a_checkpoint_deleted_by_hand_during_the_run_does_not_stop_the_next_save(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=1", "checkpoint.keep_best=0")
    saver.save(state(1), *objs, metric=None)
    (saver.dir / name(1)).unlink()  # e.g. to free disk space; the saver still lists it
    saver.save(state(2), *objs, metric=None)  # drops step 1 from the list: deleting it again is not an error
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(2)]
    assert sorted(p.name for p in saver.dir.glob("ckpt-*.pt")) == [name(2)]


def test_status_times_are_in_milliseconds(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=8")
    for s in range(1, 9):
        saver.save(state(s), *objs, metric=None)
    times = [e["time"] for e in read_status(tmp_path)["history"]]
    assert times == sorted(times) and all(t == round(t, 3) for t in times)  # 8 saves: a 4th decimal shows up


def test_keep_best_zero_keeps_only_the_last(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=2", "checkpoint.keep_best=0")
    for i, m in enumerate([0.9, 0.1, 0.5]):
        saver.save(state(i + 1), *objs, metric=m)
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(2), name(3)]
    assert read_status(tmp_path)["best"] == name(3)  # the best of what is kept


def test_best_is_none_without_scored_checkpoints_and_counts_a_zero_metric(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=3", "checkpoint.mode=max")
    saver.save(state(1), *objs, metric=None)
    assert read_status(tmp_path)["best"] is None and read_status(tmp_path)["latest"] == name(1)
    saver.save(state(2), *objs, metric=0.0)
    assert read_status(tmp_path)["best"] == name(2)


def test_keep_last_orders_by_step_not_by_save_order(tmp_path):
    # "Last" is by global step, not by list order (the status keeps its list sorted; _keep must not rely on that).
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=2", "checkpoint.keep_best=0")
    saver.status["checkpoints"] = [{"file": name(9), "epoch": 1, "step_in_epoch": 9, "step": 9, "metric": None}]
    (saver.dir / name(9)).write_bytes(b"")
    saver.save(state(5), *objs, metric=None)
    saver.save(state(6), *objs, metric=None)
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(6), name(9)]
    assert read_status(tmp_path)["latest"] == name(9)


# ---------------------------------------------------------------- reopening a folder


def test_reopening_reconciles_the_status_with_the_files(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=5")
    for s in (1, 2, 3):
        saver.save(state(s), *objs, metric=s / 10)
    (saver.dir / name(2)).unlink()  # deleted by hand: dropped from the list
    status = read_status(tmp_path)
    status["checkpoints"] = [
        e for e in status["checkpoints"] if e["file"] != name(3)
    ]  # a crash before the status update
    (saver.dir / "status.json").write_text(json.dumps(status))
    (saver.dir / name(4)).write_bytes(b"torn")  # unreadable, not listed: listed without metric
    (saver.dir / "notes.txt").write_text("x")
    reopened, _ = make_saver(tmp_path, "checkpoint.keep_last=5", resumed_step=4)
    entries = reopened.status["checkpoints"]
    assert [e["file"] for e in entries] == [name(1), name(3), name(4)]
    assert entries[0] == status["checkpoints"][0]  # listed entries are kept as they are
    p3 = saver.dir / name(3)
    assert entries[1] == {
        "file": name(3),
        "epoch": 1,
        "step_in_epoch": 3,
        "step": 3,
        "metric": 0.3,
        "bytes": p3.stat().st_size,
        "time": p3.stat().st_mtime,
    }
    assert entries[2] == {
        "file": name(4),
        "epoch": 1,
        "step_in_epoch": None,
        "step": 4,
        "metric": None,
        "bytes": 4,
        "time": (saver.dir / name(4)).stat().st_mtime,
    }
    assert len(reopened.status["history"]) == 3


def test_reopening_sorts_unlisted_files_by_step_then_epoch(tmp_path):
    saver, objs = make_saver(tmp_path)
    first = saver.save(state(1), *objs, metric=None)
    (saver.dir / "status.json").unlink()
    names = ["ckpt-e002-s0000005.pt", "ckpt-e003-s0000011.pt", "ckpt-e001-s0000005.pt", "ckpt-e001-s0000002.pt"]
    for n in names:
        (saver.dir / n).write_bytes(first.read_bytes())
    first.unlink()
    reopened, _ = make_saver(tmp_path, resumed_step=11)
    assert [e["file"] for e in reopened.status["checkpoints"]] == [
        "ckpt-e001-s0000002.pt",
        "ckpt-e001-s0000005.pt",
        "ckpt-e002-s0000005.pt",
        "ckpt-e003-s0000011.pt",
    ]
    assert reopened.status["history"] == []


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1, 2]",
        '{"checkpoints": {"a": 1}}',
        '{"history": []}',
        # Valid JSON of the wrong shape (edited by hand): entries that are not entries, a history that is not a list.
        '{"checkpoints": [1]}',
        '{"checkpoints": [{"file": "ckpt-e001-s0000001.pt"}]}',
        '{"checkpoints": [{"file": "ckpt-e001-s0000001.pt", "step": 1}]}',
        '{"checkpoints": [], "history": {}}',
    ],
)
def test_an_unreadable_status_file_is_rebuilt_from_the_files(tmp_path, text):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=3")
    saver.save(state(1), *objs, metric=0.5)
    (saver.dir / "status.json").write_text(text)
    logs = []
    reopened, objs = make_saver(tmp_path, "checkpoint.keep_last=3", log=logs.append, resumed_step=1)
    assert [e["file"] for e in reopened.status["checkpoints"]] == [name(1)]
    assert reopened.status["checkpoints"][0]["metric"] == 0.5 and reopened.status["history"] == []
    assert len(logs) == 1
    assert logs[0].startswith(f"[yellow]ignoring unreadable {saver.dir / 'status.json'}[/] (")
    assert logs[0].endswith("); rebuilding it from the files")
    if not text.startswith("{not"):
        assert "(ValueError: unexpected layout)" in logs[0]
    reopened.save(state(2), *objs, metric=None)  # and the run goes on saving
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(1), name(2)]


def test_a_status_without_history_or_with_minimal_entries_is_not_a_layout_error(tmp_path):
    saver, objs = make_saver(tmp_path)
    saver.save(state(1), *objs, metric=None)
    entry = {"file": name(1), "epoch": 1, "step": 1}  # the keys the saver needs, and no other
    for status in ({"checkpoints": read_status(tmp_path)["checkpoints"]}, {"checkpoints": [entry], "history": []}):
        (saver.dir / "status.json").write_text(json.dumps(status))
        logs = []
        reopened, _ = make_saver(tmp_path, log=logs.append, resumed_step=1)
        assert logs == [] and reopened.status["history"] == []
        assert [e["file"] for e in reopened.status["checkpoints"]] == [name(1)]
    assert reopened.status["checkpoints"] == [entry]  # kept as listed, not rebuilt from the file


def test_an_unreadable_status_path_is_rebuilt_too(tmp_path):
    saver, objs = make_saver(tmp_path)
    saver.save(state(1), *objs, metric=None)
    (saver.dir / "status.json").unlink()
    (saver.dir / "status.json").mkdir()  # refused before reading (files.read_regular: not a regular file), an OSError
    logs = []
    reopened, _ = make_saver(tmp_path, resumed_step=1, log=logs.append)
    assert [e["file"] for e in reopened.status["checkpoints"]] == [name(1)]
    assert len(logs) == 1 and "a folder, not a regular file" in logs[0]


def test_reopening_removes_temp_files_of_a_killed_write(tmp_path):
    saver, objs = make_saver(tmp_path)
    saver.save(state(1), *objs, metric=None)
    for leftover in (f".{name(2)}.tmp-123", ".status.json.tmp-9"):
        (saver.dir / leftover).write_bytes(b"partial")
    (saver.dir / ".hidden").write_text("kept")
    (saver.dir / "x.tmp-1").write_text("kept")  # not a temp name of atomic_write (no leading dot)
    make_saver(tmp_path, resumed_step=1)
    assert sorted(p.name for p in saver.dir.iterdir()) == [".hidden", name(1), "status.json", "x.tmp-1"]


def test_checkpoints_beyond_the_resume_point_are_set_aside(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=10")
    for s in range(1, 8):
        saver.save(state(s), *objs, metric=None)
    logs = []
    reopened, _ = make_saver(tmp_path, "checkpoint.keep_last=10", resumed_step=2, log=logs.append)
    assert [e["file"] for e in reopened.status["checkpoints"]] == [name(1), name(2)]
    assert [e["file"] for e in read_status(tmp_path)["checkpoints"]] == [name(1), name(2)]  # written back
    assert read_status(tmp_path)["latest"] == name(2)
    dests = list(saver.dir.glob("superseded-*"))
    assert len(dests) == 1 and re.fullmatch(r"superseded-\d{8}-\d{6}", dests[0].name)
    assert sorted(p.name for p in dests[0].iterdir()) == [name(s) for s in range(3, 8)]
    assert logs == [
        f"[yellow]moved 5 checkpoint(s) beyond the resume point into {dests[0]}[/] (this run resumed from "
        f"step 2): {name(3)}, {name(4)}, {name(5)}, {name(6)}"
    ]


def test_a_fresh_start_sets_aside_every_checkpoint_and_nothing_to_move_logs_nothing(tmp_path):
    saver, objs = make_saver(tmp_path)
    saver.save(state(1), *objs, metric=None)
    logs = []
    make_saver(tmp_path, resumed_step=1, log=logs.append)  # nothing beyond step 1
    assert logs == [] and not list(saver.dir.glob("superseded-*"))
    fresh, _ = make_saver(tmp_path, log=logs.append)
    assert fresh.status["checkpoints"] == [] and read_status(tmp_path)["checkpoints"] == []
    (dest,) = saver.dir.glob("superseded-*")
    assert logs == [
        f"[yellow]moved 1 checkpoint(s) beyond the resume point into {dest}[/] (this run starts from "
        f"scratch): {name(1)}"
    ]


def test_two_set_asides_in_one_second_share_the_folder(tmp_path):
    saver, objs = make_saver(tmp_path, "checkpoint.keep_last=5")
    # Folders for the next seconds already exist, as after an earlier set-aside within the same second.
    now = time.time()
    for dt in range(0, 4):
        (saver.dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + dt))}").mkdir(exist_ok=True)
    saver.save(state(1), *objs, metric=None)
    saver.save(state(2), *objs, metric=None)
    make_saver(tmp_path, "checkpoint.keep_last=5", resumed_step=1)
    assert [p.name for p in saver.dir.glob("superseded-*/*.pt")] == [name(2)]

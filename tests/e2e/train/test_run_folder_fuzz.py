"""Property-based: a damaged run folder never ends in a traceback, and no command writes outside it.

A real trained run is copied and damaged the ways a crash, a full disk, a bad copy or a hostile sender
would: files truncated, replaced by binary junk, by deeply nested JSON, by JSON of the wrong type, bytes
flipped inside, files deleted or replaced by folders, keys of config.yaml set to values of every type.
Then `eval`, `report`, `predict`, `export` or `train --resume` runs on it, in-process (the main() the
console script calls: an exception escaping it is what a user would see as a traceback, and fails the
test with it). Each must exit 0 or 2 (a 2 with one 'error:' line), and every file outside the run folder
(the working folder the command runs in, the image it predicts) must be left as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_config_fuzz import KEYS, assert_clean, run_main, value

from torchsprint import cli


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A finished digits run (1 epoch, a checkpoint, best/last weights, summary, metrics) and an image."""
    from PIL import Image

    root = tmp_path_factory.mktemp("pristine")
    assert (
        cli.main(
            [
                "train",
                "run.epochs=1",
                "log.tensorboard=false",
                "log.progress=false",
                "log.every_steps=5",
                "model.args={width: 4}",
                "eval.per_class=false",
                f"run.dir={root / 'run'}",
            ]
        )
        == 0
    )
    Image.new("L", (8, 8), 128).save(root / "digit.png")
    return root


def run_files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name != ".lock")


def snapshot(root: Path, skip: Path) -> dict[str, tuple[str, int] | str]:
    """Every file and folder under `root` outside `skip`: a file's SHA-256 and mode, a folder as 'dir'."""
    out: dict[str, tuple[str, int] | str] = {}
    for p in sorted(root.rglob("*")):
        if p == skip or skip in p.parents:
            continue
        out[str(p.relative_to(root))] = (
            (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode) if p.is_file() else "dir"
        )
    return out


def nested(depth: int, kind: str) -> bytes:
    if kind == "json":
        return ("[" * depth + "]" * depth).encode()
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)).encode()


def wrong_type_json(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode()


damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("junk"), st.binary(max_size=120)),
    st.tuples(st.just("deep"), st.tuples(st.sampled_from([150, 3000]), st.sampled_from(["json", "yaml"]))),
    st.tuples(st.just("wrong_type"), value),
    st.tuples(st.just("flip"), st.tuples(st.floats(0, 1), st.integers(1, 255))),
    st.tuples(st.just("delete"), st.none()),
    st.tuples(st.just("folder"), st.none()),
    st.tuples(st.just("config_key"), st.tuples(st.sampled_from(KEYS), value)),
)


def apply(run: Path, name: str, how: tuple) -> None:
    kind, arg = how
    path = run / name
    if kind == "config_key":  # a config.yaml whose keys hold values of any type (the file stays valid YAML)
        path = run / "config.yaml"
        if not path.is_file():
            return
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
            return
        if not isinstance(data, dict):
            return
        node = data
        *parents, last = arg[0].split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = arg[1]
        path.write_text(yaml.safe_dump(data))
        return
    if not path.is_file():
        return
    data = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(data[: int(len(data) * arg)])
    elif kind == "junk":
        path.write_bytes(arg)
    elif kind == "deep":
        path.write_bytes(nested(*arg))
    elif kind == "wrong_type":
        path.write_bytes(wrong_type_json(arg))
    elif kind == "flip" and data:
        i = min(int(len(data) * arg[0]), len(data) - 1)
        path.write_bytes(data[:i] + bytes([data[i] ^ arg[1]]) + data[i + 1 :])
    elif kind == "delete":
        path.unlink()
    elif kind == "folder":
        path.unlink()
        path.mkdir()


COMMANDS = {
    "eval": lambda run, img: ["eval", "-r", str(run)],
    "eval last --json": lambda run, img: ["eval", "-r", str(run), "--weights", "last", "--json"],
    "report": lambda run, img: ["report", str(run)],
    "predict": lambda run, img: ["predict", "-r", str(run), str(img)],
    "export torchscript": lambda run, img: ["export", "-r", str(run), "--format", "torchscript"],
    "export safetensors": lambda run, img: ["export", "-r", str(run), "--format", "safetensors"],
    "train --resume": lambda run, img: ["train", "--resume", str(run)],
}


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@given(data=st.data(), command=st.sampled_from(sorted(COMMANDS)))
def test_damaged_run_folder(capsys, tmp_path_factory, pristine, data, command):
    sandbox = tmp_path_factory.mktemp("fuzz")
    run = sandbox / "run"
    shutil.copytree(pristine / "run", run)
    shutil.copy(pristine / "digit.png", sandbox / "digit.png")
    names = run_files(run)
    damages = data.draw(st.lists(st.tuples(st.sampled_from(names), damage), min_size=1, max_size=2), label="damages")
    for name, how in damages:
        apply(run, name, how)
    before = snapshot(sandbox, run)
    argv = COMMANDS[command](run, sandbox / "digit.png")
    cwd = os.getcwd()
    os.chdir(sandbox)  # a relative path a command writes to lands here, where the snapshot sees it
    try:
        code, err = run_main(capsys, argv)
    finally:
        os.chdir(cwd)
    assert_clean(code, err, (argv, damages))
    assert snapshot(sandbox, run) == before, f"{argv} changed files outside the run folder"

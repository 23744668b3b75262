"""No file torchsprint reads runs code: crafted checkpoints, model files, CIFAR pickles and configs are fed to
every command that reads them, and the marker file their payload would create never appears."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paths import REPO


class Payload:
    """Unpickling this runs `touch <marker>` (what a hostile pickle does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def hostile_pickle(path: Path, marker: Path, wrap=lambda p: p) -> Path:
    with open(path, "wb") as f:
        pickle.dump(wrap(Payload(marker)), f)
    return path


def test_the_payload_really_runs_when_unpickled_plainly(tmp_path):
    """The fixture itself is live: a plain pickle.load creates the marker (so its absence below means something)."""
    marker = tmp_path / "pwned"
    with open(hostile_pickle(tmp_path / "x.pkl", marker), "rb") as f:
        pickle.load(f)
    assert marker.exists()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from torchsprint import cli

    root = tmp_path_factory.mktemp("trained")
    assert (
        cli.main(["train", "run.epochs=1", f"run.dir={root / 'run'}", "log.tensorboard=false", "model.args={width: 8}"])
        == 0
    )
    return root / "run"


def test_hostile_checkpoints_and_weights_are_refused(tmp_path, cli_in_process):
    marker = tmp_path / "pwned"
    evil = hostile_pickle(tmp_path / "evil.pt", marker, wrap=lambda p: {"format": "torchsprint-checkpoint", "model": p})
    for args in (
        ["train", f"checkpoint.resume={evil}", "run.dir=a"],
        ["train", f"model.pretrained={evil}", "run.dir=b"],
    ):
        r = cli_in_process(*args, "run.epochs=1", "log.tensorboard=false")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert not marker.exists(), args
    run = tmp_path / "c"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {epochs: 1}\n")
    hostile_pickle(run / "checkpoints" / "ckpt-e000-s0000005.pt", marker)
    r = cli_in_process("train", "--resume", str(run), "run.epochs=1", "log.tensorboard=false")
    assert r.returncode == 2 and "could be read" in r.stderr, r.stderr
    assert not marker.exists()


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_model_file_metadata_never_imports_code(tmp_path, run_cli, cli_in_process, trained_run):
    """A .safetensors/.onnx whose config lists `imports` does not import them: a module of that name in the
    working folder (which would create the marker) stays unimported; when the file needs it, the error says
    which --import to pass. Steps 1-2 run in this process (a name no other test imports here), step 3 imports it
    in a fresh process."""
    import sys

    name = "model_file_payload"
    marker = tmp_path / "pwned"
    (tmp_path / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from torchsprint.models.core import MODELS\nfrom torchsprint.models.nets import small_cnn\n"
        "MODELS.register('evil_net')(small_cnn)\n"
    )
    state = load_file(str(trained_run / "best.safetensors"))
    from safetensors import safe_open

    with safe_open(str(trained_run / "best.safetensors"), framework="pt") as f:
        meta = f.metadata()
    cfg = json.loads(meta["config"])
    images = tmp_path / "img.png"
    from PIL import Image

    Image.new("L", (8, 8), 128).save(images)
    # 1. imports listed, model a built-in: predicts without importing anything
    harmless = tmp_path / "harmless.safetensors"
    save_file(state, str(harmless), metadata=meta | {"config": json.dumps(cfg | {"imports": [name]})})
    r = cli_in_process("predict", "-r", str(harmless), str(images))
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    # 2. the model needs the module: refused with the flag to pass, still nothing imported
    needs = tmp_path / "needs.safetensors"
    cfg2 = cfg | {"imports": [name], "model": cfg["model"] | {"name": "evil_net"}}
    save_file(state, str(needs), metadata=meta | {"config": json.dumps(cfg2)})
    r = cli_in_process("predict", "-r", str(needs), str(images))
    assert r.returncode == 2 and f"--import {name}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists() and name not in sys.modules
    # 3. the user trusts it and says so: now it is imported, and predicts
    r = run_cli("predict", "--import", name, "-r", str(needs), str(images))
    assert r.returncode == 0, r.stderr
    assert marker.exists()


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_run_folder_config_never_imports_code(tmp_path, trained_run, monkeypatch, capsys, run_cli):
    """A run folder whose config.yaml lists `imports:` (someone else's run) is as safe to open as their model file:
    eval, predict, export, report and train --resume never import the module (a real file in the working folder
    that would create the marker); a run that needs it is refused in one line naming --import MODULE."""
    import shutil
    import sys

    import yaml

    from torchsprint import cli

    name = "run_folder_payload"  # a name no other test imports into this process
    marker = tmp_path / "pwned"
    (tmp_path / f"{name}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from torchsprint.models.core import MODELS\nfrom torchsprint.models.nets import small_cnn\n"
        "MODELS.register('payload_net')(small_cnn)\n"
    )
    monkeypatch.chdir(tmp_path)  # where config.import_modules would look for it
    monkeypatch.setattr(sys, "path", list(sys.path))
    image = tmp_path / "img.png"
    from PIL import Image

    Image.new("L", (8, 8), 128).save(image)

    def copy_run(dest: str, **changes) -> Path:
        run = tmp_path / dest
        shutil.copytree(trained_run, run)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["imports"] = [name]
        cfg["model"].update(changes)
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        return run

    harmless, needs = copy_run("harmless"), copy_run("needs", name="payload_net")
    commands = [["eval", "-r"], ["predict", str(image), "-r"], ["export", "--format", "safetensors", "-r"], ["report"]]
    for cmd in commands:
        if cmd[0] in ("eval", "predict"):  # a built-in model: opens without the module (not refused for listing it)
            capsys.readouterr()
            assert cli.main([*cmd, str(harmless)]) == 0, (cmd, capsys.readouterr().err)
        capsys.readouterr()
        assert cli.main([*cmd, str(needs)]) == 2, cmd
        err = capsys.readouterr().err
        assert f"--import {name}" in err and len(err.strip().splitlines()) == 1, (cmd, err)
    # train --resume would import what the saved config lists when it starts: it asks for the flag first
    assert cli.main(["train", "--resume", str(harmless)]) == 2
    err = capsys.readouterr().err
    assert f"--import {name}" in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and name not in sys.modules
    # the user trusts it and says so (a fresh process: nothing stays registered in this one)
    r = run_cli("eval", "--import", name, "-r", str(needs), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert marker.exists()


def test_onnx_metadata_never_imports_code(tmp_path, cli_in_process, trained_run):
    import sys

    import onnx

    from torchsprint.commands.export import export

    name = "onnx_metadata_payload"  # a name no other test imports into this process
    marker = tmp_path / "pwned"
    (tmp_path / f"{name}.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    path = Path(export(trained_run, "onnx", out=tmp_path / "m.onnx")["path"])
    model = onnx.load(str(path))
    for p in model.metadata_props:
        if p.key == "config":
            p.value = json.dumps(json.loads(p.value) | {"imports": [name]})
    onnx.save(model, str(path))
    from PIL import Image

    Image.new("L", (8, 8), 128).save(tmp_path / "img.png")
    r = cli_in_process("predict", "-r", str(path), "img.png", "--backend", "onnx")
    assert r.returncode == 0, r.stderr
    assert not marker.exists() and name not in sys.modules


def test_hostile_cifar_pickle_is_refused(tmp_path, cli_in_process):
    marker = tmp_path / "pwned"
    root = tmp_path / "data" / "cifar-10-batches-py"  # the run folder (r) beside data.root, never inside it
    root.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        hostile_pickle(root / name, marker, wrap=lambda p: {b"data": p, b"labels": [0]})
    for args in (
        ["train", "data.dataset=cifar10", f"data.root={root.parent}", "run.dir=r"],
        ["data", "check", "data.dataset=cifar10", f"data.root={root.parent}"],
    ):
        r = cli_in_process(*args)
        assert r.returncode == 2 and "refusing to load posix.system" in r.stderr and "Traceback" not in r.stderr, (
            r.stderr
        )
        assert not marker.exists()


def test_hostile_yaml_config_is_refused(tmp_path, cli_in_process):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.yaml").write_text(f"run: !!python/object/apply:os.system ['touch {marker}']\n")
    for args in (["config", "show", "-c", "evil.yaml"], ["train", "-c", "evil.yaml"]):
        r = cli_in_process(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert not marker.exists()


def test_torch_load_calls_are_weights_only():
    """Every torch.load in the package passes weights_only=True (a grep a regression cannot slip past)."""
    import re

    src = REPO / "src" / "torchsprint"
    for f in src.rglob("*.py"):
        for m in re.finditer(r"torch\.load\(([^)]*)\)", f.read_text()):
            assert "weights_only=True" in m.group(1), f"{f}: torch.load({m.group(1)})"
    assert torch.load  # the grep above found the calls in state/checkpoint.py and models/init.py

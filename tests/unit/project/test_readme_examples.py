"""docs/extending.md's examples (the README's "Where things go" until the docs moved) run as written: every code
block is written to the file its first line names, every command runs, and each registered name really drives the
run it is named in."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
import yaml

from paths import REPO
from torchsprint import cli

PAGE = REPO / "docs" / "extending.md"


def where_things_go() -> tuple[dict[str, str], list[str]]:
    """({relative file: code} of the page's python blocks, [commands] of its bash blocks)."""
    files, commands = {}, []
    for lang, body in re.findall(r"```(python|bash)\n(.*?)```", PAGE.read_text(), flags=re.S):
        if lang == "python":
            first = body.splitlines()[0]
            assert first.startswith("# my_project/"), (
                f"an example of docs/extending.md must start with its file name: {first}"
            )
            files[first[2:].strip()] = body
        else:
            commands += [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]
    return files, commands


def test_section_has_an_example_for_each_registry():
    files, commands = where_things_go()
    text = "\n".join(files.values())
    for registry in ("MODELS", "DATASETS", "TRANSFORMS", "LOADERS", "TASKS"):
        assert f"@{registry}.register(" in text, registry
    assert len(commands) == 2


@pytest.fixture
def registries_restored(monkeypatch):
    """The examples run in this process (python -m torchsprint's start-up is tested in test_cli.py): what they
    register goes into copies of the registries and their modules are forgotten afterwards, so no other test
    sees my_net, stripes, plain... nor a registry whose lazy providers were used up."""
    from torchsprint.data.core import DATASETS, LOADERS
    from torchsprint.data.preprocess.transforms import TRANSFORMS
    from torchsprint.models.core import MODELS
    from torchsprint.tasks.core import TASKS

    for reg in (MODELS, DATASETS, TRANSFORMS, LOADERS, TASKS):
        monkeypatch.setattr(reg, "_items", dict(reg._items))
        monkeypatch.setattr(reg, "_providers", list(reg._providers))
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_modules appends the working folder
    yield
    for name in [m for m in sys.modules if m == "my_project" or m.startswith("my_project.")]:
        del sys.modules[name]


@pytest.mark.slow
def test_readme_where_things_go_examples_run(tmp_path, monkeypatch, capsys, registries_restored):
    files, commands = where_things_go()
    for rel, code in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(code)
    (tmp_path / "my_project" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for i, command in enumerate(commands):
        argv = shlex.split(command)
        assert argv[0] == "torchsprint"
        code = cli.main([*argv[1:], f"run.dir=run{i}"])
        assert code == 0, capsys.readouterr().err[-2000:]
        cfg = yaml.safe_load((tmp_path / f"run{i}" / "config.yaml").read_text())
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        # The stripes classes are separable at a glance; chance is 0.5. Measured: 1.0 after the default 10 epochs.
        assert summary["final"]["val/top1"] >= 0.9, summary
        if i == 0:
            assert (cfg["task"], cfg["model"]["name"], cfg["data"]["dataset"]) == ("lowest_loss", "my_net", "stripes")
            assert cfg["data"]["train"]["transforms"] == ["invert"]
            # The task's monitor drives "best": the lowest validation loss, not top-1.
            assert cfg["checkpoint"]["monitor"] == "val/loss" and cfg["checkpoint"]["mode"] == "min"
            assert summary["best_metric"] == min(
                json.loads(line)["val/loss"]
                for line in (tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "eval"
            )
        else:
            assert cfg["data"]["backend"] == "plain"
    # The plain backend refuses what it would otherwise ignore.
    capsys.readouterr()
    code = cli.main(
        [
            "train",
            "--import",
            "my_project.data",
            "--import",
            "my_project.backends",
            "data.dataset=stripes",
            "data.backend=plain",
            "data.train.transforms=[hflip]",
            "run.dir=refused",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "applies no transforms" in err, err

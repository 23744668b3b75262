"""Every benchmark script imports and parses its own --help: a rename in one shared module broke
benchmarks/vs_lightning.py (it imported a function vs_plain_pytorch.py no longer had) without any test noticing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if p.name != "__init__.py")


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_script_imports_and_prints_help(path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # an ImportError or a NameError at module level fails here
    main = getattr(module, "main", None)
    if main is None:
        return  # a helper module (throttled_cat.py reads stdin at run time)
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0 and "usage" in capsys.readouterr().out.lower()

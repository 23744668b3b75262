"""The package's layering holds: the folders are the layers, imports between folders point downward, the modules of
one folder import each other without a cycle, and no module imports its own package's face.

Layers, lowest first, one folder each (../shared/DESIGN.md, "Layout (dependencies point downward)"):

  foundation   errors, registry, version (the package's root files): nothing from torchsprint beyond these
  runtime      the machine a run uses: user files, the CPU, device and ranks, seeds, collectives, preemption, wrapping
  config       the schema and reading configs (pure: files and overrides in, a validated Config out)
  observe      console, metric sinks, TensorBoard, plots
  state        precision, EMA, SWA, checkpoints and resume, the run folder
  optim        optimizers, schedules, losses, parameter groups
  data         registries and sampler, preprocess/, sources/, backends/, building, detection
  models       the registry and providers, nets, pretrained weights, init, how a model on photos starts
  tasks        what a run learns: metrics, losses, artifacts per task, test-time augmentation
  train        the resolve phase, the plan, the loop, validation, the run's flow
  commands     export, predict, serve, bench/, report, average, lr-find, weights, launch, data/ (check, compare, shard)
  cli          the `torchsprint` command

A module may import from its own folder or a folder below. A package's __init__.py is its face for users: it
re-exports and registers, and no module inside that package imports names from it (a registry there would make
every member import upward). A new folder must be placed in LAYERS, so a new layer is placed on purpose.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from paths import REPO

SRC = REPO / "src"

LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["errors", "registry", "version"]),
    ("runtime", ["runtime.*"]),
    ("config", ["config.*"]),
    ("observe", ["observe.*"]),
    ("state", ["state.*"]),
    ("optim", ["optim.*"]),
    ("data", ["data.*"]),
    ("models", ["models.*"]),
    ("tasks", ["tasks.*"]),
    ("train", ["train.*"]),
    ("commands", ["commands.*"]),
    ("cli", ["cli", "__main__"]),
]


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package __init__)} for every module of the torchsprint package."""
    out = {}
    for f in sorted((src / "torchsprint").rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        init = parts[-1] == "__init__"
        if init:
            parts = parts[:-1]
        out[".".join(parts)] = (f, init)
    return out


def layer_of(name: str, mods: dict[str, tuple[Path, bool]]) -> int | None:
    """Layer index of a module; a package face takes the highest layer of what it imports (re-exports)."""
    short = name.removeprefix("torchsprint.").removeprefix("torchsprint")
    if name in mods and mods[name][1]:  # a package face: as high as what it re-exports
        path = mods[name][0]
        inside = [layer_of(t, mods) for _, t, _ in imports(name, path, True, mods) if t != name]
        inside = [i for i in inside if i is not None]
        return max(inside) if inside else 0
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(short, p) for p in patterns):
            return i
    return None


def imports(name: str, path: Path, is_init: bool, mods) -> list[tuple[int, str, str | None]]:
    """(line, imported module, name taken from a package face or None) for every torchsprint import,
    including the ones inside functions."""
    package = name if is_init else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("torchsprint")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("torchsprint"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    out.append((node.lineno, sub, None))  # `from pkg import submodule`: the submodule itself
                elif base in mods and mods[base][1]:
                    out.append((node.lineno, base, a.name))  # a name defined in a package's __init__.py
                else:
                    out.append((node.lineno, base, None))
    return out


def violations(mods: dict[str, tuple[Path, bool]]) -> list[str]:
    problems = []
    for name, (path, is_init) in mods.items():
        here = layer_of(name, mods)
        if here is None and not is_init:
            problems.append(
                f"{name}: not placed in any layer of tests/unit/project/test_layout.py LAYERS; add it where it belongs"
            )
            continue
        for line, target, face_name in imports(name, path, is_init, mods):
            where = f"{path.relative_to(path.parents[len(name.split('.')) - (0 if is_init else 1)])}:{line}"
            if face_name is not None and not is_init and (name + ".").startswith(target + "."):
                problems.append(
                    f"{where}: {name} imports {face_name!r} from its own package's face {target} "
                    f"(__init__.py); import it from the module that defines it"
                )
                continue
            there = layer_of(target, mods)
            if is_init or there is None or here is None:
                continue  # a face may import what it re-exports
            if there > here:
                problems.append(
                    f"{where}: {name} (layer {LAYERS[here][0]}) imports {target} (layer {LAYERS[there][0]}, higher)"
                )
    return problems


def test_imports_point_downward_and_never_into_an_own_package_face():
    assert violations(modules()) == []


def folder_of(name: str) -> str:
    parts = name.removeprefix("torchsprint.").split(".")
    return parts[0] if len(parts) > 1 else ""


def cycles(mods: dict[str, tuple[Path, bool]]) -> list[list[str]]:
    """Import cycles among the modules of one folder, imports inside functions included: inside a folder the order
    of the modules is free, a cycle is not (neither module could be read, tested or moved without the other)."""
    graph = {
        name: sorted(
            {
                t
                for _, t, _ in imports(name, path, False, mods)
                if t in mods and not mods[t][1] and t != name and folder_of(t) == folder_of(name)
            }
        )
        for name, (path, is_init) in mods.items()
        if not is_init
    }
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    return found


def test_the_modules_of_a_folder_import_each_other_without_a_cycle(tmp_path):
    assert cycles(modules()) == []
    pkg = tmp_path / "torchsprint" / "train"  # the checker itself can fail: two modules importing each other
    pkg.mkdir(parents=True)
    (tmp_path / "torchsprint" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from torchsprint.train.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from torchsprint.train import a\n")
    assert cycles(modules(tmp_path)) == [["torchsprint.train.a", "torchsprint.train.b", "torchsprint.train.a"]]


def test_the_checker_flags_an_upward_import_and_a_face_import(tmp_path):
    """The checker itself can fail: a data module importing run, and a backend importing its package's face."""
    pkg = tmp_path / "torchsprint"
    (pkg / "data" / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train").mkdir()
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "run.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("from torchsprint.data.core import LOADERS\n")
    (pkg / "data" / "core.py").write_text("def f():\n    from torchsprint.train.run import train\n")
    (pkg / "data" / "backends" / "__init__.py").write_text("")
    (pkg / "data" / "backends" / "cpu.py").write_text("from torchsprint.data import LOADERS\n")
    (pkg / "stray.py").write_text("")  # at the root, beside the foundation: no layer holds it
    found = violations(modules(tmp_path))
    assert any("torchsprint.data.core (layer data) imports torchsprint.train.run" in p for p in found), found
    assert any("imports 'LOADERS' from its own package's face torchsprint.data" in p for p in found), found
    assert any("torchsprint.stray: not placed" in p for p in found), found
    assert len(found) == 3, found


@pytest.mark.parametrize(
    "module",
    [
        "torchsprint.data",
        "torchsprint.models",
        "torchsprint.data.sources",
        "torchsprint.data.backends",
        "torchsprint.data.preprocess",
        "torchsprint.commands.data",
        "torchsprint.optim",
        "torchsprint.config",
        "torchsprint.runtime",
        "torchsprint.observe",
        "torchsprint.tasks",
        "torchsprint.train",
        "torchsprint.state",
        "torchsprint.commands",
        "torchsprint.commands.bench",
    ],
)
def test_package_faces_only_reexport(module):
    """An __init__.py holds imports and __all__, no definitions (registries live beside their code)."""
    mods = modules()
    tree = ast.parse(mods[module][0].read_text())
    defs = [
        type(n).__name__
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Assign)
        and not (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])
    ]
    assert defs == []


def backend_problems(src: Path = SRC) -> list[str]:
    """A backend importing a sibling backend, or looking a backend up in LOADERS (falling back by itself)."""
    problems = []
    for f in sorted((src / "torchsprint" / "data" / "backends").glob("*.py")):
        if f.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchsprint.data.backends"):
                problems.append(f"{f.name}:{node.lineno} imports {node.module}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "LOADERS"
            ):
                problems.append(f"{f.name}:{node.lineno} calls LOADERS.get")
    return problems


def test_no_backend_imports_a_sibling_or_calls_back_into_the_registry(tmp_path):
    """Choosing, falling back and recording the backend happen in data/build.py alone."""
    assert backend_problems() == []
    bad = tmp_path / "torchsprint" / "data" / "backends"
    bad.mkdir(parents=True)
    (bad / "dali.py").write_text(
        "from torchsprint.data.backends.gpu import x\n\ndef f():\n    return LOADERS.get('cpu')\n"
    )
    assert backend_problems(tmp_path) == [
        "dali.py:1 imports torchsprint.data.backends.gpu",
        "dali.py:4 calls LOADERS.get",
    ]


def test_production_code_holds_no_test_hook():
    """Faults are the tests' own (tests/faults/sitecustomize.py, imported by the processes a test starts): no module of
    the package reads a variable that exists for tests. Fails when a TORCHSPRINT_TEST_ variable, or a FAULT_ one of
    the tests' faults, is read by production code again."""
    found = [
        f"{f.relative_to(SRC)}:{i}"
        for f in sorted((SRC / "torchsprint").rglob("*.py"))
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if re.search(r"TORCHSPRINT_TEST_|\bFAULT_[A-Z]", line)
    ]
    assert found == []


def test_no_module_re_exports_another_modules_names():
    """Callers import a name from the module that defines it (go-to-definition lands on the code, not on a shim);
    only a package's __init__.py re-exports. Fails when a module imports torchsprint names it does not use, kept
    with `noqa: F401` for other callers."""
    found = [
        f"{f.relative_to(SRC)}:{i}"
        for f in sorted((SRC / "torchsprint").rglob("*.py"))
        if f.name != "__init__.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if "noqa: F401" in line and re.match(r"\s*from torchsprint", line)
    ]
    assert found == []

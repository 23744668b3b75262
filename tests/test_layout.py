"""The package's layering holds: imports point downward, and no module imports its own package's face.

Layers, lowest first, in the terms of ../shared/DESIGN.md ("Layout (dependencies point downward)"):

  foundation   errors, registry, version, settings, files: no torchsprint imports beyond these
  machine      runtime (process group, seeds), rng, collectives, parallel (wrappers), progress, logging, plots
  numerics     precision, checkpoint (saving), resume, rundir (the run folder and its lock), metrics, optim
  data         core (registries, sampler) < preprocess/: decode < transforms/normalize/batch_ops (the spec)
               < augment/mix; < sources/ (one file per dataset family; shard_stream reads shards) < backends/
               (one file per loader backend) < auto (data.backend: auto, measured), build (build_loaders)
  models       core (MODELS registry) < nets, weights (where pretrained weights live), download (fetching them), init
  tasks        what a run learns (metrics, losses, artifacts per task)
  config       the schema (fills task defaults)
  plan         the run plan: every run-time decision of a run, resolved once (RunPlan, decisions.json)
  engine       validation (evaluations, best weights), the only loop; batch_size (data.batch_size: auto, with real
               train steps)
  run          the flow of one run
  commands     trained, export, predict, serve (engine, app, page), bench, report, weights, launch, commands/data/
               (check, compare, shard)
  cli          the `torchsprint` command and the types of its flags (commands/args.py)

A module may import from its own layer or below. A package's __init__.py is its face for users: it
re-exports and registers, and no module inside that package imports names from it (a registry there
would make every member import upward). Every module must be placed in a layer, so a new module is
placed on purpose.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: list[tuple[str, list[str]]] = [
    ("foundation", ["errors", "registry", "version", "config.fields", "runtime.files"]),
    ("machine", ["runtime.machine", "runtime.core", "runtime.rng", "runtime.collectives", "runtime.preempt", "runtime.sync_bn",
                 "runtime.parallel", "observe.*"]),
    ("numerics", ["state.*", "tasks.metrics", "optim.*"]),
    ("data.core", ["data.core", "data.prefetch"]),
    ("data.decode", ["data.preprocess.decode"]),
    ("data.spec", ["data.preprocess.transforms", "data.preprocess.normalize", "data.preprocess.batch_geometry",
                   "data.preprocess.batch_pixel", "data.preprocess.batch_auto_augment", "data.preprocess.batch_ops",
                   "data.preprocess.progressive"]),
    ("data.augment", ["data.preprocess.augment", "data.preprocess.mix", "data.preprocess.on_device"]),
    ("data.sources", ["data.sources.*"]),
    ("data.backends", ["data.backends.*"]),
    ("data.build", ["data.auto", "data.build", "data.detect"]),
    ("models.core", ["models.core"]),
    ("models", ["models.nets", "models.weights", "models.weights_cache", "models.download", "models.init",
                "models.start"]),
    ("tasks", ["tasks.core", "tasks.tta"]),
    ("config", ["config.files", "config.sections", "config.training", "config.serve", "config.schema",
                "config.saved"]),
    ("plan", ["train.plan"]),
    ("engine", ["train.context", "train.validation", "train.engine", "train.batch_size", "train.speed_probe",
                "train.distill"]),
    ("run", ["train.imbalance", "train.evaluation", "train.run"]),
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
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
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
            problems.append(f"{name}: not placed in any layer of tests/test_layout.py LAYERS; add it where it belongs")
            continue
        for line, target, face_name in imports(name, path, is_init, mods):
            where = f"{path.relative_to(path.parents[len(name.split('.')) - (0 if is_init else 1)])}:{line}"
            if face_name is not None and not is_init and (name + ".").startswith(target + "."):
                problems.append(f"{where}: {name} imports {face_name!r} from its own package's face {target} "
                                f"(__init__.py); import it from the module that defines it")
                continue
            there = layer_of(target, mods)
            if is_init or there is None or here is None:
                continue  # a face may import what it re-exports
            if there > here:
                problems.append(f"{where}: {name} (layer {LAYERS[here][0]}) imports {target} (layer "
                                f"{LAYERS[there][0]}, higher)")
    return problems


def test_imports_point_downward_and_never_into_an_own_package_face():
    assert violations(modules()) == []


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
    (pkg / "data" / "stray.py").write_text("")
    found = violations(modules(tmp_path))
    assert any("torchsprint.data.core (layer data.core) imports torchsprint.train.run" in p for p in found), found
    assert any("imports 'LOADERS' from its own package's face torchsprint.data" in p for p in found), found
    assert any("torchsprint.data.stray: not placed" in p for p in found), found
    assert len(found) == 3, found


@pytest.mark.parametrize("module", ["torchsprint.data", "torchsprint.models", "torchsprint.data.sources",
                                    "torchsprint.data.backends", "torchsprint.data.preprocess",
                                    "torchsprint.commands.data", "torchsprint.optim", "torchsprint.config",
                                    "torchsprint.runtime", "torchsprint.observe", "torchsprint.tasks", "torchsprint.train",
                                    "torchsprint.commands", "torchsprint.commands.bench"])
def test_package_faces_only_reexport(module):
    """An __init__.py holds imports and __all__, no definitions (registries live beside their code)."""
    mods = modules()
    tree = ast.parse(mods[module][0].read_text())
    defs = [type(n).__name__ for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Assign)
            and not (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
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
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "LOADERS"):
                problems.append(f"{f.name}:{node.lineno} calls LOADERS.get")
    return problems


def test_no_backend_imports_a_sibling_or_calls_back_into_the_registry(tmp_path):
    """Choosing, falling back and recording the backend happen in data/build.py alone."""
    assert backend_problems() == []
    bad = tmp_path / "torchsprint" / "data" / "backends"
    bad.mkdir(parents=True)
    (bad / "dali.py").write_text("from torchsprint.data.backends.gpu import x\n\ndef f():\n    return LOADERS.get('cpu')\n")
    assert backend_problems(tmp_path) == ["dali.py:1 imports torchsprint.data.backends.gpu", "dali.py:4 calls LOADERS.get"]

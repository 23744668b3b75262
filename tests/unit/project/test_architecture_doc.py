"""ARCHITECTURE.md names every module of src/torchsprint under the layer tests/unit/project/test_layout.py places it in,
and nothing that is not on disk: the page cannot drift from the tree."""

from __future__ import annotations

import re
from pathlib import Path

from test_layout import LAYERS, SRC, layer_of, modules

PAGE = SRC.parent / "ARCHITECTURE.md"


def documented(text: str) -> tuple[dict[str, str], set[str]]:
    """({module path: the '### layer' heading above its table row}, {face paths}) from the page."""
    mods, faces, layer, in_faces = {}, set(), None, False
    for line in text.splitlines():
        if line.startswith("### "):
            layer, in_faces = line[4:].strip(), False
        elif line.startswith("## "):
            layer, in_faces = None, line.strip() == "## Package faces"
        m = re.match(r"\| `([\w/]+\.py)` \|", line)
        if m and (in_faces or layer is not None):  # the module tables (not the Sizes table)
            path = m.group(1)
            assert path not in mods and path not in faces, f"{path} is listed twice in ARCHITECTURE.md"
            if in_faces:
                faces.add(path)
            elif layer is not None:
                mods[path] = layer
    return mods, faces


def on_disk() -> tuple[dict[str, str], set[str]]:
    """({module path: its layer name in LAYERS}, {package faces}) for the files of the package."""
    mods, faces = {}, set()
    tree = modules()
    for name, (path, is_init) in tree.items():
        rel = path.relative_to(SRC / "torchsprint").as_posix()
        if is_init:
            faces.add(rel)
        else:
            index = layer_of(name, tree)
            mods[rel] = LAYERS[index][0] if index is not None else "(no layer)"
    return mods, faces


def test_the_page_lists_every_module_in_its_layer_and_nothing_else():
    page_mods, page_faces = documented(PAGE.read_text())
    disk_mods, disk_faces = on_disk()
    assert sorted(set(disk_mods) - set(page_mods)) == [], "modules missing from ARCHITECTURE.md"
    assert sorted(set(page_mods) - set(disk_mods)) == [], "ARCHITECTURE.md lists modules that do not exist"
    wrong = {p: (page_mods[p], disk_mods[p]) for p in disk_mods if page_mods[p] != disk_mods[p]}
    assert wrong == {}, "(ARCHITECTURE.md layer, tests/unit/project/test_layout.py layer)"
    assert page_faces == disk_faces
    headings = [h for h in re.findall(r"^### (.+)$", PAGE.read_text(), re.M)]
    assert headings == [name for name, _ in LAYERS], "one section per layer, in LAYERS order"


def test_the_checker_notices_a_missing_and_a_misplaced_module():
    """The comparison itself can fail: drop a row and move another under a wrong heading."""
    text = PAGE.read_text()
    text = text.replace("| `version.py` | the package version |\n", "")
    text = text.replace("| `train/engine.py` |", "| `cli.py` |", 1).replace(
        "| `cli.py` | the `torchsprint` command |\n", ""
    )
    page_mods, _ = documented(text)
    disk_mods, _ = on_disk()
    assert "version.py" not in page_mods and page_mods["cli.py"] == "train" != disk_mods["cli.py"]


# In ruff-formatted lines (line-length 120, aaed54c): a call that does not fit on one line takes a line per argument,
# so the same code counts 15-35% more lines than in the denser style the first limits (450, 80) were set in; at
# 550 and 100 the same files and functions as before sit at the limit, and those over it have a row.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 550, 100


def oversized(src: Path = SRC) -> dict[str, int]:
    """{'path.py': lines} for files over MAX_FILE_LINES and {'path.py::function': lines} for functions over
    MAX_FUNCTION_LINES, in src/torchsprint."""
    import ast

    out = {}
    for f in sorted((src / "torchsprint").rglob("*.py")):
        rel, text = f.relative_to(src / "torchsprint").as_posix(), f.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            out[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{rel}::{node.name}"] = n
    return out


def listed_sizes(text: str) -> set[str]:
    section = text.split("## Sizes", 1)[1]
    return set(re.findall(r"^\| `([\w/]+\.py(?:::\w+)?)` \| \d+ \|", section, re.M))


def test_every_file_and_function_over_the_size_limits_is_listed_with_its_seam():
    """No file over MAX_FILE_LINES lines and no function over MAX_FUNCTION_LINES, or a row in ARCHITECTURE.md's
    "Sizes" saying where it splits. A row for something back under the limit must go too (the table stays true)."""
    over, listed = set(oversized()), listed_sizes(PAGE.read_text())
    assert sorted(over - listed) == [], "over the size limits: split it, or add a row to ARCHITECTURE.md's Sizes"
    assert sorted(listed - over) == [], "ARCHITECTURE.md's Sizes lists what is back under the limits: remove the row"


def test_the_size_check_counts_a_long_file_and_a_long_function(tmp_path):
    pkg = tmp_path / "torchsprint"
    pkg.mkdir()
    (pkg / "short.py").write_text("def f():\n    return 1\n")
    (pkg / "long.py").write_text("def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n" * MAX_FILE_LINES)
    lines = 1 + 2 * MAX_FUNCTION_LINES + MAX_FILE_LINES - MAX_FUNCTION_LINES  # def + body + blank lines
    assert oversized(tmp_path) == {"long.py": lines, "long.py::g": MAX_FUNCTION_LINES + 1}


MAX_LOOP_PARAMETERS = 5
LOOP_MODULES = ("train/engine.py", "train/validation.py", "train/context.py")


def wide_functions(src: Path = SRC) -> dict[str, int]:
    """{'path.py::function': parameters} for the loop's functions over MAX_LOOP_PARAMETERS parameters (self counted;
    a dataclass counts its fields): the run's services travel as one context.RunContext, not one keyword each."""
    import ast

    out = {}
    for rel in LOOP_MODULES:
        tree = ast.parse((src / "torchsprint" / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            elif isinstance(node, ast.ClassDef) and any(
                getattr(d, "id", getattr(d, "func", None) and getattr(d.func, "id", "")) == "dataclass"
                for d in node.decorator_list
            ):
                n = sum(isinstance(x, ast.AnnAssign) for x in node.body)
                if rel == "train/context.py" and node.name == "RunContext":
                    continue  # the context itself: its fields are the services
            else:
                continue
            if n > MAX_LOOP_PARAMETERS:
                out[f"{rel}::{node.name}"] = n
    return out


def test_no_loop_function_takes_more_than_five_parameters(tmp_path):
    assert wide_functions() == {}
    pkg = tmp_path / "torchsprint" / "train"
    pkg.mkdir(parents=True)
    (pkg / "engine.py").write_text("def fit(plan, b, state, *, rt, run_dir, logger):\n    pass\n")
    (pkg / "validation.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass V:\n" + "".join(f"    f{i}: int\n" for i in range(6))
    )
    (pkg / "context.py").write_text("")
    assert wide_functions(tmp_path) == {"train/engine.py::fit": 6, "train/validation.py::V": 6}

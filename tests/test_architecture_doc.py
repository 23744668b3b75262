"""ARCHITECTURE.md names every module of src/torchsprint under the layer tests/test_layout.py places it in,
and nothing that is not on disk: the page cannot drift from the tree (issue 26)."""

from __future__ import annotations

import re

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
        if m:
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
    assert wrong == {}, "(ARCHITECTURE.md layer, tests/test_layout.py layer)"
    assert page_faces == disk_faces
    headings = [h for h in re.findall(r"^### (.+)$", PAGE.read_text(), re.M)]
    assert headings == [name for name, _ in LAYERS], "one section per layer, in LAYERS order"


def test_the_checker_notices_a_missing_and_a_misplaced_module():
    """The comparison itself can fail: drop a row and move another under a wrong heading."""
    text = PAGE.read_text()
    text = text.replace("| `version.py` | the package version |\n", "")
    text = text.replace("| `engine.py` |", "| `cli.py` |", 1).replace("| `cli.py` | the `torchsprint` command |\n", "")
    page_mods, _ = documented(text)
    disk_mods, _ = on_disk()
    assert "version.py" not in page_mods and page_mods["cli.py"] == "engine" != disk_mods["cli.py"]

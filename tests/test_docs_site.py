"""The documentation: the site builds without a warning, every module has its API page, the README stays a
five-minute read whose figures stand in BENCHMARKS.md, and no internal issue number reaches a reader.

The site build is `mkdocs build --strict` (mkdocs.yml: broken links and anchors, pages left out of the nav,
API references mkdocstrings cannot resolve are all warnings, and --strict makes a warning fail the build).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
BENCHMARKS = REPO / "BENCHMARKS.md"
SRC = REPO / "src" / "torchsprint"

SETUP_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/torchsprint train",
    # CI runs this one (.ci/run): it must stay as it is, byte for byte
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[dev]" && .venv/bin/python -m pytest -n 2',
)
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def test_site_builds_without_a_warning(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason='the docs site needs pip install -e ".[docs]" (in the dev extra)')
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's end-of-life banner, not a warning of ours
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env, timeout=240)
    warnings = [line for line in r.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert r.returncode == 0 and not warnings, "\n".join(warnings) or r.stderr[-3000:]
    # The hook put BENCHMARKS.md's text in the site (its sections are what the docs link to).
    assert "torchsprint bench on the default run" in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def api_references() -> set[str]:
    return {m for page in (DOCS / "api").glob("*.md")
            for m in re.findall(r"^::: (torchsprint[\w.]*)\s*$", page.read_text(), flags=re.M)}


def test_every_module_has_an_api_page():
    """A module added without its `::: torchsprint.x.y` block would be missing from the API pages (mkdocs builds
    fine without it); a block naming a module that is gone fails the strict build above."""
    modules = {".".join(("torchsprint", *p.relative_to(SRC).with_suffix("").parts)) for p in SRC.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(modules - api_references())
    assert not missing, f"modules without an API page (add `::: NAME` to a page of docs/api/): {missing}"


def test_readme_is_a_five_minute_read_with_the_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150, "README.md is the five-minute read: move details into docs/"
    lines = text.splitlines()
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md must hold the set-up command as it is: {command}"


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading (and the site's: mkdocs.yml uses pymdownx's slugify with case=lower)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def benchmark_sections() -> dict[str, str]:
    """{anchor: text of the section, its subsections included} of BENCHMARKS.md."""
    sections, lines = {}, BENCHMARKS.read_text().splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := re.match(r"^(#{1,4}) (.+)$", line))]
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        sections[github_slug(title)] = "\n".join(lines[i:end])
    return sections


def without_thousands(text: str) -> str:
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


def figures(text: str) -> list[str]:
    """The figures of a text with their unit where one is attached: 2.13x, 99.72%, 2.7 s, 5417."""
    return re.findall(r"\d+(?:\.\d+)?(?:x|%| s\b| ms\b)?", without_thousands(text))


def stands_in(figure: str, text: str) -> bool:
    """`figure` in `text` as a whole figure: 2.14x is not in "torch 2.14.1", 2.1 is not in 2.13x."""
    return re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d]|\.\d)", without_thousands(text)) is not None


def test_readme_results_stand_in_the_benchmark_sections_they_link():
    """Every figure of the README's results table is in the BENCHMARKS.md section its row links to: a figure
    typed wrong, or a section renamed or re-measured without the README following, fails here."""
    text = README.read_text()
    table = text[text.index("## Measured results"):]
    table = table[: table.index("\n## ", 1)]
    sections = benchmark_sections()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "](BENCHMARKS.md#" in line]
    assert len(rows) >= 6, "the README's results table lost its rows"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        anchor = re.search(r"\]\(BENCHMARKS\.md#([^)]+)\)", cells[-1]).group(1)
        assert anchor in sections, f"README links BENCHMARKS.md#{anchor}, which is no section of it"
        quoted = figures(cells[1])
        missing = [f for f in quoted if not stands_in(f, sections[anchor])]
        assert quoted and not missing, f"{missing} of README's row {cells[0]!r} not in BENCHMARKS.md#{anchor}"


def test_readme_links_to_benchmark_sections_resolve():
    """The README is not in the site (whose strict build checks the docs' anchors): check its own."""
    sections = benchmark_sections()
    anchors = re.findall(r"\]\(BENCHMARKS\.md#([^)]+)\)", README.read_text())
    assert anchors and all(a in sections for a in anchors), [a for a in anchors if a not in sections]
    for target in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):
        assert (REPO / target).exists(), f"README links {target}, which does not exist"


def string_literals(path: Path) -> list[tuple[int, str]]:
    kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    with path.open("rb") as f:
        return [(t.start[0], t.string) for t in tokenize.tokenize(f.readline) if t.type in kinds]


def test_no_internal_issue_numbers_reach_a_reader():
    """Readers cannot open the project's issue tracker: every tracked text file of the repository (the package,
    tests, benchmarks, docs, README, BENCHMARKS.md, scripts), comments included, cites the benchmark section, the
    test or the commit instead. The files git tracks: a virtualenv or a run folder beside them is not the project's."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    found = []
    for name in tracked.stdout.splitlines():
        path = REPO / name
        if path.suffix not in (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg") and path.parent.name != ".ci":
            continue
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{name}:{i}: {line.strip()[:120]}" for i, line in enumerate(lines, 1) if ISSUE.search(line)]
    assert not found, "internal issue numbers (cite the BENCHMARKS.md section or the test instead):\n" + "\n".join(found)


def test_the_issue_check_finds_what_it_looks_for(tmp_path):
    """The checks above would pass on nothing: they must see a string, a docstring and an f-string piece."""
    mod = tmp_path / "m.py"
    word = "issue"  # the fixture's numbers are joined here, so this file holds none itself
    mod.write_text(f'"""Docstring ({word} 31)."""\nx = 1  # {word} 5 in a comment is not user-facing\n'
                   f'y = f"{{x}} fixed in {word.title()} #12"\n')
    hits = [s for _, s in string_literals(mod) if ISSUE.search(s)]
    assert len(hits) == 2, hits
    assert figures("5,417 images/s; 2.13x and 99.72%, 2.7 s") == ["5417", "2.13x", "99.72%", "2.7 s"]
    assert not stands_in("2.14x", "torch 2.14.1, 2.13x") and stands_in("2.13x", "ran **2.13x** faster")
    assert not stands_in("2.1", "2.13x") and stands_in("1062", "**1,062** images/s")
    assert github_slug("GPU, first run: one NVIDIA H200, 2026-11-26") == "gpu-first-run-one-nvidia-h200-2026-11-26"
    assert github_slug("`torchsprint bench` on the default run") == "torchsprint-bench-on-the-default-run"

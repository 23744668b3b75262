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

from paths import REPO  # noqa: E402

README = REPO / "README.md"
DOCS = REPO / "docs"
BENCHMARKS = REPO / "BENCHMARKS.md"
HISTORY = REPO / "benchmarks" / "HISTORY.md"
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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    warnings = [line for line in r.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert r.returncode == 0 and not warnings, "\n".join(warnings) or r.stderr[-3000:]
    # The hook put BENCHMARKS.md's text in the site (its sections are what the docs link to).
    assert "torchsprint bench on the default run" in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def api_references() -> set[str]:
    return {
        m
        for page in (DOCS / "api").glob("*.md")
        for m in re.findall(r"^::: (torchsprint[\w.]*)\s*$", page.read_text(), flags=re.M)
    }


def test_every_module_has_an_api_page():
    """A module added without its `::: torchsprint.x.y` block would be missing from the API pages (mkdocs builds
    fine without it); a block naming a module that is gone fails the strict build above."""
    modules = {
        ".".join(("torchsprint", *p.relative_to(SRC).with_suffix("").parts))
        for p in SRC.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
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


def benchmark_sections(path: Path = BENCHMARKS) -> dict[str, str]:
    """{anchor: text of the section, its subsections included} of BENCHMARKS.md (or another page)."""
    sections, lines = {}, path.read_text().splitlines()
    heads = [
        (i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := re.match(r"^(#{1,4}) (.+)$", line))
    ]
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1 :] if lv <= level), len(lines))
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
    table = text[text.index("## Measured results") :]
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
        if (
            path.suffix not in (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg")
            and path.parent.name != ".ci"
        ):
            continue
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{name}:{i}: {line.strip()[:120]}" for i, line in enumerate(lines, 1) if ISSUE.search(line)]
    assert not found, "internal issue numbers (cite the BENCHMARKS.md section or the test instead):\n" + "\n".join(
        found
    )


def test_the_issue_check_finds_what_it_looks_for(tmp_path):
    """The checks above would pass on nothing: they must see a string, a docstring and an f-string piece."""
    mod = tmp_path / "m.py"
    word = "issue"  # the fixture's numbers are joined here, so this file holds none itself
    mod.write_text(
        f'"""Docstring ({word} 31)."""\nx = 1  # {word} 5 in a comment is not user-facing\n'
        f'y = f"{{x}} fixed in {word.title()} #12"\n'
    )
    hits = [s for _, s in string_literals(mod) if ISSUE.search(s)]
    assert len(hits) == 2, hits
    assert figures("5,417 images/s; 2.13x and 99.72%, 2.7 s") == ["5417", "2.13x", "99.72%", "2.7 s"]
    assert not stands_in("2.14x", "torch 2.14.1, 2.13x") and stands_in("2.13x", "ran **2.13x** faster")
    assert not stands_in("2.1", "2.13x") and stands_in("1062", "**1,062** images/s")
    assert github_slug("GPU, first run: one NVIDIA H200, 2026-11-26") == "gpu-first-run-one-nvidia-h200-2026-11-26"
    assert github_slug("`torchsprint bench` on the default run") == "torchsprint-bench-on-the-default-run"


# ---------------------------------------------------------------- what the pages name in benchmarks/ exists

# The pages that cite benchmarks, their results and their sections, and the code that does (comments included).
PAGES = [
    README,
    BENCHMARKS,
    HISTORY,
    REPO / "benchmarks" / "results" / "README.md",
    REPO / "TESTING.md",
    REPO / "ARCHITECTURE.md",
    *sorted(DOCS.rglob("*.md")),
]
CODE = [
    *sorted((REPO / "benchmarks").rglob("*.py")),
    *sorted((REPO / "benchmarks").rglob("*.sh")),
    *sorted(SRC.rglob("*.py")),
    *sorted((REPO / ".ci").glob("*")),
]
BENCH_PATH = re.compile(r"(?<![\w/.-])benchmarks/[\w./*-]*[\w*]")  # benchmarks/compare/vs_timm.py, .../x_*.json
RESULT_FILE = re.compile(r"(?<![\w/.-])[a-z0-9_-]+_\d{4}-\d{2}-\d{2}[a-z0-9_-]*\.json\b")  # a results file's name
MODULE = re.compile(r"python3? -m (benchmarks(?:\.\w+)+)")
CITED = re.compile(r"\b(BENCHMARKS|HISTORY)\.md`?,? \(?\[?\"([A-Za-z`][^\"]{2,160})\"")  # BENCHMARKS.md, "Data loading"


def flat(path: Path) -> str:
    """A file's text as one line: comment markers and line breaks gone, so a name or citation broken over two
    lines of a docstring, a comment or a paragraph reads whole."""
    lines = (re.sub(r"^\s*(#+|//|\*|>)?\s*", "", line) for line in path.read_text().splitlines())
    return " ".join(lines)


def named_paths(text: str) -> list[str]:
    """Every benchmarks/... path and results file name a text names (a template such as .../measure_<device>_... is
    no name)."""
    found = [m.group() for m in BENCH_PATH.finditer(text) if text[m.end() : m.end() + 1] != "<"]
    found += ["benchmarks/results/" + m.group() for m in RESULT_FILE.finditer(text)]
    found += [m.group(1).replace(".", "/") + ".py" for m in MODULE.finditer(text)]
    return found


def missing_paths(text: str) -> list[str]:
    return sorted({p for p in named_paths(text) if not (any(REPO.glob(p)) if "*" in p else (REPO / p).exists())})


def headings(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^#{2,4} (.+)$", path.read_text(), flags=re.M)]


def unresolved_citations(text: str) -> list[str]:
    """Citations of a section by name (BENCHMARKS.md, "Data loading"; ... "data.backend auto ... re-measured") that
    begin no heading of the file they cite."""
    titles = {"BENCHMARKS": headings(BENCHMARKS), "HISTORY": headings(HISTORY)}
    bad = []
    for page, cited in CITED.findall(text):
        pattern = ".*?".join(re.escape(part.strip()) for part in cited.split("..."))
        if not any(re.match(pattern, re.sub(r"[`*]", "", t)) for t in titles[page]):
            bad.append(f'{page}.md "{cited}"')
    return bad


def test_what_the_pages_name_in_benchmarks_exists():
    """benchmarks/ moved into folders by kind and its results were renamed: a page or a comment naming
    benchmarks/vs_timm.py, serve_load_2026-11-29c_digits.json or `python -m benchmarks.x` sent a reader to nothing.
    Every benchmarks/... path, results file and benchmark module named in the docs, BENCHMARKS.md, HISTORY.md, the
    results README and the code's comments exists (a glob matches a file)."""
    bad = {str(p.relative_to(REPO)): m for p in PAGES + CODE if p.is_file() and (m := missing_paths(flat(p)))}
    assert not bad, bad
    planted = "`benchmarks/vs_timm.py`, benchmarks/results/serve_load_2026-11-29c_digits.json, python -m benchmarks.x.y"
    assert missing_paths(planted) == [
        "benchmarks/results/serve_load_2026-11-29c_digits.json",
        "benchmarks/vs_timm.py",
        "benchmarks/x/y.py",
    ], missing_paths(planted)
    assert not missing_paths("benchmarks/results/measure_<device>_<date>.json, benchmarks/compare/")


def test_cited_benchmark_sections_exist():
    """A section moved to benchmarks/HISTORY.md or renamed leaves every citation of it by its title in the docs and
    the code citing nothing. Each citation by name begins a heading of the file it names ("..." skips words)."""
    files = PAGES + CODE + sorted((REPO / "tests").rglob("*.py"))
    bad = {str(p.relative_to(REPO)): b for p in files if p.is_file() and (b := unresolved_citations(flat(p)))}
    assert not bad, bad
    page = "BENCHMARKS" + ".md"  # joined here, so this file cites no section itself
    assert unresolved_citations(f'{page}, "Data loading"; {page} "data.backend auto ... re-measured"') == []
    assert unresolved_citations(f'{page}, "Engine overhead: torchsprint"') == [f'{page} "Engine overhead: torchsprint"']


def test_links_of_the_benchmark_pages_resolve():
    """BENCHMARKS.md, HISTORY.md and the results README are read on GitHub (HISTORY.md and the README are not in the
    site, whose strict build checks the docs' links): a relative link to a moved file, or to an anchor of a section
    that moved, is dead there. Every relative link of theirs, and every link anywhere to an anchor of BENCHMARKS.md or
    HISTORY.md, resolves."""
    anchors = {BENCHMARKS.name: set(benchmark_sections(BENCHMARKS)), HISTORY.name: set(benchmark_sections(HISTORY))}
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            if page in (BENCHMARKS, HISTORY, PAGES[3]) and not file.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            if anchor and file.name in anchors and anchor not in anchors[file.name]:
                bad.append(f"{page.relative_to(REPO)}: {target} (no such section)")
    assert not bad, bad
    assert "torchsprint-serve-under-load-2026-11-29" in anchors["BENCHMARKS.md"] and anchors["HISTORY.md"]

"""Every `torchsprint ...` command written in a shell code block of README.md or docs/*.md runs, exit code 0.

What a page promises with a command is checked by running it: a renamed flag, a config key that moved, a
subcommand or config file that is gone, or a placeholder the docs use wrongly fails here with the page and line.

- Extraction: ```bash (or sh, shell, console, or unmarked) blocks; backslash continuations joined, `# comments`
  dropped, `a && b`, `;` and `|` split, a redirection (`> file`) cut. A command is a `torchsprint` word at the
  start (`.venv/bin/torchsprint` too) or after a launcher (`exec`, `srun`, `ssh HOST`, `torchrun ... -m`); the
  launcher is left out and the torchsprint command it starts is run.
- Not run: a block preceded by `<!-- not run: REASON -->` (the last non-blank line before its fence) is
  skipped with that reason, so the skips and their reasons are listed in the test report. Use it only for
  what cannot run on a CPU-only test machine (a GPU, SLURM, two machines, the network, a fresh virtualenv).
- Placeholders map to generated stand-ins, made once per test process (`workspace`): `~/data/<name>` and
  `/data/<name>` to a small JPEG folder with train/ val/ test/ (conftest.make_image_folder), `/shared/...shards`
  to WebDataset shards of it, other `/shared/...` paths into the test's folder, `runs/<name>/<timestamp>`,
  `runs/<name>/<t1>` and `RUN`, `RUN_A`... to copies of a tiny run trained on that folder, `run.yaml` to a
  short digits config, `configs/` to the repository's, `images/`, `photo.jpg`, `more.jpg` and
  `soup.safetensors` to files of the right kind.
- Kept short: `train` gets `--dry-run` (everything built and checked, nothing trained or written), `bench`
  measures its baseline only, for 2 steps, in this process (`isolate=False`: the variants' own processes are
  tests/e2e/cli/test_bench.py's), `lr-find` takes 10 steps, `tune` gets `--dry-run` (the space and every value
  a trial may take checked, no trial run). Each command runs in this process (conftest's `cli_in_process`), in a
  folder of its own, so the cases spread over xdist workers.
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import make_image_folder
from paths import REPO  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
FENCE = re.compile(r"^```\s*(\w*)\s*$")
SHELL = {"bash", "sh", "shell", "console", ""}
SEPARATORS = {"&&", "||", ";", "|"}
REDIRECTS = re.compile(r"^\d?(>>?|<)")
LAUNCHERS = {"exec", "srun", "-m", "nohup", "time"}


@dataclass(frozen=True)
class Documented:
    page: str
    line: int
    argv: tuple[str, ...]  # after `torchsprint`
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: torchsprint {shlex.join(self.argv)}"


def torchsprint_part(tokens: list[str]) -> list[str] | None:
    """The arguments after `torchsprint` in one simple command, or None when it does not run torchsprint."""
    for k, tok in enumerate(tokens):
        if Path(tok).name != "torchsprint":
            continue
        if k == 0 or tokens[k - 1] in LAUNCHERS or (k >= 2 and tokens[k - 2] == "ssh"):
            return tokens[k + 1 :]
    return None


def commands_of_block(body: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """[(line number, argv after torchsprint)] of a shell block's (line number, line) pairs."""
    out, logical, start = [], "", None
    for number, line in body:
        start = start or number
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        segment, cut = [], False
        for tok in [*shlex.split(logical + line, comments=True), ";"]:
            if tok in SEPARATORS:
                argv = torchsprint_part(segment)
                if argv is not None:
                    out.append((start, argv))
                segment, cut = [], False
            elif cut or REDIRECTS.match(tok):
                cut = True  # a redirection and its target: nothing up to the next separator is an argument
            else:
                segment.append(tok)
        logical, start = "", None
    return out


def documented_commands() -> list[Documented]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(before)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) in SHELL:
                body = [(j + 1, lines[j]) for j in range(i + 1, end)]
                for number, argv in commands_of_block(body):
                    found.append(
                        Documented(
                            str(page.relative_to(REPO)), number, tuple(argv), marker.group(1) if marker else None
                        )
                    )
            i = end + 1
    return found


COMMANDS = documented_commands()


def unique(commands: list[Documented]) -> dict[Documented, list[str]]:
    """Each distinct command once (the README's first day is also on docs/first-day.md), with the other places
    it is written."""
    first: dict[tuple, Documented] = {}
    places: dict[Documented, list[str]] = {}
    for c in commands:
        key = (c.argv, c.not_run is None)
        if key in first:
            places[first[key]].append(f"{c.page}:{c.line}")
        else:
            first[key] = c
            places[c] = []
    return places


UNIQUE = unique(COMMANDS)


# ---------------------------------------------------------------------------------------------- the stand-ins

RUN_NAME = "20261126-101500"


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """The stand-ins every command may name, made once per test process: an image folder, a short config, a
    tiny trained run with three checkpoints, its weights averaged, shards. Built through the CLI itself."""
    from torchsprint import cli

    root = tmp_path_factory.mktemp("documented")
    pets = make_image_folder(root / "pets", per_class=8, size=(40, 36), splits=("train", "val", "test"))
    (root / "images").mkdir()
    for i, jpg in enumerate(sorted((pets / "test").rglob("*.jpg"))[:4]):
        shutil.copy(jpg, root / "images" / f"{i}.jpg")
    for name in ("photo.jpg", "more.jpg", "img.jpg"):
        shutil.copy(root / "images" / "0.jpg", root / name)
    (root / "configs").symlink_to(REPO / "configs")
    (root / "run.yaml").write_text(
        "# a short digits run: what the docs' run.yaml stands for here\n"
        "run: {epochs: 1}\nmodel: {name: small_cnn, args: {width: 8}}\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        run = f"runs/default/{RUN_NAME}"
        calls = [
            [
                "train",
                "data.root=pets",
                "model.name=small_cnn",
                "model.args={width: 8}",
                "run.epochs=3",
                "data.train.transforms=[random_resized_crop: 32, hflip]",
                "data.eval.transforms=[resize: 36, center_crop: 32]",
                "checkpoint.keep_last=3",
                "log.tensorboard=false",
                "log.progress=false",
                f"run.dir={run}",
            ],
            ["average", run, run, "-o", "soup.safetensors"],
            ["data", "shard", "pets", "shards", "--shard-size", "1GB"],
        ]  # the docs' size: a rerun keeps them
        for argv in calls:
            assert cli.main(argv) == 0, argv
    return root


def materialize(tok: str, workspace: Path, cwd: Path) -> str:
    """A documented placeholder -> the stand-in in the test's folder (a run folder copied there, so commands
    that write into it, such as export, leave the shared one alone)."""
    if "=" in tok and not tok.startswith("-") and not tok.startswith(("runs/", "/", "~")):
        key, value = tok.split("=", 1)
        return f"{key}={materialize(value, workspace, cwd)}"
    if re.match(r"^(~|)/data/[\w-]+$", tok):
        return "pets"
    if re.match(r"^/shared/[\w-]*shards$", tok):
        return "shards"
    if tok.startswith("/shared/"):
        return "shared/" + tok[len("/shared/") :]
    m = re.match(r"^runs/([\w-]+)/(<[^>]+>|\d{8}-\d{6})(/.*)?$", tok) or re.match(r"^()(RUN(?:_[A-Z])?)()$", tok)
    if m:
        folder = cwd / "runs" / (m.group(1) or "x") / re.sub(r"\W", "", m.group(2))
        if not folder.exists():
            shutil.copytree(workspace / "runs" / "default" / RUN_NAME, folder)
        return str(folder.relative_to(cwd)) + (m.group(3) or "")
    return tok


MULTI_MACHINE = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend")


def kept_short(argv: list[str]) -> list[str]:
    command = argv[0] if argv else ""
    if command == "train" and ("--nproc-per-node" in argv or "--nnodes" in argv):
        # A launch dry-runs in real workers (commands/launch.py): two of them on this machine alone, the other
        # machines' flags left out (their rendezvous would wait for machines that are not there).
        out, skip = [], False
        for tok in argv:
            if skip:
                skip = False
            elif tok in MULTI_MACHINE:
                skip = True
            else:
                out.append("2" if out and out[-1] == "--nproc-per-node" else tok)
        argv = out
    if command == "train" and "--dry-run" not in argv:
        return [*argv, "--dry-run"]
    if command == "bench":  # argparse keeps the last of a repeated option
        return [
            *argv,
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--variants",
            "baseline (seeds)",
            "--out",
            "bench-out",
        ]
    if command == "lr-find":
        return [*argv, "--steps", "10"]
    if command == "tune":  # the space printed and every value checked; the trials: tests/e2e/cli/test_tune.py
        return [*argv, "--dry-run"]
    return argv


# A launch dry-runs in two real worker processes (8-11 s each on 2 cores): the documented launches run in .ci/slow;
# tests/e2e/ddp/test_ddp.py's dry run (every worker checks its part, nothing written) holds the path in the main suite.
LAUNCHES = [c for c in UNIQUE if "--nproc-per-node" in c.argv or "--nnodes" in c.argv]


def as_param(c: Documented):
    return pytest.param(c, id=f"{c.page}:{c.line}", marks=[pytest.mark.slow] if c in LAUNCHES else [])


@pytest.mark.parametrize("documented", [as_param(c) for c in UNIQUE])
def test_documented_command_runs(documented, workspace, tmp_path, cli_in_process, monkeypatch):
    also = f" (also {', '.join(UNIQUE[documented])})" if UNIQUE[documented] else ""
    if documented.not_run:
        pytest.skip(f"{documented}{also}: not run, as its page says: {documented.not_run}")
    outputs = {documented.argv[i + 1] for i, tok in enumerate(documented.argv[:-1]) if tok in ("-o", "--out")}
    for entry in workspace.iterdir():  # the stand-ins, except what this command writes (`average -o soup.safetensors`
        if entry.name != "runs" and entry.name not in outputs:  # would meet the one `eval --weights` reads, and refuse)
            (tmp_path / entry.name).symlink_to(entry.resolve())
    argv = kept_short([materialize(tok, workspace, tmp_path) for tok in documented.argv])
    if argv[0] == "bench":  # measured in this process: the variants' own processes are tests/e2e/cli/test_bench.py's
        from torchsprint.commands.bench import main as bench_main

        monkeypatch.setattr(bench_main, "bench", functools.partial(bench_main.bench, isolate=False))
    r = cli_in_process(*argv)
    assert r.returncode == 0, (
        f"{documented}{also}\nran as: torchsprint {shlex.join(argv)}\nexit {r.returncode}\n{r.stderr[-3000:]}"
    )


# ------------------------------------------------------------------------------------------ the extraction


def test_the_pages_document_commands_and_every_not_run_marker_is_used():
    """The extraction finds the commands (a change to the fences or the parser would otherwise test nothing),
    and a `not run` marker stands right before a block holding a torchsprint command: a stale one would hide a
    command added later to the block it precedes."""
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/first-day.md", "docs/recipes.md", "docs/cluster.md"} <= pages, pages
    run = [c for c in COMMANDS if not c.not_run]
    assert len(run) >= 40, len(run)
    subcommands = {c.argv[0] for c in run}
    assert {
        "train",
        "eval",
        "export",
        "predict",
        "bench",
        "lr-find",
        "report",
        "average",
        "data",
        "config",
        "list",
    } <= subcommands, subcommands
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if NOT_RUN.match(line.strip()):
                nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
                assert nxt is not None and FENCE.match(lines[nxt]), (
                    f"{page.name}:{i + 1}: a marker must precede a block"
                )
                assert any(c.page.endswith(page.name) and c.line > nxt and c.not_run for c in COMMANDS), (
                    f"{page.name}:{i + 1}: marker before a block without a torchsprint command"
                )


def test_extraction_of_a_block():
    body = list(
        enumerate(
            [
                "torchsprint train -c a.yaml   # a comment",
                "torchrun --nproc-per-node 4 -m torchsprint train -c run.yaml",
                "ssh host-a torchsprint eval -r RUN && echo done",
                "exec torchsprint train --nproc-per-node 8 \\",
                "    run.dir=/shared/x",
                "torchsprint config schema > schema.json",
                "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/torchsprint train",
                "pip install torchsprint; tensorboard --logdir runs",
            ],
            start=1,
        )
    )
    assert commands_of_block(body) == [
        (1, ["train", "-c", "a.yaml"]),
        (2, ["train", "-c", "run.yaml"]),
        (3, ["eval", "-r", "RUN"]),
        (4, ["train", "--nproc-per-node", "8", "run.dir=/shared/x"]),
        (6, ["config", "schema"]),
        (7, ["train"]),
    ]

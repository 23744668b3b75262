"""Every command's flags are checked as the config schema checks its fields, driven by cli.COMMANDS: each flag
with a checked type (cli_args: Count, Number, device, Output...) gets bad values drawn from what its type
accepts, and `torchsprint <command> --flag=<bad>` must exit 2 with one `error:` line naming the flag and no
traceback, before any work. Bugs caught (c32f344): `predict --batch-size 0`, `--topk -1` and `--device cuda`
without a GPU were tracebacks; `--nproc-per-node 0` trained one process; `lr-find --out` on a file or below
one failed only after the whole sweep; numeric flags took any int or float (`--tolerance nan`, `--wrong -3`).
The commands run in this process (cli_in_process); the GPU is hidden from unmarked tests, so `cuda` is absent."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchsprint import cli
from torchsprint.commands import args as cli_args


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every command and sub-command (data check, config show...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, p in sub.choices.items():
            yield from leaf_parsers(p, (*path, name))


PARSERS = [(words, p) for words, p in leaf_parsers(cli.build_parser()) if words]
CHECKED = (cli_args.Count, cli_args.Number, cli_args.Output)
CHECKED_FUNCTIONS = (cli_args.device, cli_args.nnodes, cli_args.shard_size)


def checked(action) -> bool:
    return isinstance(action.type, CHECKED) or action.type in CHECKED_FUNCTIONS


FLAGS = [(words, p, a) for words, p in PARSERS for a in p._actions if checked(a)]


def test_every_command_is_covered_and_no_flag_takes_an_unchecked_number():
    """A new command or flag joins the property test below by its type; a plain int/float flag would escape it."""
    assert {words[0] for words, _ in PARSERS} == {c.name for c in cli.COMMANDS}
    plain = [f"{' '.join(w)} {a.dest}" for w, p in PARSERS for a in p._actions if a.type in (int, float)]
    assert plain == []
    assert len(FLAGS) >= 30, len(FLAGS)


@pytest.fixture
def places(tmp_path):
    """Paths an output flag must refuse: a file, a path below a file, a run's own files, a read-only folder."""
    (tmp_path / "file").write_text("x")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in (
        "config.yaml",
        "last.safetensors",
        "best.safetensors",
        "metrics.jsonl",
        "checkpoints/ckpt-e001-s0000001.pt",
    ):
        (run / name).write_text("x")
    ro = tmp_path / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    return {
        "file": tmp_path / "file",
        "below_file": tmp_path / "file" / "sub" / "out.x",
        "run": run,
        "own": [
            run / n for n in ("config.yaml", "last.safetensors", "metrics.jsonl", "checkpoints", "checkpoints/x.pt")
        ],
        "readonly": ro / "out",
        "ok": tmp_path / "fine",
    }


def is_number(text: str) -> bool:
    try:
        float(text)  # also whatever int() takes: '1_000', ' 5', Arabic digits
    except ValueError:
        return False
    return True


def bad_values(action, places) -> st.SearchStrategy[str]:
    """Values the flag's type must refuse."""
    t = action.type
    junk = st.text(min_size=1, max_size=8).filter(lambda s: not is_number(s))
    if isinstance(t, cli_args.Count):
        return st.one_of(st.integers(-(10**9), t.minimum - 1).map(str), junk, st.sampled_from(["1.5", "1e3", ""]))
    if isinstance(t, cli_args.Number):
        out = [st.sampled_from(["nan", "inf", "-inf", "1e999"]), junk]
        if t.low is not None:
            out.append(st.floats(max_value=t.low, exclude_max=not t.above, allow_nan=False, min_value=-1e9).map(repr))
        if t.high is not None:
            out.append(st.floats(min_value=t.high, exclude_min=True, allow_nan=False, max_value=1e9).map(repr))
        return st.one_of(*out)
    if t is cli_args.device:
        return st.one_of(
            st.sampled_from(["cuda", "cuda:0", "cuda:7", "meta", "mps", "tpu", "gpu", "", "cuda:-1"]),
            junk.filter(lambda s: s not in ("auto",) and not s.startswith("cpu")),
        )
    if t is cli_args.nnodes:
        return st.sampled_from(["0", "-1", "3:2", "a", "1:0", "0:4", "", "2:x"])
    if t is cli_args.shard_size:
        return st.sampled_from(["", "1", "10KB", "big", "-1GB", "1 parsec"])
    own = [str(p) for p in places["own"]]
    wrong_kind = places["file"] if t.folder else places["run"]  # a file for a folder, a folder for a file
    kinds = [str(wrong_kind), str(places["below_file"]), *own]
    if os.geteuid() != 0:  # root writes into a read-only folder
        kinds.append(str(places["readonly"]))
    return st.sampled_from(kinds)


def argv_for(words, parser, tested, value, places) -> list[str]:
    """The command line: the command words, a placeholder for every other required argument, the tested flag."""
    argv = list(words)
    for a in parser._actions:
        if a is tested or isinstance(a, argparse._HelpAction):
            continue
        good = str(places["ok"] / ("d" if isinstance(a.type, cli_args.Output) and a.type.folder else "f.safetensors"))
        placeholder = good if isinstance(a.type, cli_args.Output) else "x"
        if not a.option_strings:
            argv.append(placeholder)
        elif a.required:
            argv += [max(a.option_strings, key=len), placeholder]
    if tested.option_strings:
        return [*argv, f"{max(tested.option_strings, key=len)}={value}"]
    i = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._HelpAction)].index(tested)
    return [*argv[: len(words) + i], value, *argv[len(words) + i + 1 :]]


@pytest.mark.parametrize("words,parser,action", FLAGS, ids=[f"{' '.join(w)} {a.dest}" for w, _, a in FLAGS])
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_bad_flag_value_is_one_line_naming_the_flag(words, parser, action, places, cli_in_process, data):
    value = data.draw(bad_values(action, places))
    argv = argv_for(words, parser, action, value, places)
    r = cli_in_process(*argv)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (argv, r.returncode, r.stderr)
    assert f"argument {argparse._get_action_name(action)}:" in errors[0], (argv, errors)  # e.g. 'argument -o/--out:'
    assert not Path(places["ok"]).exists()  # refused while parsing: nothing was created


def test_the_flags_still_take_good_values(tmp_path, cli_in_process):
    """The types accept what the commands always took (the defaults go through them too)."""
    p = cli.build_parser()
    args = p.parse_args(
        [
            "predict",
            "-r",
            "x",
            "y",
            "--batch-size",
            "1",
            "--topk",
            "3",
            "--threshold",
            "0.5",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "new" / "r.jsonl"),
        ]
    )
    assert (args.batch_size, args.topk, args.threshold, args.device) == (1, 3, 0.5, "cpu")
    assert not (tmp_path / "new").exists()  # checked, not created
    args = p.parse_args(["lr-find", "--steps", "10", "--start", "1e-6", "--end", "1", "--out", str(tmp_path)])
    assert (args.steps, args.start, args.end) == (10, 1e-6, 1.0)
    args = p.parse_args(["train", "--nproc-per-node", "2", "--nnodes", "1:4", "--node-rank", "0"])
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == (2, "1:4", 0)
    assert p.parse_args(["data", "shard", "a", str(tmp_path / "o"), "--shard-size", "64MiB"]).shard_size == "64MiB"


def test_lr_find_out_is_refused_before_the_sweep(tmp_path, cli_in_process):
    """The sweep (build, 10 steps) never starts: the refusal comes in well under the time of a sweep."""
    import time

    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "below"):
        t0 = time.perf_counter()
        r = cli_in_process("lr-find", "--steps", "10", "--out", out)
        assert r.returncode == 2 and "argument --out" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert time.perf_counter() - t0 < 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("flags") / "run"
    assert (
        cli.main(
            [
                "train",
                "run.epochs=1",
                "log.tensorboard=false",
                "log.progress=false",
                "model.args={width: 4}",
                f"run.dir={run}",
            ]
        )
        == 0
    )
    return run


@pytest.mark.parametrize(
    "flags",
    [["--batch-size", "0"], ["--topk", "-1"], ["--device", "cuda"], ["--device", "cuda:7"]],
    ids=lambda f: " ".join(f),
)
def test_the_reported_predict_flags_on_a_real_run(trained, tmp_path, cli_in_process, flags):
    """The reported cases end to end on a trained run and a real image (before: ValueError 'range() arg 3 must not
    be zero', RuntimeError 'selected index k out of range', RuntimeError 'Found no NVIDIA driver')."""
    from PIL import Image

    Image.new("L", (8, 8), 100).save(tmp_path / "a.png")
    r = cli_in_process("predict", "-r", trained, tmp_path / "a.png", *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert f"argument {flags[0]}" in line, line


def test_nproc_per_node_zero_is_refused(cli_in_process):
    """Before: 0 is falsy, so `train --nproc-per-node 0` trained in this one process (-1 was refused)."""
    r = cli_in_process("train", "--nproc-per-node", "0", "--dry-run")
    assert r.returncode == 2 and "argument --nproc-per-node: must be >= 1, got 0" in r.stderr, r.stderr

"""No command writes over a run's own files, nor over any existing file without --overwrite, and a run folder
never goes inside data.root. Bugs caught (c32f344): `average A B -o B/last.safetensors` replaced run B's own
weights; `export --out` and `predict --out` replaced a run's best weights, config.yaml or metrics.jsonl, and any
existing file; `bench --out <run>` wrote over its config.yaml and `report --out <run>` over its confusion matrix;
a run.dir inside data.root was accepted, and the next run read the run folder as a class. Every case runs the
real CLI in this process on real runs; the files it must not touch are compared byte for byte."""

from __future__ import annotations

import pytest

from conftest import make_image_folder
from torchsprint import cli

FAST = ["run.epochs=1", "log.tensorboard=false", "log.progress=false", "model.args={width: 4}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("A", 0), ("B", 1)):
        assert cli.main(["train", *FAST, f"run.seed={seed}", f"run.dir={root / name}"]) == 0
    return root / "A", root / "B"


def snapshot(run) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def refused(r, *fragments) -> str:
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in errors[0], (f, errors[0])
    return errors[0]


def test_no_command_writes_over_a_runs_own_files(runs, tmp_path, cli_in_process):
    a, b = runs
    before = snapshot(b)
    image = tmp_path / "a.png"
    from PIL import Image

    Image.new("L", (8, 8), 100).save(image)
    for argv in (
        ["average", a, b, "-o", b / "last.safetensors"],
        ["average", a, b, "-o", b / "last.safetensors", "--overwrite"],
        ["export", "-r", a, "--format", "safetensors", "--out", b / "best.safetensors", "--overwrite"],
        ["export", "-r", a, "--format", "onnx", "--out", b / "config.yaml"],
        ["predict", "-r", a, image, "--out", b / "metrics.jsonl", "--overwrite"],
        ["predict", "-r", a, image, "--out", b / "checkpoints" / "ckpt-e001-s0000001.pt"],
    ):
        refused(cli_in_process(*argv), "of the run in", str(b), "replace the run's own file")
    for argv in (["bench", "--out", b, "--steps", "1"], ["report", a, "--out", b]):  # a run folder as their --out
        refused(cli_in_process(*argv), "of the run in", "replace the run's own file")
    assert snapshot(b) == before


def test_an_existing_file_needs_overwrite(runs, tmp_path, cli_in_process):
    a, b = runs
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my notes\n")
    from PIL import Image

    Image.new("L", (8, 8), 100).save(tmp_path / "a.png")
    refused(
        cli_in_process("predict", "-r", a, tmp_path / "a.png", "--out", mine),
        f"--out {mine} already exists",
        "--overwrite",
    )
    assert mine.read_text() == "my notes\n"
    assert cli_in_process("predict", "-r", a, tmp_path / "a.png", "--out", mine, "--overwrite").returncode == 0
    assert mine.read_text() != "my notes\n"
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"mine")
    refused(cli_in_process("export", "-r", a, "--format", "safetensors", "--out", model), "already exists")
    assert model.read_bytes() == b"mine"
    out = tmp_path / "avg.safetensors"
    out.write_bytes(b"mine")
    refused(cli_in_process("average", a, b, "-o", out), "already exists")
    assert out.read_bytes() == b"mine"


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_an_earlier_report_lr_find_or_bench_in_out_needs_overwrite(runs, tmp_path, cli_in_process):
    """report, lr-find and bench given an --out that holds their own earlier files (report.html, lr_find.json,
    bench.json): refused without --overwrite, the files byte for byte as they were; with it, replaced. Before, each
    replaced them without a word (writable_file was called with overwrite on). Their default folders (<run>/report,
    a temp folder, bench/<timestamp>) stay theirs: a second `report RUN` needs no flag."""
    a, _ = runs
    cases = {
        "report": (["report", a, "--wrong", "0"], "report.html"),
        "lr-find": (["lr-find", *FAST, "--steps", "10"], "lr_find.json"),
        "bench": (
            ["bench", *FAST, "--steps", "1", "--warmup", "0", "--repeats", "1", "--variants", "baseline (seeds)"],
            "bench.json",
        ),
    }
    for name, (argv, own) in cases.items():
        out = tmp_path / name
        out.mkdir()
        (out / own).write_text("an earlier result\n")
        refused(cli_in_process(*argv, "--out", out), f"--out {out / own} already exists", "--overwrite")
        assert (out / own).read_text() == "an earlier result\n", name
        r = cli_in_process(*argv, "--out", out, "--overwrite")
        assert r.returncode == 0, (name, r.stderr[-2000:])
        assert (out / own).read_text() != "an earlier result\n", name
    for _ in range(2):
        assert cli_in_process("report", a, "--wrong", "0").returncode == 0


def test_the_default_export_is_replaced_by_a_new_export(runs, cli_in_process):
    """<run>/export/ is export's own folder: exporting again there needs no --overwrite (as before)."""
    a, _ = runs
    for _ in range(2):
        r = cli_in_process("export", "-r", a, "--format", "safetensors")
        assert r.returncode == 0, r.stderr


def test_a_run_folder_inside_data_root_is_refused(tmp_path, cli_in_process):
    root = make_image_folder(tmp_path / "imgs", per_class=3)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    for where in ([f"run.dir={root / 'train' / 'run'}"], [f"run.dir={root}"], [f"run.out_dir={root / 'runs'}"]):
        refused(
            cli_in_process("train", *FAST, "data.dataset=image_folder", f"data.root={root}", *where),
            "is inside data.root",
            "outside data.root",
        )
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before

"""Every benchmark script imports and parses its own --help: a rename in one shared module broke
benchmarks/compare/vs_lightning.py (it imported a function vs_plain_pytorch.py no longer had) without any test noticing.
And the rules of benchmarks/: every script a module of the `benchmarks` package (`python -m benchmarks.<kind>.<name>`),
no sys.path edit, nothing imported from tests/, every results file named by benchmarks/results/README.md's rule."""

from __future__ import annotations

import ast
import datetime
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO  # noqa: E402

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if p.name != "__init__.py")
RESULTS = BENCH / "results"
# <benchmark>_<device>_<YYYY-MM-DD>[_<variant>].json: benchmarks/results/README.md
RESULT_NAME = re.compile(
    r"^(?P<benchmark>[a-z0-9]+(?:_[a-z0-9]+)*)_(?P<device>[a-z0-9]+(?:-[a-z0-9]+)*)"
    r"_(?P<date>\d{4}-\d{2}-\d{2})(?:_(?P<variant>[a-z0-9]+(?:-[a-z0-9]+)*))?\.json$"
)


def module_name(path: Path) -> str:
    """benchmarks/compare/vs_timm.py -> benchmarks.compare.vs_timm"""
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def load(name: str):
    """A benchmark script as the module `python -m` runs (`benchmarks.<kind>.<name>`)."""
    return importlib.import_module(name)


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_script_imports_and_prints_help(path, monkeypatch, capsys):
    module = load(module_name(path))  # an ImportError or a NameError at module level fails here
    main = getattr(module, "main", None)
    if main is None:
        assert path.parent.name == "common", f"{path}: a script without main() (helpers go in benchmarks/common/)"
        return
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_every_folder_of_benchmarks_is_a_package():
    """A folder without its __init__.py imports as a namespace package here and breaks `python -m` nowhere, but is
    left out of tools that walk packages; and a script outside a kind folder (benchmarks/x.py) is the flat layout
    back."""
    folders = {p.parent for p in SCRIPTS}
    missing = sorted(str(f.relative_to(REPO)) for f in folders | {BENCH} if not (f / "__init__.py").is_file())
    assert not missing, f"folders of benchmarks/ without __init__.py: {missing}"
    flat = sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")
    assert not flat, f"scripts directly in benchmarks/ (put them in the folder of their kind): {flat}"


TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("*.py")} | {"tests"}
PATH_CALL = re.compile(
    r"^(.*\.)?(Path|PurePath|joinpath|join|open)$"
)  # ROOT / "tests", Path("tests"), os.path.join(...)


def offences(source: str) -> list[str]:
    """What a benchmark's source does that benchmarks/ forbids: sys.path edits (or reads: a script that needs
    one is run wrongly), loading a file as a module by path, importing a module of tests/."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append(f"line {node.lineno}: sys.path")
        if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "run_path"):
            found.append(f"line {node.lineno}: {node.attr} (import the module by its name)")
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        found += [f"line {node.lineno}: imports {n} from tests/" for n in names if n.split(".")[0] in TEST_MODULES]
        parts = (
            [node.left, node.right]
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            else node.args
            if isinstance(node, ast.Call) and PATH_CALL.match(ast.unparse(node.func))
            else []
        )
        if any(
            isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.split("/")[0] == "tests" for a in parts
        ):
            found.append(f"line {node.lineno}: a path into tests/")
    return found


def test_no_benchmark_edits_sys_path_or_imports_tests():
    """Nine scripts put benchmarks/, src/ or tests/ on sys.path to import a sibling script or a test module
    (numerics/amp_tolerance.py imported tests/e2e/tasks/test_task_everything.py): a script then ran only from one
    folder, and a test's refactor broke a benchmark. Shared code lives in benchmarks/common/, imported by name."""
    bad = {str(p.relative_to(REPO)): o for p in SCRIPTS if (o := offences(p.read_text()))}
    assert not bad, bad
    planted = (
        "import sys\nsys.path.insert(0, 'x')\nfrom test_serve import soak\nimport importlib.util\n"
        "importlib.util.spec_from_file_location('m', 'm.py')\nROOT = None; ROOT / 'tests'\n"
        "out = {'tests': {}}; out.get('tests')\n"
    )  # a key named "tests" is no path
    assert len(offences(planted)) == 4, offences(planted)  # the check sees each kind


def test_task_runs_are_the_tests_own():
    """numerics/amp_tolerance.py measures the spread test_task_everything.py's amp bounds come from, on a copy of its
    runs (benchmarks import nothing from tests/): a config changed in the test but not in the copy would set a
    bound from runs the test no longer makes."""
    t = importlib.import_module("test_task_everything")
    runs = importlib.import_module("benchmarks.common.task_runs")
    assert (runs.CFG, runs.COMMON, runs.EPOCHS, runs.MONITOR) == (t.CFG, t.COMMON, t.EPOCHS, t.MONITOR)
    source = inspect.getsource(t.test_amp_bf16_trains_close_to_fp32)
    assert all(f'"{o}"' in source for o in runs.VIDEO), "the amp test's video overrides changed: update VIDEO"


def results_readme() -> tuple[set[str], set[str]]:
    """(the results files, the devices) that benchmarks/results/README.md lists in its tables."""
    text = (RESULTS / "README.md").read_text()
    files = set(re.findall(r"^\| `([^`]+\.json)` \|", text, flags=re.M))
    devices = set(re.findall(r"^\| `([a-z0-9-]+)` \|", text, flags=re.M))
    return files, devices


def recorded_date(path: Path) -> str | None:
    """The YYYY-MM-DD a results file records for itself (its `date`, or its machine's), if any."""
    data = json.loads(path.read_text())
    for date in (
        data.get("date"),
        (data.get("machine") or {}).get("date") if isinstance(data.get("machine"), dict) else None,
    ):
        if isinstance(date, str) and re.match(r"\d{4}-\d{2}-\d{2}", date):
            return date[:10]
    return None


def test_every_results_file_follows_the_naming_rule():
    """Results were named ad hoc (2026-11-26-h200.json with no benchmark, serve_load_2026-11-29c_digits.json with a
    letter on the date, serve_soak_... for serve_load's soak): a file's name did not say which script wrote it, on
    which device, on which day. Each must be <benchmark>_<device>_<YYYY-MM-DD>[_<variant>].json with the benchmark a
    script of benchmarks/, the device one README.md lists, the date a real day (the file's own when it records one),
    and README.md must list exactly the files there are."""
    listed, devices = results_readme()
    scripts = {p.stem for p in SCRIPTS}
    files = sorted(p for p in RESULTS.iterdir() if p.name != "README.md")
    assert files and devices, "no results files, or README.md lists no devices"
    bad = []
    for p in files:
        m = RESULT_NAME.match(p.name)
        if not m:
            bad.append(f"{p.name}: not <benchmark>_<device>_<YYYY-MM-DD>[_<variant>].json")
            continue
        if m["benchmark"] not in scripts:
            bad.append(f"{p.name}: no benchmark script is called {m['benchmark']!r}")
        if m["device"] not in devices:
            bad.append(f"{p.name}: device {m['device']!r} is not in README.md's device table")
        try:
            datetime.date.fromisoformat(m["date"])
        except ValueError:
            bad.append(f"{p.name}: {m['date']} is no date")
        if (own := recorded_date(p)) not in (None, m["date"]):
            bad.append(f"{p.name}: the file says it was measured on {own}")
    names = {p.name for p in files}
    bad += [f"README.md lists {n}, which is not in results/" for n in sorted(listed - names)]
    bad += [f"{n} is not listed in README.md" for n in sorted(names - listed)]
    assert not bad, "\n".join(bad)
    assert not RESULT_NAME.match("2026-11-26-h200.json") and not RESULT_NAME.match("serve_load_2026-11-29c_digits.json")


def test_merge_results_adds_a_later_calls_dali_figures_to_m2_and_m3():
    """run_all.sh dali runs in a later device call than M2/M3 (DALI arrives in parts): its figures must join
    the earlier ones, not replace M2 or M3, and its `None`s must not erase measured figures."""
    merge = load("benchmarks.gpu.merge_results").merge
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}
    full = env | {
        "date": "2026-12-01T10:00",
        "command": "measure.py --only M2,M3",
        "measurements": {
            "M2": {
                "images_per_s": {"gpu backend, cpu_fraction 0": 9000.0, "dali backend": None},
                "workers": 16,
                "dali": "not measured",
                "details": {"gpu backend, cpu_fraction 0": {"epochs": 3}},
            },
            "M3": {"backend": "gpu", "images_per_s": 20000.0, "by_backend": {"gpu": {"images_per_s": 20000.0}}},
        },
    }
    dali = env | {
        "date": "2026-12-01T10:20",
        "command": "measure.py --only M2,M3 --backends dali",
        "measurements": {
            "M2": {
                "images_per_s": {"dali backend": 11000.0},
                "workers": 16,
                "dali": "measured",
                "details": {"dali backend": {"epochs": 3}},
            },
            "M3": {"by_backend": {"dali": {"images_per_s": 21000.0}}},
        },
    }
    m = merge([full, dali])["measurements"]
    assert m["M2"]["images_per_s"] == {"gpu backend, cpu_fraction 0": 9000.0, "dali backend": 11000.0}
    assert set(m["M2"]["details"]) == {"gpu backend, cpu_fraction 0", "dali backend"} and m["M2"]["dali"] == "measured"
    assert m["M3"]["backend"] == "gpu" and m["M3"]["images_per_s"] == 20000.0
    assert m["M3"]["by_backend"] == {"gpu": {"images_per_s": 20000.0}, "dali": {"images_per_s": 21000.0}}
    again = merge([dali, full])["measurements"]  # the full run second: its None leaves DALI's figure alone
    assert again["M2"]["images_per_s"]["dali backend"] == 11000.0
    assert full["measurements"]["M2"]["images_per_s"]["dali backend"] is None  # the inputs are not modified


def test_merge_results_names_the_fastest_jpeg_backend_over_every_call():
    """M2["fastest_backend"] (what data.backend: auto's rule reads) comes from the merged figures: DALI's,
    measured in the last call, must compete with the cpu and gpu backends' of an earlier call, and lose when slower."""
    merge = load("benchmarks.gpu.merge_results").merge
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}
    call2 = env | {
        "date": "d1",
        "measurements": {"M2": {"by_backend": {"cpu": 7666.0, "gpu": 9690.0, "gpu_split_auto": 8031.0}}},
    }
    for dali_rate, fastest in ((11000.0, "dali"), (9000.0, "gpu")):
        call3 = env | {"date": "d2", "measurements": {"M2": {"by_backend": {"dali": dali_rate}}}}
        m2 = merge([call2, call3])["measurements"]["M2"]
        assert m2["by_backend"] == {"cpu": 7666.0, "gpu": 9690.0, "gpu_split_auto": 8031.0, "dali": dali_rate}
        assert m2["fastest_backend"] == fastest, (dali_rate, m2)
    assert "fastest_backend" not in call2["measurements"]["M2"]  # the inputs are not modified


def test_merge_results_refuses_two_devices():
    merge = load("benchmarks.gpu.merge_results").merge
    with pytest.raises(SystemExit, match="different devices"):
        merge([{"device": "H100", "torch": "2.11", "date": "d"}, {"device": "H200", "torch": "2.11", "date": "d"}])


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
@pytest.mark.skipif(not shutil.which("xz"), reason="needs xz (run_all.sh unpacks DALI's parts with it)")
def test_run_all_installs_dali_only_from_every_matching_part(tmp_path):
    """The DALI install of benchmarks/gpu/run_all.sh (parts made the way fetch_wheels.sh --dali makes them, a
    stand-in package instead of DALI's 170 MiB): it waits for missing parts, refuses parts from two packings
    or for another Python, and unpacks a complete set once."""
    site = tmp_path / "pkg"
    (site / "dalistandin").mkdir(parents=True)
    (site / "dalistandin" / "__init__.py").write_text("VALUE = 42\n")
    archive = tmp_path / "a.tar.xz"
    subprocess.run(f"tar -C {site} -cf - . | xz -1 > {archive}", shell=True, check=True)
    blob = archive.read_bytes()
    parts_root = tmp_path / "repo"
    chunks = [blob[: len(blob) // 2], blob[len(blob) // 2 :]]
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    manifest = f'PARTS=2\nSHA256={hashlib.sha256(blob).hexdigest()}\nPYVER={pyver}\nPACKAGES="dalistandin"\n'
    for k, chunk in enumerate(chunks, 1):
        (parts_root / f".dali-{k}").mkdir(parents=True)
        (parts_root / f".dali-{k}" / "part").write_bytes(chunk)
        (parts_root / f".dali-{k}" / "manifest").write_text(manifest)

    def setup() -> str:
        env = os.environ | {
            "OUT": str(tmp_path / "out"),
            "NO_INSTALL": "1",
            "PY": sys.executable,
            "DALI_PARTS": str(parts_root),
            "DALI_SITE": str(tmp_path / "site-dali"),
            "WHEELS": str(tmp_path / "no-wheels"),
        }  # not the repository's .whl/ (the device's Python)
        p = subprocess.run(
            ["bash", str(BENCH / "gpu" / "run_all.sh"), "setup"], env=env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        return p.stdout

    shutil.move(parts_root / ".dali-2", tmp_path / "aside")
    assert "DALI: 1 of 2 parts here; carry .dali-2 in the next calls" in setup()
    assert not (tmp_path / "site-dali").exists()
    (tmp_path / "aside" / "part").write_bytes(chunks[1][:-1] + b"x")  # a part from another packing
    shutil.move(tmp_path / "aside", parts_root / ".dali-2")
    assert "do not match their manifest's sha256" in setup()
    assert not (tmp_path / "site-dali").exists()
    (parts_root / ".dali-2" / "part").write_bytes(chunks[1])
    for k in (1, 2):  # packed for another Python (binary wheels: cp312 libraries do not load in 3.11)
        (parts_root / f".dali-{k}" / "manifest").write_text(manifest.replace(f"PYVER={pyver}", "PYVER=2.7"))
    assert f"packed for Python 2.7, this is {pyver}" in setup()
    assert not (tmp_path / "site-dali").exists()
    for k in (1, 2):
        (parts_root / f".dali-{k}" / "manifest").write_text(manifest)
    out = setup()
    assert "DALI: unpacked 2 parts (dalistandin)" in out and "DALI: ready in" in out
    assert (tmp_path / "site-dali" / "dalistandin" / "__init__.py").read_text() == "VALUE = 42\n"
    assert "DALI: unpacked" not in setup()  # unpacked once: a later call on the same machine reuses it


@pytest.mark.slow  # 15 s: a benchmark script's own run
def test_data_throughput_runs_its_cpu_tables(tmp_path):
    """benchmarks/data/data_throughput.py end to end on 64 JPEGs: it reaches into the cpu backend's dataset and
    collate (the per-core CPU figure, also M2's on the GPU machine), which a refactor of the backend broke
    unnoticed (AttributeError) while --help still worked."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.data.data_throughput",
            "--images",
            "64",
            "--workers",
            "1",
            "--repeats",
            "1",
            "--batch-size",
            "16",
            "--root",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in p.stdout.splitlines() if line.startswith("| ")}
    for name in ("cpu backend, decoder=auto", "cpu backend, decoder=torchvision", "cpu backend, decoder=pil"):
        per_core = float(rows[name][4])  # images/s per core from CPU seconds per image
        assert per_core > 0 and float(rows[name][0]) > 0
    assert "torchvision.io.decode_jpeg" in rows


def errors_in(node, path=""):
    """(path, message) of every "error" entry in a results JSON."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "error":
                yield path, str(v)
            else:
                yield from errors_in(v, f"{path}/{k}")


@pytest.mark.slow
def test_gpu_measurements_run_end_to_end_on_the_cpu(tmp_path):
    """`python -m benchmarks.gpu.measure --smoke-cpu`: M1-M6's code with tiny sizes on the CPU (about a minute), the
    rehearsal of the GPU session's 30 minutes. Every measurement must produce figures under the keys the issue
    names; the only errors allowed are the gpu backend's refusal without CUDA. A script that would crash on the
    GPU machine (an attribute a refactor renamed, a wrong key) fails here first."""
    out = tmp_path / "results.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu.measure",
            "--smoke-cpu",
            "--out",
            str(out),
            "--data",
            str(tmp_path / "jpegs"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert {"device", "torch", "cuda", "date", "command"} <= set(res) and res["device"] == "cpu"
    m = res["measurements"]
    assert sorted(m) == ["M1", "M2", "M3", "M4", "M5", "M6"]
    bad = [(path, msg) for path, msg in errors_in(m) if "needs a CUDA GPU" not in msg]
    assert not bad, bad
    assert {
        "resnet18 | fp32",
        "resnet18 | amp_bf16",
        "resnet18 | amp_bf16 + channels_last",
        "resnet50 | amp_bf16 + channels_last",
    } <= set(m["M1"]["images_per_s"])
    assert all(v > 0 for v in m["M1"]["images_per_s"].values())
    # Every measured variant beside the plain loop, timed in alternating windows, with its ratio.
    assert set(m["M1"]["plain_images_per_s"]) == set(m["M1"]["ratio_to_plain"]) == set(m["M1"]["images_per_s"])
    for key, ratio in m["M1"]["ratio_to_plain"].items():
        model, variant = key.split(" | ")
        row = m["M1"][model][variant]
        assert len(row["runs"]) == len(row["plain"]["runs"]) >= 2 and all(r > 0 for r in row["plain"]["runs"])
        per_window = sorted(t / p for t, p in zip(row["runs"], row["plain"]["runs"]))
        # the median of the per-window-pair ratios (recomputed from the rates: equal up to rounding, 1e-9 relative)
        assert any(abs(ratio - r) <= 1e-9 * r for r in per_window), (key, ratio, per_window)
    assert m["M2"]["by_backend"]["cpu"] == m["M2"]["images_per_s"]["cpu backend, 1 workers"]
    assert m["M2"]["images_per_s"]["cpu backend, 1 workers"] > 0
    assert m["M2"]["images_per_s"]["cpu backend per core (CPU time)"] > 0
    assert [k for k, _ in errors_in(m["M2"])] == [
        "/details/gpu backend, cpu_fraction 0",
        "/details/gpu backend, cpu_fraction auto",
    ]
    assert m["M3"]["images_per_s"] > 0 and m["M3"]["ratio_to_m1"] > 0 and 0 <= m["M3"]["data_wait_share"] < 1
    assert m["M3"]["by_backend"]["cpu"]["images_per_s"] == m["M3"]["images_per_s"]
    assert m["M4"]["seconds_per_epoch"] > 0 and 0 < m["M4"]["loader_share"] < 1
    assert set(m["M5"]["images_per_s"]) == {
        "default run | baseline (seeds)",
        "default run | + channels_last",
        "jpeg 224 | baseline (seeds)",
        "jpeg 224 | + channels_last",
    }
    assert all(v > 0 for v in m["M5"]["images_per_s"].values())
    assert m["M6"]["exit_code"] == 0 and any(v > 0 for v in m["M6"]["images_per_s"].values())


def test_backend_agreement_smoke_run(tmp_path, monkeypatch, capsys):
    """benchmarks/numerics/backend_agreement.py end to end on a tiny job (2 seeds x cpu, memory, gpu on the CPU device):
    every run lands in the table and the JSON; and its spread test flags separated means, not equal ones."""
    module = load("benchmarks.numerics.backend_agreement")
    out = tmp_path / "agree.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "backend_agreement.py",
            "--job",
            "jpeg",
            "--model",
            "small_cnn",
            "--seeds",
            "0,1",
            "--train-images",
            "20",
            "--val-images",
            "10",
            "--size",
            "20",
            "--crop",
            "16",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--root",
            str(tmp_path / "data"),
            "--json",
            str(out),
        ],
    )
    module.main()
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["backend"], r["seed"]) for r in result["runs"]] == [
        (b, s) for s in (0, 1) for b in ("cpu", "memory", "gpu_on_cpu")
    ]
    assert all(0 <= r["top1"] <= 1 for r in result["runs"]) and len(result["comparison"]) == 3
    assert "gpu_on_cpu" in printed and "seed-to-seed spread" in printed
    same, apart = (
        module.compare({"a": [0.5, 0.6, 0.7], "b": [0.5, 0.6, 0.7]}),
        module.compare({"a": [0.5, 0.51, 0.52], "b": [0.9, 0.91, 0.92]}),
    )
    assert not same[0]["beyond_spread"] and apart[0]["beyond_spread"] and apart[0]["diff"] == pytest.approx(-0.4)


def test_photo_folder_parses_the_feedback_times_from_timestamped_cli_lines():
    """benchmarks/defaults/photo_folder.py's figures come from the CLI's lines as they arrive: epoch 1's start is
    the first heartbeat's arrival less its `elapsed` (a clock that may read M:SS), and each time is taken from the
    first matching line only. Canned lines (the shapes of a real run's, times in seconds since the process began)
    against times worked out by hand."""
    parse = load("benchmarks.defaults.photo_folder").parse_lines
    lines = [
        (25.1, "model resnet18: initialised from random initialisation"),
        (25.6, "loader: data.backend=cpu (measured ...), decoder simplejpeg (JPEG: 200 files)"),
        (
            36.8,
            "epoch 1/10: step 1/25 (4%), 5.7 img/s, elapsed 11.2 s, "
            "ETA 2:01 (rough: from the first step, its warm-up included)",
        ),
        (45.3, "estimate: epoch 1 takes ~1:19 (25 steps at 20.1 img/s); the run ~14:02 (10 epoch(s) x 25 steps)"),
        (98.0, "epoch 1/10: step 20/25 (80%), 21.0 img/s, elapsed 1:12, ETA 14.0 s"),
        (112.0, "epoch 1: train loss 1.2, top1 0.45, 20 img/s, data wait 3%"),
        (120.5, "epoch 1/10  val loss 1.1  top1 0.5000  balanced acc 0.2500"),
        (130.0, "epoch 2/10: step 1/25 (4%), 5.7 img/s, elapsed 90.0 s, ETA 3.0 s"),
        (200.0, "epoch 2/10  val loss 1.0  top1 0.6000"),
    ]
    got = parse(lines)
    assert got["first_line_s"] == 25.1 and got["epoch_start_s"] == 25.6  # 36.8 - 11.2
    assert got["first_progress_after_start_s"] == 11.2 and got["first_estimate_after_start_s"] == 19.7  # 45.3 - 25.6
    assert got["epoch1_train_end_s"] == 112.0 and got["epoch1_end_s"] == 120.5
    assert (
        parse([(10.0, "x"), (85.0, "epoch 1/3: step 9/9 (100%), 1.0 img/s, elapsed 1:05, ETA 0.0 s")])["epoch_start_s"]
        == 20.0
    )

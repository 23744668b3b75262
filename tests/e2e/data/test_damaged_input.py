"""Damaged or odd input ends in one line and exit code 2 (or a skip that is named), never a traceback:
cut or junk metrics.jsonl, CIFAR labels out of range, an over-long run.dir, the memory backend forced on
data over its budget, configs nested too deeply, with a bad `extends`, not UTF-8, or with a key written
twice. Each case runs the real CLI in-process (the main() the console script calls) on real files."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_image_folder
from torchsprint import cli

FAST = ["run.epochs=1", "log.tensorboard=false", "log.progress=false", "model.args={width: 4}"]


def fails_cleanly(capsys, argv, *fragments) -> str:
    """main(argv) exits 2 with one 'error: ...' line holding every fragment, and no traceback."""
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------- config files


def test_config_nested_deeper_than_python_can_parse(tmp_path, capsys):
    for name, text in (
        ("deep.yaml", "run: " + "[" * 1200 + "]" * 1200 + "\n"),
        ("deep.json", '{"run": ' + "[" * 1200 + "]" * 1200 + "}"),
        ("deep.toml", "x = " + "[" * 1200 + "]" * 1200 + "\n"),
        ("block.yaml", "".join("  " * i + f"a{i}:\n" for i in range(1200))),
    ):
        (tmp_path / name).write_text(text)
        fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / name)], name, "nested too deeply")


def test_config_nested_past_the_limit_and_a_cyclic_alias(tmp_path, capsys):
    """Parsable, but deeper than config.MAX_DEPTH: merging, validating and dumping it would recurse past
    Python's limit later (a YAML alias to itself is infinitely deep)."""
    (tmp_path / "d.yaml").write_text("model:\n  args:\n    x: " + "[" * 150 + "]" * 150 + "\n")
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / "d.yaml")], "nested too deeply (over 100 levels")
    (tmp_path / "cyc.yaml").write_text("model:\n  args:\n    x: &a [*a]\n")
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / "cyc.yaml")], "cyc.yaml", "nested too deeply")


def test_config_whose_aliases_expand_to_millions_of_values(tmp_path, capsys):
    """90 lines of YAML whose aliases nest 9 lists of 9 to 9 levels: ~390 million values once expanded (the
    "billion laughs"). `config show` on it ran past 30 s (validating and dumping the expansion); it is refused at
    once. A file with a few ordinary aliases still loads."""
    import time

    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    (tmp_path / "bomb.yaml").write_text("\n".join([*lines, "model: {name: small_cnn, args: {x: *l8}}"]) + "\n")
    t0 = time.perf_counter()
    fails_cleanly(
        capsys, ["config", "show", "-c", str(tmp_path / "bomb.yaml")], "bomb.yaml", "holds over 100,000 values"
    )
    assert time.perf_counter() - t0 < 5  # measured 0.01 s
    (tmp_path / "ok.yaml").write_text("run: {epochs: &n 4}\nsched: {warmup_epochs: *n}\n")
    assert cli.main(["config", "show", "-c", str(tmp_path / "ok.yaml")]) == 0
    assert "warmup_epochs: 4.0" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["5", "[5]", "[base.yaml, null]", "{a: 1}", "''"])
def test_extends_that_is_not_file_names(tmp_path, capsys, value):
    (tmp_path / "base.yaml").write_text("run: {epochs: 2}\n")
    (tmp_path / "c.yaml").write_text(f"extends: {value}\n")
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / "c.yaml")], "c.yaml", "`extends` must be a file name")


def test_a_latin1_config_names_the_line_and_the_byte(tmp_path, capsys):
    (tmp_path / "c.yaml").write_bytes("# settings\nrun:\n  name: caf\u00e9\n".encode("latin-1"))  # é: byte 0xe9
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / "c.yaml")], "c.yaml: line 3", "0xe9", "UTF-8")


@pytest.mark.parametrize(
    "name,text,where",
    [
        (
            "c.yaml",
            "optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.2\n",
            "line 4: key 'lr' is written twice in one mapping (first on line 2)",
        ),
        ("c.yaml", "run: {epochs: 1}\nrun: {epochs: 2}\n", "line 2: key 'run' is written twice"),
        ("c.json", '{"optim": {"lr": 0.1, "lr": 0.2}}', "key 'lr' is written twice"),
        ("c.toml", "[optim]\nlr = 0.1\nlr = 0.2\n", "TOML syntax error"),  # tomllib refuses it itself
    ],
)
def test_a_key_written_twice_is_refused(tmp_path, capsys, name, text, where):
    (tmp_path / name).write_text(text)
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / name)], name, where)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path, capsys):
    """`<<: *base` then the same key is what a merge key is for, not a duplicate."""
    (tmp_path / "c.yaml").write_text("model:\n  args: &w {width: 4}\nema:\n  <<: {decay: 0.5}\n  decay: 0.9\n")
    assert cli.main(["config", "show", "-c", str(tmp_path / "c.yaml")]) == 0
    assert "decay: 0.9" in capsys.readouterr().out


# ---------------------------------------------------------------- metrics.jsonl


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("damaged") / "run"
    assert cli.main(["train", *FAST, f"run.dir={run}", "log.every_steps=5"]) == 0
    return run


def copy_run(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


def test_a_cut_off_last_metrics_line_is_skipped_with_a_note(trained_run, tmp_path, capsys):
    run = copy_run(trained_run, tmp_path)
    rows = (run / "metrics.jsonl").read_bytes()
    assert rows.endswith(b"\n")
    (run / "metrics.jsonl").write_bytes(rows + b'{"kind": "train", "step": 99, "train/lo')  # a run killed mid-write
    n = rows.count(b"\n") + 1
    assert cli.main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"note: {run / 'metrics.jsonl'}: line {n} is cut off" in err and "Traceback" not in err
    assert f"line {n} is cut off" in (run / "report" / "report.html").read_text()


@pytest.mark.parametrize("junk", [b"\xff\xfe\x00binary\x9c", b'{"kind": "train", "st', b"[1, 2]", b"null"])
def test_junk_inside_metrics_jsonl_names_the_file_and_line(trained_run, tmp_path, capsys, junk):
    run = copy_run(trained_run, tmp_path)
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    lines.insert(2, junk)  # a complete line (a newline follows it) that is not a row: damage, not a cut-off write
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    fails_cleanly(capsys, ["report", str(run)], f"{run / 'metrics.jsonl'}: line 3", "damaged")


@pytest.mark.parametrize("name", ["summary.json", "env.json"])
def test_a_damaged_summary_or_env_is_named(trained_run, tmp_path, capsys, name):
    run = copy_run(trained_run, tmp_path)
    (run / name).write_bytes(b'{"best_metric": 0.9, \xff')
    fails_cleanly(capsys, ["report", str(run)], f"{run / name} is damaged")


def test_report_reads_a_summary_with_odd_types(trained_run, tmp_path, capsys):
    run = copy_run(trained_run, tmp_path)
    (run / "summary.json").write_text(
        json.dumps({"best_metric": "high", "final": [1, 2], "train_images_per_s": "fast"})
    )
    assert cli.main(["report", str(run)]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- CIFAR labels


def write_cifar(root, bad_label: int | None = None, k: int = 10):
    """The python CIFAR-10 layout (as in test_data_datasets.py), 4 images per batch; data_batch_3's sample 2
    gets `bad_label`."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, k, 4).tolist()
        if f == "data_batch_3" and bad_label is not None:
            labels[2] = bad_label
        with open(root / f, "wb") as fh:
            pickle.dump({b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": labels}, fh)
    with open(root / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(k)]}, fh)


@pytest.mark.parametrize("bad", [10, 255, -1])
def test_cifar_labels_out_of_range(tmp_path, capsys, bad):
    write_cifar(tmp_path / "data" / "cifar-10-batches-py", bad_label=bad)  # the run folder beside data.root, not inside
    for argv in (
        ["data", "check", "data.dataset=cifar10", f"data.root={tmp_path / 'data'}"],
        ["train", *FAST, "data.dataset=cifar10", f"data.root={tmp_path / 'data'}", f"run.dir={tmp_path / 'r'}"],
    ):
        fails_cleanly(capsys, argv, "data_batch_3", f"label {bad} (sample 2", "outside 0..9")


def test_cifar_labels_in_range_still_load(tmp_path, capsys):
    write_cifar(tmp_path / "cifar-10-batches-py", bad_label=9)
    assert (
        cli.main(["data", "check", "data.dataset=cifar10", f"data.root={tmp_path}", "--out", str(tmp_path / "chk")])
        == 0
    )


# ---------------------------------------------------------------- run.dir


def test_a_run_dir_name_longer_than_the_filesystem_allows(tmp_path, capsys):
    long = tmp_path / ("a" * 300)  # NAME_MAX is 255 bytes on Linux filesystems
    fails_cleanly(capsys, ["train", *FAST, f"run.dir={long}"], "cannot use the run folder", "File name too long")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- memory backend over its budget


def test_forced_memory_backend_over_the_budget_refuses_before_decoding(tmp_path, capsys):
    # digits decode to 1,797 x 1 x 8 x 8 = 115,008 bytes = 112.3 KiB; the budget 0.0001 GiB = 104.9 KiB
    fails_cleanly(
        capsys,
        ["train", *FAST, "data.backend=memory", "data.memory_budget_gib=0.0001", f"run.dir={tmp_path / 'r'}"],
        "data.backend=memory",
        "about 112.3 KiB",
        "104.9 KiB it may use (data.memory_budget_gib=0.0001)",
        "data.backend=cpu",
    )
    root = make_image_folder(tmp_path / "imgs", per_class=3)  # 12 JPEGs of 24x20 RGB: 17,280 bytes decoded
    fails_cleanly(
        capsys,
        [
            "train",
            *FAST,
            "data.backend=memory",
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.memory_budget_gib=0.00001",
            f"run.dir={tmp_path / 'r2'}",
        ],
        "about 16.9 KiB",
        "data.backend=cpu",
    )


def test_memory_backend_stops_decoding_at_the_budget(tmp_path, capsys):
    """Files whose decoded size is unknown up front (here: mixed sizes, which the memory backend would refuse
    only after decoding them all) are guarded while decoding: it stops as soon as the budget is passed."""
    from PIL import Image

    root = make_image_folder(tmp_path / "imgs", per_class=3)
    Image.new("RGB", (300, 300)).save(root / "train" / "square" / "zz.png")  # sorts last; 270,000 bytes decoded
    line = fails_cleanly(
        capsys,
        [
            "train",
            *FAST,
            "data.backend=memory",
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.train.transforms=[resize: [16, 16]]",
            "data.eval.transforms=[resize: [16, 16]]",
            "data.memory_budget_gib=0.0001",
            f"run.dir={tmp_path / 'r'}",
            "data.cache=off",
        ],  # the files decoded: the cache would resize them to 16x16 first
        "over the 104.9 KiB it may use",
        "data.backend=cpu",
    )
    assert "images" in line and "sizes" not in line


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_memory_backend_budget_holds_the_address_space_limit(tmp_path):
    """A process under `ulimit -v` (RLIMIT_AS, set here in a real child process to what it has mapped after its
    imports + 128 MiB) asks the memory backend to hold 144 MiB of decoded images: refused before decoding, in one
    line naming the limit. The budget was 25% of the machine's RAM alone, so the check passed and decoding died
    with "DefaultCPUAllocator: can't allocate memory" (a MemoryError) and a traceback."""
    import os
    import subprocess
    import sys

    from PIL import Image

    for split in ("train", "val"):  # 48 one-colour 1024x1024 JPEGs: small files, 3 MiB each decoded
        for c in ("a", "b"):
            (tmp_path / "imgs" / split / c).mkdir(parents=True)
            for i in range(12):
                Image.new("RGB", (1024, 1024), (20 * i, 200 if c == "a" else 10, 50)).save(
                    tmp_path / "imgs" / split / c / f"{i}.jpg"
                )
    child = (
        "import resource, sys\n"
        "from torchsprint import cli, data\n"
        "from torchsprint.train import run  # noqa: F401  (mapped before the limit, as a shell's ulimit would)\n"
        "import torchvision.transforms.v2  # noqa: F401\n"
        "mapped = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (mapped + 128 * 2**20, resource.RLIM_INFINITY))\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            child,
            "train",
            *FAST,
            "data.backend=memory",
            "data.cache=off",
            "data.dataset=image_folder",
            f"data.root={tmp_path / 'imgs'}",
            f"run.dir={tmp_path / 'r'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "the decoded dataset would take about 144.0 MiB, over the" in line, line
    assert "this process may still map under its address-space limit" in line and "(ulimit -v)" in line, line


def test_memory_budget_holds_the_cgroup_limit(tmp_path):
    """A real memory cgroup (v2 memory.max or v1 memory.limit_in_bytes; creating one needs root, else skipped) of
    1 GiB, a child process inside it: its memory backend budget is 25% of that 1 GiB, not of the machine's RAM (a
    container's limit is the one its OOM killer enforces)."""
    import os
    import subprocess
    import sys

    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
    group, limit_file = (
        (v2 / f"ts-test-{os.getpid()}", "memory.max")
        if (v2 / "cgroup.controllers").is_file() and "memory" in (v2 / "cgroup.subtree_control").read_text()
        else (v1 / f"ts-test-{os.getpid()}", "memory.limit_in_bytes")
    )
    try:
        group.mkdir()
        (group / limit_file).write_text(str(2**30))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here ({e.strerror}): needs root and a memory controller")
    try:
        code = (
            "import torch\nfrom torchsprint.data.core import memory_budget\n"
            "print(*memory_budget(torch.device('cpu')), sep='|')"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert (
            r.stdout.strip()
            == f"268435456|25% of the 1.0 GiB memory limit of this process's cgroup ({group / limit_file})"
        )
    finally:
        group.rmdir()


# ---------------------------------------------------------------- model file metadata


def damage_metadata(src: Path, dest: Path, key: str) -> Path:
    """A copy of a .safetensors weights file whose metadata entry `key` is cut off mid-JSON (weights intact)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_file(load_file(str(src)), str(dest), metadata=meta | {key: meta[key][: len(meta[key]) // 2]})
    return dest


@pytest.mark.parametrize("key", ["classes", "config"])
def test_model_file_metadata_that_is_not_json_is_one_line_everywhere(trained_run, tmp_path, capsys, key):
    """A .safetensors file whose `classes` or `config` metadata is cut off mid-JSON: predict, export, average and a
    distillation teacher each end in one line naming the file and the key. Each read it with its own json.loads
    and ended in a JSONDecodeError traceback."""
    from PIL import Image

    bad = damage_metadata(trained_run / "best.safetensors", tmp_path / "bad.safetensors", key)
    Image.new("L", (8, 8), 128).save(tmp_path / "x.png")
    where = f"{bad}: its metadata entry '{key}' is not valid JSON"
    fails_cleanly(capsys, ["predict", "-r", str(bad), str(tmp_path / "x.png")], where)
    fails_cleanly(
        capsys,
        ["train", *FAST, f"run.dir={tmp_path / 'student'}", f"distill.teacher.weights={bad}"],
        "distill.teacher: " + where,
    )
    if key == "classes":  # export and average read a run's weights file for its classes (the config is config.yaml)
        fails_cleanly(
            capsys,
            [
                "export",
                "-r",
                str(trained_run),
                "--weights",
                str(bad),
                "--format",
                "safetensors",
                "--out",
                str(tmp_path / "out.safetensors"),
            ],
            where,
        )
        run = copy_run(trained_run, tmp_path)
        damage_metadata(trained_run / "last.safetensors", run / "last.safetensors", key)
        fails_cleanly(
            capsys,
            ["average", str(trained_run), str(run), "-o", str(tmp_path / "avg.safetensors")],
            f"{run / 'last.safetensors'}: its metadata entry 'classes' is not valid JSON",
        )

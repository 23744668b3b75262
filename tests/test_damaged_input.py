"""Damaged or odd input ends in one line and exit code 2 (or a skip that is named), never a traceback:
cut or junk metrics.jsonl, CIFAR labels out of range, an over-long run.dir, the memory backend forced on
data over its budget, configs nested too deeply, with a bad `extends`, not UTF-8, or with a key written
twice. Each case runs the real CLI in-process (the main() the console script calls) on real files."""

from __future__ import annotations

import json
import pickle
import shutil

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
    for name, text in (("deep.yaml", "run: " + "[" * 1200 + "]" * 1200 + "\n"),
                       ("deep.json", '{"run": ' + "[" * 1200 + "]" * 1200 + "}"),
                       ("deep.toml", "x = " + "[" * 1200 + "]" * 1200 + "\n"),
                       ("block.yaml", "".join("  " * i + f"a{i}:\n" for i in range(1200)))):
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
    fails_cleanly(capsys, ["config", "show", "-c", str(tmp_path / "bomb.yaml")], "bomb.yaml", "holds over 100,000 values")
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


@pytest.mark.parametrize("name,text,where", [
    ("c.yaml", "optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.2\n", "line 4: key 'lr' is written twice in one mapping (first on line 2)"),
    ("c.yaml", "run: {epochs: 1}\nrun: {epochs: 2}\n", "line 2: key 'run' is written twice"),
    ("c.json", '{"optim": {"lr": 0.1, "lr": 0.2}}', "key 'lr' is written twice"),
    ("c.toml", "[optim]\nlr = 0.1\nlr = 0.2\n", "TOML syntax error"),  # tomllib refuses it itself
])
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
    (run / "summary.json").write_text(json.dumps({"best_metric": "high", "final": [1, 2], "train_images_per_s": "fast"}))
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
    for argv in (["data", "check", "data.dataset=cifar10", f"data.root={tmp_path / 'data'}"],
                 ["train", *FAST, "data.dataset=cifar10", f"data.root={tmp_path / 'data'}", f"run.dir={tmp_path / 'r'}"]):
        fails_cleanly(capsys, argv, "data_batch_3", f"label {bad} (sample 2", "outside 0..9")


def test_cifar_labels_in_range_still_load(tmp_path, capsys):
    write_cifar(tmp_path / "cifar-10-batches-py", bad_label=9)
    assert cli.main(["data", "check", "data.dataset=cifar10", f"data.root={tmp_path}", "--out", str(tmp_path / "chk")]) == 0


# ---------------------------------------------------------------- run.dir


def test_a_run_dir_name_longer_than_the_filesystem_allows(tmp_path, capsys):
    long = tmp_path / ("a" * 300)  # NAME_MAX is 255 bytes on Linux filesystems
    fails_cleanly(capsys, ["train", *FAST, f"run.dir={long}"], "cannot use the run folder", "File name too long")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- memory backend over its budget


def test_forced_memory_backend_over_the_budget_refuses_before_decoding(tmp_path, capsys):
    # digits decode to 1,797 x 1 x 8 x 8 = 115,008 bytes = 112.3 KiB; the budget 0.0001 GiB = 104.9 KiB
    fails_cleanly(capsys, ["train", *FAST, "data.backend=memory", "data.memory_budget_gib=0.0001", f"run.dir={tmp_path / 'r'}"],
                  "data.backend=memory", "about 112.3 KiB", "104.9 KiB it may use (data.memory_budget_gib=0.0001)",
                  "data.backend=cpu")
    root = make_image_folder(tmp_path / "imgs", per_class=3)  # 12 JPEGs of 24x20 RGB: 17,280 bytes decoded
    fails_cleanly(capsys, ["train", *FAST, "data.backend=memory", "data.dataset=image_folder", f"data.root={root}",
                           "data.memory_budget_gib=0.00001", f"run.dir={tmp_path / 'r2'}"], "about 16.9 KiB", "data.backend=cpu")


def test_memory_backend_stops_decoding_at_the_budget(tmp_path, capsys):
    """Files whose decoded size is unknown up front (here: mixed sizes, which the memory backend would refuse
    only after decoding them all) are guarded while decoding: it stops as soon as the budget is passed."""
    from PIL import Image

    root = make_image_folder(tmp_path / "imgs", per_class=3)
    Image.new("RGB", (300, 300)).save(root / "train" / "square" / "zz.png")  # sorts last; 270,000 bytes decoded
    line = fails_cleanly(capsys, ["train", *FAST, "data.backend=memory", "data.dataset=image_folder", f"data.root={root}",
                                  "data.train.transforms=[resize: [16, 16]]", "data.eval.transforms=[resize: [16, 16]]",
                                  "data.memory_budget_gib=0.0001", f"run.dir={tmp_path / 'r'}"],
                         "over the 104.9 KiB it may use", "data.backend=cpu")
    assert "images" in line and "sizes" not in line

"""The CLI as a user runs it: exit codes, messages without tracebacks. Runs that train, and one or two refusals,
start a real `python -m torchsprint`; the other refusals and listings call cli.main in this process (same code path
after the imports, without their ~3 s each)."""

import json
import subprocess
import sys
import time

import pytest


def test_help_is_fast_and_lists_commands(run_cli):
    t = time.perf_counter()
    r = run_cli("--help")
    elapsed = time.perf_counter() - t
    assert r.returncode == 0
    for cmd in ("train", "eval", "export", "predict", "data", "bench", "config", "list"):
        assert cmd in r.stdout
    # --help never imports torch (a start-up regression would show up here as seconds, not ms)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torchsprint.cli as c\n"
            "try:\n c.main(['--help'])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules, 'torchsprint.commands.serve' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    # nor the server's module (its flags live in commands/args.py; importing it cost --help 17 ms, a third more)
    assert probe.stdout.strip().endswith("False False")
    assert elapsed < 5  # generous bound for a loaded CI machine; measured ~0.1 s


@pytest.mark.parametrize("cmd", ["train", "eval", "config show", "list", "export", "predict", "data check", "bench"])
def test_every_command_has_help(run_cli, cmd):
    r = run_cli(*cmd.split(), "--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "--debug" in r.stdout


def test_config_show_and_schema(cli_in_process, tmp_path):
    (tmp_path / "r.toml").write_text("[optim]\nlr = 0.3\n")
    r = cli_in_process("config", "show", "-c", "r.toml", "run.epochs=2")
    assert r.returncode == 0, r.stderr
    assert "lr: 0.3" in r.stdout and "epochs: 2" in r.stdout
    r = cli_in_process("config", "schema")
    assert r.returncode == 0 and "properties" in json.loads(r.stdout)


def test_list_models(cli_in_process):
    r = cli_in_process("list", "models")
    names = r.stdout.split()
    assert {"small_cnn", "cifar_resnet18", "resnet18", "mobilenet_v3_small", "efficientnet_b0"} <= set(names)


def test_train_then_eval_reproduces_metrics(run_cli, cli_in_process, tmp_path):
    """Trained by a real process; evaluated in this one (its own process adds nothing to what eval computes)."""
    r = run_cli("train", "run.epochs=2", "run.dir=run", "log.tensorboard=false", "model.args={width: 8}")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    r = cli_in_process("eval", "-r", "run", "--weights", "best", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["top1"] == pytest.approx(summary["best_metric"], abs=1e-9)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_user_module_registers_a_model(run_cli, tmp_path):
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\nfrom torchsprint.models import MODELS\n\n"
        "@MODELS.register('my_mlp')\ndef my_mlp(num_classes, in_channels=3):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels "
        "* 64, 32), nn.ReLU(), nn.Linear(32, num_classes))\n"
    )
    r = run_cli(
        "train", "--import", "my_models", "model.name=my_mlp", "run.epochs=1", "run.dir=run", "log.tensorboard=false"
    )
    assert r.returncode == 0, r.stderr
    assert "model my_mlp" in r.stdout
    (tmp_path / "cfg.yaml").write_text("imports: [my_models]\nmodel: {name: my_mlp}\nrun: {epochs: 1, dir: run2}\n")
    assert run_cli("train", "-c", "cfg.yaml", "log.tensorboard=false").returncode == 0


BAD_INPUT = [
    (["train", "-c", "missing.yaml"], "config file not found"),
    (["train", "optim.lrr=0.1"], "Did you mean: optim.lr"),
    (["train", "optim.lr=-1"], "optim.lr"),
    (["train", "run.epochs=abc"], "run.epochs"),
    (["train", "model.name=resnet19"], "Did you mean: resnet18"),
    (["train", "optim.name=sgdd"], "Did you mean: sgd"),
    (["train", "sched.name=cosin"], "Did you mean: cosine"),
    (["train", "loss.name=crossentropy"], "Did you mean: cross_entropy"),
    (["train", "data.dataset=digit"], "Did you mean: digits"),
    (["train", "data.dataset=image_folder", "data.root=nowhere"], "does not exist"),
    (["train", "data.dataset=image_folder", "data.root=empty"], "no class subfolders"),
    (["train", "--import", "no_such_module_xyz"], "cannot import"),
    (["eval", "-r", "nowhere"], "not a torchsprint run folder"),
    (["config", "show", "-c", "bad.yaml"], "line 2"),
    (["config", "show", "-c", "cycle.yaml"], "cycle"),
]


def check_bad_input(run, tmp_path, args, fragment):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.yaml").write_text("run:\n  epochs: 3: 4\n")
    (tmp_path / "cycle.yaml").write_text("extends: cycle.yaml\n")
    r = run(*args, "log.tensorboard=false", "run.dir=run") if args[0] == "train" else run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert fragment in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,fragment", BAD_INPUT)
def test_bad_input_exits_2_without_traceback(cli_in_process, tmp_path, args, fragment):
    """Every refusal, through cli.main in this process (a subprocess each cost ~3-7 s of imports)."""
    check_bad_input(cli_in_process, tmp_path, args, fragment)


@pytest.mark.parametrize("args,fragment", [BAD_INPUT[1], BAD_INPUT[4]])
def test_bad_input_exits_2_without_traceback_in_a_real_process(run_cli, tmp_path, args, fragment):
    """The real `python -m torchsprint` process exits 2 without a traceback: a refusal from the config
    (before torch is imported) and one from a registry (after)."""
    check_bad_input(run_cli, tmp_path, args, fragment)


def test_debug_shows_traceback(cli_in_process):
    r = cli_in_process("--debug", "train", "optim.lrr=1")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_image_folder_without_images(cli_in_process, tmp_path):
    (tmp_path / "imgs" / "train" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "train" / "a" / "readme.txt").write_text("not an image")
    r = cli_in_process("train", "data.dataset=image_folder", "data.root=imgs", "run.dir=run", "log.tensorboard=false")
    assert r.returncode == 2 and "no images" in r.stderr


def test_an_unknown_name_points_at_a_command_that_lists_the_names(cli_in_process):
    """Every registry's "unknown name" message either names a `torchsprint list FAMILY` that exists and prints that
    registry's names, or names them all itself (the message once said `torchsprint list losss`, and
    `list decoders` / `list exporters`, which do not exist)."""
    import re

    from torchsprint.commands.args import FAMILIES
    from torchsprint.commands.export import EXPORTERS
    from torchsprint.data import DATASETS, LOADERS
    from torchsprint.data.preprocess.batch_ops import BATCH_OPS
    from torchsprint.data.preprocess.decode import DECODERS
    from torchsprint.data.preprocess.transforms import TRANSFORMS
    from torchsprint.errors import UsageError
    from torchsprint.models import MODELS
    from torchsprint.optim import LOSSES, OPTIMIZERS, SCHEDULERS
    from torchsprint.tasks.core import TASKS

    for reg in (
        MODELS,
        OPTIMIZERS,
        SCHEDULERS,
        LOSSES,
        DATASETS,
        LOADERS,
        TRANSFORMS,
        TASKS,
        EXPORTERS,
        BATCH_OPS,
        DECODERS,
    ):
        with pytest.raises(UsageError) as e:
            reg.get("zz_no_such_name")
        msg = str(e.value)
        assert msg.startswith(f"unknown {reg.family} 'zz_no_such_name'."), msg
        m = re.search(r"Run `torchsprint list (\w+)`", msg)
        if m:
            assert m.group(1) in FAMILIES, msg
            r = cli_in_process("list", m.group(1))
            assert r.returncode == 0 and r.stdout.split() == reg.names(), (msg, r.stdout[:200])
        else:
            assert all(name in msg for name in reg.names()), msg

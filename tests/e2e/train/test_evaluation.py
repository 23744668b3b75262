"""evaluation.evaluate_run: its refusal when the weights asked for do not exist (it says why and names the weights the
run has; it used to tell a user who asked for --weights last to use --weights last), and its figures against the run's
own."""

from __future__ import annotations

import pytest

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.train.evaluation import evaluate_run
from torchsprint.train.run import train


def test_missing_weights_say_why_and_name_the_weights_the_run_has(tmp_path):
    run_dir = tmp_path / "paused"
    # Paused after 3 steps with an evaluation every 2: best.safetensors exists, last.safetensors does not yet.
    train(
        config.load(
            None,
            [
                "model.args={width: 4}",
                "log.tensorboard=false",
                "log.progress=false",
                "eval.every_steps=2",
                "run.stop_after_steps=3",
                f"run.dir={run_dir}",
            ],
        ),
        quiet=True,
    )
    assert (run_dir / "best.safetensors").is_file() and not (run_dir / "last.safetensors").exists()
    with pytest.raises(UsageError) as e:
        evaluate_run(run_dir, weights="last")
    msg = str(e.value)
    assert "the run has not finished" in msg and "--resume" in msg
    assert msg.endswith("Weights this run has: --weights best.")
    with pytest.raises(UsageError, match="did not train with swa.enabled=true. Weights this run has: --weights best."):
        evaluate_run(run_dir, weights="swa")
    assert evaluate_run(run_dir, weights="best")["step"] == 2  # the weights it names are there and evaluate


@pytest.mark.parametrize("channels_last", ["auto", "false", "fp64"])
def test_eval_gives_the_runs_own_validation_figures_to_the_last_digit(tmp_path, channels_last):
    """`torchsprint eval` on the last weights computes what the run's own last validation computed: every figure
    equal, not close. It builds the model and batches in the run's memory formats (under speed.channels_last=auto
    the model is NHWC): NCHW throughout gave a val/loss 3.3e-9 off the run's on digits. A precision=fp64 run (case
    "fp64") is evaluated in float64: its float64 weights loaded into fp32 parameters gave a val/loss 1e-8 off."""
    run_dir = tmp_path / "run"
    fmt = ["precision=fp64"] if channels_last == "fp64" else [f"speed.channels_last={channels_last}"]
    s = train(
        config.load(None, ["run.epochs=2", *fmt, "log.tensorboard=false", "log.progress=false", f"run.dir={run_dir}"]),
        quiet=True,
    )
    if channels_last == "fp64":
        from safetensors.torch import load_file

        weights = load_file(str(run_dir / "last.safetensors"))
        assert {str(v.dtype) for v in weights.values() if v.is_floating_point()} == {"torch.float64"}
    e = evaluate_run(run_dir, weights="last")
    shared = {k.removeprefix("val/"): v for k, v in s["final"].items() if k.startswith("val/") and k[4:] in e}
    assert {"loss", "top1", "top5", "balanced_acc"} <= set(shared), shared
    assert {k: e[k] for k in shared} == shared

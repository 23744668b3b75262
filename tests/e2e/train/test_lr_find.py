"""`torchsprint lr-find`: the range test's curve against a plain PyTorch loop, its suggestion trains, the run
folder stays untouched, the plot is a real image, bad ranges exit 2 with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchsprint import cli, config, runtime
from torchsprint.commands.lr_find import lr_find
from torchsprint.train.build import build_training
from torchsprint.train.run import train

# digits on the memory backend, no weight decay (the reference optimizer below is a bare torch.optim.SGD).
BASE = ["run.device=cpu", "data.backend=memory", "optim.weight_decay=0", "model.args.width=8"]
STEPS, START, END = 40, 1e-4, 10.0  # 40 steps cross an epoch of digits (22 batches of 64): the sweep goes on


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("lrf")
    cfg = config.load(None, BASE + [f"run.dir={out / 'run'}"])
    return lr_find(cfg, steps=STEPS, start=START, end=END, out=out / "out", log=lambda *_: None), cfg, out


def test_curve_equals_plain_torch_loop(found):
    """The raw losses equal a plain loop (bare SGD, F.cross_entropy, lr set by hand from np.geomspace) on the
    same batches, and the smoothed curve equals an independently computed debiased EMA."""
    result, cfg, _ = found
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    b = build_training(cfg, rt, log=lambda *_: None)  # the same seed: the same initial weights and batches
    model = b.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=START, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
    lrs = np.geomspace(START, END, STEPS)
    ref, epoch = [], 0
    while len(ref) < len(result["losses"]):
        b.loaders.train.set_epoch(epoch)
        for images, targets in b.loaders.train:
            if len(ref) == len(result["losses"]):
                break
            for g in opt.param_groups:
                g["lr"] = float(lrs[len(ref)])
            loss = F.cross_entropy(model(images), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref.append(loss.item())
        epoch += 1
    runtime.teardown(rt)
    assert len(result["losses"]) > 22  # it went past the first epoch
    np.testing.assert_allclose(result["lrs"], lrs[: len(ref)], rtol=1e-12)
    # Measured: identical (0.0) on CPU; 1e-5 relative leaves room for kernel-order rounding only.
    np.testing.assert_allclose(result["losses"], ref, rtol=1e-5, atol=0)
    x = np.array(result["losses"])
    w = 0.98 ** np.arange(len(x))  # step t's smoothed loss: sum_i beta^(t-i) x_i / sum_i beta^(t-i)
    smoothed = [float((x[: t + 1] * w[: t + 1][::-1]).sum() / w[: t + 1].sum()) for t in range(len(x))]
    np.testing.assert_allclose(result["smoothed"], smoothed, rtol=1e-12)


def test_suggestion_is_sane_and_trains(found, tmp_path):
    result, _, out = found
    lr = result["suggestion"]
    assert 1e-3 <= lr <= 0.5, lr  # SGD on digits: the loss falls from ~1e-2 and diverges above ~1
    assert "valley" in result["rule"]
    # Training with the suggestion converges (3 epochs of digits): a bad pick (the loss minimum's neighbourhood or
    # the flat start) does not reach this.
    summary = train(
        config.load(None, BASE + [f"optim.lr={lr}", "run.epochs=3", f"run.dir={tmp_path / 'run'}"]), quiet=True
    )
    assert summary["final"]["val/top1"] >= 0.9, summary["final"]
    assert not (out / "run").exists()  # the module fixture's run.dir was never created


def test_cli_leaves_run_folder_and_writes_png(tmp_path, capsys, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)

    run_dir = tmp_path / "existing_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {name: x}\n")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    code = cli.main(["lr-find", "--steps", "12", "--json", *BASE, f"run.dir={run_dir}"])
    r = capsys.readouterr()
    assert code == 0, r.err
    res = json.loads(r.out.strip().splitlines()[-1])
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # nothing added, nothing changed
    assert not (tmp_path / "runs").exists()
    png = res["files"]["plot"]
    assert not png.startswith(str(run_dir))  # a temp folder when --out is not given
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        a = np.asarray(im.convert("L"))
    assert a.shape[0] >= 200 and a.shape[1] >= 300 and a.std() > 5  # a drawn figure, not a blank image
    assert json.loads(open(res["files"]["json"]).read())["suggestion"] == res["suggestion"]


@pytest.mark.parametrize(
    "args,says",
    [
        # --steps and --start are checked while the command line is parsed (commands/args.py), as every
        # command's flags are
        (["--steps", "0"], "argument --steps: must be >= 10"),
        (["--start", "1", "--end", "0.1"], "is not below --end"),
        (["--start", "0.1", "--end", "0.1"], "is not below --end"),
        (["--start", "-1"], "argument --start: must be a finite number > 0"),
        (["strategy.name=ddp"], "add strategy.name=single"),
    ],
)
def test_bad_range_exits_2_one_line(cli_in_process, args, says):
    r = cli_in_process("lr-find", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr

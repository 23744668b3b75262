"""Precision modes on CPU: bf16 autocast, half weights with fp32 masters, non-finite skip/stop, checkpoint state."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchsprint import config
from torchsprint.cli import main as cli_main
from torchsprint.engine import train_step
from torchsprint.errors import UsageError
from torchsprint.precision import HalfModel, Precision
from torchsprint.run import train

CPU = torch.device("cpu")


def test_apex_levels_are_aliases():
    for alias, mode in {"O0": "fp32", "O1": "amp_fp16", "O2": "fp16"}.items():
        assert config.load(None, [f"precision={alias}"]).precision.mode == mode


@pytest.mark.parametrize("mode", ["amp_fp16", "fp16"])
def test_fp16_on_cpu_is_refused_with_what_to_use(mode, capsys, tmp_path):
    with pytest.raises(UsageError, match="amp_bf16"):
        Precision(mode, CPU)
    assert cli_main(["train", f"precision={mode}", "run.device=cpu", "run.max_steps=1", f"run.dir={tmp_path}"]) == 2
    assert "on CPU use precision=amp_bf16" in capsys.readouterr().err


def test_amp_bf16_autocasts_on_cpu_and_fp32_is_a_null_context():
    layer = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with Precision("amp_bf16", CPU).autocast():
        assert layer(x).dtype == torch.bfloat16
    with Precision("fp32", CPU).autocast():
        assert layer(x).dtype == torch.float32
    assert not Precision("amp_bf16", CPU).scaler.is_enabled()  # bf16 needs no loss scaling


def test_amp_bf16_trains_the_default_digits_run_to_98_percent(tmp_path):
    """The same threshold as the fp32 default run (tests/test_smoke.py)."""
    cfg = config.load(None, [f"run.dir={tmp_path}", "precision=amp_bf16", "log.tensorboard=false",
                             "checkpoint.every_epochs=null"])
    summary = train(cfg, quiet=True)
    assert summary["final"]["val/top1"] >= 0.98
    assert summary["skipped_steps"] == 0


def half_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_bf16_half_weights_keep_batchnorm_and_masters_in_fp32():
    prec = Precision("bf16", CPU)
    model = prec.prepare(half_net())
    assert isinstance(model, HalfModel)
    net = model.module
    assert net[0].weight.dtype == net[4].weight.dtype == torch.bfloat16
    assert net[1].weight.dtype == net[1].running_var.dtype == torch.float32  # apex O2: BatchNorm in fp32
    assert [m.dtype for _, m in prec.masters] == [torch.float32] * 3  # conv weight, linear weight and bias
    out = model(torch.randn(2, 1, 8, 8))  # fp32 input is cast in, fp32 logits come out
    assert out.dtype == torch.float32


def test_bf16_master_weights_accumulate_updates_below_bf16_resolution():
    """10 SGD steps of 1e-4 each on a weight of 1.0: bf16 cannot represent 1 - 1e-4 (its spacing near
    1 is 2^-7), so without fp32 masters the weight would never move."""
    prec = Precision("bf16", CPU)
    lin = nn.Linear(4, 1, bias=False)
    nn.init.ones_(lin.weight)
    model = prec.prepare(lin)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.ones(8, 4)
    for _ in range(10):
        train_step(model, [(x, torch.zeros(8))], lambda out, y: out.mean(), opt, prec)  # d loss / d w = 1
    master = prec.masters[0][1]
    assert master.dtype == torch.float32
    assert torch.allclose(master, torch.full_like(master, 1 - 10 * 1e-4), atol=1e-7)
    assert torch.equal(lin.weight, master.to(torch.bfloat16))  # the model runs on the rounded master
    pure = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(10):
        pure -= 1e-4  # what an optimizer working on the bf16 weights themselves would do
    assert torch.equal(pure, torch.ones(4, dtype=torch.bfloat16))


def fp32_reference_steps(batches, lr=0.1):
    """A plain PyTorch loop over `batches` (the independent reference for the skip tests)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("mode", ["fp32", "amp_bf16"])
def test_nonfinite_step_is_skipped_and_counted(mode):
    g = torch.Generator().manual_seed(1)
    good = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    bad = (torch.full((8, 4), float("nan")), torch.zeros(8, dtype=torch.long))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prec = Precision(mode, CPU, on_nonfinite="skip")
    for batch in [good[0], bad, good[1], good[2]]:
        train_step(model, [batch], nn.CrossEntropyLoss(), opt, prec)
    assert prec.pop_nonfinite(step=4) == 1
    assert prec.pop_nonfinite(step=4) == 0  # counters reset after each read
    ref = fp32_reference_steps(good)  # the same run without the bad batch
    tol = 1e-6 if mode == "fp32" else 2e-2
    assert torch.allclose(model.weight, ref.weight, atol=tol) and torch.isfinite(model.weight).all()


def test_nonfinite_loss_stops_at_the_next_check_under_stop():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = Precision("fp32", CPU, on_nonfinite="stop")
    loss = train_step(model, [(torch.full((2, 4), float("inf")), torch.zeros(2, dtype=torch.long))], nn.CrossEntropyLoss(),
                      opt, prec)
    # The engine judges the losses (free at its log-step mean) and hands the verdict to Precision.
    with pytest.raises(FloatingPointError, match="on_nonfinite=stop"):
        prec.pop_nonfinite(step=1, loss_finite=bool(torch.isfinite(loss)))


def test_bf16_skip_leaves_masters_untouched():
    prec = Precision("bf16", CPU, on_nonfinite="skip")
    model = prec.prepare(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, [(torch.randn(8, 4), torch.randint(0, 3, (8,)))], nn.CrossEntropyLoss(), opt, prec)
    before = [m.clone() for _, m in prec.masters]
    momentum = [opt.state[m]["momentum_buffer"].clone() for _, m in prec.masters]  # the optimizer steps the masters
    halves = [p.detach().clone() for p, _ in prec.masters]
    train_step(model, [(torch.full((8, 4), float("nan")), torch.zeros(8, dtype=torch.long))], nn.CrossEntropyLoss(), opt, prec)
    assert prec.pop_nonfinite(step=2) == 1
    assert all(torch.equal(a, m) for a, (_, m) in zip(before, prec.masters))
    assert all(torch.equal(a, p) for a, (p, _) in zip(halves, prec.masters))
    assert all(torch.equal(a, opt.state[m]["momentum_buffer"]) for a, (_, m) in zip(momentum, prec.masters))
    assert all(opt.state[m]["momentum_buffer"].dtype == torch.float32 for _, m in prec.masters)


def test_half_weight_state_round_trips_through_a_checkpoint():
    """Masters and fp32 optimizer state survive save -> torch.load(weights_only) -> load into a fresh run."""
    def build():
        prec = Precision("bf16", CPU)
        torch.manual_seed(0)
        model = prec.prepare(nn.Linear(4, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        prec.attach(opt)
        return prec, model, opt

    prec, model, opt = build()
    for _ in range(3):
        train_step(model, [(torch.randn(8, 4), torch.randint(0, 3, (8,)))], nn.CrossEntropyLoss(), opt, prec)
    import io

    buf = io.BytesIO()
    torch.save({"scaler": prec.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    prec2, model2, opt2 = build()
    opt2.load_state_dict(ckpt["optimizer"])  # as checkpoint.restore does, before the scaler state
    prec2.load_state_dict(ckpt["scaler"])
    for (_, m1), (p2, m2) in zip(prec.masters, prec2.masters):
        assert torch.equal(m1, m2) and torch.equal(p2, m1.to(torch.bfloat16))
    for (_, m1), (_, m2) in zip(prec.masters, prec2.masters):
        b1, b2 = opt.state[m1]["momentum_buffer"], opt2.state[m2]["momentum_buffer"]
        assert b2.dtype == torch.float32 and torch.equal(b1, b2)  # not rounded through bf16


def test_diverging_run_counts_skipped_steps_or_stops(tmp_path):
    """optim.lr=1e30 blows the weights up after one step; every later step has NaN gradients."""
    base = ["optim.lr=1e30", "run.max_steps=6", "log.every_steps=2", "log.tensorboard=false", "model.args.width=8",
            "checkpoint.every_epochs=null", "eval.per_class=false"]
    summary = train(config.load(None, [*base, "precision.on_nonfinite=skip", f"run.dir={tmp_path / 'skip'}"]), quiet=True)
    assert summary["skipped_steps"] >= 4
    logged = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/skipped_steps"] for x in logged if x["kind"] == "train"][-1] == summary["skipped_steps"]
    with pytest.raises(FloatingPointError, match="on_nonfinite=stop"):
        train(config.load(None, [*base, "precision.on_nonfinite=stop", f"run.dir={tmp_path / 'stop'}"]), quiet=True)


@pytest.mark.gpu
def test_amp_fp16_scaler_skips_overflow_and_its_state_is_checkpointed():
    dev = torch.device("cuda")
    prec = Precision("amp_fp16", dev, on_nonfinite="skip")
    model = nn.Linear(4, 3).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, [(torch.randn(8, 4, device=dev), torch.randint(0, 3, (8,), device=dev))], nn.CrossEntropyLoss(), opt, prec)
    w = model.weight.detach().clone()
    train_step(model, [(torch.full((8, 4), float("inf"), device=dev), torch.zeros(8, dtype=torch.long, device=dev))],
               nn.CrossEntropyLoss(), opt, prec)
    assert torch.equal(w, model.weight) and prec.pop_nonfinite(step=2) == 1
    state = prec.state_dict()
    prec2 = Precision("amp_fp16", dev)
    prec2.load_state_dict(state)
    assert prec2.scaler.get_scale() == prec.scaler.get_scale() < 65536.0  # backed off once


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["amp_fp16", "amp_bf16", "fp16", "bf16"])
def test_gpu_precisions_train_the_default_run(tmp_path, mode):
    summary = train(config.load(None, [f"run.dir={tmp_path}", f"precision={mode}", "log.tensorboard=false"]), quiet=True)
    assert summary["final"]["val/top1"] >= 0.98


def test_bf16_run_paused_and_resumed_equals_uninterrupted(tmp_path):
    """fp32 masters, fp32 optimizer state and the step position go through a real checkpoint:
    a bf16 run paused after 3 steps and resumed ends bit-identical to one that never stopped."""
    from safetensors.torch import load_file

    base = ["precision=bf16", "model.args.width=8", "run.max_steps=6", "log.tensorboard=false", "eval.per_class=false",
            "optim.clip_grad_norm=1.0", "checkpoint.every_epochs=null"]
    train(config.load(None, [*base, f"run.dir={tmp_path / 'full'}"]), quiet=True)
    part = [*base, f"run.dir={tmp_path / 'part'}"]
    assert train(config.load(None, [*part, "run.stop_after_steps=3"]), quiet=True)["paused"]
    train(config.load(None, [*part, "checkpoint.resume=auto"]), quiet=True)
    full, resumed = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("full", "part"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


# ---------------------------------------------------------------- sync-free skip (masked_step)


def _optim_cases():
    cases = [("sgd-for_loop", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=False)),
             ("sgd-foreach", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)),
             ("sgd-no-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1)),
             ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
             ("adam-fused", lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)),
             ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5))]
    return cases


@pytest.mark.parametrize("name,make", _optim_cases(), ids=[c[0] for c in _optim_cases()])
def test_masked_step_skips_bit_exactly_and_steps_like_opt_step(name, make):
    """Reference: the same optimizer stepped plainly (opt.step) or not at all. A skipped step with NaN
    gradients leaves parameters and state bit-identical; an unskipped one equals opt.step() bit for bit;
    a skipped first step creates no state (as GradScaler's skip would)."""
    import copy

    from torchsprint.precision import masked_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    opt = make(model.parameters())
    memo = {}
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))

    def grads(m, poison=False):
        m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
        if poison:
            next(m.parameters()).grad[0, 0] = float("nan")

    grads(model, poison=True)
    masked_step(opt, torch.tensor(True), memo)  # first step, skipped
    assert all(not s for s in opt.state.values()) and "stepped" not in memo
    for _ in range(2):  # real steps: the first creates state (host path), the second runs masked
        grads(model)
        masked_step(opt, torch.tensor(False), memo)
    before_p = [p.detach().clone() for p in model.parameters()]
    before_s = copy.deepcopy(opt.state_dict())
    grads(model, poison=True)
    masked_step(opt, torch.tensor(True), memo)
    assert all(torch.equal(a, b) for a, b in zip(before_p, model.parameters()))
    after_s = opt.state_dict()["state"]
    for k, st in before_s["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after_s[k][key])), (k, key)
    ref_model = copy.deepcopy(model)
    ref_opt = make(ref_model.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict keeps the same tensors otherwise
    grads(model)
    grads(ref_model)
    masked_step(opt, torch.tensor(False), memo)
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))


def test_skip_mode_step_does_not_change_weights_on_nonfinite_gradients():
    prec = Precision("fp32", CPU, on_nonfinite="skip")
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    for _ in range(2):
        train_step(model, batch, nn.CrossEntropyLoss(), opt, prec)
    w, buf = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()
    train_step(model, [(torch.full((8, 4), float("inf")), torch.zeros(8, dtype=torch.long))], nn.CrossEntropyLoss(), opt, prec)
    assert torch.equal(w, model.weight) and torch.equal(buf, opt.state[model.weight]["momentum_buffer"])
    assert prec.pop_nonfinite(step=3) == 1

"""Precision modes on CPU: bf16 autocast, half weights with fp32 masters, non-finite skip/stop, checkpoint state."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torchsprint import config
from torchsprint.cli import main as cli_main
from torchsprint.errors import UsageError
from torchsprint.state.precision import HalfModel, Precision
from torchsprint.train.context import Trainable
from torchsprint.train.engine import train_step
from torchsprint.train.run import train

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


@pytest.mark.bf16_training
def test_amp_bf16_trains_the_default_digits_run_to_98_percent(tmp_path):
    """The same threshold as the fp32 default run (tests/e2e/train/test_smoke.py)."""
    cfg = config.load(
        None, [f"run.dir={tmp_path}", "precision=amp_bf16", "log.tensorboard=false", "checkpoint.every_epochs=null"]
    )
    summary = train(cfg, quiet=True)
    assert summary["final"]["val/top1"] >= 0.98
    assert summary["skipped_steps"] == 0


def half_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )


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
        train_step(Trainable(model, lambda out, y: out.mean(), opt, prec), [(x, torch.zeros(8))])  # d loss / d w = 1
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
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), [batch])
    assert prec.pop_nonfinite(step=4) == 1
    assert prec.pop_nonfinite(step=4) == 0  # counters reset after each read
    ref = fp32_reference_steps(good)  # the same run without the bad batch
    tol = 1e-6 if mode == "fp32" else 2e-2
    assert torch.allclose(model.weight, ref.weight, atol=tol) and torch.isfinite(model.weight).all()


def test_nonfinite_loss_stops_at_the_next_check_under_stop():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = Precision("fp32", CPU, on_nonfinite="stop")
    loss = train_step(
        Trainable(model, nn.CrossEntropyLoss(), opt, prec),
        [(torch.full((2, 4), float("inf")), torch.zeros(2, dtype=torch.long))],
    )
    # The engine judges the losses (free at its log-step mean) and hands the verdict to Precision.
    with pytest.raises(FloatingPointError, match="on_nonfinite=stop"):
        prec.pop_nonfinite(step=1, loss_finite=bool(torch.isfinite(loss)))


def test_bf16_skip_leaves_masters_untouched():
    prec = Precision("bf16", CPU, on_nonfinite="skip")
    model = prec.prepare(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), [(torch.randn(8, 4), torch.randint(0, 3, (8,)))])
    before = [m.clone() for _, m in prec.masters]
    momentum = [opt.state[m]["momentum_buffer"].clone() for _, m in prec.masters]  # the optimizer steps the masters
    halves = [p.detach().clone() for p, _ in prec.masters]
    train_step(
        Trainable(model, nn.CrossEntropyLoss(), opt, prec),
        [(torch.full((8, 4), float("nan")), torch.zeros(8, dtype=torch.long))],
    )
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
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), [(torch.randn(8, 4), torch.randint(0, 3, (8,)))])
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
    base = [
        "optim.lr=1e30",
        "run.max_steps=6",
        "log.every_steps=2",
        "log.tensorboard=false",
        "model.args.width=8",
        "checkpoint.every_epochs=null",
        "eval.per_class=false",
    ]
    summary = train(
        config.load(None, [*base, "precision.on_nonfinite=skip", f"run.dir={tmp_path / 'skip'}"]), quiet=True
    )
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
    train_step(
        Trainable(model, nn.CrossEntropyLoss(), opt, prec),
        [(torch.randn(8, 4, device=dev), torch.randint(0, 3, (8,), device=dev))],
    )
    w = model.weight.detach().clone()
    train_step(
        Trainable(model, nn.CrossEntropyLoss(), opt, prec),
        [(torch.full((8, 4), float("inf"), device=dev), torch.zeros(8, dtype=torch.long, device=dev))],
    )
    assert torch.equal(w, model.weight) and prec.pop_nonfinite(step=2) == 1
    state = prec.state_dict()
    prec2 = Precision("amp_fp16", dev)
    prec2.load_state_dict(state)
    assert prec2.scaler.get_scale() == prec.scaler.get_scale() < 65536.0  # backed off once


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["amp_fp16", "amp_bf16", "fp16", "bf16"])
def test_gpu_precisions_train_the_default_run(tmp_path, mode):
    summary = train(
        config.load(None, [f"run.dir={tmp_path}", f"precision={mode}", "log.tensorboard=false"]), quiet=True
    )
    assert summary["final"]["val/top1"] >= 0.98


def test_bf16_run_paused_and_resumed_equals_uninterrupted(tmp_path):
    """fp32 masters, fp32 optimizer state and the step position go through a real checkpoint:
    a bf16 run paused after 3 steps and resumed ends bit-identical to one that never stopped."""
    from safetensors.torch import load_file

    base = [
        "precision=bf16",
        "model.args.width=8",
        "run.max_steps=6",
        "log.tensorboard=false",
        "eval.per_class=false",
        "optim.clip_grad_norm=1.0",
        "checkpoint.every_epochs=null",
    ]
    train(config.load(None, [*base, f"run.dir={tmp_path / 'full'}"]), quiet=True)
    part = [*base, f"run.dir={tmp_path / 'part'}"]
    assert train(config.load(None, [*part, "run.stop_after_steps=3"]), quiet=True)["paused"]
    train(config.load(None, [*part, "checkpoint.resume=auto"]), quiet=True)
    full, resumed = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("full", "part"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


# ---------------------------------------------------------------- sync-free skip (masked_step)


def _optim_cases():
    cases = [
        (
            "sgd-for_loop",
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=False),
        ),
        ("sgd-foreach", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)),
        ("sgd-no-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
        ("adam-fused", lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)),
        ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5)),
    ]
    return cases


@pytest.mark.parametrize("name,make", _optim_cases(), ids=[c[0] for c in _optim_cases()])
def test_masked_step_skips_bit_exactly_and_steps_like_opt_step(name, make):
    """Reference: the same optimizer stepped plainly (opt.step) or not at all. A skipped step with NaN
    gradients leaves parameters and state bit-identical; an unskipped one equals opt.step() bit for bit;
    a skipped first step creates no state (as GradScaler's skip would)."""
    import copy

    from torchsprint.state.precision import masked_step

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
        train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), batch)
    w, buf = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()
    train_step(
        Trainable(model, nn.CrossEntropyLoss(), opt, prec),
        [(torch.full((8, 4), float("inf")), torch.zeros(8, dtype=torch.long))],
    )
    assert torch.equal(w, model.weight) and torch.equal(buf, opt.state[model.weight]["momentum_buffer"])
    assert prec.pop_nonfinite(step=3) == 1


# ---------------------------------------------------------------- unit checks (mutation testing, TESTING.md)


def scaled_cpu_precision(on_nonfinite="skip", init_scale=1024.0):
    """amp_fp16's loss-scaled path on the CPU: a real torch.amp.GradScaler('cpu') in a Precision whose
    autocast is bf16 (fp16 modes are refused on CPU). Exercises step/unscale_/pop_nonfinite with a scaler."""
    prec = Precision("amp_bf16", CPU, on_nonfinite=on_nonfinite)
    prec.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    return prec


def test_scaled_step_skips_overflow_backs_off_and_otherwise_equals_plain_sgd():
    g = torch.Generator().manual_seed(2)
    good = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    bad = (torch.full((8, 4), float("inf")), torch.zeros(8, dtype=torch.long))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prec = scaled_cpu_precision()
    for x, y in [good[0], bad, good[1], good[2]]:
        opt.zero_grad(set_to_none=True)
        prec.backward(nn.functional.cross_entropy(model(x), y))
        if y[0] % 2:  # some steps unscale first, as before clipping (step() must not unscale twice); others not
            prec.unscale_(opt)
        prec.step(opt)
    assert prec.scaler.get_scale() == 512.0  # backed off once, from 1024
    assert prec.pop_nonfinite(step=4) == 1 and prec.pop_nonfinite(step=4) == 0
    ref = fp32_reference_steps(good)  # the same steps without the overflowing batch, no scaling
    # measured: bit-identical (scaling by a power of 2 and unscaling is exact)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    # on_nonfinite=stop with a scaler: skipped steps are the scaler finding its scale, not divergence...
    stop = scaled_cpu_precision("stop")
    stop._skipped += 3
    assert stop.pop_nonfinite(step=5) == 3
    # ...but a non-finite loss stops, suggesting bf16 (fp16's range is what overflowed)
    with pytest.raises(FloatingPointError, match=r"\(fp16's range overflows where bf16's does not\)\; "):
        stop.pop_nonfinite(step=6, loss_finite=False)
    assert not scaled_cpu_precision().state_dict()["masters"]


def test_scaler_state_round_trips_and_a_bare_scaler_state_is_accepted():
    a = scaled_cpu_precision(init_scale=256.0)
    b = scaled_cpu_precision(init_scale=8.0)
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 256.0
    c = scaled_cpu_precision(init_scale=8.0)
    c.load_state_dict(a.scaler.state_dict())  # older checkpoints: the GradScaler state alone
    assert c.scaler.get_scale() == 256.0
    c.load_state_dict({})  # nothing saved: unchanged
    assert c.scaler.get_scale() == 256.0
    c.load_state_dict({"scaler": scaled_cpu_precision(init_scale=64.0).scaler.state_dict()})  # no masters key
    assert c.scaler.get_scale() == 64.0
    assert set(a.state_dict()) == {"scaler", "masters"}
    plain = Precision("bf16", CPU)  # no scaler: a scaler state in the checkpoint is ignored
    plain.prepare(nn.Linear(2, 2))
    plain.load_state_dict({"scaler": a.scaler.state_dict(), "masters": [torch.ones(2, 2), torch.ones(2)]})
    assert not plain.scaler.is_enabled() and torch.equal(plain.masters[0][0], torch.ones(2, 2, dtype=torch.bfloat16))
    plain.load_state_dict({"masters": [torch.zeros(2, 2), torch.zeros(2)]})  # masters without a scaler entry
    assert torch.equal(plain.masters[1][1], torch.zeros(2))
    with pytest.raises(UsageError) as e:
        plain.load_state_dict({"masters": [torch.zeros(2, 2)]})
    assert str(e.value) == (
        "checkpoint has 1 fp32 master weights, this run 2: resume with the same model and precision.mode."
    )


def test_diverged_message_names_what_where_and_what_to_try():
    prec = Precision("fp32", CPU, on_nonfinite="stop")
    with pytest.raises(FloatingPointError) as e:
        prec.pop_nonfinite(step=9, loss_finite=False, bad_step=7, lr=0.125)
    assert str(e.value) == (
        "training diverged: the loss became non-finite (inf/NaN) at step 7, with precision=fp32; stopped "
        "(precision.on_nonfinite=stop). Try a lower optim.lr (now 0.125), optim.clip_grad_norm or "
        "sched.warmup_epochs; precision.on_nonfinite=skip skips such steps instead."
    )
    prec._skipped += 1  # non-finite gradients without a loss scaler also stop
    with pytest.raises(FloatingPointError) as e:
        prec.pop_nonfinite(step=9)
    assert "the gradients became non-finite (inf/NaN) by step 9" in str(e.value)
    assert "Try a lower optim.lr, optim.clip_grad_norm" in str(e.value)
    assert Precision("fp32", CPU, on_nonfinite="skip").pop_nonfinite(step=1, loss_finite=False) == 0


def test_check_mode_messages_and_what_each_device_accepts():
    with pytest.raises(UsageError, match="^precision=amp_fp16 needs a CUDA device"):
        Precision("amp_fp16", CPU)
    with pytest.raises(UsageError) as e:
        Precision("fp16", CPU)
    assert str(e.value) == (
        "precision=fp16 needs a CUDA device (CPUs have no fast fp16 math); on CPU use "
        "precision=amp_bf16 (CPU autocast), bf16 or fp32."
    )
    from torchsprint.state.precision import check_mode

    cuda = torch.device("cuda")  # check_mode only reads the device type: no GPU needed
    for mode in ("fp32", "amp_fp16", "fp16"):
        check_mode(mode, cuda)
    for mode in ("fp32", "amp_bf16", "bf16"):
        check_mode(mode, CPU)
    if not torch.cuda.is_available():  # no GPU: no bf16 support reported
        with pytest.raises(
            UsageError,
            match=r"^precision=bf16: this GPU has no bfloat16 support \(needs compute "
            r"capability 8.0\+, Ampere or newer\). Use precision=amp_fp16.$",
        ):
            check_mode("bf16", cuda)
        with pytest.raises(UsageError, match="^precision=amp_bf16: this GPU has no bfloat16 support"):
            check_mode("amp_bf16", cuda)


def test_precision_defaults_and_graph_safe_autocast():
    prec = Precision("amp_bf16", CPU)
    assert prec.on_nonfinite == "skip" and not prec.graph_safe and not prec.scaler.is_enabled()
    assert prec._skipped.dtype == torch.int64 and prec._skipped.device == CPU
    assert prec.autocast().fast_dtype == torch.bfloat16 and prec.autocast()._cache_enabled
    assert not Precision("amp_bf16", CPU, graph_safe=True).autocast()._cache_enabled  # CUDA graph capture
    assert Precision("bf16", CPU).half == torch.bfloat16 and Precision("fp32", CPU).half is None


def test_half_model_casts_only_floating_tensors_in_args_and_kwargs():
    class Probe(nn.Module):
        def forward(self, x, idx, *, scale):
            self.seen = (x.dtype, idx.dtype, scale.dtype)
            return x * scale, idx

    m = HalfModel(Probe(), torch.bfloat16)
    out, idx = m(torch.ones(2), torch.arange(2), scale=torch.full((2,), 2.0))
    assert m.module.seen == (torch.bfloat16, torch.int64, torch.bfloat16)
    assert out.dtype == torch.float32 and idx.dtype == torch.int64


def test_prepare_casts_buffers_and_keeps_frozen_and_nested_batchnorm_out_of_masters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 1)
            self.block = nn.Sequential(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1))  # BN nested with a sibling conv
            self.register_buffer("offset", torch.zeros(2))
            self.conv.bias.requires_grad_(False)

    prec = Precision("bf16", CPU)
    model = prec.prepare(Net()).module
    assert model.offset.dtype == torch.bfloat16 and model.block[1].weight.dtype == torch.bfloat16
    assert model.block[0].weight.dtype == model.block[0].running_mean.dtype == torch.float32
    assert model.conv.bias.dtype == torch.bfloat16  # frozen: cast, but no master (never stepped)
    assert [p for p, _ in prec.masters] == [model.conv.weight, model.block[1].weight, model.block[1].bias]


def test_attach_rekeys_state_loaded_before_it_in_fp32_and_once():
    prec = Precision("bf16", CPU)
    model = prec.prepare(nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    w = model.module.weight
    step = torch.tensor(3.0, dtype=torch.float64)  # kept as it is (device/dtype are the optimizer's business)
    opt.state[w] = {"step": step, "exp_avg": torch.ones(2, 2, dtype=torch.bfloat16), "n": 4, "idx": torch.tensor([1])}
    prec.attach(opt)
    master = prec.masters[0][1]
    assert w not in opt.state and opt.state[master]["exp_avg"].dtype == torch.float32
    assert opt.state[master]["step"] is step and opt.state[master]["n"] == 4
    assert opt.state[master]["idx"].dtype == torch.int64
    groups = [list(g["params"]) for g in opt.param_groups]
    prec.attach(opt)  # a second call changes nothing
    assert [list(g["params"]) for g in opt.param_groups] == groups and groups[0][0] is master
    assert id(opt) in prec._attached


def test_masked_step_on_a_stateless_optimizer_runs_sync_free_after_its_first_step():
    from torchsprint.state.precision import masked_step

    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    memo = {}
    p.grad = torch.ones(3)
    masked_step(opt, torch.tensor(False), memo)  # first step: on the host
    assert memo == {"stepped": True} and torch.equal(p.detach(), torch.full((3,), 0.5))
    masked_step(opt, torch.tensor(True), memo)  # then masked: buffers kept, skip undone on the device
    assert len(memo["saved"]) == 1 and torch.equal(p.detach(), torch.full((3,), 0.5))
    masked_step(opt, torch.tensor(False), memo)
    assert torch.equal(p.detach(), torch.zeros(3))


def test_grad_max_abs_is_the_inf_norm_and_zero_without_gradients():
    from torchsprint.state.precision import grad_max_abs

    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([a, b], lr=1)
    assert float(grad_max_abs(opt)) == 0.0
    a.grad, b.grad = torch.tensor([1.0, -5.0]), torch.tensor([2.0, 3.0, -4.0])
    assert float(grad_max_abs(opt)) == 5.0
    b.grad[0] = float("nan")
    assert not torch.isfinite(grad_max_abs(opt))


def test_bf16_step_after_unscale_keeps_the_gradients_and_unused_parameters_are_fine():
    """unscale_ (before clipping) moves the half gradients to the masters once; step() must not move them
    again (they would be gone). A parameter without a gradient stays without one."""
    results = []
    for unscale_first in (False, True):
        prec = Precision("bf16", CPU)
        torch.manual_seed(0)
        net = nn.ModuleDict({"used": nn.Linear(4, 3), "unused": nn.Linear(4, 3)})
        model = prec.prepare(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(8, 4, dtype=torch.bfloat16)
        prec.backward(net["used"](x).float().square().mean())
        if unscale_first:
            prec.unscale_(opt)
        prec.step(opt)
        results.append([m.clone() for _, m in prec.masters])
        assert all(m.grad is None for _, m in prec.masters)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    torch.manual_seed(0)
    assert not torch.equal(results[0][0], nn.Linear(4, 3).weight.float())  # the used layer moved


def test_masked_step_runs_on_the_device_once_every_parameter_has_state():
    from torchsprint.state.precision import masked_step

    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a, b], lr=0.5, momentum=0.9)
    memo = {}
    for _ in range(2):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        masked_step(opt, torch.tensor(False), memo)
    assert len(memo["saved"]) == 4  # two parameters and their momentum buffers: the sync-free path ran

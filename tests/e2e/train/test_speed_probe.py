"""precision=auto and speed.channels_last=auto: the decision against a stubbed step timer (which candidate
wins, the margin, ties, what is never a candidate, when nothing is measured), this machine's bf16 support, and a real
run that measures: its records say what ran, and its weights are bit for bit those of a run that named the choice."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from torchsprint import config
from torchsprint.runtime.machine import native_bf16
from torchsprint.train import run, speed_probe
from torchsprint.train.speed_probe import Candidate, decide_auto

CPU = SimpleNamespace(device=torch.device("cpu"), world_size=1)
CONV = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
LINEAR = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
LONG = [None] * 10_000  # a training loader's length only (a stubbed step takes no batch): 10,000 steps per epoch
B16 = "amp_bf16"


def stub(times: dict[str, object], calls: list | None = None):
    """A step timer: candidate -> seconds, from `times` by name ('fp32 NHWC'); a list gives one value per call, in turn
    (warm-ups and the estimating step take the first ones)."""
    seen: dict[str, int] = {}

    def step(c: Candidate) -> float:
        if calls is not None:
            calls.append(c.name)
        t = times[c.name]
        if isinstance(t, list):
            i = seen[c.name] = seen.get(c.name, -1) + 1
            return t[min(i, len(t) - 1)]
        return t

    return step


def decide(*over: str, times=None, model=CONV, rt=CPU, loader=LONG, calls=None, **kw):
    cfg = config.load(None, list(over))
    step = stub(times or {}, calls)
    return decide_auto(cfg, rt, model, loader, None, step=step, **kw)


@pytest.fixture(autouse=True)
def probing(monkeypatch):
    """The suite turns the probe off (tests/conftest.py: TORCHSPRINT_SPEED_PROBE=off); these tests measure on
    purpose."""
    monkeypatch.delenv(speed_probe.OFF_ENV, raising=False)


@pytest.fixture
def bf16(monkeypatch):
    """This CPU said to have native bf16, whatever it has (the stubbed timer decides)."""
    monkeypatch.setattr(speed_probe, "bf16_kernels", lambda: True)


ALL = {"fp32 NHWC": 1.0, "fp32 NCHW": 1.0, f"{B16} NHWC": 1.0, f"{B16} NCHW": 1.0}


def test_the_fastest_beyond_the_margin_wins_and_is_written_into_the_config(bf16):
    # bug caught: the first, the last or the baseline taken instead of the fastest; a choice not in the config
    a = decide(times=ALL | {f"{B16} NHWC": 0.5, f"{B16} NCHW": 0.6})
    assert (a.precision, a.channels_last) == (B16, "auto") and a.measured["chosen"] == f"{B16} NHWC"
    assert (
        a.measured["candidates"][f"{B16} NHWC"]["images_per_s"]
        == 2 * a.measured["candidates"]["fp32 NHWC"]["images_per_s"]
        and a.measured["speedup"] == 2.0
        and a.measured["margin"] == 0.05
    )
    cfg = a.resolved(config.load(None, []))
    assert cfg.precision.mode == B16 and cfg.speed.channels_last == "auto"
    assert "precision=auto: amp_bf16, measured" in a.precision_why and "precision=fp32" in a.precision_why
    # NCHW faster: the run's config says false (what a resume and eval read); bug caught: auto left on (NHWC ran)
    b = decide(times=ALL | {"fp32 NCHW": 0.8})
    assert (b.precision, b.channels_last) == ("fp32", False)
    assert b.channels_last_why.startswith("speed.channels_last=auto: off, measured NHWC")


@pytest.mark.parametrize("faster, wins", [(1.04, False), (1.0, False), (1.06, True)])
def test_a_gain_inside_the_margin_or_a_tie_keeps_the_baseline(bf16, faster, wins):
    # bug caught: any gain taken (noise would flip runs between modes), or a tie going to the later candidate
    a = decide(times=ALL | {f"{B16} NCHW": 1.0 / faster})
    assert a.measured["chosen"] == (f"{B16} NCHW" if wins else "fp32 NHWC")
    assert (a.precision, a.channels_last) == ((B16, False) if wins else ("fp32", "auto"))


def test_one_disturbed_baseline_round_does_not_veto_a_clear_gain(bf16):
    # Another job slows the baseline's second round 3x (its warm-up and estimating step first, then rounds of 1.0,
    # 3.06, 1.0): amp_bf16 at 1.67x in every round still wins. bug caught: the margin taken from the baseline's spread
    # between rounds (306%), which kept fp32 on a loaded machine where amp_bf16 trained 1.7x faster
    disturbed = [1.0, 1.0, 1.0, 3.06, 1.0]
    a = decide(times=ALL | {"fp32 NHWC": disturbed, f"{B16} NHWC": 0.6})
    assert a.measured["chosen"] == f"{B16} NHWC" and a.measured["margin"] == 0.05
    assert a.measured["speedups"][f"{B16} NHWC"] == [
        pytest.approx(1 / 0.6, rel=1e-3),
        pytest.approx(3.06 / 0.6, rel=1e-3),
        pytest.approx(1 / 0.6, rel=1e-3),
    ]
    # ...and a gain the rounds do not hold (a fast round amid slow ones) does not win. bug caught: the best round taken
    b = decide(times=ALL | {"fp32 NHWC": disturbed, f"{B16} NHWC": 1.02})
    assert b.measured["chosen"] == "fp32 NHWC"


def test_rounds_that_disagree_about_the_winner_are_measured_again(bf16):
    # amp_bf16's rounds: 2x, then slower than fp32, then 2x: the load changed during the probe. Two more rounds are
    # timed, and their median decides. bug caught: a decision from rounds that contradict each other
    calls = []
    a = decide(times=ALL | {f"{B16} NHWC": [0.5, 0.5, 1.2, 0.5, 0.5, 0.5]}, calls=calls)
    assert a.measured["rounds"] == speed_probe.MEASURE_ROUNDS + speed_probe.EXTRA_ROUNDS
    assert calls.count("fp32 NCHW") == speed_probe.WARMUP_STEPS + speed_probe.MEASURE_ROUNDS + speed_probe.EXTRA_ROUNDS
    assert a.measured["chosen"] == f"{B16} NHWC"
    # rounds that agree: no extra rounds. bug caught: every probe paying for five rounds
    assert decide(times=ALL | {f"{B16} NHWC": 0.5}).measured["rounds"] == speed_probe.MEASURE_ROUNDS


def test_a_measurement_is_reused_on_the_same_machine_and_keys_until_remeasured(bf16, monkeypatch, tmp_path):
    """What a probe measured is stored with this machine's identity and the probe's keys; the next run with the same
    keys takes it without measuring (saying "measured before"), another model or batch does not, and --remeasure's
    switch reads nothing. Bugs caught: figures of another model or batch reused, the store never read (the probe
    measured at every start), --remeasure ignored."""
    from torchsprint.runtime import measurements

    monkeypatch.setenv("TORCHSPRINT_MEASURED_DIR", str(tmp_path))
    cfg = config.load(None, [])
    cands, _ = speed_probe.candidates("auto", "auto", CONV)
    keys = speed_probe.probe_keys(cfg, CONV, cands)
    stored = decide(times=ALL | {f"{B16} NHWC": 0.5}).measured
    measurements.remember("speed_probe", keys, stored)
    a = decide_auto(cfg, CPU, CONV, LONG, None)  # real steps would need batches: reused, nothing is stepped
    assert (a.precision, a.measured["chosen"]) == (B16, f"{B16} NHWC") and "measured before, " in a.precision_why
    assert (
        measurements.recall(
            "speed_probe", speed_probe.probe_keys(config.load(None, ["data.batch_size=32"]), CONV, cands)
        )
        is None
    )
    assert measurements.recall("speed_probe", speed_probe.probe_keys(cfg, LINEAR, cands)) is None
    monkeypatch.setenv(measurements.REMEASURE_ENV, "1")
    assert measurements.recall("speed_probe", keys) is None
    monkeypatch.delenv(measurements.REMEASURE_ENV)
    assert measurements.recall("speed_probe", keys)["value"]["chosen"] == f"{B16} NHWC"


def test_rounds_are_interleaved_after_each_candidate_s_warm_up(bf16):
    # bug caught: one candidate timed after the other (a load change on the machine falls on one only), or warm-up
    # steps timed (oneDNN's first-use cost counted against a candidate)
    calls = []
    decide(times=ALL, calls=calls)
    n = speed_probe.WARMUP_STEPS
    assert calls[: n + 1] == ["fp32 NHWC"] * (n + 1)  # warm-up, then the step the estimate comes from
    rounds = calls[n + 1 + 3 * n :]
    assert len(rounds) == 4 * speed_probe.MEASURE_ROUNDS
    assert [sorted(rounds[i : i + 4]) for i in range(0, len(rounds), 4)] == [sorted(ALL)] * speed_probe.MEASURE_ROUNDS
    assert rounds[0] != rounds[4]  # each round starts with another candidate


@pytest.mark.parametrize(
    "over, varies",
    [
        (["precision=fp32"], {"fp32 NHWC", "fp32 NCHW"}),
        (["speed.channels_last=true"], {"fp32 NHWC", f"{B16} NHWC"}),
        (["speed.channels_last=false"], {"fp32 NCHW", f"{B16} NCHW"}),
        (["precision=bf16"], {"bf16 NHWC", "bf16 NCHW"}),
    ],
)
def test_a_named_setting_never_varies(bf16, over, varies):
    # bug caught: a run that named its precision or format measured (and changed) on that dimension
    calls = []
    fastest = {f"{B16} NCHW": 0.1, "bf16 NCHW": 0.1, f"{B16} NHWC": 0.2}
    a = decide(*over, times=ALL | {"bf16 NHWC": 1.0} | fastest, calls=calls)
    assert set(calls) == varies
    named = dict(o.split("=") for o in over)
    assert a.precision == named.get("precision", a.precision)
    if "speed.channels_last" in named:
        assert a.channels_last is (named["speed.channels_last"] == "true")


def test_both_named_or_nothing_to_vary_is_not_measured(bf16):
    calls = []
    a = decide("precision=fp32", "speed.channels_last=false", times=ALL, calls=calls)
    assert not calls and a.measured is None and (a.precision, a.channels_last) == ("fp32", False)
    b = decide("speed.channels_last=true", times=ALL, model=LINEAR, calls=calls)  # fp32 vs bf16 still varies
    assert set(calls) == {"fp32 NHWC", f"{B16} NHWC"} and b.measured is not None


@pytest.mark.parametrize("forced", [False, True])
def test_without_native_bf16_auto_never_picks_amp_bf16(monkeypatch, forced):
    # forced: native_bf16 said False on this machine; not forced: this machine as it is, where it lacks bf16 support
    # (on a CPU with it, the forced case is the check). bug caught: amp_bf16 tried (and chosen) on an AVX2 CPU
    if forced:
        monkeypatch.setattr(speed_probe, "native_bf16", lambda: False)
    elif speed_probe.bf16_kernels():
        pytest.skip("this CPU has native bf16: the forced case checks the refusal")
    calls = []
    a = decide(times=ALL | {f"{B16} NHWC": 0.01, f"{B16} NCHW": 0.01}, calls=calls)
    assert a.precision == "fp32" and B16 not in " ".join(calls) and set(calls) == {"fp32 NHWC", "fp32 NCHW"}
    assert "amp_bf16 not tried: this CPU has no native bf16" in a.precision_why
    b = decide(times=ALL, model=LINEAR, calls=calls)  # nothing left to compare
    assert b.measured is None and b.precision == "fp32" and "nothing to compare" in b.precision_why


def test_native_bf16_agrees_with_the_cpu_and_pytorch():
    # bug caught: native_bf16 reading another flag (plain AVX-512 emulates bf16), or saying yes where oneDNN has no bf16
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    if native_bf16():
        assert torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert speed_probe.bf16_kernels() == native_bf16()  # PyTorch's oneDNN has bf16 wherever the CPU has it natively


@pytest.mark.parametrize(
    "rt, kw, why",
    [
        (SimpleNamespace(device=torch.device("cuda"), world_size=1), {}, "on cuda the existing choice stands"),
        (SimpleNamespace(device=torch.device("cpu"), world_size=2), {}, "2 processes share the cores"),
        (CPU, {"distilling": True}, "distillation"),
        (CPU, {"loader": [None] * 10}, "run too short (100 training steps; measuring takes 17, which pays from 170"),
    ],
)
def test_not_measured_where_it_cannot_pay_or_would_not_be_the_run_s(bf16, rt, kw, why):
    # bug caught: CUDA runs measured (their choices stand), DDP ranks deciding apart, a short run (every test's) paying
    # for a probe or getting amp_bf16 depending on the CPU it runs on
    calls = []
    a = decide("run.epochs=10", **{"rt": rt, "times": ALL | {f"{B16} NHWC": 0.1}, "calls": calls, **kw})
    assert not calls and a.measured is None and a.precision == "fp32" and a.channels_last == "auto"
    assert why in a.precision_why


def test_compile_is_not_measured(bf16):
    calls = []
    a = decide("speed.compile=true", times=ALL | {f"{B16} NHWC": 0.1}, calls=calls)
    assert not calls and "speed.compile=true" in a.precision_why


def test_a_run_too_short_by_its_first_timed_step_stops_there(bf16):
    # 10,000 steps x 1 ms = 10 s < MEASURE_MIN_S: two steps of the baseline (warm-up, estimate), nothing else.
    calls = []
    a = decide("run.epochs=1", times={k: 0.001 for k in ALL}, calls=calls)
    assert calls == ["fp32 NHWC"] * (speed_probe.WARMUP_STEPS + 1) and a.precision == "fp32"
    assert "run too short (~10 s in fp32 NHWC: 10,000 steps x 1 ms; measured from 60 s)" in a.precision_why


def test_the_estimate_scales_the_half_batch_step_to_the_run_s_batch():
    """measure(scale=...): the probe steps half a batch, so its step time is scaled by the run's batch over the
    probe's before it estimates the run's length. Bug caught: the half-batch step estimating a run at half its time
    (ResNet-18, batch 32 at 112 px, 3 epochs: 52 s estimated, 'too short', where its fp32 training took ~100 s)."""
    from torchsprint.train.speed_probe import measure

    cands = [Candidate("fp32", True), Candidate(B16, True)]
    per_step = speed_probe.MEASURE_MIN_S / 200 * 0.75  # 200 steps of it: 3/4 of the threshold
    assert measure(cands, lambda c: per_step, 200)[1].startswith("run too short")
    figures, why_not = measure(cands, lambda c: per_step, 200, scale=2.0)
    assert why_not is None and figures["estimate_s"] == pytest.approx(1.5 * speed_probe.MEASURE_MIN_S)


def test_a_slice_of_a_run_counts_as_what_this_invocation_trains(bf16):
    # run.stop_after_steps and run.max_time end this invocation: a long run trained in slices (the tests' runs that
    # stop after a few steps, a job's time budget) pays for a probe only where the slice can. bug caught: the probe
    # sized by run.epochs alone (a test stopping at step 8 of 2,000 epochs measured, on CPUs with bf16 only)
    calls = []
    a = decide("run.stop_after_steps=8", times=ALL, calls=calls)
    assert not calls and "run too short (8 training steps" in a.precision_why
    b = decide("run.max_time=30s", times=ALL, calls=calls)  # 100,000 steps x 1 s, but 30 s of them
    assert calls == ["fp32 NHWC"] * (speed_probe.WARMUP_STEPS + 1)
    assert "run too short (~30 s run.max_time; measured from 60 s)" in b.precision_why


def test_a_resumed_run_keeps_what_it_began_with(bf16):
    # bug caught: a resumed run measured again (another mode on top of the first one's optimizer state and numerics)
    calls = []
    ckpt = {"config": {"precision": {"mode": B16}, "speed": {"channels_last": False}}}
    a = decide(times=ALL | {"fp32 NHWC": 0.1}, calls=calls, ckpt=ckpt)
    assert not calls and (a.precision, a.channels_last) == (B16, False) and "as the run began" in a.precision_why
    b = decide("precision=fp32", times=ALL, calls=calls, ckpt=ckpt)  # named: as named
    assert (b.precision, b.channels_last) == ("fp32", False)


def test_auto_is_the_default_and_the_cli_shorthand_takes_it():
    assert (
        config.load(None, []).precision.mode == "auto"
        and config.load(None, ["precision=auto"]).precision.mode == "auto"
    )


# A real run that measures: small_cnn with dropout (the probe's steps draw from the RNG the run's dropout uses), on
# the digits, 40 steps; the thresholds lowered so that it measures (every other test's run never does).
RUN = [
    "log.tensorboard=false",
    "log.progress=false",
    "checkpoint.every_epochs=null",
    "eval.per_class=false",
    "run.max_steps=40",
    "model.args={width: 8, dropout: 0.3}",
]


def test_a_measured_run_records_it_and_trains_as_the_run_that_named_its_choice(tmp_path, monkeypatch, capsys):
    # bugs caught: the probe training the run's model or leaving its RNG moved (the weights differ from the named
    # run's), config.yaml saying auto (a resume or eval would not know what ran), decisions.json without the figures
    with monkeypatch.context() as m:
        m.setattr(speed_probe, "MEASURE_MIN_S", 0.0)
        m.setattr(speed_probe, "MAX_PROBE_SHARE", 1.0)
        run.train(config.load(None, [*RUN, f"run.dir={tmp_path / 'auto'}"]))
    out = capsys.readouterr().out
    d = json.loads((tmp_path / "auto" / "decisions.json").read_text())
    saved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    m = d["speed_measured"]
    assert m is not None and len(m["candidates"]) == (4 if speed_probe.bf16_kernels() else 2)
    assert m["rounds"] in (speed_probe.MEASURE_ROUNDS, speed_probe.MEASURE_ROUNDS + speed_probe.EXTRA_ROUNDS)
    assert all(c["images_per_s"] > 0 and len(c["step_ms"]) == m["rounds"] for c in m["candidates"].values())
    chosen = m["candidates"][m["chosen"]]
    assert d["precision"] == saved["precision"]["mode"] == chosen["precision"] and d["precision_config"] == "auto"
    assert d["channels_last"] is chosen["channels_last"]
    assert saved["speed"]["channels_last"] == ("auto" if chosen["channels_last"] else False)
    assert f"  {d['precision_why']}" in out and "measured" in d["precision_why"]
    # The same run naming what auto chose (config.yaml's values), measuring nothing: the same weights, bit for bit.
    named = [
        f"precision={saved['precision']['mode']}",
        f"speed.channels_last={str(saved['speed']['channels_last']).lower()}",
    ]
    run.train(config.load(None, [*RUN, *named, f"run.dir={tmp_path / 'named'}"]), quiet=True)
    assert json.loads((tmp_path / "named" / "decisions.json").read_text())["speed_measured"] is None
    # The same run again on this machine: the stored figures decide, nothing is measured, the same weights.
    # bug caught: the probe measured at every start (its ~14 s of the photo defaults' start-up)
    with monkeypatch.context() as m:
        m.setattr(speed_probe, "MEASURE_MIN_S", 0.0)
        m.setattr(speed_probe, "MAX_PROBE_SHARE", 1.0)
        m.setattr(speed_probe, "measure", lambda *a, **k: pytest.fail("measured again"))
        run.train(config.load(None, [*RUN, f"run.dir={tmp_path / 'again'}"]), quiet=True)
    again = json.loads((tmp_path / "again" / "decisions.json").read_text())
    assert again["speed_measured"]["measured_before"] and again["precision"] == d["precision"]
    assert "measured before, " in again["precision_why"]
    a, b, c = (load_file(str(tmp_path / r / "last.safetensors")) for r in ("auto", "named", "again"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("value, off", [("off", True), ("0", True), ("false", True), ("on", False), ("", False)])
def test_the_environment_switch_turns_the_probe_off(bf16, monkeypatch, value, off):
    # bug caught: the suite's switch ignored (a loaded CI machine makes a test's run look long enough to measure, and it
    # then trains in amp_bf16 on a CPU with native bf16 only), or any value turning it off
    monkeypatch.setenv(speed_probe.OFF_ENV, value)
    calls = []
    a = decide("run.epochs=10", times=ALL | {f"{B16} NHWC": 0.1}, calls=calls)
    if off:
        assert not calls and a.precision == "fp32" and f"{speed_probe.OFF_ENV}={value}" in a.precision_why
    else:
        assert calls and a.precision == B16


def test_one_copy_steps_every_candidate_in_its_own_memory_format():
    # Catches: a channels_last candidate timed on NCHW weights (or the reverse) after the single copy's format switch,
    # so the probe would compare a layout with itself; the optimizer's momentum left in the other layout; the run's
    # own model trained or converted by the probe; a second copy made per format (the probe's peak memory).
    from torchsprint.optim.losses import build_loss
    from torchsprint.train.speed_probe import ProbeSteps

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(), torch.nn.LazyLinear(3)
    )
    model(torch.zeros(1, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = config.load(None, ["optim.momentum=0.9"])
    steps = ProbeSteps(cfg, model, build_loss(cfg.loss), (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])))
    for c in (Candidate("fp32", True), Candidate("fp32", False), Candidate("fp32", True)):
        assert steps(c) > 0
        copy, opt, _ = steps.copy
        fmt = torch.channels_last if c.channels_last else torch.contiguous_format
        weight = copy[0].weight
        assert weight.is_contiguous(memory_format=fmt)  # (the step leaves no gradient: set to None)
        assert opt.state[weight]["momentum_buffer"].is_contiguous(memory_format=fmt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model[0].weight.is_contiguous() and len(steps.trainables) == 2


def test_the_probe_times_half_the_batch_with_its_targets():
    """speed_probe.half: the images and every tensor as long as them halved together, anything else kept. Bugs
    caught: targets left at full length (the probe's loss would refuse the shapes), a one-image batch emptied, the
    full batch timed (its fp32 activations were the run's peak memory)."""
    from torchsprint.train.speed_probe import half

    x, y, w = torch.zeros(8, 3, 4, 4), torch.arange(8), torch.tensor(1.0)
    got = half((x, y, w))
    assert isinstance(got, tuple) and got[0].shape[0] == 4 and torch.equal(got[1], torch.arange(4)) and got[2] is w
    assert half([x[:1], y[:1]])[0].shape[0] == 1
    batch = {"image": x}
    assert half(batch) is batch  # not a sequence: kept as it is
    assert isinstance(half([x, y]), list)

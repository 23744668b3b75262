"""Model initialisation order (checkpoint > pretrained > random), pretrained loading, and freezing by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchsprint import config
from torchsprint.errors import UsageError
from torchsprint.models.init import apply_freeze, frozen_norm_layers, init_model, load_pretrained
from torchsprint.models.nets import small_cnn
from torchsprint.state.checkpoint import load_checkpoint
from torchsprint.state.resume import find_checkpoints
from torchsprint.train.engine import set_train_mode
from torchsprint.train.run import train

FAST = [
    "model.args={width: 8}",
    "data.batch_size=128",
    "eval.per_class=false",
    "log.tensorboard=false",
    "log.progress=false",
    "run.epochs=1",
]


def fast_run(run_dir: Path, *extra: str, quiet: bool = True) -> dict:
    return train(config.load(None, [*FAST, f"run.dir={run_dir}", *extra]), quiet=quiet)


def model_cfg(*overrides: str):
    return config.load(None, ["model.args={width: 8}", *overrides]).model


def net(seed: int, num_classes: int = 10) -> torch.nn.Module:
    """small_cnn(width 8) on 1-channel input with seeded weights and non-trivial BN statistics."""
    torch.manual_seed(seed)
    m = small_cnn(num_classes, 1, width=8)
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    return m


def state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture
def pretrained(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = state(net(seed=5))
    path = tmp_path / "pretrained.safetensors"
    save_file(src, str(path))
    return path, src


# ---------------------------------------------------------------- initialisation order


@pytest.mark.parametrize(
    "suffix, wrap",
    [
        (".pt", lambda sd: {f"module.{k}": v for k, v in sd.items()}),  # saved from DDP / DataParallel
        (".safetensors", lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()}),  # saved from torch.compile
        (".pth", lambda sd: {"state_dict": {f"module._orig_mod.{k}": v for k, v in sd.items()}}),  # Lightning-style
    ],
)
def test_pretrained_loads_every_format_and_strips_wrapper_prefixes(tmp_path, suffix, wrap):
    src = state(net(seed=1))
    path = tmp_path / f"weights{suffix}"
    save_file(wrap(src), str(path)) if suffix == ".safetensors" else torch.save(wrap(src), path)
    dst = net(seed=2)
    logs: list[str] = []
    assert init_model(dst, model_cfg(f"model.pretrained={path}"), None, logs.append) == "pretrained"
    assert all(torch.equal(v, src[k]) for k, v in dst.state_dict().items())
    assert logs == []  # everything matched: nothing to report


def test_head_with_another_class_count_is_skipped_and_named(tmp_path):
    src = state(net(seed=1, num_classes=5))
    path = tmp_path / "five-classes.pt"
    torch.save(src, path)
    dst = net(seed=2)
    own_head = dst[7].weight.detach().clone()
    logs: list[str] = []
    init_model(dst, model_cfg(f"model.pretrained={path}"), None, logs.append)
    assert torch.equal(dst[0][0].weight, src["0.0.weight"])  # the body is loaded
    assert torch.equal(dst[7].weight, own_head)  # the head keeps its random initialisation
    assert any(
        "shape mismatch" in line and "7.weight: file (5, 32) vs model (10, 32)" in line and "7.bias" in line
        for line in logs
    ), logs
    with pytest.raises(UsageError, match=r"model\.strict=true.*7\.weight: file \(5, 32\) vs model \(10, 32\)"):
        load_pretrained(net(seed=2), path, strict=True)


def test_checkpoint_beats_pretrained_beats_random(tmp_path, pretrained, capsys):
    path, src = pretrained
    fast_run(tmp_path / "a", "run.stop_after_steps=2", quiet=False)
    assert "initialised from random initialisation" in capsys.readouterr().out
    ckpt_path = find_checkpoints(tmp_path / "a")[0]
    ckpt = load_checkpoint(ckpt_path)

    # The order itself: with both a checkpoint and a pretrained file, the checkpoint's weights win.
    logs: list[str] = []
    m = net(seed=3)
    assert init_model(m, model_cfg(f"model.pretrained={path}"), ckpt, logs.append) == "checkpoint"
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in m.state_dict().items())
    assert any("not loaded" in line for line in logs)

    # ... and the log of a real run says which happened.
    fast_run(
        tmp_path / "a", "checkpoint.resume=auto", f"model.pretrained={path}", "run.stop_after_steps=1", quiet=False
    )
    out = capsys.readouterr().out
    assert f"initialised from checkpoint {ckpt_path}" in out and "not loaded" in out
    fast_run(tmp_path / "b", f"model.pretrained={path}", "run.stop_after_steps=1", quiet=False)
    assert f"initialised from pretrained weights {path}" in capsys.readouterr().out


def test_bad_pretrained_files_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="file not found"):
        load_pretrained(net(1), tmp_path / "missing.pt")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"\x00garbage")
    with pytest.raises(UsageError, match=r"cannot read .*junk\.pth"):
        load_pretrained(net(1), junk)
    other = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(3)}, other)
    with pytest.raises(UsageError, match="no tensor matches this model"):
        load_pretrained(net(1), other)


# ---------------------------------------------------------------- freezing


def test_frozen_parameters_get_no_gradients_and_frozen_bn_stays_in_eval():
    m = net(seed=0)
    trainable, frozen = apply_freeze(m, ["0.*", "re:^1\\.1\\."], [])
    names_frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert names_frozen == {"0.0.weight", "0.1.weight", "0.1.bias", "1.1.weight", "1.1.bias"}
    assert frozen == sum(p.numel() for n, p in m.named_parameters() if n in names_frozen) and trainable > 0
    m(torch.rand(2, 1, 8, 8)).sum().backward()
    for n, p in m.named_parameters():
        assert (p.grad is None) == (n in names_frozen), n
    norms = frozen_norm_layers(m)
    assert norms == [m[0][1], m[1][1]]
    set_train_mode(m, norms)
    assert m.training and not m[0][1].training and not m[1][1].training and m[3][1].training


def test_a_pattern_that_matches_nothing_is_an_error_naming_it():
    with pytest.raises(UsageError, match=re.escape("model.freeze: pattern 'layer9.*' matches no parameter")):
        apply_freeze(net(0), ["0.*", "layer9.*"], [])
    with pytest.raises(UsageError, match=re.escape("model.train_only: pattern 're:^head' matches no parameter")):
        apply_freeze(net(0), [], ["re:^head"])


def test_freeze_in_training_keeps_weights_and_bn_statistics(tmp_path, pretrained, capsys):
    path, src = pretrained
    fast_run(
        tmp_path, f"model.pretrained={path}", "model.freeze=['0.*', 're:^1\\.1\\.']", "run.max_steps=4", quiet=False
    )
    out = capsys.readouterr().out
    frozen_names = ["0.0.weight", "0.1.weight", "0.1.bias", "1.1.weight", "1.1.bias"]
    n_frozen = sum(src[n].numel() for n in frozen_names)
    n_total = sum(v.numel() for k, v in src.items() if "running" not in k and "num_batches" not in k)
    assert f"parameters: {n_total - n_frozen:,} trainable, {n_frozen:,} frozen" in out
    after = load_file(str(tmp_path / "last.safetensors"))
    for n in frozen_names + ["0.1.running_mean", "0.1.running_var", "1.1.running_mean", "1.1.running_var"]:
        assert torch.equal(after[n], src[n]), f"{n} changed although frozen"
    for n in ["1.0.weight", "3.0.weight", "3.1.running_mean", "7.weight"]:
        assert not torch.equal(after[n], src[n]), f"{n} did not train"
    groups = load_checkpoint(find_checkpoints(tmp_path)[0])["optimizer"]["param_groups"]
    n_params = len([k for k in src if "running" not in k and "num_batches" not in k])
    assert sum(len(g["params"]) for g in groups) == n_params - len(frozen_names)  # frozen ones are not in the optimizer


def test_train_only_and_unfrozen_bn_statistics(tmp_path, pretrained):
    path, src = pretrained
    fast_run(
        tmp_path,
        f"model.pretrained={path}",
        "model.train_only=['7.*']",
        "model.freeze_bn_stats=false",
        "run.max_steps=3",
    )
    after = load_file(str(tmp_path / "last.safetensors"))
    for n, v in src.items():
        if n in ("7.weight", "7.bias") or "running" in n or "num_batches" in n:
            assert not torch.equal(after[n], v), f"{n} should have changed"  # BN layers ran in train mode
        else:
            assert torch.equal(after[n], v), f"{n} changed although frozen"

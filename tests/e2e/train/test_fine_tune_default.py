"""Fine-tuning as the photo default (models/start.py): a folder of photos given alone fine-tunes the
picked model's published weights when they are cached or downloadable, else trains from scratch and says how to
get them. No internet: the cache is a tmp TORCH_HOME holding a real resnet18 state dict under torchvision's file
name, and downloads come from a real HTTP server on 127.0.0.1 (tests/e2e/models/test_weights_download.py's Server).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import load_file
from test_weights_download import Server, sha256

from conftest import load_resolved
from torchsprint import config
from torchsprint.models import start
from torchsprint.train.run import train

TV_FILE = "resnet18-f37072fd.pth"  # torchvision's ResNet18_Weights.DEFAULT (IMAGENET1K_V1) file name
IMAGENET = "imagenet"
# data.batch_size named: these folders are tiny, and a tiny folder's own batch rule (data/detect.py tiny_folder_batch,
# tested in test_user_folders.py) would move the lr figures worked out here at the default 64.
FAST = ["log.tensorboard=false", "log.progress=false", "eval.per_class=false", "run.device=cpu", "data.batch_size=64"]


def photos(root: Path, per_class: int = 4, size=(72, 64)) -> Path:
    """Two class folders of small RGB JPEGs (train/val): larger than digits, so the photo defaults apply."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                arr = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
                arr[..., 0 if c == "a" else 2] = 255
                Image.fromarray(arr).save(root / split / c / f"{i}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def r18_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return torchvision.models.resnet18(weights=None).state_dict()


@pytest.fixture
def online(tmp_path, monkeypatch):
    """Downloads allowed (tests/conftest.py sets TORCHSPRINT_OFFLINE=1), TORCH_HOME in tmp_path, no DDP world."""
    for name in ("TORCHSPRINT_OFFLINE", "HF_HUB_OFFLINE", "TORCHSPRINT_WEIGHTS_MIRROR", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    return tmp_path


def cache(tmp_path: Path, state) -> Path:
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / TV_FILE)
    return folder / TV_FILE


def chosen(cfg) -> dict:
    return {c["setting"]: c for c in cfg.chosen()}


def test_cached_weights_are_fine_tuned_with_their_normalisation_lr_and_head_first(online, r18_state):
    # Catches: the default not choosing cached weights; the weights chosen but not loaded into the body; inputs not
    # normalised as the weights were trained (the body sees [0, 1] pixels); the from-scratch lr (0.025, ten times
    # the fine-tuning rate) or its warm-up kept; the head not trained first; the choices missing from decisions.json.
    path = cache(online, r18_state)
    root = photos(online / "p")
    cfg = load_resolved(None, [f"data.root={root}", *FAST])
    got = chosen(cfg)
    assert (cfg.model.name, cfg.model.pretrained) == ("resnet18", "torchvision:DEFAULT")
    assert cfg.data.train.transforms[-1] == {"normalize": IMAGENET} == cfg.data.eval.transforms[-1]
    assert got["data.train.transforms"]["value"][-1] == {"normalize": IMAGENET}  # the record says so too
    assert cfg.optim.lr == pytest.approx(0.01 * 64 / 256) and cfg.sched.warmup_epochs == 0
    assert cfg.model.freeze_epochs == 1 and "sched.warmup_epochs" not in got
    assert (
        str(path) in got["model.pretrained"]["why"] and "model.pretrained=null" in got["model.pretrained"]["override"]
    )
    # ImageNet's statistics are what torchvision publishes with the weights, read from it (not typed here).
    t = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    assert start.normalization("torchvision:DEFAULT", "resnet18") == (list(t.mean), list(t.std))

    run = online / "run"
    summary = train(
        load_resolved(
            None,
            [
                f"data.root={root}",
                *FAST,
                "run.epochs=2",
                "run.max_steps=1",
                f"run.dir={run}",
                "checkpoint.every_epochs=null",
            ],
        ),
        quiet=True,
    )
    assert summary["init"]["file"] == str(path) and summary["init"]["head_replaced"] == ["fc.weight", "fc.bias"]
    trained = load_file(str(run / "last.safetensors"))
    # One step in the head-only epoch: the body is the file's, bit for bit (BatchNorm statistics too: frozen BN
    # layers stay in eval mode); the new 2-class head moved.
    for k, v in r18_state.items():
        if not k.startswith("fc."):
            assert torch.equal(trained[k], v), k
    assert trained["fc.weight"].shape == (2, 512)
    import json

    decided = {c["setting"]: c["value"] for c in json.loads((run / "decisions.json").read_text())["chosen"]}
    assert decided["model.pretrained"] == "torchvision:DEFAULT" and decided["model.freeze_epochs"] == 1


def served_default(monkeypatch, server: Server, body: bytes, how: list[str] | None = None) -> str:
    """PHOTO_WEIGHTS pointed at `body` on the test's server (torchvision's own fixed hash, f37072fd, cannot be met by
    a test file; its torch.hub path is tested in test_weights_download.py)."""
    name = f"resnet18-{sha256(body)[:8]}.pth"
    server.files[f"/models/{name}"] = body
    if how:
        server.misbehave[f"/models/{name}"] = how
    spec = f"{server.url}/models/{name}#sha256={sha256(body)}"
    monkeypatch.setattr(start, "PHOTO_WEIGHTS", spec)
    return spec


def pth(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_weights_not_cached_are_downloaded_then_fine_tuned(online, r18_state, monkeypatch):
    # Catches: "downloadable" treated as "not there" (the user with network trains from scratch); the download left
    # under a temporary name; a second run downloading again.
    server = Server()
    try:
        spec = served_default(monkeypatch, server, body := pth(r18_state))
        root = photos(online / "p")
        cfg = load_resolved(None, [f"data.root={root}", *FAST])
        assert cfg.model.pretrained == spec and "downloaded" in chosen(cfg)["model.pretrained"]["why"]
        assert cfg.model.freeze_epochs == 1 and cfg.optim.lr == pytest.approx(0.0025)
        # A URL does not say how its weights were trained: no normalisation is added (a torchsprint run's own
        # weights keep that run's transforms).
        assert not any("normalize" in str(s) for s in cfg.data.train.transforms)
        files = sorted(p.name for p in (online / "torch/hub/checkpoints").iterdir())
        assert files == [f"resnet18-{sha256(body)[:8]}.pth"]
        load_resolved(None, [f"data.root={root}", *FAST])
        assert server.gets(f"/models/{files[0]}") == 1  # the second run read the cache
    finally:
        server.http.shutdown()
        server.http.server_close()


@pytest.mark.parametrize("how", ["drop", "other", "offline", "ddp"])
def test_no_weights_to_be_had_trains_from_scratch_and_says_how_to_get_them(online, r18_state, monkeypatch, how):
    # Catches: a failed or refused download stopping the run (the default must fall back, not fail); a connection
    # attempted offline or from a DDP worker; the fine-tuning settings applied to a model that starts from random
    # weights; a broken file kept in the cache; the line not naming `torchsprint weights get`.
    server = Server()
    try:
        served_default(monkeypatch, server, pth(r18_state), [how] if how in ("drop", "other") else None)
        if how == "offline":
            monkeypatch.setenv("TORCHSPRINT_OFFLINE", "1")
        if how == "ddp":
            monkeypatch.setenv("WORLD_SIZE", "2")
        cfg = load_resolved(None, [f"data.root={photos(online / 'p')}", *FAST])
        line = chosen(cfg)["model.pretrained"]
        assert cfg.model.pretrained is None and line["value"] is None and "from scratch" in line["why"]
        assert "torchsprint weights get" in line["override"] and "\n" not in line["why"]
        assert cfg.optim.lr == pytest.approx(0.1 * 64 / 256)  # the from-scratch rule (no strategy.name=ddp here)
        assert cfg.sched.warmup_epochs == 1.0 and cfg.model.freeze_epochs == 0
        assert not any("normalize" in str(s) for s in cfg.data.train.transforms)
        folder = online / "torch/hub/checkpoints"
        assert not folder.is_dir() or not list(folder.iterdir())
        if how in ("offline", "ddp"):
            assert server.requests == []
            assert ("TORCHSPRINT_OFFLINE=1" if how == "offline" else "DDP") in line["why"]
    finally:
        server.http.shutdown()
        server.http.server_close()


def test_what_the_user_sets_wins(online, r18_state):
    # Catches: the default overriding a named model, weights=null, an lr, freeze_epochs or transforms; normalisation
    # appended to transforms the user wrote.
    cache(online, r18_state)
    root = photos(online / "p")
    base = [f"data.root={root}", *FAST]
    assert load_resolved(None, [*base, "model.pretrained=null"]).model.pretrained is None
    assert load_resolved(None, [*base, "model.name=resnet34"]).model.pretrained is None  # a named model: not picked
    mine = load_resolved(None, [*base, "optim.lr=0.05", "model.freeze_epochs=0"])
    assert (mine.model.pretrained, mine.optim.lr, mine.model.freeze_epochs) == ("torchvision:DEFAULT", 0.05, 0)
    own = load_resolved(
        None,
        [
            *base,
            "model.name=resnet18",
            "model.pretrained=torchvision:DEFAULT",
            "data.train.transforms=[resize: 64]",
            "data.eval.transforms=[resize: 64]",
        ],
    )
    assert own.data.train.transforms == [{"resize": 64}] and own.model.freeze_epochs == 1  # named weights: fine-tuned
    assert own.optim.lr == pytest.approx(0.0025)
    short = load_resolved(None, [*base, "run.epochs=1"])  # one epoch: no room for a head-only epoch
    assert short.model.pretrained == "torchvision:DEFAULT" and short.model.freeze_epochs == 0


def test_a_saved_run_config_reads_back_unchanged(online, r18_state, tmp_path):
    # Catches: the normalisation appended a second time, or the default re-decided, when a run's config.yaml is read
    # again (resume, predict, export read it).
    cache(online, r18_state)
    cfg = load_resolved(None, [f"data.root={photos(online / 'p')}", *FAST])
    saved = tmp_path / "config.yaml"
    saved.write_text(config.dump_yaml(cfg))  # what a run writes as its config.yaml
    again = load_resolved(saved, [])
    assert again.data.train.transforms == cfg.data.train.transforms and again.model.freeze_epochs == 1
    assert (again.model.pretrained, again.optim.lr) == (cfg.model.pretrained, cfg.optim.lr)


@pytest.mark.parametrize("name, last_bn", [("resnet18", "bn2"), ("resnet50", "bn3")])
def test_a_resnet_from_scratch_starts_each_block_as_the_identity(online, name, last_bn):
    # Catches: zero_init_residual on with a warm-up (it slowed the photo defaults), or not passed to torchvision's
    # builder without one (the blocks' last BatchNorm at 1: the lr-0.1 runs of the timm comparison then swing between
    # 0.28 and 0.94 top-1); applied to the wrong layer; forced on a user who set it, or on a model that starts from
    # weights.
    from torchsprint.models.core import build_model

    root = photos(online / "p")
    # With the photo defaults' warm-up it stays off: there it slowed learning (val top-1 0.980 vs 1.000 after 10
    # epochs, BENCHMARKS.md "Zero-initialised residuals: with and without a warm-up").
    assert load_resolved(None, [f"data.root={root}", *FAST, f"model.name={name}"]).model.args == {}
    cfg = load_resolved(
        None, [f"data.root={root}", *FAST, f"model.name={name}", "optim.lr=0.1", "sched.warmup_epochs=0"]
    )
    assert cfg.model.args == {"zero_init_residual": True}
    model = build_model(cfg.model, num_classes=2, in_channels=3)
    reference = torchvision.models.get_model(name, num_classes=2, zero_init_residual=True)  # torchvision's own switch
    zeros = {k for k, v in reference.state_dict().items() if k.endswith(f"{last_bn}.weight") and not v.any()}
    assert zeros and all(not model.state_dict()[k].any() for k in zeros)
    assert model.state_dict()["bn1.weight"].all()  # the stem's BatchNorm is not a block's last
    off = load_resolved(
        None,
        [
            f"data.root={root}",
            *FAST,
            f"model.name={name}",
            "sched.warmup_epochs=0",
            "model.args={zero_init_residual: false}",
        ],
    )
    assert off.model.args == {"zero_init_residual": False}
    assert (
        load_resolved(
            None,
            [
                f"data.root={root}",
                *FAST,
                "model.name=resnet18",
                "sched.warmup_epochs=0",
                "model.pretrained=x.safetensors",
            ],
        ).model.args
        == {}
    )

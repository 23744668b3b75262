"""Library pretrained weights from the library's own cache, offline: torchvision weight enums and timm tags.

No network (tests/conftest.py sets TORCHSPRINT_OFFLINE=1): each test writes the cached file itself (a randomly
initialised 1000-class model's state dict) at the exact path the library would have downloaded it to, under a
temporary TORCH_HOME / HF_HOME. Downloads: tests/e2e/models/test_weights_download.py.
"""

from __future__ import annotations

import pytest
import torch
import torchvision

from torchsprint import config, runtime
from torchsprint.errors import UsageError
from torchsprint.train.build import build_training
from torchsprint.train.run import train

BASE = [
    "log.tensorboard=false",
    "log.progress=false",
    "run.epochs=1",
    "eval.per_class=false",
    "data.train.transforms=[resize: 32]",
    "data.eval.transforms=[resize: 32]",
]


def build(*over):
    cfg = config.load(None, [*BASE, *over])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    logs: list[str] = []
    try:
        return build_training(cfg, rt, logs.append), logs
    finally:
        runtime.teardown(rt)


def imagenet_resnet18(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return torchvision.models.resnet18(weights=None).state_dict()  # 1000 classes, as the published file


def check_loaded(model, saved: dict[str, torch.Tensor], skipped: set[str]) -> None:
    own = model.state_dict()
    for k, v in saved.items():
        if k in skipped:
            assert own[k].shape != v.shape
        else:
            assert torch.equal(own[k], v), k


@pytest.mark.parametrize("spec", ["torchvision:ResNet18_Weights.IMAGENET1K_V1", "torchvision:DEFAULT"])
def test_torchvision_weights_from_the_torch_hub_cache(tmp_path, monkeypatch, spec):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    over = ["model.name=resnet18", f"model.pretrained={spec}"]
    with pytest.raises(UsageError) as e:
        build(*over)
    path = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "https://download.pytorch.org/models/resnet18-f37072fd.pth" in msg
    path.parent.mkdir(parents=True)
    saved = imagenet_resnet18(seed=3)
    torch.save(saved, path)
    b, logs = build(*over)
    # digits: 1 channel (conv1 adapted) and 10 classes (fc replaced); everything else is the file's.
    check_loaded(b.model, saved, {"conv1.weight", "fc.weight", "fc.bias"})
    assert b.init["from"] == "pretrained" and b.init["file"] == str(path)
    assert sorted(b.init["head_replaced"]) == ["fc.bias", "fc.weight"]  # safetensors stores keys sorted
    assert any("classifier head replaced" in m and "fc.weight" in m for m in logs)


def test_the_run_summary_records_the_replaced_head(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.save(imagenet_resnet18(seed=4), path)
    summary = train(
        config.load(
            None,
            [
                *BASE,
                "model.name=resnet18",
                "model.pretrained=torchvision:DEFAULT",
                "run.max_steps=2",
                f"run.dir={tmp_path / 'r'}",
            ],
        ),
        quiet=True,
    )
    assert (
        summary["init"]["head_replaced"] == ["fc.weight", "fc.bias"]
        and summary["init"]["source"] == "torchvision:DEFAULT"
    )


def test_timm_weights_from_the_hugging_face_cache(tmp_path, monkeypatch):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    over = ["model.name=timm/resnet18", "model.pretrained=timm:resnet18.a1_in1k"]
    path = tmp_path / "hf" / "hub" / "models--timm--resnet18.a1_in1k" / "snapshots" / "main" / "model.safetensors"
    with pytest.raises(UsageError, match="put the file at " + str(path).replace(".", r"\.")) as e:
        build(*over)
    assert "https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors" in str(e.value)
    torch.manual_seed(5)
    saved = timm.create_model("resnet18", num_classes=1000).state_dict()
    path.parent.mkdir(parents=True)
    save_file(saved, str(path))
    b, logs = build(*over)
    check_loaded(b.model, saved, {"conv1.weight", "fc.weight", "fc.bias"})
    assert sorted(b.init["head_replaced"]) == ["fc.bias", "fc.weight"]  # safetensors stores keys sorted


def test_library_weight_mistakes_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(UsageError, match="not weights of model.name=resnet18"):
        build("model.name=resnet18", "model.pretrained=torchvision:ResNet50_Weights.IMAGENET1K_V2")
    with pytest.raises(UsageError, match="torchvision has no weights 'ResNet18_Weights.NOPE'.*IMAGENET1K_V1"):
        build("model.name=resnet18", "model.pretrained=torchvision:ResNet18_Weights.NOPE")
    if pytest.importorskip("timm"):
        with pytest.raises(UsageError, match="set model.name=timm/resnet50"):
            build("model.name=timm/resnet18", "model.pretrained=timm:resnet50.a1_in1k")
        with pytest.raises(UsageError, match="no pretrained weights 'resnet18.nope'.*timm:resnet18.a1_in1k"):
            build("model.name=timm/resnet18", "model.pretrained=timm:resnet18.nope")

"""Settings that used to be accepted and then ignored (or to fail inside PyTorch) are honoured or refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsprint import cli, config
from torchsprint.data.preprocess.augment import compile_batch_spec
from torchsprint.errors import UsageError
from torchsprint.models import MODELS
from torchsprint.optim import build_loss

FAST = ["run.epochs=1", "log.tensorboard=false", "model.args={width: 8}"]


@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("step", ["resize", "random_resized_crop"])
def test_batched_backends_honour_antialias(step, antialias):
    """The memory/gpu backends' batched ops against torchvision v2 on the same crop: equal pixels with
    antialias on and off, and the two settings really differ (a downscale by ~3x)."""
    from torchvision.transforms import v2

    x = (torch.rand(4, 3, 96, 120) * 255).to(torch.uint8)
    arg = {"size": [32, 40], "antialias": antialias}
    pipe = compile_batch_spec([{step: arg}], "t", 3, "memory")
    seeds = torch.arange(4)
    got = pipe(x, seeds)
    if step == "resize":
        ref = v2.functional.resize(x, [32, 40], antialias=antialias)
    else:
        op = pipe.steps[0][1]
        u = pipe.draw(seeds)
        p, _, _ = op.params(u, torch.full((4,), 96), torch.full((4,), 120))
        # random_resized_crop runs batch_ops.resample_batch (one pass for the batch), which accumulates
        # in fp32 and rounds once, like torchvision's float path: compare with that path.
        xf = x.float()
        ref = torch.stack(
            [
                v2.functional.resized_crop(
                    xf[i],
                    int(p["top"][i]),
                    int(p["left"][i]),
                    int(p["h"][i]),
                    int(p["w"][i]),
                    [32, 40],
                    antialias=antialias,
                )
                for i in range(4)
            ]
        )
        ref = ref.round().clamp(0, 255).to(torch.uint8)
    d = (got.int() - ref.int()).abs()
    if step == "resize":
        assert torch.equal(got, ref)
    else:  # summation order: measured max 1 level on 0.0065% (antialias) / 0.026% (not) of pixels
        assert d.max() <= 1 and (d > 0).float().mean() < 0.0008
    other = compile_batch_spec([{step: arg | {"antialias": not antialias}}], "t", 3, "memory")(x, seeds)
    assert not torch.equal(got, other)  # the setting changes the pixels


@pytest.mark.parametrize("name", ["mse", "l1", "smooth_l1"])
def test_label_smoothing_without_labels_is_refused(name):
    cfg = config.load(None, ["task=image_to_image", f"loss.name={name}", "loss.label_smoothing=0.1"])
    with pytest.raises(UsageError, match=f"loss {name} has no class labels to smooth"):
        build_loss(cfg.loss, "image")


@pytest.mark.parametrize("name", ["mse", "l1", "smooth_l1"])
def test_regression_losses_on_class_targets_are_refused_at_start(tmp_path, capsys, name):
    assert cli.main(["train", *FAST, f"loss.name={name}", f"run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert f"loss {name} compares outputs with image targets" in err and "cross_entropy" in err
    assert not (tmp_path / "r").exists()


def test_class_weights_from_the_config_weight_the_loss():
    """loss.args.weight as a YAML list becomes a tensor: equal to torch's own weighted cross-entropy."""
    cfg = config.load(None, ["loss.args={weight: [1.0, 2.0, 0.5]}"])
    logits, target = torch.randn(16, 3), torch.randint(0, 3, (16,))
    got = build_loss(cfg.loss, "class_index", num_classes=3)(logits, target)
    want = nn.functional.cross_entropy(logits, target, weight=torch.tensor([1.0, 2.0, 0.5]))
    assert torch.allclose(got, want) and not torch.allclose(got, nn.functional.cross_entropy(logits, target))
    with pytest.raises(UsageError, match="2 values for 3 classes"):
        build_loss(config.load(None, ["loss.args={weight: [1, 2]}"]).loss, "class_index", num_classes=3)


def test_class_weights_train_end_to_end(tmp_path, capsys):
    weights = "[" + ", ".join(["1.0"] * 9 + ["3.0"]) + "]"
    assert cli.main(["train", *FAST, f"loss.args={{weight: {weights}}}", f"run.dir={tmp_path / 'r'}"]) == 0


@pytest.mark.parametrize(
    "model,key",
    [
        ("resnet18", "weights"),
        ("resnet18", "num_classes"),
        ("small_cnn", "in_channels"),
        ("timm/resnet18", "pretrained"),
        ("timm/resnet18", "in_chans"),
    ],
)
def test_model_args_that_torchsprint_sets_are_refused(tmp_path, capsys, model, key):
    assert (
        cli.main(["train", *FAST, f"model.name={model}", f"model.args={{{key}: 3}}", f"run.dir={tmp_path / 'r'}"]) == 2
    )
    err = capsys.readouterr().err
    assert f"model.args.{key}: torchsprint sets this itself" in err and "multiple values" not in err


class Flaky(nn.Module):
    """A model whose forward uses an operation without a deterministic implementation (PyTorch's own alert)."""

    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        from torch._prims_common import alert_not_deterministic  # what PyTorch's own Python-side ops call

        alert_not_deterministic("Flaky.scatter_like_op")
        return self.fc(x.flatten(1))


MODELS.register("test_flaky", override=True)(lambda num_classes, in_channels=3: Flaky(num_classes, in_channels))


def test_deterministic_is_strict_and_names_the_operation(tmp_path, capsys):
    """run.deterministic=true used warn_only: a non-deterministic op ran with a warning. Now it stops the run."""
    base = ["train", "model.name=test_flaky", "run.epochs=1", "log.tensorboard=false"]
    assert cli.main([*base, "run.deterministic=true", f"run.dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert "run.deterministic=true: Flaky.scatter_like_op has no deterministic implementation" in err
    assert "Traceback" not in err
    assert cli.main([*base, "run.deterministic=false", f"run.dir={tmp_path / 'b'}"]) == 0


@pytest.mark.parametrize(
    "dataset,options",
    [
        ("image_folder", "{modee: GRAY}"),
        ("file_list", "{classs: [a]}"),
        ("cifar10", "{mode: GRAY}"),
        ("digits", "{mode: GRAY}"),
        ("image_folder", "{mode: grey}"),
    ],
)
def test_dataset_options_it_does_not_read_are_refused(tmp_path, dataset, options):
    from torchsprint.data import DATASETS

    cfg = config.load(None, [f"data.dataset={dataset}", f"data.options={options}", f"data.root={tmp_path}"])
    with pytest.raises(UsageError, match="does not take data.options|use RGB or GRAY|takes no data"):
        DATASETS.get(dataset)(cfg.data)


def test_flips_that_change_a_direction_label_are_refused(tmp_path, capsys):
    for flip in ("hflip", "vflip"):
        assert (
            cli.main(
                [
                    "train",
                    "task=video",
                    "data.dataset=synthetic_video",
                    f"data.root={tmp_path / 'data'}",
                    "model.name=small_3d_cnn",
                    "data.options={per_class: 2, val_per_class: 1, size: 16, frames: 8}",
                    f"data.train.transforms=[{{random_clip: {{frames: 4}}}}, {flip}]",
                    "data.eval.transforms=[{center_clip: {frames: 4}}]",
                    f"run.dir={tmp_path / flip}",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert f"{flip} on data.dataset=synthetic_video mirrors" in err

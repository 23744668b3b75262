"""Every shipped recipe (configs/recipes/*.yaml) validates and trains a few steps on generated data of its shape.

Only the data location, the length and the batch size are overridden (and the image size where a
recipe's is too slow for CPU tests); every technique the recipe switches on runs.
"""

from __future__ import annotations

import json

import pytest

from conftest import make_image_folder
from paths import REPO
from torchsprint import cli, config

RECIPES = REPO / "configs" / "recipes"
SHORT = [
    "run.max_steps=2",
    "log.progress=false",
    "log.tensorboard=false",
    "eval.per_class=false",
    "checkpoint.every_epochs=null",
]


def cifar_root(tmp_path):
    from test_datasets import write_cifar

    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    write_cifar(root, "cifar10", n_train=16, n_test=8)
    return root


def image_root(tmp_path, size):
    return make_image_folder(tmp_path / "img", classes=("a", "b", "c"), per_class=4, size=size)


# recipe -> overrides that point it at generated data of the shape it expects (and keep the step small)
DATA = {
    "cifar10_airbench.yaml": lambda t: [f"data.root={cifar_root(t)}", "data.batch_size=16"],
    "finetune_resnet50.yaml": lambda t: [
        f"data.root={image_root(t, (96, 80))}",
        "data.batch_size=4",
        "data.num_workers=0",
        "model.pretrained=null",  # the cache lookup is tested in test_recipes_pretrained
        "data.train.transforms=[random_resized_crop: 64, hflip, normalize: imagenet]",
        "data.eval.transforms=[resize: 72, center_crop: 64, normalize: imagenet]",
    ],
    # ImageNet recipes: their own transforms and sizes, on a few small JPEGs; one process (they say ddp)
    "torchvision_resnet50.yaml": lambda t: [
        f"data.root={image_root(t, (96, 80))}",
        "data.batch_size=2",
        "data.num_workers=0",
        "strategy.name=single",
    ],
    "timm_resnet50_a3.yaml": lambda t: [
        f"data.root={image_root(t, (96, 80))}",
        "data.batch_size=2",
        "data.num_workers=0",
        "strategy.name=single",
    ],
}


def test_every_recipe_has_a_data_fixture():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(DATA)


@pytest.mark.parametrize("name", sorted(DATA))
def test_recipe_names_its_source_and_reported_accuracy(name):
    text = (RECIPES / name).read_text()
    assert "reports" in text and "%" in text  # e.g. "torchvision reports at 80.858% ImageNet-1k top-1"
    config.load(RECIPES / name, [])  # validates as it is


def bf16_recipe(name: str) -> bool:
    return config.load(RECIPES / name, []).precision.mode == "amp_bf16"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.bf16_training) if bf16_recipe(n) else n for n in sorted(DATA)]
)
def test_recipe_trains_a_few_steps(tmp_path, name):
    run_dir, data = tmp_path / "run", DATA[name](tmp_path)
    assert cli.main(["train", "-c", str(RECIPES / name), *SHORT, *data, f"run.dir={run_dir}"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 2
    saved = config.load(run_dir / "config.yaml", [])
    recipe = config.load(RECIPES / name, [])
    # the recipe's techniques really ran: the saved config keeps them; a recipe's precision=auto is saved as the mode
    # that ran (decisions.json says it came from auto)
    decided = json.loads((run_dir / "decisions.json").read_text())
    assert decided["precision_config"] == recipe.precision.mode and decided["precision"] == saved.precision.mode
    ran = recipe.precision.model_copy(update={"mode": decided["precision"]})
    assert (saved.model.name, saved.optim, saved.loss, saved.precision, saved.mix, saved.ema) == (
        recipe.model.name,
        recipe.optim,
        recipe.loss,
        ran,
        recipe.mix,
        recipe.ema,
    )
    if not any(o.startswith("data.train.transforms") for o in data):
        assert saved.data.train == recipe.data.train  # the recipe's own augmentation ran

"""Shared fixtures: tiny CPU configs and a real JPEG image folder generated on the fly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Two cores on CI: keep each test process to one intra-op thread so xdist workers don't oversubscribe.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in items:
            if "gpu" in item.keywords or "dali" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m torchsprint ...` in a subprocess; returns CompletedProcess (text)."""

    def run(*args, timeout=300, cwd=None, env=None):
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="200")
        e.update(env or {})
        return subprocess.run([sys.executable, "-m", "torchsprint", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or tmp_path, env=e)

    return run


def make_image_folder(root: Path, classes=("circle", "square"), per_class: int = 6, size=(24, 20), splits=("train", "val")):
    """Real JPEG files: class 0 bright disc, class 1 dark square on noise (learnable, decodable)."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(0)
    for split in splits:
        for ci, c in enumerate(classes):
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                noise = (torch.rand(size[1], size[0], 3, generator=g) * 80).to(torch.uint8).numpy()
                im = Image.fromarray(noise)
                draw = ImageDraw.Draw(im)
                if ci == 0:
                    draw.ellipse([4, 4, size[0] - 4, size[1] - 4], fill=(250, 250, 250))
                else:
                    draw.rectangle([4, 4, size[0] - 4, size[1] - 4], fill=(20, 200, 20))
                im.save(d / f"{i}.jpg", quality=90)
    return root


@pytest.fixture
def image_folder(tmp_path):
    return make_image_folder(tmp_path / "images")

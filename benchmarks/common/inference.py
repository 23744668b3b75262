"""What the inference benchmarks serve and predict (serve/predict_throughput.py, serve/serve_load.py): a run folder
with random weights (throughput does not depend on them) and generated image files."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_run(root: Path, model: str, eval_spec: list, in_channels: int, classes: int, data: list[str] = ()) -> Path:
    """A run folder with random weights and the given eval spec (what `train` would leave behind)."""
    from torchsprint import config
    from torchsprint.commands.trained import Trained
    from torchsprint.models import build_model
    from torchsprint.state.checkpoint import save_weights

    cfg = config.load(None, [f"model.name={model}", f"data.eval.transforms={eval_spec}", *data])
    trained = Trained(
        build_model(cfg.model, classes, in_channels).eval(),
        [str(i) for i in range(classes)],
        in_channels,
        cfg,
        root / "best.safetensors",
    )
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(config.dump_yaml(cfg))
    save_weights(root / "best.safetensors", trained.model, trained.metadata())
    return root


def make_images(folder: Path, n: int, size: tuple[int, int], gray: bool, ext: str) -> list[str]:
    """n image files of `size` (width, height) in `folder`, grey or RGB, ".jpg" (quality 90) or ".png": their paths."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        shape = (size[1], size[0]) if gray else (size[1], size[0], 3)
        # Smooth content plus noise: realistic JPEG sizes, not pure noise (which decodes unusually slowly).
        base = np.linspace(0, 255, size[0], dtype=np.float32)[None, :]
        arr = (base + rng.normal(0, 25, shape[:2])).clip(0, 255).astype(np.uint8)
        if not gray:
            arr = np.stack([arr, arr[::-1], np.roll(arr, 7, 1)], -1)
        p = folder / f"{i}{ext}"
        Image.fromarray(arr).save(p, quality=90) if ext == ".jpg" else Image.fromarray(arr).save(p)
        paths.append(str(p))
    return paths

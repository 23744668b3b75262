"""scikit-learn's bundled handwritten digits (the default run's dataset; no download)."""

from __future__ import annotations

import numpy as np
import torch

from torchsprint.data.core import DATASETS, Splits, TensorImages, stratified_split
from torchsprint.errors import UsageError


@DATASETS.register("digits")
def digits(data_cfg) -> Splits:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 grayscale images, 10 classes, no download."""
    from sklearn.datasets import load_digits

    if data_cfg.root is not None or data_cfg.options:
        what = f"data.root={data_cfg.root}" if data_cfg.root is not None else f"data.options={data_cfg.options}"
        raise UsageError(
            f"data.dataset=digits is scikit-learn's bundled set and takes no {what.split('=')[0]}; remove "
            f"{what}, or set data.dataset=image_folder to train on your own images."
        )

    d = load_digits()
    # Pixel values are 0..16 ink counts; scale to the uint8 range every other dataset uses.
    images = torch.from_numpy(np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(d.target.astype(np.int64))
    tr, va = stratified_split(d.target, data_cfg.val_fraction, data_cfg.split_seed)
    classes = [str(c) for c in d.target_names]
    return Splits(
        train=TensorImages(images[tr], labels[tr], [f"digits/{i}" for i in tr]),
        val=TensorImages(images[va], labels[va], [f"digits/{i}" for i in va]),
        classes=classes,
        in_channels=1,
        source=f"scikit-learn's bundled digits, split {1 - data_cfg.val_fraction:.0%}/{data_cfg.val_fraction:.0%} into "
        f"train/val (data.val_fraction, data.split_seed={data_cfg.split_seed})",
    )

"""Datasets, preprocessing and loader backends. Every loader yields on-device (images, targets)."""

from __future__ import annotations

from torchsprint.registry import Registry

DATASETS = Registry("dataset")
LOADERS = Registry("loader")

from torchsprint.data import cpu as _cpu  # noqa: E402,F401  (registers the cpu loader)
from torchsprint.data import datasets as _datasets  # noqa: E402,F401  (registers datasets)
from torchsprint.data import gpu as _gpu  # noqa: E402,F401  (registers the gpu loader)
from torchsprint.data import memory as _memory  # noqa: E402,F401  (registers the memory loader)
from torchsprint.data import multilabel as _multilabel  # noqa: E402,F401  (registers multi-label datasets)
from torchsprint.data import paired as _paired  # noqa: E402,F401  (registers paired image-to-image datasets)
from torchsprint.data import video as _video  # noqa: E402,F401  (registers video datasets and clip steps)
from torchsprint.data.dali import register_dali  # noqa: E402

register_dali()  # only when nvidia.dali imports
from torchsprint.data.core import DataInfo, Loaders, build_loaders  # noqa: E402

__all__ = ["DATASETS", "LOADERS", "DataInfo", "Loaders", "build_loaders"]

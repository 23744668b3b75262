"""Datasets, preprocessing and loader backends. Every loader yields on-device (images, targets).

Where things are: `core.py` (the DATASETS and LOADERS registries, the sampler), `build.py`
(`build_loaders`), `auto.py` (`data.backend: auto`), `sources/` (one file per dataset family; `webdataset.py`
for tar shards, read by `shard_stream.py`), `preprocess/` (decode, the transforms spec, its batched ops and
normalisation, augmentation, mix), `backends/` (one file per loader backend); the `torchsprint data` commands are in
commands/data/. This file only re-exports; importing `sources` and `backends` registers every dataset and backend.
"""

from __future__ import annotations

from torchsprint.data import backends, sources  # noqa: F401  (each module registers itself in core's registries)
from torchsprint.data.build import build_loaders
from torchsprint.data.core import DATASETS, LOADERS, DataInfo, Loaders

__all__ = ["DATASETS", "LOADERS", "DataInfo", "Loaders", "build_loaders"]

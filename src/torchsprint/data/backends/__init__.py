"""Loader backends, one file per backend; each registers itself in data.core.LOADERS on import
(dali only when NVIDIA DALI imports)."""

from torchsprint.data.backends import cpu, dali, gpu, memory  # noqa: F401

"""Dataset sources, one file per family; each registers its builders in data.core.DATASETS on import."""

from torchsprint.data.sources import cifar, digits, folders, multilabel, paired, synthetic, video, webdataset  # noqa: F401

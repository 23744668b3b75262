"""Dataset sources, one file per family; each registers its builders in data.core.DATASETS on import."""

from torchsprint.data.sources import folders, multilabel, paired, video  # noqa: F401

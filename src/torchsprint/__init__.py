"""torchsprint: train PyTorch vision models fast, with results you can trust."""

from torchsprint.version import __version__

__all__ = ["__version__"]

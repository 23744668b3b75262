"""torchsprint: train PyTorch vision models fast, with results you can trust."""

__version__ = "0.1.0"

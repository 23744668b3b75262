"""torchsprint: train PyTorch vision models fast, with results you can trust."""

import os

# run.deterministic on CUDA needs cuBLAS's deterministic workspace setting, and PyTorch reads the variable
# once, at the first cuBLAS call of the process (a static in ATen's Context::alertCuBLASConfigNotDeterministic):
# set in runtime.setup it came too late whenever a matrix product had run before (a non-deterministic run,
# then a deterministic one, in one process). ":4096:8" (8 x 4 MiB) is also PyTorch's default size on Hopper;
# a value the user set wins.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from torchsprint.version import __version__  # noqa: E402

__all__ = ["__version__"]

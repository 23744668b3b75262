"""Models: the MODELS registry and builders (core.py), built-in nets (nets.py), initialisation and freezing
(init.py). This file only re-exports; importing nets registers the built-in nets."""

from torchsprint.models import nets  # noqa: F401  (registers small_cnn, cifar_resnet18, ...)
from torchsprint.models.core import MODELS, adapt_in_channels, build_model, count_parameters

__all__ = ["MODELS", "build_model", "count_parameters", "adapt_in_channels"]

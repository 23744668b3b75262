"""The run's config: the schema (root and sections), reading files and overrides, a saved run's config."""

from torchsprint.config.files import MAX_DEPTH, deep_merge, read_file  # noqa: F401  (the face: `config.read_file`)
from torchsprint.config.schema import *  # noqa: F403  (the package's face: schema's names)

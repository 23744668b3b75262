"""The machine a run uses: device, ranks, seeds, collectives, parallel wrapping, SyncBN, preemption, launching."""

from torchsprint.runtime.core import *  # noqa: F403  (the package's face: core's names)

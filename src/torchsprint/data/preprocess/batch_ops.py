"""Batched preprocessing steps (the BATCH_OPS registry) for the memory and gpu backends.

Each step has `k` (uniforms it reads per sample); `params(u (B, k), hs, ws)` -> (parameters, output
heights, output widths) as CPU tensors; `fixes_size` (output size independent of the input);
`apply_one(img CHW, params, i)` for the per-image head; `apply_batch(x NCHW, params)` for the batched
tail, with per-sample parameters (never one coin for the whole batch). augment.py compiles a spec
into a pipeline of these steps and draws the uniforms.

The steps live by kind: batch_geometry.py (crops, resize, flips and `resample_batch`, the fused crop +
resize), batch_pixel.py (color_jitter, cutout), batch_auto_augment.py (rand_augment, trivial_augment_wide).
This module registers them, in that order; import an op from the module that defines it.
"""

from __future__ import annotations

from torchsprint.data.preprocess.batch_auto_augment import (
    AutoAugmentOps,
)
from torchsprint.data.preprocess.batch_geometry import (
    CenterCrop,
    Flip,
    RandomCrop,
    RandomResizedCrop,
    Resize,
)
from torchsprint.data.preprocess.batch_pixel import ColorJitter, Cutout
from torchsprint.registry import Registry

BATCH_OPS = Registry("batched transform")

BATCH_OPS.register("random_resized_crop")(RandomResizedCrop)
BATCH_OPS.register("resize")(Resize)
BATCH_OPS.register("center_crop")(CenterCrop)
BATCH_OPS.register("random_crop")(RandomCrop)
BATCH_OPS.register("hflip")(lambda p=0.5: Flip(p, -1))
BATCH_OPS.register("vflip")(lambda p=0.5: Flip(p, -2))
BATCH_OPS.register("cutout")(Cutout)
BATCH_OPS.register("color_jitter")(ColorJitter)
BATCH_OPS.register("rand_augment")(
    lambda num_ops=2, magnitude=9, num_magnitude_bins=31, interpolation="nearest", fill=None: AutoAugmentOps(
        "rand_augment", num_ops, magnitude, num_magnitude_bins, interpolation, fill
    )
)
BATCH_OPS.register("trivial_augment_wide")(
    lambda num_magnitude_bins=31, interpolation="nearest", fill=None: AutoAugmentOps(
        "trivial_augment_wide", 1, None, num_magnitude_bins, interpolation, fill
    )
)

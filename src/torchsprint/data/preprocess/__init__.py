"""Preprocessing: decode (bytes -> pixels), transforms (the spec), batch_ops and normalize (its batched and
on-device forms), augment (per-sample random parameters, the pipelines), mix (Mixup/CutMix).

Import the modules themselves; this face re-exports nothing.
"""

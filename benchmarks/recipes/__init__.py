"""Recipe switches (augmentations, Mixup/CutMix, EMA, label smoothing, distillation, progressive resizing): what
each costs in throughput and what it buys in accuracy."""

"""The tiny task runs of tests/e2e/tasks/test_task_everything.py (multilabel, image_to_image, video), for
numerics/amp_tolerance.py, which measures the spread the test's amp_bf16 bounds are set from.

A copy, since a benchmark imports nothing from tests/: tests/e2e/cli/test_benchmark_scripts.py holds it equal to the
test's (CFG, COMMON, EPOCHS, MONITOR), so the benchmark cannot drift from what the test runs. One difference, on
purpose: the video task reads `synthetic_video` (the whole balanced validation set), where the test registers
`synthetic_video_odd` (7 clips, for uneven DDP shards) and its amp test reads `synthetic_video` too.
"""

from __future__ import annotations

from pathlib import Path

CFG = {
    "multilabel": [
        "task=multilabel",
        "data.dataset=synthetic_multilabel",
        "model.args={width: 8}",
        "data.batch_size=16",
        "optim.lr=0.05",
        "data.options={num_images: 64, val_images: 15, size: 16}",
    ],
    "image_to_image": [
        "task=image_to_image",
        "data.dataset=synthetic_blur",
        "model.name=unet_small",
        "model.args={width: 8}",
        "data.batch_size=8",
        "optim.name=adam",
        "optim.lr=0.003",
        "optim.weight_decay=0",
        "data.options={num_images: 32, val_images: 7, size: 24}",
        "data.train.transforms=[{random_crop: 16}, hflip]",
    ],
    "video": [
        "task=video",
        "data.dataset=synthetic_video_odd",
        "model.name=small_3d_cnn",
        "model.args={width: 4}",
        "data.batch_size=8",
        "optim.name=adam",
        "optim.lr=0.01",
        "optim.weight_decay=0",
        "data.options={per_class: 8, val_per_class: 2, size: 16, frames: 8}",
        # no flips: classes are directions
        "data.train.transforms=[{random_clip: {frames: 4, stride: 1}}, {random_crop: 14}]",
        "data.eval.transforms=[{center_clip: {frames: 4}}, {center_crop: 14}]",
    ],
}
COMMON = ["log.tensorboard=false", "log.progress=false", "run.epochs=2", "log.every_steps=2"]
EPOCHS = {"multilabel": 8, "image_to_image": 24}  # the amp test's epochs (video: VIDEO below)
MONITOR = {"multilabel": "val/mAP", "image_to_image": "val/psnr", "video": "val/top1"}
# the amp test's video run: longer, on the balanced set
VIDEO = ["run.epochs=16", "model.args={width: 8}", "data.options={per_class: 8, val_per_class: 4, size: 16, frames: 8}"]


def amp_overrides(task: str, data_root: Path, run_dir: Path) -> list[str]:
    """The amp test's overrides of one task (precision and seed not included)."""
    over = [*CFG[task], *COMMON, f"data.root={data_root}", f"run.dir={run_dir}"]
    over += VIDEO if task == "video" else [f"run.epochs={EPOCHS[task]}"]
    return [o.replace("synthetic_video_odd", "synthetic_video") for o in over]

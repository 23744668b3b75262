"""task=video end to end on real MPEG-4 files decoded by PyAV: learning vs chance, clip sampling, bad videos counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchsprint import config
from torchsprint.errors import UsageError

pytest.importorskip("av")

CLIPS = ["data.train.transforms=[{random_clip: {frames: 6, stride: 1}}, {random_crop: 20}]",
         "data.eval.transforms=[{center_clip: {frames: 6}}, {center_crop: 20}]"]


def test_learns_direction_above_chance(tmp_path):
    from torchsprint.run import train

    cfg = config.load(None, ["task=video", "data.dataset=synthetic_video", f"data.root={tmp_path / 'data'}",
                             f"run.dir={tmp_path / 'run'}", "run.epochs=12", "log.tensorboard=false", "log.progress=false",
                             "model.name=small_3d_cnn", "model.args={width: 8}", "data.batch_size=8", "optim.name=adam",
                             "optim.lr=0.01", "optim.weight_decay=0", *CLIPS])
    s = train(cfg, quiet=True)
    chance = 1 / 4  # four directions, balanced validation set (4 videos each)
    assert s["final"]["val/count"] == 16
    assert s["final"]["val/top1"] >= chance + 0.25, s["final"]


def write(path, frames):
    from torchsprint.data.video import write_video

    path.parent.mkdir(parents=True, exist_ok=True)
    write_video(path, frames)


@pytest.mark.parametrize("on_bad", ["skip", "error"])
def test_unreadable_and_short_videos_are_named_and_counted(tmp_path, on_bad):
    from torchsprint import runtime
    from torchsprint.data import build_loaders

    g = np.random.default_rng(0)
    for c in ("a", "b"):
        for i in range(3):
            write(tmp_path / "v" / "train" / c / f"{i}.mp4", g.integers(0, 255, (8, 24, 24, 3), dtype=np.uint8))
    write(tmp_path / "v" / "train" / "a" / "short.mp4", g.integers(0, 255, (3, 24, 24, 3), dtype=np.uint8))
    (tmp_path / "v" / "train" / "b" / "broken.mp4").write_bytes(b"not a video at all" * 10)
    cfg = config.load(None, ["task=video", "data.dataset=video_folder", f"data.root={tmp_path / 'v'}", "data.batch_size=8",
                             "data.val_fraction=0", "data.drop_last=false", f"data.on_bad_sample={on_bad}", *CLIPS])
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)
    loaders.train.set_epoch(0)
    if on_bad == "error":
        with pytest.raises(UsageError, match=r"(short|broken)\.mp4"):
            list(loaders.train)
        return
    (x, y), = list(loaders.train)
    assert x.shape == (6, 6, 3, 20, 20) and y.tolist().count(0) == 3  # (N, T, C, H, W): the 6 good videos
    reasons = sorted(loaders.train.skipped)
    assert len(reasons) == 2
    text = "\n".join(reasons)
    assert "broken.mp4: unreadable video" in text and "short.mp4: 3 frames, shorter than one clip (6 frames)" in text


def test_clip_sampling_random_in_train_centred_in_eval():
    from torchsprint.data.video import Clip

    video = torch.arange(20).view(20, 1, 1, 1).expand(20, 3, 2, 2).to(torch.uint8)
    eval_clip = Clip(4, stride=3, random=False)
    assert eval_clip(video)[:, 0, 0, 0].tolist() == [5, 8, 11, 14]  # span 10 of 20, centred: start (20-10)//2
    starts = set()
    for seed in range(30):
        torch.manual_seed(seed)
        c = Clip(4, stride=3)(video)[:, 0, 0, 0].tolist()
        assert [b - a for a, b in zip(c, c[1:])] == [3, 3, 3]
        starts.add(c[0])
    assert len(starts) > 5 and max(starts) <= 10


def test_clip_step_required_and_video_models_registered():
    from torchsprint.data.video import clip_of
    from torchsprint.models import MODELS, build_model

    with pytest.raises(UsageError, match="random_clip"):
        clip_of([{"random_crop": 20}], "data.train.transforms")
    for name in ("r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v2_s", "small_3d_cnn"):
        assert name in MODELS
    m = build_model(config.load(None, ["model.name=r3d_18"]).model, 4, 3).eval()
    with torch.no_grad():
        assert m(torch.zeros(1, 4, 3, 32, 32)).shape == (1, 4)  # (N, T, C, H, W) in

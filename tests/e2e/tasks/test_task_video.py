"""task=video end to end on real MPEG-4 files decoded by PyAV: learning vs chance, clip sampling, bad videos counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchsprint import config
from torchsprint.errors import UsageError

pytest.importorskip("av")

CLIPS = [
    "data.train.transforms=[{random_clip: {frames: 6, stride: 1}}, {random_crop: 20}]",
    "data.eval.transforms=[{center_clip: {frames: 6}}, {center_crop: 20}]",
]


@pytest.mark.slow  # > 12 s on 2 cores: .ci/slow runs it (the main suite stays under 10 minutes)
def test_learns_direction_above_chance(tmp_path):
    from torchsprint.train.run import train

    cfg = config.load(
        None,
        [
            "task=video",
            "data.dataset=synthetic_video",
            f"data.root={tmp_path / 'data'}",
            f"run.dir={tmp_path / 'run'}",
            "run.epochs=12",
            "log.tensorboard=false",
            "log.progress=false",
            "model.name=small_3d_cnn",
            "model.args={width: 8}",
            "data.batch_size=8",
            "optim.name=adam",
            "optim.lr=0.01",
            "optim.weight_decay=0",
            *CLIPS,
        ],
    )
    s = train(cfg, quiet=True)
    chance = 1 / 4  # four directions, balanced validation set (4 videos each)
    assert s["final"]["val/count"] == 16
    assert s["final"]["val/top1"] >= chance + 0.25, s["final"]


def write(path, frames):
    from torchsprint.data.sources.video import write_video

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
    cfg = config.load(
        None,
        [
            "task=video",
            "data.dataset=video_folder",
            f"data.root={tmp_path / 'v'}",
            "data.batch_size=8",
            "data.val_fraction=0",
            "data.drop_last=false",
            f"data.on_bad_sample={on_bad}",
            *CLIPS,
        ],
    )
    loaders = build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)
    loaders.train.set_epoch(0)
    if on_bad == "error":
        with pytest.raises(UsageError, match=r"(short|broken)\.mp4"):
            list(loaders.train)
        return
    ((x, y),) = list(loaders.train)
    assert x.shape == (6, 6, 3, 20, 20) and y.tolist().count(0) == 3  # (N, T, C, H, W): the 6 good videos
    reasons = sorted(loaders.train.skipped)
    assert len(reasons) == 2
    text = "\n".join(reasons)
    assert "broken.mp4: unreadable video" in text and "short.mp4: 3 frames, shorter than one clip (6 frames)" in text


def test_clip_sampling_random_in_train_centred_in_eval():
    from torchsprint.data.sources.video import Clip

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
    from torchsprint.data.sources.video import clip_of
    from torchsprint.models import MODELS, build_model

    with pytest.raises(UsageError, match="random_clip"):
        clip_of([{"random_crop": 20}], "data.train.transforms")
    for name in ("r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v2_s", "small_3d_cnn"):
        assert name in MODELS
    m = build_model(config.load(None, ["model.name=r3d_18"]).model, 4, 3).eval()
    with torch.no_grad():
        assert m(torch.zeros(1, 4, 3, 32, 32)).shape == (1, 4)  # (N, T, C, H, W) in


# ---------------------------------------------------------------- multi-clip evaluation

TINY = [
    "task=video",
    "data.dataset=synthetic_video",
    "model.name=small_3d_cnn",
    "model.args={width: 4}",
    "data.batch_size=8",
    "data.options={per_class: 4, val_per_class: 2, size: 16, frames: 8}",
    "run.epochs=1",
    "log.tensorboard=false",
    "log.progress=false",
    "data.train.transforms=[{random_clip: {frames: 4}}, {random_crop: 14}]",
]


def eval_spec(step: str) -> str:
    return f"data.eval.transforms=[{step}, {{center_crop: 14}}]"


def test_multi_clip_positions_evenly_spaced_deterministic_and_k1_is_center_clip():
    from torchsprint.data.sources.video import Clip, MultiClip

    video = torch.arange(20).view(20, 1, 1, 1).expand(20, 3, 2, 2).to(torch.uint8)
    clips = MultiClip(4, stride=1, clips=4)(video)
    assert clips.shape == (4, 4, 3, 2, 2)  # (K, T, C, H, W)
    # slack 16 split in 4 parts of 4, each clip at a part's centre: starts 2, 6, 10, 14 (evenly spaced, symmetric)
    assert clips[:, :, 0, 0, 0].tolist() == [[s + i for i in range(4)] for s in (2, 6, 10, 14)]
    strided = MultiClip(3, stride=2, clips=2)(video)[:, :, 0, 0, 0].tolist()  # span 5, slack 15: starts 3, 11
    assert strided == [[3, 5, 7], [11, 13, 15]]
    torch.manual_seed(1)
    a = MultiClip(4, 2, 3)(video)
    torch.manual_seed(2)
    assert torch.equal(a, MultiClip(4, 2, 3)(video))  # no random draw
    for frames, stride, length in ((4, 1, 20), (4, 3, 20), (3, 2, 9), (5, 1, 5)):
        v = video[:length]
        assert torch.equal(MultiClip(frames, stride, clips=1)(v)[0], Clip(frames, stride, random=False)(v))


def test_multi_clip_logits_are_the_mean_over_clips():
    from torchsprint.data.sources.video import MultiClip
    from torchsprint.models.nets import small_3d_cnn

    torch.manual_seed(0)
    model = small_3d_cnn(num_classes=4, width=4)
    with torch.no_grad():  # non-trivial BatchNorm running statistics, as after training
        model.train()(torch.randn(6, 4, 3, 12, 12))
    model.eval()
    videos = torch.randn(2, 12, 3, 12, 12)  # (N, F, C, H, W), already normalised
    batch = torch.stack([MultiClip(4, stride=1, clips=3)(v) for v in videos])  # (N, K, T, C, H, W)
    assert batch.shape == (2, 3, 4, 3, 12, 12)
    with torch.no_grad():
        got = model(batch)
        # reference: slice each clip by hand (slack 8: starts 8//6, 24//6, 40//6) and run the model per clip
        ref = torch.stack([model(videos[:, s : s + 4]) for s in (1, 4, 6)]).mean(0)
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_multi_clip_in_training_spec_is_refused(tmp_path):
    from torchsprint import runtime
    from torchsprint.data import build_loaders

    cfg = config.load(
        None,
        TINY
        + [
            f"data.root={tmp_path / 'data'}",
            eval_spec("{center_clip: {frames: 4}}"),
            "data.train.transforms=[{multi_clip: {frames: 4, clips: 2}}]",
        ],
    )
    with pytest.raises(UsageError, match=r"data.train.transforms: multi_clip is for evaluation only.*random_clip"):
        build_loaders(cfg.data, runtime.Runtime(torch.device("cpu")), seed=0)


def test_multi_clip_eval_k1_equals_center_clip_and_export_takes_one_clip(tmp_path):
    import onnx

    from torchsprint.commands.export import export
    from torchsprint.train.evaluation import evaluate_run
    from torchsprint.train.run import train

    run = tmp_path / "run"
    cfg = config.load(
        None,
        TINY + [f"data.root={tmp_path / 'data'}", f"run.dir={run}", eval_spec("{multi_clip: {frames: 4, clips: 3}}")],
    )
    s = train(cfg, quiet=True)  # validation batches are (N, 3, 4, 3, 14, 14) during fit
    assert s["final"]["val/count"] == 8
    run_dir = run
    center = evaluate_run(run_dir, overrides=[eval_spec("{center_clip: {frames: 4}}")])
    one = evaluate_run(run_dir, overrides=[eval_spec("{multi_clip: {frames: 4, clips: 1}}")])
    assert one["count"] == center["count"] == 8
    assert one["top1"] == center["top1"] and one["confusion"] == center["confusion"]
    assert one["loss"] == pytest.approx(center["loss"], abs=1e-6)
    three = evaluate_run(run_dir)  # the run's own eval spec: 3 clips per video, as during fit
    assert three["count"] == 8 and three["top1"] == s["final"]["val/top1"]

    # export: the single-clip model (N, T, C, H, W), parity checked on each video's first clip
    r = export(run_dir, "onnx")
    assert r["max_abs_diff"] <= 1e-3 and r["images_checked"] == 8
    dims = onnx.load(r["path"]).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims][1:] == [4, 3, 14, 14]


def test_a_video_folder_says_what_it_left_out(tmp_path):
    """Files that are not samples are counted by why, as image_folder does, never read. Before: a FIFO named .mp4
    and a notes file were dropped without a word, and a macOS ._ copy was listed, decoded and failed as a bad
    sample."""
    import os

    from torchsprint.data import DATASETS
    from torchsprint.data.sources.folders import HIDDEN
    from torchsprint.data.sources.video import NOT_VIDEO
    from torchsprint.runtime.files import NOT_REGULAR

    g = np.random.default_rng(0)
    root = tmp_path / "v"
    for c in ("a", "b"):
        for i in range(2):
            write(root / "train" / c / f"{i}.mp4", g.integers(0, 255, (8, 24, 24, 3), dtype=np.uint8))
    os.mkfifo(root / "train" / "a" / "fifo.mp4")
    (root / "train" / "b" / "notes.txt").write_text("shot on a phone")
    (root / "train" / "b" / "._0.mp4").write_bytes(b"\x00\x05\x16\x07" * 8)
    cfg = config.load(
        None, ["task=video", "data.dataset=video_folder", f"data.root={root}", "data.val_fraction=0.5", *CLIPS]
    )
    splits = DATASETS.get("video_folder")(cfg.data)
    assert splits.skipped == {
        NOT_REGULAR: [str(root / "train/a/fifo.mp4")],
        NOT_VIDEO: [str(root / "train/b/notes.txt")],
        HIDDEN: [str(root / "train/b/._0.mp4")],
    }
    listed = sorted(p for p, _ in splits.train.samples + splits.val.samples)
    assert listed == sorted(str(root / "train" / c / f"{i}.mp4") for c in "ab" for i in range(2))

"""Video datasets (task=video): `video_folder` (class subfolders of video files) and the generated `synthetic_video`.

Decoder: PyAV (`av` on PyPI), whose wheels bundle FFmpeg, so `pip install` alone is enough on a
machine with only Python. torchcodec 0.17 was measured first: its wheel installs, but importing
VideoDecoder fails to load libtorchcodec_core without system FFmpeg shared libraries (libavutil...),
which pip cannot provide; torchvision 0.29 has no video decoding of its own any more.

Temporal sampling is a step of the spec, like a crop: `random_clip: {frames: T, stride: S}` in
data.train.transforms and `center_clip: {...}` in data.eval.transforms, drawn from the per-sample
seed like every other random step (exact resume). A clip is (T, C, H, W) uint8, frames first, so
the spatial steps (crop, flip, resize) apply the same parameters to every frame of a clip, and
per-channel normalisation broadcasts as for images. `multi_clip: {frames: T, stride: S, clips: K}`
(evaluation only) takes K evenly spaced clips, (K, T, C, H, W); batches are then (N, K, T, C, H, W)
and the video model wrapper (models.core.FramesFirst) averages the K clips' logits, so the engine
never knows. Videos too short for one clip, and unreadable
files, are bad samples: counted and named (data.on_bad_sample=skip) or an error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from torchsprint.data.core import DATASETS, MODE, Splits, check_options, existing_folder, need_root
from torchsprint.data.preprocess.transforms import TRANSFORMS, parse_step
from torchsprint.errors import UsageError

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v")
# a skipped-files reason (folders.NOT_IMAGE's)
NOT_VIDEO = f"not videos by their extension (videos: {', '.join(VIDEO_EXTENSIONS)})"
CLIP_STEPS = ("random_clip", "center_clip", "multi_clip")


class Clip:
    """Pick T frames `stride` apart from a (F, C, H, W) video: a random start (train) or the centred one (eval)."""

    def __init__(self, frames: int, stride: int = 1, random: bool = True):
        if frames < 1 or stride < 1:
            raise UsageError(f"{'random' if random else 'center'}_clip: frames and stride must be >= 1.")
        self.frames, self.stride, self.random = int(frames), int(stride), random

    @property
    def span(self) -> int:
        """Frames a clip covers in the source video."""
        return (self.frames - 1) * self.stride + 1

    def __call__(self, video: torch.Tensor) -> torch.Tensor:
        slack = video.shape[0] - self.span
        if slack < 0:  # VideoFiles checks lengths first; a direct call gets a clear error too
            raise ValueError(f"video has {video.shape[0]} frames, a clip needs {self.span}")
        start = int(torch.randint(slack + 1, ())) if self.random else slack // 2
        return video[start : start + self.span : self.stride]

    def __repr__(self) -> str:
        return f"Clip(frames={self.frames}, stride={self.stride}, random={self.random})"


@TRANSFORMS.register("random_clip")
def random_clip(frames: int = 8, stride: int = 1):
    """task=video: T = `frames` frames, `stride` apart, from a random start (training)."""
    return Clip(frames, stride, random=True)


@TRANSFORMS.register("center_clip")
def center_clip(frames: int = 8, stride: int = 1):
    """task=video: T = `frames` frames, `stride` apart, centred in the video (evaluation)."""
    return Clip(frames, stride, random=False)


class MultiClip:
    """K clips of T frames `stride` apart from a (F, C, H, W) video, evenly spaced: (K, T, C, H, W) (evaluation).

    Clip k starts at floor((2k + 1) * slack / (2K)), slack = F - span: the centre of the k-th of K equal
    parts of the possible starts, so K=1 is exactly center_clip's clip and the clips sit symmetrically
    in the video. Deterministic (no random draw). The model's prediction is the mean of the K clips' logits.
    """

    def __init__(self, frames: int, stride: int = 1, clips: int = 3):
        if frames < 1 or stride < 1 or clips < 1:
            raise UsageError("multi_clip: frames, stride and clips must be >= 1.")
        self.frames, self.stride, self.clips = int(frames), int(stride), int(clips)

    @property
    def span(self) -> int:
        """Frames one clip covers in the source video."""
        return (self.frames - 1) * self.stride + 1

    def starts(self, num_frames: int) -> list[int]:
        """First frame of each of the K clips in a video of `num_frames` frames."""
        slack = num_frames - self.span
        if slack < 0:
            raise ValueError(f"video has {num_frames} frames, a clip needs {self.span}")
        return [(2 * k + 1) * slack // (2 * self.clips) for k in range(self.clips)]

    def __call__(self, video: torch.Tensor) -> torch.Tensor:
        return torch.stack([video[s : s + self.span : self.stride] for s in self.starts(video.shape[0])])

    def __repr__(self) -> str:
        return f"MultiClip(frames={self.frames}, stride={self.stride}, clips={self.clips})"


@TRANSFORMS.register("multi_clip")
def multi_clip(frames: int = 8, stride: int = 1, clips: int = 3):
    """task=video, evaluation only: K = `clips` evenly spaced clips per video; the prediction averages their logits."""
    return MultiClip(frames, stride, clips)


def clip_of(spec: list, where: str, train: bool = False) -> Clip | MultiClip:
    """The spec's clip step, which must come first (it picks frames before any spatial step).

    `train`: the training spec, where multi_clip is refused (a training batch is one clip per video).
    """
    steps = [parse_step(s, where) for s in spec]
    if not steps or steps[0][0] not in CLIP_STEPS:
        raise UsageError(
            f"{where}: task=video needs a clip step first, e.g. [random_clip: {{frames: 8, stride: 2}}, ...] "
            f"for training and [center_clip: {{frames: 8, stride: 2}}, ...] for evaluation."
        )
    name, arg = steps[0]
    if train and name == "multi_clip":
        raise UsageError(
            f"{where}: multi_clip is for evaluation only (it averages the logits of K clips per video); "
            f"train on one clip per video with random_clip: {{frames: T, stride: S}} and put multi_clip "
            f"in data.eval.transforms."
        )
    return TRANSFORMS.get(name)(**(arg or {}))


def decode_video(path: str, channels: int = 3) -> torch.Tensor:
    """Every frame of a video file as (F, C, H, W) uint8 RGB (or gray), decoded by PyAV (FFmpeg)."""
    import av

    fmt = "gray" if channels == 1 else "rgb24"
    with av.open(path) as container:
        frames = [f.to_ndarray(format=fmt) for f in container.decode(video=0)]
    if not frames:
        raise ValueError("no video frames")
    arr = np.stack(frames)
    arr = arr[..., None] if arr.ndim == 3 else arr
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


class VideoFiles(torch.utils.data.Dataset):
    """(path, class index) videos decoded on access; unreadable or too-short ones yield
    (None, label, "path: reason")."""

    def __init__(self, samples: list[tuple[str, int]], min_frames: int, channels: int = 3):
        self.samples, self.min_frames, self.channels = samples, min_frames, channels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            video = decode_video(path, self.channels)
        except Exception as e:  # noqa: BLE001 - any decoder failure is a bad sample, named and counted
            return None, label, f"{path}: unreadable video ({type(e).__name__}: {str(e)[:120]})"
        if video.shape[0] < self.min_frames:
            return None, label, f"{path}: {video.shape[0]} frames, shorter than one clip ({self.min_frames} frames)"
        return video, label, path


def scan_video_folders(root: Path):
    """The classes, (path, class index) samples and what was left out by why below `root` (a folders.FolderScan),
    listed as image_folder lists images (folders.list_images): hidden files (macOS ._ copies of videos), other
    extensions, broken links and FIFOs or devices are counted and said at start-up, never read. Before, the others
    were dropped without a word and a ._ copy was decoded, to fail as a bad sample."""
    from torchsprint.data.sources.folders import FolderScan, list_images

    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UsageError(f"{root}: no class subfolders. video_folder expects <root>/<class>/<video> files.")
    samples, skipped, seen = [], {}, set()
    for ci, c in enumerate(classes):
        files, _ = list_images(root / c, skipped, seen, max_bytes=None, extensions=VIDEO_EXTENSIONS, other=NOT_VIDEO)
        samples += [(str(p), ci) for p in files]
    if not samples:
        raise UsageError(f"{root}: no videos ({', '.join(VIDEO_EXTENSIONS)}) in the class subfolders {classes[:5]}.")
    return FolderScan(classes, samples, skipped)


def video_splits(root: Path, data_cfg) -> Splits:
    try:
        import av  # noqa: F401
    except ImportError:
        raise UsageError("task=video decodes with PyAV: `pip install av` (its wheels bundle FFmpeg).") from None
    train_clip = clip_of(data_cfg.train.transforms, "data.train.transforms", train=True)
    eval_clip = clip_of(data_cfg.eval.transforms, "data.eval.transforms")
    if train_clip.frames != eval_clip.frames:
        raise UsageError(
            f"the train and eval clip steps take different frame counts ({train_clip.frames} vs "
            f"{eval_clip.frames}); the model sees T frames in both."
        )
    channels = 1 if data_cfg.options.get("mode", "RGB") == "GRAY" else 3
    from torchsprint.data.sources.folders import merge_skipped

    scans = [scan_video_folders(root / "train" if (root / "train").is_dir() else root)]
    if (root / "train").is_dir() and (root / "val").is_dir():
        scans.append(scan_video_folders(root / "val"))
    classes, train, skipped = scans[0].classes, scans[0].samples, merge_skipped(*scans)
    val = scans[1].samples if len(scans) > 1 else []
    if not val:
        from torchsprint.data.core import split_samples

        train, val = split_samples(train, data_cfg)
    return Splits(
        VideoFiles(train, train_clip.span, channels),
        VideoFiles(val, eval_clip.span, channels),
        classes,
        in_channels=channels,
        task="video",
        skipped=skipped,
    )


@DATASETS.register("video_folder")
def video_folder(data_cfg) -> Splits:
    """Class-per-subfolder videos (task=video): <root>/train/<class>/*.mp4 and <root>/val/<class>/* (or split by
    val_fraction).

    Clips come from the spec's first step: random_clip (train) / center_clip or multi_clip (eval). data.options: mode
    (RGB or GRAY).
    """
    check_options(data_cfg, MODE)
    root = existing_folder(need_root(data_cfg, "folder with train/ and val/ class subfolders of videos"))
    return video_splits(root, data_cfg)


# ---------------------------------------------------------------- synthetic_video

DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}
VIDEO_DEFAULTS = {"per_class": 12, "val_per_class": 4, "size": 24, "frames": 12, "seed": 0}


def write_video(path: Path, frames: np.ndarray, fps: int = 8) -> None:
    """Encode (F, H, W, 3) uint8 frames as MPEG-4 Part 2 in an .mp4 with PyAV (an encoder every FFmpeg build has)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.bit_rate = 400_000
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def render_moving(rng: np.random.Generator, direction: tuple[int, int], size: int, frames: int) -> np.ndarray:
    """(F, size, size, 3) uint8: a bright square moving 1 px per frame in `direction` over a noisy background."""
    sq, speed = max(4, size // 4), 1
    travel = speed * (frames - 1)
    if travel > size - sq:
        raise UsageError(
            f"synthetic_video: a {size}px frame cannot hold {frames} frames of motion; raise size or lower frames."
        )

    def start(d: int) -> int:  # the square stays inside the frame for the whole video
        if d > 0:
            return int(rng.integers(0, size - sq - travel + 1))
        if d < 0:
            return int(rng.integers(travel, size - sq + 1))
        return int(rng.integers(0, size - sq + 1))

    x, y = start(direction[0]), start(direction[1])
    bg = rng.uniform(30, 80) + rng.normal(0, 6, (size, size, 3))
    colour = rng.uniform(180, 255, 3)
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        img = bg.copy()
        cx, cy = x + direction[0] * speed * t, y + direction[1] * speed * t
        img[max(cy, 0) : cy + sq, max(cx, 0) : cx + sq] = colour
        out[t] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def generate_moving_shapes(
    folder: Path, *, per_class: int, val_per_class: int, size: int, frames: int, seed: int
) -> Path:
    """Write folder/{train,val}/<direction>/<i>.mp4 once (real MPEG-4 files); reuse a complete folder."""
    from torchsprint.data.sources.synthetic import generate_once

    def write(tmp: Path) -> None:
        rng = np.random.default_rng(seed)
        for split, n in (("train", per_class), ("val", val_per_class)):
            for name, d in DIRECTIONS.items():
                (tmp / split / name).mkdir(parents=True)
                for i in range(n):
                    write_video(tmp / split / name / f"{i:04d}.mp4", render_moving(rng, d, size, frames))

    return generate_once(
        folder,
        {"per_class": per_class, "val_per_class": val_per_class, "size": size, "frames": frames, "seed": seed},
        write,
    )


@DATASETS.register("synthetic_video")
def synthetic_video(data_cfg) -> Splits:
    """Generated MPEG-4 clips of a square moving right/left/down/up (the class), made once under data.root (task=video).

    data.options: per_class (12 train videos), val_per_class (4), size (24 px), frames (12), seed (0).
    """
    need_root(data_cfg, "folder to generate the videos into")
    check_options(data_cfg, {k: f"default {v}" for k, v in VIDEO_DEFAULTS.items()})
    p = VIDEO_DEFAULTS | data_cfg.options
    folder = Path(data_cfg.root).expanduser() / (
        f"synthetic_video-n{p['per_class']}-v{p['val_per_class']}-{p['size']}px-f{p['frames']}-s{p['seed']}"
    )
    generate_moving_shapes(folder, **p)
    splits = video_splits(folder, data_cfg.model_copy(update={"options": {}}))
    # The classes are motion directions: a flip would show a 'left' clip moving right, labelled 'left'.
    splits.label_changing = {
        "hflip": "mirrors left and right motion, so a 'left' clip would move right",
        "vflip": "mirrors up and down motion, so an 'up' clip would move down",
    }
    return splits

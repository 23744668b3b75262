"""A data.root given alone: which dataset it holds (detected from its files), and the defaults that fit its images.

Called once, from config validation (config.Config), so the resolved settings are the config every
command reads and config.yaml keeps; what was chosen and why is kept beside it (Config.chosen) for the
start-up summary and decisions.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from torchsprint.errors import UsageError


@dataclass(frozen=True)
class Choice:
    """A setting torchsprint chose because the config left it unset: its value, why, and how to choose otherwise."""

    setting: str  # the dotted config key, e.g. data.dataset
    value: object
    why: str
    override: str

    def as_dict(self) -> dict:
        return asdict(self)


# The dataset a folder holds under a task that is not about class labels per image.
TASK_FOLDERS = {"video": "video_folder", "image_to_image": "paired_folder"}


def detect_dataset(root: str, task: str) -> tuple[str, str]:
    """(dataset name, what was found) for `data.root=root` without data.dataset, checked in this order:

    1. a .csv/.txt/.tsv/.lst file: a list of `path,label` lines (file_list; multilabel_csv for task=multilabel);
    2. a folder with train-*.tar: WebDataset shards (webdataset);
    3. a folder with a train.csv (or .txt, .tsv, .lst) list: file_list (multilabel_csv for task=multilabel);
    4. a folder of class folders, or of train/ and val/ (and test/) split folders of class folders (image_folder).
    Anything else is a UsageError saying what was found and what is expected.
    """
    from torchsprint.data.sources.folders import LIST_SUFFIXES, _find_list, _listing, find_layout

    path = Path(root).expanduser()
    listed = "multilabel_csv" if task == "multilabel" else "file_list"
    if not path.exists():
        raise UsageError(
            f"data.root={root} does not exist. Give a folder of class folders (or of train/ and val/), "
            "WebDataset shards, or a .csv list of `path,label` lines."
        )
    if task in TASK_FOLDERS:
        return TASK_FOLDERS[task], f"task={task} reads a {TASK_FOLDERS[task]} at {path}"
    if path.is_file():
        if path.suffix.lower() in LIST_SUFFIXES:
            return listed, f"{path.name} is a list of labelled files"
        raise UsageError(
            f"data.root={root} is a {path.suffix or 'suffix-less'} file, neither a folder of images nor a "
            f"list ({', '.join(LIST_SUFFIXES)}). Give the folder that holds the images, or set data.dataset."
        )
    shards = sorted(path.glob("train-*.tar"))
    if shards:
        return "webdataset", f"{len(shards)} WebDataset shard(s) {path}/train-*.tar"
    lst = _find_list(path, "train")
    if lst is not None:
        return listed, f"a list of labelled files {lst}"
    if any(path.glob("*.tar")):
        raise UsageError(
            f"data.root={root} holds .tar files but none named train-*.tar: for WebDataset shards set "
            "data.dataset=webdataset and data.options.train=<shard pattern> (and .val)."
        )
    layout = find_layout(path)  # refuses the layouts it would misread, showing what is there
    if layout["train"] is not None:
        where = " and ".join(f"{path}/{layout[k].name}" for k in ("train", "val", "test") if layout[k] is not None)
        return "image_folder", f"class folders under {where}"
    if not any(p.is_dir() and not p.name.startswith(".") for p in path.iterdir()):
        raise UsageError(
            f"data.root={root} holds {_listing(path)}, no class folders: put each class's images in a "
            f"folder named after it (<root>/<class>/<image>), or give train/ and val/ folders of them, "
            "WebDataset shards (train-*.tar) or a train.csv list; or set data.dataset."
        )
    return "image_folder", f"class folders under {path} (split by data.val_fraction)"


# ---------------------------------------------------------------- defaults that fit the images

# A median short side at most this is "digits-sized" (digits 8, MNIST 28, CIFAR 32 px): the native size and the
# built-in small_cnn stay the defaults, as for the default run.
DIGITS_SIZED = 32
# The training size's cap: 224 px on a GPU (torchvision's and timm's ImageNet recipes, fastai's and Ultralytics'
# default); 128 px on a CPU, where 224 px costs ~3x the time per image (the pixel count) for little accuracy on
# a run of a few epochs from scratch (BENCHMARKS.md, "Defaults for your own photos").
SIZE_CAP = {"cuda": 224, "cpu": 128}
# The default model for larger images: torchvision's ResNet-18. Evidence so far is a user's report measured on the
# 2-core CPU (ResNet-18 at 128 px: 39 img/s training, top-1 within one standard error of timm's train.py on a real
# 2,624-image folder; small_cnn: 2 img/s at 300 px, 35 at 64 px). benchmarks/defaults/photo_defaults.py measured it
# against mobilenet_v3_small on 2,000 generated 300x300 photos (BENCHMARKS.md "Defaults for your own photos: the
# model"): 0.994 val top-1 after 3 epochs against chance for mobilenet_v3_small (5.3x faster, not learning at that lr).
PHOTO_MODEL = "resnet18"
# The random crop keeps at least this share of the image (fastai's examples' min_scale; torchvision's 0.08 suits
# ImageNet's 90+ epochs, not a run of a few epochs on a small folder).
CROP_SCALE = (0.35, 1.0)
# The photo model's learning rate when optim.lr is unset: 0.1 per 256 images of the batch (torchvision's ResNet
# recipe, the linear scaling rule of Goyal et al. 2017), with a linear warm-up over the first epoch. The project's
# default lr (0.1, made for small_cnn on digits at batch 64) kept ResNet-18 at the majority class on generated photos
# (3 epochs at 128 px, batch 64: train loss 2.74 after epoch 1, val top-1 0.55 = the majority's share; with 0.025
# and the warm-up: 0.83 after epoch 2, val top-1 0.77; BENCHMARKS.md "Defaults for your own photos").
PHOTO_LR_PER_256 = 0.1
PHOTO_WARMUP_EPOCHS = 1.0
SAMPLED = 64  # images measured for the size rule (headers only)
GREY_MODES = ("L", "LA", "I", "I;16", "I;16B", "I;16L", "1")


def training_size(short_sides: list[int], device_type: str) -> int:
    """The size rule: the median image's short side, capped at SIZE_CAP (224 GPU, 128 CPU), rounded down to
    a multiple of 32, at least 32."""
    import statistics

    median = int(statistics.median_low(short_sides))
    return max(32, min(median, SIZE_CAP.get(device_type, SIZE_CAP["cpu"])) // 32 * 32)


def sample_paths(data_cfg, n: int = SAMPLED) -> list[str]:
    """Up to `n` training image paths spread over the classes (image_folder) or the list (file_list,
    multilabel_csv), without listing every file; [] for datasets that are not image files on disk."""
    import os

    from torchsprint.data.sources.folders import IMAGE_EXTENSIONS, _find_list, find_layout, read_file_list

    root = Path(data_cfg.root).expanduser()
    if data_cfg.dataset == "image_folder" and root.is_dir():
        try:
            layout = find_layout(root)
        except UsageError:
            return []  # a layout it would misread: image_folder refuses it when the data is built, saying why
        top = layout["train"] or root
        classes = sorted(p for p in top.iterdir() if p.is_dir() and not p.name.startswith("."))
        per = max(1, -(-n // max(1, len(classes))))
        out = []
        for c in classes:
            took = 0
            for dirpath, dirs, files in os.walk(c, followlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS:
                        out.append(os.path.join(dirpath, f))
                        took += 1
                        if took >= per:
                            break
                if took >= per:
                    break
        return out[:n]
    if data_cfg.dataset in ("file_list", "multilabel_csv"):
        lst = root if root.is_file() else _find_list(root, "train") if root.is_dir() else None
        if lst is None:
            return []
        try:
            rows = read_file_list(lst)
        except UsageError:
            return []  # the dataset itself says what is wrong with the list
        return [p for p, _ in rows[:: max(1, len(rows) // n)]][:n]
    return []


# A tiny folder (fewer than TINY_STEPS x the default batch of training images) trains at a batch that gives each
# epoch TINY_STEPS optimizer steps, at least TINY_MIN_BATCH: at the default 64, 32 training images made one step an
# epoch (ten steps in a default run). The lr rules scale with the batch (step_batch), so they follow it.
TINY_STEPS = 8
TINY_MIN_BATCH = 8
DEFAULT_BATCH = 64


def training_images(data_cfg, limit: int) -> int | None:
    """The training images of an image_folder or file_list (the val_fraction share taken off where the data has no
    val split), counted up to `limit` (a large folder is not listed whole); None for other datasets."""
    import os

    from torchsprint.data.sources.folders import IMAGE_EXTENSIONS, _find_list, find_layout, read_file_list

    root = Path(data_cfg.root).expanduser()
    n, split = 0, False
    if data_cfg.dataset == "image_folder" and root.is_dir():
        try:
            layout = find_layout(root)
        except UsageError:
            return None
        split = layout["val"] is not None
        for _dirpath, dirs, files in os.walk(layout["train"] or root, followlinks=False):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            n += sum(1 for f in files if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS)
            if n >= limit:
                return n
    elif data_cfg.dataset == "file_list":
        lst = root if root.is_file() else _find_list(root, "train") if root.is_dir() else None
        if lst is None:
            return None
        try:
            n = len(read_file_list(lst))
        except UsageError:
            return None
        split = root.is_dir() and _find_list(root, "val") is not None
    else:
        return None
    return n if split else int(n * (1 - data_cfg.val_fraction))


def tiny_folder_batch(cfg) -> list[Choice]:
    """data.batch_size for a tiny folder (TINY_STEPS), where the config sets no batch and one process trains."""
    data = cfg.data
    if (
        "batch_size" in data.model_fields_set
        or data.effective_batch_size is not None
        or cfg.strategy.name == "ddp"
        or cfg.optim.accum_steps != 1
    ):
        return []
    n = training_images(data, TINY_STEPS * DEFAULT_BATCH)
    if n is None or n >= TINY_STEPS * DEFAULT_BATCH:
        return []
    batch = max(TINY_MIN_BATCH, 1 << max(0, (n // TINY_STEPS).bit_length() - 1))  # a power of two, n/8 or below
    if batch >= DEFAULT_BATCH:
        return []
    data.batch_size = batch
    return [
        Choice(
            "data.batch_size",
            batch,
            f"{n} training images: at the default {DEFAULT_BATCH} an epoch would be "
            f"{max(1, n // DEFAULT_BATCH)} optimizer step(s); {batch} gives {n // batch} (rule: about {TINY_STEPS} "
            f"steps an epoch, a power of two, at least {TINY_MIN_BATCH})",
            "set data.batch_size",
        )
    ]


def measure(paths: list[str]) -> tuple[list[tuple[int, int]], list[str]]:
    """(width, height) and Pillow mode of each readable file (headers only); unreadable files are left to the loader."""
    from PIL import Image

    from torchsprint.runtime.files import open_regular

    sizes, modes = [], []
    for p in paths:
        try:  # open_regular: a FIFO among the files would block open(), a device never end
            with open_regular(p) as f, Image.open(f) as im:
                sizes.append(im.size)
                modes.append(im.mode)
        except Exception:  # noqa: BLE001 - data.on_bad_sample reports unreadable files when they load
            continue
    return sizes, modes


def photo_defaults(cfg, start=None) -> list[Choice]:
    """data.train/eval.transforms, model.name and the grey-channel decision for a folder of larger images.

    `start(cfg, chosen)`: how a model on photo-sized images starts, given what was chosen so far (models/start.py's
    `photo_start` from config validation: published weights fine-tuned, or from scratch); None: photo_schedule,
    from scratch.

    Applied where the config leaves them unset: the transforms when neither data.train.transforms nor
    data.eval.transforms is set and the images are larger than DIGITS_SIZED or of different sizes; the model
    when model.name and model.pretrained are unset, the transforms were chosen here and the images are larger than
    DIGITS_SIZED (digits-sized images of mixed sizes are resized, and keep small_cnn).
    """
    import torch

    data, chosen = cfg.data, []
    paths = sample_paths(data)
    sizes, modes = measure(paths)
    if not sizes:
        return chosen
    shorts = [min(w, h) for w, h in sizes]
    mixed = len(set(sizes)) > 1
    device = (
        "cuda"
        if cfg.run.device.startswith("cuda") or (cfg.run.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    unset = "transforms" not in data.train.model_fields_set and "transforms" not in data.eval.model_fields_set
    picked_size = False
    import statistics

    median = int(statistics.median_low(shorts))
    if unset and (median > DIGITS_SIZED or mixed):
        size = training_size(shorts, device)
        resize = (
            int(size / 0.875) // 2 * 2
        )  # eval: resize the short side to size/0.875, then crop (torchvision's 256->224)
        data.train.transforms = [{"random_resized_crop": {"size": size, "scale": list(CROP_SCALE)}}, "hflip"]
        data.eval.transforms = [{"resize": resize}, {"center_crop": size}]
        picked_size = True
        lo, hi = min(shorts), max(shorts)
        why = (
            f"the median short side of {len(sizes)} sampled images is {median} px "
            f"({lo}-{hi}){', sizes differ' if mixed else ''}; rule: the median short side capped at {SIZE_CAP[device]} "
            f"on {device} (224 on a GPU, 128 on a CPU), rounded down to a multiple of 32, at least 32 -> {size}"
        )
        chosen.append(
            Choice(
                "data.train.transforms",
                data.train.transforms,
                f"{why}; a random crop of {CROP_SCALE[0]:.0%}-100% of the image resized to {size}x{size}, "
                "and a horizontal flip",
                "set data.train.transforms (and data.eval.transforms)",
            )
        )
        chosen.append(
            Choice(
                "data.eval.transforms",
                data.eval.transforms,
                f"the short side resized to {resize}, the centre {size}x{size} cut out (the same size as "
                "training; predict and export use it too)",
                "set data.eval.transforms",
            )
        )
    if (
        picked_size
        and median > DIGITS_SIZED
        and "name" not in cfg.model.model_fields_set
        and cfg.model.pretrained is None
    ):
        cfg.model.name = PHOTO_MODEL
        chosen.append(
            Choice(
                "model.name",
                PHOTO_MODEL,
                f"images of {size}x{size} px: torchvision's ResNet-18, 0.994 val top-1 after 3 "
                "epochs at 128 px on 2,000 generated photos on a 2-core CPU, where small_cnn (made for 8x8 "
                "digits) trained 3.7 img/s at 300 px "
                '(BENCHMARKS.md, "Defaults for your own photos: the model")',
                "set model.name (`torchsprint list models`)",
            )
        )
    if modes and all(m in GREY_MODES for m in modes) and "mode" not in data.options and data.dataset != "webdataset":
        chosen.append(
            Choice(
                "data.options.mode",
                "RGB",
                f"all {len(modes)} sampled images are grey: each is read as 3 "
                "identical channels, which every registered model and pretrained weights take",
                "data.options.mode=GRAY keeps 1 channel (a third of the memory; models get in_channels=1)",
            )
        )
    if median > DIGITS_SIZED:
        chosen += tiny_folder_batch(cfg)  # before the lr rules, which scale with the batch
        # Any model on photos, the one picked here or one the user named: the default lr (0.1, made for small_cnn on
        # digits at batch 64) is as wrong for a user's resnet50 as for the picked ResNet-18.
        chosen += start(cfg, chosen) if start is not None else photo_schedule(cfg)
    return chosen


def step_batch(cfg) -> tuple[int, str]:
    """The batch of one optimizer step and how it was read: data.batch_size x optim.accum_steps x the DDP processes,
    or data.effective_batch_size when set (data.batch_size=auto: 64, the default batch)."""
    from torchsprint.runtime.core import launch_env

    optim = cfg.optim
    # DDP: every process trains data.batch_size, so one optimizer step sees world x that (the launcher's WORLD_SIZE,
    # which each worker has when its config is read); data.effective_batch_size is that global figure already.
    world = launch_env().world_size if cfg.strategy.name == "ddp" else 1
    times = f" x {world} processes" if world > 1 else ""
    if cfg.data.effective_batch_size is not None:
        batch, which = cfg.data.effective_batch_size, "data.effective_batch_size"
    elif isinstance(cfg.data.batch_size, int):
        batch, which = cfg.data.batch_size * optim.accum_steps * world, f"data.batch_size x optim.accum_steps{times}"
    else:
        batch, which = 64 * world, f"data.batch_size=auto: taken as 64{times}"
    return batch, which


def lr_unset(cfg) -> bool:
    """Whether the config leaves the optimizer and its learning rate to the defaults (the lr rules may set it)."""
    return "name" not in cfg.optim.model_fields_set and "lr" not in cfg.optim.model_fields_set


def photo_schedule(cfg) -> list[Choice]:
    """optim.lr and sched.warmup_epochs for a model trained from scratch on photos (picked or named), where the config
    leaves the optimizer's name, its lr and the warm-up unset (PHOTO_LR_PER_256 x step_batch / 256,
    PHOTO_WARMUP_EPOCHS)."""
    optim, sched, chosen = cfg.optim, cfg.sched, []
    if not lr_unset(cfg):
        return chosen
    batch, which = step_batch(cfg)
    optim.lr = round(PHOTO_LR_PER_256 * batch / 256, 12)
    chosen.append(
        Choice(
            "optim.lr",
            optim.lr,
            f"{PHOTO_LR_PER_256} per 256 images of the batch (torchvision's ResNet "
            f"recipe, the linear scaling rule) x {batch} ({which}); the default 0.1 is made for small_cnn on "
            "digits and kept ResNet-18 at the majority class on photos",
            "set optim.lr",
        )
    )
    if "warmup_epochs" not in sched.model_fields_set:
        sched.warmup_epochs = PHOTO_WARMUP_EPOCHS
        chosen.append(
            Choice(
                "sched.warmup_epochs",
                PHOTO_WARMUP_EPOCHS,
                "a linear warm-up over the first epoch "
                "(from sched.warmup_start x optim.lr), as torchvision's and timm's ResNet recipes do, so the "
                "first steps of a model trained from scratch do not diverge",
                "set sched.warmup_epochs",
            )
        )
    return chosen


def resolve(cfg, start=None) -> list[Choice]:
    """Fill what the config leaves unset and the data decides; returns what was chosen (applied to `cfg`).

    data.dataset: when data.root is set without it (an explicit data.dataset always wins; no data.root:
    the default digits run). Then, for image files on disk, photo_defaults (transforms, model, channels, and how the
    model starts: `start`, see photo_defaults).
    """
    chosen = []
    data = cfg.data
    if data.root is not None and "dataset" not in data.model_fields_set:
        name, found = detect_dataset(data.root, cfg.task)
        data.dataset = name
        chosen.append(Choice("data.dataset", name, f"detected: {found}", "set data.dataset"))
    if data.root is not None and cfg.task in ("classification", "multilabel"):
        chosen += photo_defaults(cfg, start)
    return chosen

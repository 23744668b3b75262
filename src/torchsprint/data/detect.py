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
        raise UsageError(f"data.root={root} does not exist. Give a folder of class folders (or of train/ and val/), "
                         "WebDataset shards, or a .csv list of `path,label` lines.")
    if task in TASK_FOLDERS:
        return TASK_FOLDERS[task], f"task={task} reads a {TASK_FOLDERS[task]} at {path}"
    if path.is_file():
        if path.suffix.lower() in LIST_SUFFIXES:
            return listed, f"{path.name} is a list of labelled files"
        raise UsageError(f"data.root={root} is a {path.suffix or 'suffix-less'} file, neither a folder of images nor a "
                         f"list ({', '.join(LIST_SUFFIXES)}). Give the folder that holds the images, or set data.dataset.")
    shards = sorted(path.glob("train-*.tar"))
    if shards:
        return "webdataset", f"{len(shards)} WebDataset shard(s) {path}/train-*.tar"
    lst = _find_list(path, "train")
    if lst is not None:
        return listed, f"a list of labelled files {lst}"
    if any(path.glob("*.tar")):
        raise UsageError(f"data.root={root} holds .tar files but none named train-*.tar: for WebDataset shards set "
                         "data.dataset=webdataset and data.options.train=<shard pattern> (and .val).")
    layout = find_layout(path)  # refuses the layouts it would misread, showing what is there
    if layout["train"] is not None:
        where = " and ".join(f"{path}/{layout[k].name}" for k in ("train", "val", "test") if layout[k] is not None)
        return "image_folder", f"class folders under {where}"
    if not any(p.is_dir() and not p.name.startswith(".") for p in path.iterdir()):
        raise UsageError(f"data.root={root} holds {_listing(path)}, no class folders: put each class's images in a "
                         f"folder named after it (<root>/<class>/<image>), or give train/ and val/ folders of them, "
                         "WebDataset shards (train-*.tar) or a train.csv list; or set data.dataset.")
    return "image_folder", f"class folders under {path} (split by data.val_fraction)"


def resolve(cfg) -> list[Choice]:
    """Fill what the config leaves unset and the data decides; returns what was chosen (applied to `cfg`).

    data.dataset: when data.root is set without it (an explicit data.dataset always wins; no data.root:
    the default digits run).
    """
    chosen = []
    data = cfg.data
    if data.root is not None and "dataset" not in data.model_fields_set:
        name, found = detect_dataset(data.root, cfg.task)
        data.dataset = name
        chosen.append(Choice("data.dataset", name, f"detected: {found}", "set data.dataset"))
    return chosen

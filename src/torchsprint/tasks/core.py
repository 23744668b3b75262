"""TASKS registry: what a run learns (classification, multilabel, image_to_image, video) as one object.

A Task supplies everything that differs between learning problems, so that the engine, the CLI
and the exporter never ask which task they run (DESIGN rule 3): the default loss and
`checkpoint.monitor`, a metrics factory (update(output, target, loss) / compute(), reduced across
DDP ranks), the extra artifacts written with the best weights, the one-line evaluation summary,
the predict post-processing, and which loader backends / export formats it supports (anything
else is refused with a UsageError naming the combination, never run silently wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

TASKS = Registry("task", listed="tasks")


@dataclass(frozen=True)
class Task:
    """One learning problem. Fields are plain values and functions, no inheritance (DESIGN rule 8).

    Attributes:
        name: the `task:` value.
        loss: default loss name (used when the config does not name one).
        monitor, mode: default `checkpoint.monitor` / `checkpoint.mode`.
        make_metrics: (DataInfo, eval config section, device) -> metrics object.
        summary: validation metrics dict (keys 'val/...') -> one log line.
        write_artifacts: (run_dir, validation metrics, DataInfo, weights) -> the names of the files written, called on
            rank 0 for the best weights (when they improve) and for the last ones (at the end). `weights` says
            which weights the metrics come from ({"weights": "best" | "last", "file", "epoch", "step"}); every
            file and figure names them (artifact_name, and inside where the format has room).
        postprocess: (model outputs float32 CPU, classes, options dict) -> one result dict per sample.
        backends: loader backends that deliver this task's batches correctly; None: any (plain image
            batches with class targets, which every backend, a user's own included, delivers).
        export_formats: export formats whose parity check applies to this task's outputs.
        example: raw uint8 loader batch -> the model's uint8 input (export's parity batch).
        channels_last: whether speed.channels_last applies (4-D image batches only).
        data_task: which datasets it takes, by their Splits.task (None: datasets made for `name`), so a
            variant of classification (another monitor, another metric) trains on classification datasets.
    """

    name: str
    loss: str
    monitor: str
    mode: str
    make_metrics: Callable
    summary: Callable[[dict], str]
    write_artifacts: Callable
    postprocess: Callable
    backends: tuple[str, ...] | None = None
    export_formats: tuple[str, ...] = ("onnx", "safetensors", "torchscript", "tensorrt")
    example: Callable = field(default=lambda x, in_channels: x)
    channels_last: bool = True
    unsupported: dict = field(default_factory=dict)  # feature ("predict", "bench", ...) -> why it is refused
    data_task: str | None = None  # the kind of samples it trains on (a dataset's Splits.task); None: `name`
    min_classes: int = 2  # one class is nothing to tell apart (torchmetrics refuses it too)
    targets: str = "class_index"  # what the loss compares outputs with: class_index, multi_hot or image (optim.loss)
    eval_fields: tuple[str, ...] = ("topk", "per_class")  # the `eval` settings its metrics read (besides every_epochs)
    artifact_files: tuple[
        str, ...
    ] = ()  # what write_artifacts may write for the best weights (artifact_name: the last's)

    def artifacts(self, weights: str) -> list[str]:
        """The file names write_artifacts uses for the `weights` ("best" or "last") weights."""
        return [artifact_name(n, weights) for n in self.artifact_files]

    def check(self, cfg) -> None:
        """Refuse config combinations this task cannot run correctly, naming them and what to do instead."""
        if self.backends is not None and cfg.data.backend not in (*self.backends, "auto"):
            raise UsageError(
                f"task={self.name} does not support data.backend={cfg.data.backend} (supported: "
                f"{', '.join(self.backends)}). Set data.backend={self.backends[0]}."
            )
        if cfg.data.progressive.start_size is not None and "progressive" in self.unsupported:
            raise UsageError(
                f"task={self.name}: data.progressive is not supported: {self.unsupported['progressive']} "
                "Remove data.progressive."
            )
        if cfg.speed.channels_last is True and not self.channels_last:
            raise UsageError(
                f"task={self.name}: speed.channels_last applies to 4-D "
                "image batches only; set speed.channels_last=false."
            )
        from torchsprint.tasks.tta import plan_tta

        plan_tta(cfg.eval.tta, self, cfg.data.eval.transforms)  # refuses eval.tta where it has no meaning
        for key in ("topk", "per_class", "threshold"):
            value = getattr(cfg.eval, key)
            if key not in self.eval_fields and value != type(cfg.eval).model_fields[key].default:
                raise UsageError(
                    f"eval.{key}={value}: task={self.name} does not use it (it reads "
                    f"{', '.join('eval.' + k for k in self.eval_fields) or 'no eval setting but every_epochs'}); "
                    "remove it."
                )

    def check_export(self, fmt: str) -> None:
        if fmt not in self.export_formats:
            raise UsageError(
                f"task={self.name}: export --format {fmt} is not supported (supported: "
                f"{', '.join(self.export_formats)})."
            )


def get_task(name: str) -> Task:
    """The Task registered as `name` (a UsageError with the closest names otherwise)."""
    return TASKS.get(name)()


def apply_defaults(cfg) -> None:
    """Fill the task's default loss and checkpoint.monitor/mode where the config does not set them.

    Written into the section's __dict__, past pydantic's validating __setattr__ (the values are the task's own
    constants), so that they stay unset in `model_fields_set`: a default the task fills is not the user's choice
    (Config.set_by_user; train/imbalance.py changes the monitor only where the user set none)."""
    task = get_task(cfg.task)
    if "name" not in cfg.loss.model_fields_set and not cfg.loss.terms:
        cfg.loss.__dict__["name"] = task.loss
    if "monitor" not in cfg.checkpoint.model_fields_set:
        cfg.checkpoint.__dict__["monitor"] = task.monitor
    if "mode" not in cfg.checkpoint.model_fields_set:
        cfg.checkpoint.__dict__["mode"] = task.mode


def check_data_task(cfg, info) -> None:
    """The dataset's kind of targets must match `task:` (a paired dataset cannot train a classifier)."""
    task = get_task(cfg.task)
    wanted = task.data_task or cfg.task
    if info.task != wanted:
        raise UsageError(
            f"data.dataset={cfg.data.dataset} provides {info.task} samples but task={cfg.task}. "
            f"Set task: {info.task}, or pick a dataset made for task={cfg.task}."
        )
    if info.num_classes < task.min_classes:
        found = f"{info.num_classes} class ({', '.join(info.classes)})" if info.classes else "no classes"
        raise UsageError(
            f"data.dataset={cfg.data.dataset} (root {cfg.data.root}) has {found}: task={cfg.task} needs at "
            f"least {task.min_classes} to tell apart. Add a folder (or label) per class."
        )


# ---------------------------------------------------------------- classification (and video)


def _classification_metrics(info, eval_cfg, device):
    from torchsprint.tasks.metrics import ClassificationMetrics

    return ClassificationMetrics(info.num_classes, eval_cfg.topk, eval_cfg.per_class, device, info.classes)


# Above this ratio of the largest to the smallest validation class, the epoch line adds the figures that expose
# a majority-class model (balanced accuracy, the weakest class's recall). 1.5: a 60/40 split already lets
# "always the majority" score 60% top-1.
IMBALANCED = 1.5


def _classification_summary(ev: dict) -> str:
    top = "".join(f"  {k[4:]} {v:.4f}" for k, v in ev.items() if k.startswith("val/top") and k != "val/top1")
    line = f"val loss {ev['val/loss']:.4f}  top1 {ev['val/top1']:.4f}{top}"
    if ev.get("val/class_imbalance", 1.0) >= IMBALANCED:
        line += (
            f"  balanced acc {ev['val/balanced_acc']:.4f}  macro-F1 {ev['val/f1_macro']:.4f}  weakest class "
            f"{ev['val/min_recall_class']} recall {ev['val/min_recall']:.4f}"
        )
    return line


def artifact_name(name: str, weights: str) -> str:
    """The file name of an artifact of the `weights` ("best" or "last") weights: per_class.csv for the best
    ones (the name it always had), per_class_last.csv for the last ones."""
    if weights == "best":
        return name
    stem, dot, ext = name.partition(".")
    return f"{stem}_{weights}{dot}{ext}"


CONFUSION_FILES = ("confusion_matrix.csv", "confusion_matrix.png", "per_class.csv")


def _write_confusion(run_dir: Path, ev: dict, info, weights: dict) -> list[str]:
    from torchsprint.tasks.metrics import write_confusion, write_per_class

    if "val/confusion" not in ev:
        return []
    matrix, png, per_class = (artifact_name(n, weights["weights"]) for n in CONFUSION_FILES)
    write_confusion(run_dir / matrix.removesuffix(".csv"), ev["val/confusion"], info.classes, weights=weights)
    write_per_class(run_dir / per_class, ev, info.classes, weights=weights)
    return [matrix, png, per_class]


def _topk(outputs: torch.Tensor, classes: list[str], options: dict) -> list[dict]:
    """The k most probable classes of each image, ranked by logit with ties to the lower class index: how argmax,
    the metrics' top-1, breaks them. topk leaves the order of equal values open and gave the higher index here;
    equal logits are common in an int8 graph (its logits lie on a grid of quantization steps: 2 of the 360 digits
    of tests/e2e/export/test_int8.py, whose predicted class then differed from `eval`'s)."""
    k = min(options.get("topk", 5), len(classes))
    c = outputs.sort(dim=1, descending=True, stable=True).indices[:, :k]
    p = torch.softmax(outputs, dim=1).gather(1, c)
    return [
        {"top": [{"class": classes[j], "prob": q} for j, q in zip(ci, pi)]} for pi, ci in zip(p.tolist(), c.tolist())
    ]


@TASKS.register("classification")
def classification() -> Task:
    """One class per image: cross-entropy, top-1/top-k, per-class P/R/F1 and a confusion matrix."""
    return Task(
        "classification",
        "cross_entropy",
        "val/top1",
        "max",
        _classification_metrics,
        _classification_summary,
        _write_confusion,
        _topk,
        artifact_files=CONFUSION_FILES,
    )


# ---------------------------------------------------------------- multilabel


def _multilabel_metrics(info, eval_cfg, device):
    from torchsprint.tasks.metrics import MultilabelMetrics

    return MultilabelMetrics(info.num_classes, eval_cfg.threshold, device)


def _multilabel_summary(ev: dict) -> str:
    return f"val loss {ev['val/loss']:.4f}  mAP {ev['val/mAP']:.4f}  F1 {ev['val/f1_macro']:.4f}"


def _above_threshold(outputs: torch.Tensor, classes: list[str], options: dict) -> list[dict]:
    threshold = options.get("threshold", 0.5)
    out = []
    for probs in torch.sigmoid(outputs).tolist():
        labels = [{"class": c, "prob": q} for c, q in zip(classes, probs) if q >= threshold]
        out.append({"labels": sorted(labels, key=lambda d: -d["prob"]), "probs": dict(zip(classes, probs))})
    return out


def _nothing(*_args) -> list[str]:
    """No extra artifacts (off is a no-op, not a branch)."""
    return []


@TASKS.register("multilabel")
def multilabel() -> Task:
    """Any number of labels per image: BCE-with-logits on multi-hot targets, mAP and per-label F1 at eval.threshold."""
    return Task(
        "multilabel",
        "bce_with_logits",
        "val/mAP",
        "max",
        _multilabel_metrics,
        _multilabel_summary,
        _nothing,
        _above_threshold,
        backends=("cpu", "memory"),
        min_classes=1,
        targets="multi_hot",
        eval_fields=("threshold",),
    )


# ---------------------------------------------------------------- image_to_image


def _restoration_metrics(info, eval_cfg, device):
    from torchsprint.tasks.metrics import RestorationMetrics

    return RestorationMetrics(device)


def _restoration_summary(ev: dict) -> str:
    return f"val loss {ev['val/loss']:.4f}  PSNR {ev['val/psnr']:.2f} dB  SSIM {ev['val/ssim']:.4f}"


def to_pixels(outputs: torch.Tensor) -> torch.Tensor:
    """Model outputs in [0, 1] units (targets are x / 255) -> uint8 pixels: round(clamp(y, 0, 1) * 255)."""
    return (outputs.float().clamp(0, 1) * 255).round().to(torch.uint8)


def _images(outputs: torch.Tensor, classes: list[str], options: dict) -> list[dict]:
    return [{"image": img} for img in to_pixels(outputs)]


def _paired_example(x: torch.Tensor, in_channels: int) -> torch.Tensor:
    # Paired loaders stack input and target along channels (so one crop/flip covers both): keep the input.
    return x[:, :in_channels]


@TASKS.register("image_to_image")
def image_to_image() -> Task:
    """Paired restoration (deblur, denoise): MSE by default, PSNR and SSIM, predict writes output images.

    MSE, not L1, by default: PSNR is -10 log10(MSE), and with errors concentrated at edges (most pixels of
    a blurred image are already right) L1's sign gradient held the residual U-Net at the identity on
    synthetic_blur (24.23 -> 24.23 dB after 150 steps) where MSE gained +1.1 dB. Set loss.name=l1 or
    weighted loss.terms for other data.
    """
    return Task(
        "image_to_image",
        "mse",
        "val/psnr",
        "max",
        _restoration_metrics,
        _restoration_summary,
        _nothing,
        _images,
        backends=("cpu", "memory"),
        export_formats=("onnx", "safetensors", "torchscript"),
        example=_paired_example,
        min_classes=1,
        targets="image",
        eval_fields=(),
        unsupported={
            "progressive": "it is made and measured for image classification batches; restoration models "
            "are evaluated on whole images, and a schedule of patch sizes for them is not measured."
        },
    )


# ---------------------------------------------------------------- video


def _first_clip(x: torch.Tensor, in_channels: int) -> torch.Tensor:
    # multi_clip eval batches are (N, K, T, C, H, W). The exported model is the single-clip model,
    # (N, T, C, H, W) -> logits, so parity is checked on each video's first clip; averaging the K
    # clips' logits is left to the caller, as multi_clip's metadata (the eval spec) says.
    return x[:, 0] if x.ndim == 6 else x


@TASKS.register("video")
def video() -> Task:
    """Clip classification: cross-entropy on T-frame clips, top-1/top-k and a confusion matrix.

    Clips travel frames-first, (N, T, C, H, W) uint8, so that per-channel normalisation broadcasts
    exactly as for images; the registered video models permute to torchvision's (N, C, T, H, W).
    With multi_clip in the eval spec, val batches are (N, K, T, C, H, W) and the model wrapper averages
    the K clips' logits; export takes the single-clip model (parity on the first clip).
    """
    return Task(
        "video",
        "cross_entropy",
        "val/top1",
        "max",
        _classification_metrics,
        _classification_summary,
        _write_confusion,
        _topk,
        backends=("cpu",),
        export_formats=("onnx", "safetensors"),
        channels_last=False,
        artifact_files=CONFUSION_FILES,
        example=_first_clip,
        unsupported={
            "predict": "predict decodes image files; evaluate clips with `torchsprint eval` instead.",
            "tta": "clips are averaged over time by multi_clip in data.eval.transforms instead.",
            "progressive": "clips are cropped frame by frame on the cpu backend only, and the schedule "
            "is made and measured for image batches.",
        },
    )


__all__ = ["TASKS", "Task", "get_task", "apply_defaults", "check_data_task", "to_pixels"]

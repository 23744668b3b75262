"""Knowledge distillation: a frozen teacher's logits as soft targets beside the task loss (Hinton et al. 2015).

The loss of a training batch, with student logits s, teacher logits t (both (B, C)), T = distill.temperature
and alpha = distill.alpha:

    loss = (1 - alpha) * task_loss(s, y) + alpha * T^2 * KL(softmax(t / T) || softmax(s / T))

where KL(p || q) = sum_c p_c (log p_c - log q_c), averaged over the batch (F.kl_div, reduction="batchmean"),
as timm's LogitDistillationTask computes it (timm/task/distillation.py: kl_div of log-softmaxes with
log_target=True, times T^2; its complementary mode task_loss_weight = 1 - alpha). The T^2 keeps the soft
term's gradients on the scale of the hard term's as T changes (Hinton et al., section 2).

How it reaches the one training loop without the engine knowing (DESIGN rule 3): `DistillLoader` wraps the
training loader (after Mixup/CutMix, so the teacher sees the very images the student sees) and yields
(images, Distilled(targets, teacher_logits)); `DistillLoss` wraps the task loss and reads the teacher's logits
from that pair. Evaluation batches carry plain targets, so validation loss and metrics are the student's alone
with the task loss; training accuracy counts the task's targets (engine.train_step reads a tuple's first item).

The teacher is frozen (requires_grad=False), in eval mode for the whole run (`Teacher.train` keeps it there,
whatever calls model.train()), on the run's device and in the run's precision: the same autocast in AMP modes,
half weights (BatchNorm in fp32) in fp16/bf16 modes, as Precision.prepare makes the student. Under DDP each
rank builds its own copy from the same file (never DDP-wrapped: it has no gradients to all-reduce). It is not
in the checkpoint: a resumed run rebuilds it from the config, and since the teacher draws no random numbers
(eval mode), the resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchsprint.errors import UsageError

RUN_WEIGHTS = ("best", "last", "ema")


class Distilled(NamedTuple):
    """A training batch's targets with the teacher's logits: what DistillLoader yields as targets.

    A tuple whose first item is the task's targets (engine.train_step counts training accuracy against it).
    """

    targets: torch.Tensor  # the task's: (B,) class indices, or (B, C) Mixup/CutMix soft targets
    teacher: torch.Tensor  # (B, C) teacher logits, fp32, no gradient


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch (a scalar, fp32)."""
    t = temperature
    log_p_student = F.log_softmax(student_logits.float() / t, dim=1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / t, dim=1)
    return F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True) * (t * t)


class DistillLoss(nn.Module):
    """(1 - alpha) * task_loss + alpha * kd_loss on Distilled targets; the task loss alone on plain targets
    (evaluation, which never runs the teacher)."""

    def __init__(self, task_loss: nn.Module, temperature: float, alpha: float):
        super().__init__()
        self.task_loss, self.temperature, self.alpha = task_loss, float(temperature), float(alpha)

    def forward(self, logits: torch.Tensor, targets) -> torch.Tensor:
        if not isinstance(targets, Distilled):
            return self.task_loss(logits, targets)
        soft = kd_loss(logits, targets.teacher, self.temperature)
        if self.alpha == 1.0:  # teacher only: the labels are not read (and may be anything)
            return soft
        return (1.0 - self.alpha) * self.task_loss(logits, targets.targets) + self.alpha * soft


class Teacher(nn.Module):
    """A frozen model that stays in eval mode: train() leaves it in eval, and its forward runs without gradients.

    `autocast`: the run's Precision.autocast (a null context in fp32 and half-weight modes).
    """

    def __init__(self, model: nn.Module, autocast):
        super().__init__()
        self.model = model
        self.autocast = autocast
        for p in self.model.parameters():
            p.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True) -> Teacher:  # noqa: ARG002 - the teacher never trains
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model(images).float()


class DistillLoader:
    """The training loader with the teacher's logits added to every batch: (images, Distilled(targets, logits))."""

    def __init__(self, loader, teacher: Teacher):
        self.loader, self.teacher = loader, teacher

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.loader.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for images, targets in self.loader:
            yield images, Distilled(targets, self.teacher(images))

    def __getattr__(self, name):  # skipped-sample lists and other backend attributes
        return getattr(self.loader, name)


# ---------------------------------------------------------------- building the teacher


def distill_on(distill_cfg) -> bool:
    """Whether the config asks for distillation (a teacher is named)."""
    t = distill_cfg.teacher
    return bool(t.run or t.model or t.weights)


def check_distill(cfg, targets: str) -> bool:
    """Whether distillation is on; refuses settings that would be ignored and runs it cannot serve (no data read)."""
    d = cfg.distill
    if not distill_on(d):
        defaults = {k: f.default for k, f in type(d).model_fields.items() if k != "teacher"}
        set_ = [f"distill.{k}={getattr(d, k)}" for k in defaults if getattr(d, k) != defaults[k]]
        if d.teacher.args:
            set_.append("distill.teacher.args")
        if set_:
            raise UsageError(
                f"{', '.join(set_)}: distillation is off (no distill.teacher). Set distill.teacher.run (a run "
                "folder) or distill.teacher.model and distill.teacher.weights, or remove it."
            )
        return False
    if targets != "class_index":
        raise UsageError(
            f"distill: logit distillation matches the softmax over classes of a teacher and a student, but "
            f"task={cfg.task} has {targets} targets (no class logits); remove the distill section."
        )
    if cfg.data.batch_size == "auto":
        raise UsageError(
            "distill with data.batch_size=auto: the batch-size search does not run the teacher, so its "
            "choice could run out of memory in training; set data.batch_size to a number."
        )
    return True


def _teacher_error(what: str) -> UsageError:
    return UsageError(f"distill.teacher: {what}")


def _load_exact(model: nn.Module, state: dict, source: str, num_classes: int) -> None:
    """Load every key of `state` into `model`, or one UsageError saying what does not fit (class count first)."""
    from torchsprint.models.init import compare_state, head_keys

    own = model.state_dict()
    report = compare_state(own, state)
    head = head_keys(report, own, num_classes)
    if head:
        other = state[head[0]].shape[0]
        raise _teacher_error(
            f"{source} has {other} output classes ({head[0]}), this run's data has {num_classes}: a "
            f"teacher must predict the same classes. Use a teacher trained on this data set."
        )
    if any(report.values()):
        from torchsprint.models.init import _details

        raise _teacher_error(
            f"{source} does not fit the teacher's model ({_details(report, 3)}); name the model it was "
            "saved from with distill.teacher.model (and .args)."
        )
    model.load_state_dict(state)


def _read_file(path: Path) -> dict:
    from torchsprint.models.init import read_weights

    try:
        return read_weights(path)
    except UsageError as e:  # read_weights speaks of model.pretrained
        raise _teacher_error(str(e).replace("model.pretrained: ", "", 1) + " Give a readable weights file.") from None


def _metadata(path: Path) -> dict[str, str]:
    """A .safetensors file's metadata ({} for other files); a truncated or corrupt file is one UsageError."""
    from torchsprint.state.checkpoint import read_safetensors_metadata

    if path.suffix != ".safetensors":
        return {}
    try:
        return read_safetensors_metadata(path)
    except Exception as e:  # noqa: BLE001 - whatever safetensors raises for a damaged file: said, never a traceback
        raise _teacher_error(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {str(e)[:160]}). Give an "
            "intact weights file (re-train or re-export the teacher)."
        ) from None


def _metadata_entry(meta: dict, key: str, source, default=None):
    """saved_config.metadata_entry, its refusal said as the teacher's."""
    from torchsprint.config.saved import metadata_entry

    try:
        return metadata_entry(meta, key, source, default)
    except UsageError as e:
        raise _teacher_error(str(e)) from None


def fingerprint(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256: says in decisions.json which teacher file a run used."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _locate(t) -> tuple[object, Path, list[str]]:
    """(the teacher's model section, its weights file, the `imports:` its saved config lists) from distill.teacher."""
    from torchsprint.config.saved import file_config, load_run_config
    from torchsprint.config.sections import ModelConfig
    from torchsprint.models.core import MODELS
    from torchsprint.models.init import resolve_pretrained

    if t.model is not None:  # an unknown name first, whatever else is wrong: "did you mean"
        try:
            MODELS.get(t.model)
        except UsageError as e:
            raise _teacher_error(f"model={t.model}: {e}") from None
    if t.run:
        if t.model or t.args:
            raise _teacher_error("teacher.run's config.yaml names the model; remove distill.teacher.model/args.")
        which = t.weights or "best"
        if which not in RUN_WEIGHTS:
            raise _teacher_error(f"weights={which}: with teacher.run, weights is one of {', '.join(RUN_WEIGHTS)}.")
        try:
            run_cfg = load_run_config(Path(t.run))
        except UsageError as e:
            raise _teacher_error(f"run={t.run}: {e}") from None
        path = Path(t.run) / f"{which}.safetensors"
        if not path.is_file():
            raise _teacher_error(
                f"run={t.run} has no {which}.safetensors (the run has not saved {which} weights); "
                f"use weights={'last' if which != 'last' else 'best'} or let the run finish."
            )
        return run_cfg.model, path, run_cfg.imports
    if t.weights is None:
        raise _teacher_error(
            f"model={t.model} needs its weights: set distill.teacher.weights (a file, torchvision:..., timm:...)."
        )
    if t.model is None and ":" in t.weights and not Path(t.weights).exists():
        raise _teacher_error(f"weights={t.weights} are a library's: name the architecture with distill.teacher.model.")
    try:
        path = resolve_pretrained(t.weights, t.model or "") if t.model else Path(t.weights)
    except UsageError as e:
        raise _teacher_error(
            str(e).replace("model.pretrained=", "weights=").replace("model.name=", "teacher.model=")
        ) from None
    if not path.is_file():
        raise _teacher_error(f"weights file not found: {path}. Give the path of the teacher's weights.")
    if t.model is not None:
        return ModelConfig(name=t.model, args=t.args), path, []
    meta = _metadata(path)
    if "config" not in meta:
        raise _teacher_error(
            f"{path} does not say which model it holds (no torchsprint metadata); name it "
            "with distill.teacher.model (and .args)."
        )
    file_cfg = file_config(_metadata_entry(meta, "config", path), path)
    return file_cfg.model, path, file_cfg.imports


def _check_fits(meta: dict, source: str, classes: list[str], in_channels: int) -> None:
    """Refuse a teacher whose file says it predicts other classes (count, names, order) or takes other images."""
    theirs = _metadata_entry(meta, "classes", source, default=None)
    if theirs is not None and len(theirs) != len(classes):
        raise _teacher_error(
            f"{source} predicts {len(theirs)} classes, this run's data has {len(classes)}: a "
            "teacher must predict the same classes. Use a teacher trained on this data set."
        )
    if theirs is not None and theirs != list(classes):
        raise _teacher_error(
            f"{source} predicts classes {theirs[:6]}{' ...' if len(theirs) > 6 else ''}, "
            f"this run's are {list(classes)[:6]}{' ...' if len(classes) > 6 else ''} (names or order "
            "differ): its logits would be matched to the wrong classes. Use a teacher trained on this data set."
        )
    if _metadata_entry(meta, "in_channels", source, default=in_channels) != in_channels:
        raise _teacher_error(
            f"{source} takes {meta['in_channels']}-channel images, this run's have {in_channels} "
            "(data.options.mode sets grey or RGB); use a teacher trained on the same kind of images."
        )


def load_teacher_model(teacher_cfg, num_classes: int, in_channels: int, classes: list[str]) -> tuple[nn.Module, dict]:
    """The teacher's model with its weights loaded (CPU, fp32), and a record of where it came from.

    Checks that it predicts this run's classes (count, and names and order where its file says them) from
    inputs of this run's channel count; its weights load strictly (every key, every shape).
    """
    from torchsprint.config.saved import naming_imports
    from torchsprint.models import build_model

    model_cfg, path, imports = _locate(teacher_cfg)
    source = str(path)
    _check_fits(_metadata(path), source, classes, in_channels)
    with naming_imports(imports, source):
        try:
            model = build_model(model_cfg, num_classes, in_channels)
        except UsageError as e:
            raise _teacher_error(f"{e}") from None
    _load_exact(model, _read_file(path), source, num_classes)
    t = teacher_cfg
    record = {
        "source": "run" if t.run else "file" if Path(t.weights).exists() else "library",
        "model": model_cfg.name,
        "args": dict(model_cfg.args),
        "file": source,
        "sha256_16": fingerprint(path),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return model, record


def half_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The teacher in a half-weight precision mode: weights and buffers in `dtype` except BatchNorm's (fp32, as
    Precision.prepare keeps the student's), wrapped so that inputs are cast in and logits out (HalfModel)."""
    from torchsprint.state.precision import HalfModel

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for p in m.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(m, name, b.to(dtype))
    return HalfModel(model, dtype)


def build_teacher(
    distill_cfg, info, device: torch.device, prec, channels_last: bool | str = False, log=lambda *_: None
) -> tuple[Teacher, dict]:
    """The run's frozen teacher on `device` in the run's precision, and the record decisions.json keeps.

    Args:
        distill_cfg: the `distill` section (check_distill said it is on).
        info: the run's DataInfo (class names and count, channels).
        device: the training device; prec: the run's Precision (its autocast, its half-weight dtype).
        channels_last: speed.channels_last (true, false, auto: when the teacher has 2-D convolutions), for the
            teacher's weights as parallel.channels_last_on decides it for the student's.
        log: one-line messages.
    """
    model, record = load_teacher_model(distill_cfg.teacher, info.num_classes, info.in_channels, info.classes)
    from torchsprint.runtime.parallel import channels_last_on

    model = model.to(device)
    if channels_last_on(channels_last, model):
        model = model.to(memory_format=torch.channels_last)
    if prec.half is not None:
        model = half_weights(model, prec.half)
    teacher = Teacher(model, prec.autocast)
    record |= {"temperature": distill_cfg.temperature, "alpha": distill_cfg.alpha, "precision": prec.mode}
    log(
        f"distill: teacher {record['model']} ({record['parameters']:,} parameters, frozen, eval mode) from "
        f"{record['file']} (sha256 {record['sha256_16']}); loss = {1 - distill_cfg.alpha:g} x task loss + "
        f"{distill_cfg.alpha:g} x T^2 x KL(teacher || student) at T={distill_cfg.temperature:g}"
    )
    return teacher, record


def check_same_teacher(record: dict | None, ckpt, resume_path) -> None:
    """A resumed run's teacher must be the file it began with (decisions.json's distill.sha256_16): a teacher file
    replaced or retrained between pause and resume would change what the rest of the run learns from, silently."""
    from torchsprint.state.resume import decisions_at_start

    if record is None or ckpt is None:
        return
    began = decisions_at_start(resume_path).get("distill") or {}
    if began.get("sha256_16") not in (None, record["sha256_16"]):
        raise _teacher_error(
            f"{record['file']} changed since this run began (sha256 {began['sha256_16']} then, "
            f"{record['sha256_16']} now; from {began.get('file')}): the resumed run would learn from "
            "another teacher. Restore the teacher file, or start a new run (a new run.dir)."
        )


__all__ = [
    "Distilled",
    "DistillLoss",
    "DistillLoader",
    "Teacher",
    "build_teacher",
    "check_distill",
    "distill_on",
    "check_same_teacher",
    "kd_loss",
    "load_teacher_model",
]

"""The config schema's base `Section` and the sections of what a run trains on: run, data (with its split,
progressive and mix settings), distill and model."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from torchsprint.runtime.files import MAX_FILE_MB


def bool_for_number(value: Any, annotation: Any) -> bool:
    """Whether `value` holds a boolean where `annotation` means a number: int or float among its members and bool
    not (a flag field, or `bool | 'auto'`, takes booleans), also inside a list or tuple of numbers."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return bool_for_number(value, args[0])
    members = args if origin in (Union, UnionType) else (annotation,)
    if isinstance(value, bool):
        kinds = {m for m in members if isinstance(m, type)}
        kinds |= {type(v) for m in members if get_origin(m) is Literal for v in get_args(m)}
        return bool(kinds & {int, float}) and bool not in kinds
    if isinstance(value, list | tuple):
        items = [get_args(m)[0] for m in members if get_origin(m) in (list, tuple) and get_args(m)]
        return any(bool_for_number(v, item) for item in items for v in value)
    return False


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, numbers are numbers."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # inf/NaN: never a setting

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, v, info):
        # pydantic takes true for 1 in an int or float field, and YAML reads `true` as a boolean: run.epochs=true was
        # 1 epoch, run.max_time=true a 1-second budget, optim.lr=true 1.0. A number field takes numbers (1 for a float
        # still is one).
        if bool_for_number(v, cls.model_fields[info.field_name].annotation):
            raise ValueError("a number is meant here, not true/false")
        return v


# A transform step: "hflip" or {"random_resized_crop": {"size": 224}} or {"resize": 256}.
TransformSpec = str | dict[str, Any]


class RunConfig(Section):
    name: str = Field("default", description="Run name; the run folder is <out_dir>/<name>/<timestamp>.")
    out_dir: str = Field("runs", description="Folder that holds all runs.")
    dir: str | None = Field(
        None, description="Exact run folder to use instead of <out_dir>/<name>/<timestamp> (resume, tests)."
    )
    seed: int = Field(0, ge=0, description="Seed for Python, NumPy and torch RNGs, data order and augmentation.")
    epochs: int = Field(10, ge=1, description="Number of passes over the training set.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (overrides epochs when reached first)."
    )
    stop_after_steps: int | None = Field(
        None,
        ge=1,
        description="Pause after this many optimizer steps of this invocation and save a checkpoint; unlike "
        "max_steps the schedule and run length are unchanged, so resuming continues exactly (time slices, tests).",
    )
    max_time: str | float | None = Field(
        None,
        description="Wall-clock budget of this invocation: '45m', '2h30m', '90s' or seconds, counted from the "
        "start of `train` (building the data and model included). At the first step boundary past it the run stops "
        "with a checkpoint (like stop_after_steps: no extra evaluation, no last.safetensors; summary.json says "
        "stopped: max_time) and exits 0; resuming continues to run.epochs with a fresh budget. It can overshoot by "
        "about one step, an evaluation due at that step, and the checkpoint write.",
    )
    train_time: str | float | None = Field(
        None,
        description="Train for this wall-clock time ('5m', '1h', '90s' or seconds, counted like max_time from the "
        "start of `train`), the run's length fitted to it: after its first steps the run measures its speed "
        "(evaluations included) and sets run.max_steps to the steps that fit, again at each epoch's start, so the "
        "learning-rate schedule ends when the time does (a faster setting trains longer). run.epochs is then an "
        "upper bound (unset: none). summary.json's `train_time` says what was measured and fitted; a resumed run "
        "keeps its fitted length. `torchsprint tune --trial-time` gives each trial this. Needs sched.interval=step.",
    )
    stop_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"],
        description="Signals that stop the run after the current step with a resumable checkpoint and exit code 75 "
        "(EX_TEMPFAIL: retry later); under DDP every rank stops at the same step even if one got it. A second signal "
        "during the save is ignored. [] keeps the default actions (SIGTERM/SIGUSR1 end the process at once).",
    )
    requeue: bool = Field(
        False,
        description="After a stop signal, requeue the SLURM job (`scontrol requeue $SLURM_JOB_ID`); the requeued "
        "job runs the same command and continues the run. Needs a SLURM job, run.dir and checkpoint.resume=auto.",
    )
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    deterministic: bool = Field(
        False,
        description="Use deterministic algorithms only (slower on GPU; bit-exact reruns); "
        "an operation without a deterministic implementation stops the run, naming it.",
    )

    @field_validator("max_time", "train_time")
    @classmethod
    def _duration(cls, v):
        from torchsprint.runtime.preempt import parse_duration

        if v is not None:
            parse_duration(v)  # raises ValueError naming the accepted forms
        return v

    @field_validator("stop_signals")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        from torchsprint.runtime.preempt import signal_name

        return list(dict.fromkeys(signal_name(n) for n in v))

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # The name is one folder level under out_dir: '../..', an absolute path or a separator would put the run
        # (and --overwrite's moves) outside out_dir. Choosing a path is what run.dir is for.
        if v in ("", ".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError(
                "must be a plain folder name (no / or \\, not '.', '..' or empty); to choose the run "
                "folder's path, set run.dir instead"
            )
        return v


class SplitConfig(Section):
    transforms: list[TransformSpec] = Field(
        default_factory=list,
        description=(
            "Preprocessing steps in order, e.g. [random_resized_crop: {size: 224}, hflip, normalize: imagenet]."
        ),
    )


class ProgressiveConfig(Section):
    """Progressive resizing (FFCV's min_res -> max_res, timm's --train-size-schedule): fewer pixels in the early
    epochs."""

    start_size: int | None = Field(
        None,
        ge=1,
        description="Side (pixels) of data.train.transforms' random_resized_crop output in the first epochs; "
        "None: off. The size of epoch e depends on e alone (exact across resume).",
    )
    end_size: int | None = Field(
        None,
        ge=1,
        description="Side at and after end_epoch; None: the random_resized_crop's own size (a different "
        "value is refused: the crop's size is the run's final training size).",
    )
    start_epoch: int = Field(1, ge=1, description="Last epoch (counted from 1, as the log prints) at start_size.")
    end_epoch: int | None = Field(
        None,
        ge=2,
        description="First epoch (from 1) at end_size; between start_epoch and end_epoch the side grows "
        "linearly, rounded to the nearest multiple of step (halves up). Required with start_size.",
    )
    step: int = Field(
        32,
        ge=1,
        description="Sizes are multiples of this (FFCV's res_step): few distinct sizes, so "
        "torch.compile builds one graph per size, and 32 keeps ResNet strides whole.",
    )

    @model_validator(mode="after")
    def _schedule(self):
        if self.start_size is None:
            changed = sorted(k for k in self.model_fields_set if getattr(self, k) != type(self).model_fields[k].default)
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} has no effect without data.progressive.start_size; set start_size "
                    "(the first epochs' crop side) or remove it"
                )
            return self
        if self.end_epoch is None:
            raise ValueError("set end_epoch too (the first epoch at the final size), e.g. data.progressive.end_epoch=8")
        if self.end_epoch <= self.start_epoch:
            raise ValueError(
                f"end_epoch={self.end_epoch} must come after start_epoch={self.start_epoch} (the ramp runs "
                "from start_epoch to end_epoch)"
            )
        for name in ("start_size", "end_size"):
            v = getattr(self, name)
            if v is not None and v % self.step:
                raise ValueError(
                    f"{name}={v} is not a multiple of step={self.step}; use "
                    f"{max(self.step, v // self.step * self.step)} or another step"
                )
        if self.end_size is not None and self.end_size < self.start_size:
            raise ValueError(
                f"end_size={self.end_size} is below start_size={self.start_size}: progressive resizing "
                "grows the crop; swap them"
            )
        return self


class DataConfig(Section):
    dataset: str = Field("digits", description="Dataset name from the DATASETS registry (`torchsprint list datasets`).")
    root: str | None = Field(None, description="Dataset folder (image_folder: holds train/ and optionally val/).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the dataset builder."
    )
    val_fraction: float = Field(
        0.2, ge=0.0, lt=1.0, description="Share held out for validation when the dataset has no val split."
    )
    split_seed: int = Field(0, ge=0, description="Seed of the train/val split (fixed, independent of run.seed).")
    backend: str = Field(
        "auto",
        description="Loader backend from the LOADERS registry (`torchsprint list loaders`), or "
        "'auto': memory when the decoded dataset fits (25% of RAM, 50% of the GPU) and the preprocessing "
        "runs batched, gpu for JPEG files on CUDA, else cpu; the run says which and why.",
    )
    memory_budget_gib: float | None = Field(
        None,
        gt=0,
        description="The most memory (GiB) the memory backend may hold the decoded dataset in: auto picks "
        "memory only under it, and data.backend=memory refuses a dataset over it. null: 25% of RAM on CPU, 50% of "
        "the GPU's memory on CUDA.",
    )
    cache: Literal["auto", "on", "off"] = Field(
        "auto",
        description="The decoded-image cache (data/image_cache.py): image files decoded once with the run's "
        "decoder, pre-sized to what each split's transforms can use (the eval resize applied exactly; the training "
        "images shrunk only where random_resized_crop's smallest crop keeps its full size), stored as raw uint8 in a "
        "memory-mapped file under data.cache_dir and read by every later run and epoch instead of the files (cpu "
        "and memory backends). Rebuilt when a file's size or mtime changes; a damaged cache is refused. auto: on for "
        "image files where the cache fits data.cache_gib, else off, said at start-up; on: refuse where it cannot "
        "be used; off: decode the files every epoch.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where the decoded-image cache lives; null: $TORCHSPRINT_CACHE_DIR, else "
        "$XDG_CACHE_HOME/torchsprint/images (~/.cache/torchsprint/images). `torchsprint data cache` lists and "
        "clears it.",
    )
    cache_gib: float | None = Field(
        None,
        gt=0,
        description="The most disk (GiB) the cache folder may hold: least recently used caches are "
        "removed past it, and a data set that does not fit is not cached (data.cache=on refuses it). null: 20 GiB, "
        "at most half of the free disk.",
    )
    batch_size: int | Literal["auto"] = Field(
        64,
        description="Training batch size per process, or 'auto': the largest that trains here, found at start-up with "
        "real steps of the run's model, precision and optimizer (CUDA: doubling, then bisecting on out-of-memory; CPU: "
        "50% of the free memory over the measured memory of a step, a power of two, confirmed by a step); at most the "
        "training images per process and 4096. The run says what "
        "it found (start-up, decisions.json) and resuming keeps it.",
    )
    effective_batch_size: int | None = Field(
        None,
        ge=1,
        description="Images per optimizer step over all processes (batch_size x optim.accum_steps x "
        "processes): optim.accum_steps is derived from it, so with batch_size=auto the effective batch stays the same "
        "on any device (the batch found is lowered to a divisor). None: batch_size x optim.accum_steps x processes.",
    )
    eval_batch_size: int | None = Field(None, ge=1, description="Evaluation batch size (defaults to 2 x batch_size).")

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, v):
        # YAML reads on/off (and yes/no, true/false) as booleans: the same setting either way.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, v):
        # One clear message for every bad value (pydantic would list one failure per member of the union).
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        if isinstance(v, str) and v.strip().isdigit() and int(v) >= 1:
            return int(v)
        raise ValueError("must be a whole number of images >= 1 per process, or 'auto' (the largest that trains here)")

    num_workers: int = Field(0, ge=0, description="DataLoader worker processes (0 loads in the main process).")
    pin_memory: bool = Field(
        True, description="Pin host memory for faster, asynchronous copies to CUDA (ignored on CPU)."
    )
    persistent_workers: bool = Field(True, description="Keep workers alive between epochs (when num_workers > 0).")
    prefetch_factor: int = Field(2, ge=1, description="Batches prefetched per worker (when num_workers > 0).")
    drop_last: bool = Field(
        True, description="Drop the last incomplete training batch (keeps shapes static; never in eval)."
    )
    repeated_aug: int = Field(
        1,
        ge=1,
        description="Repeated-augmentation sampling (DeiT's RASampler, timm's --aug-repeats): each chosen sample "
        "appears this many times per epoch, differently augmented and spread over the DDP ranks; an epoch keeps the "
        "length of one without repeats (timm's RepeatAugSampler). 1: off.",
    )
    sampler: Literal["auto", "shuffle", "balanced", "sqrt"] = Field(
        "auto",
        description="Training order: auto (sqrt where the training classes' largest / smallest count is at "
        "least 4x and no loss.class_weights / loss.logit_adjust is set, the best measured trade on imbalanced classes, "
        "with checkpoint.monitor=val/balanced_acc unless set; shuffle otherwise; the start-up summary and "
        "decisions.json say what it chose and why, config.yaml keeps the result), shuffle (a seeded permutation per "
        "epoch), balanced (class-balanced: "
        "each epoch draws as many samples as the training set holds, with replacement, sample i with probability "
        "proportional to 1 / its class's count n_c, so every class is drawn equally often in expectation) or sqrt "
        "(square-root frequency: probability proportional to 1 / sqrt(n_c), so class c's share of the draws is "
        "sqrt(n_c) / sum_k sqrt(n_k), between shuffle's and balanced's). balanced and sqrt are seeded by run.seed and "
        "the epoch, exact across resume, DDP ranks take disjoint shards of one draw; tasks with one class per image "
        "only (auto: shuffle for the others).",
    )
    sampler_from_epoch: int = Field(
        1,
        ge=1,
        description="data.sampler=balanced or sqrt from this epoch on (1-based); the epochs before it shuffle. "
        "Deferred re-sampling (Cao et al. 2019, 'LDAM-DRW'): learn features from the natural frequencies first, then "
        "re-balance the classifier. 1: from the start. Needs data.sampler=balanced or sqrt.",
    )
    on_bad_sample: Literal["skip", "error"] = Field(
        "error", description="Unreadable image: skip it (counted and logged) or stop."
    )
    max_image_pixels: int = Field(
        89_478_485,
        ge=1,
        description="Images with more pixels (width x height, read from the header) are bad samples; PIL's bomb limit.",
    )
    max_file_mb: float = Field(
        MAX_FILE_MB,
        gt=0,
        description="The largest file read as an image, in MiB (2^20 bytes). Larger files, and "
        "anything that is not a regular file (a FIFO, a device, a link to one), are never opened: listed in a folder "
        "or a file list they are left out and counted among the skipped files (start-up summary, decisions.json); "
        "read anyway (predict) they are bad samples. 512 holds an uncompressed RGB image at max_image_pixels (268 MB).",
    )
    decoder: Literal["auto", "torchvision", "simplejpeg", "pil"] = Field(
        "auto", description="CPU JPEG decoder (auto: the fastest measured that is installed; see BENCHMARKS.md)."
    )
    cpu_fraction: float | Literal["auto"] = Field(
        0.0,
        description=(
            "gpu backend: share of each batch decoded and cropped on "
            "the CPU (0..1), or 'auto' to tune it from the data wait."
        ),
    )
    fallback: Literal["cpu"] | None = Field(
        None,
        description=(
            "When the gpu/dali backend cannot run here (no CUDA, no DALI): use this backend instead of failing."
        ),
    )
    train: SplitConfig = Field(default_factory=SplitConfig, description="Training preprocessing.")
    eval: SplitConfig = Field(default_factory=SplitConfig, description="Evaluation and inference preprocessing.")
    progressive: ProgressiveConfig = Field(
        default_factory=ProgressiveConfig,
        description="Progressive resizing: the training crop's side per epoch "
        "(data.train.transforms' random_resized_crop), on the cpu, memory and gpu backends; evaluation runs "
        "data.eval.transforms unchanged.",
    )


class MixConfig(Section):
    """Mixup / CutMix on training batches (data/preprocess/mix.py): torchvision v2 MixUp/CutMix arithmetic, timm's
    switches."""

    mixup_alpha: float = Field(
        0.0,
        ge=0,
        description="Mixup: the mixing weight is drawn from Beta(alpha, alpha); 0 turns "
        "Mixup off (torchvision references --mixup-alpha, timm --mixup; 0.2 is usual for ImageNet).",
    )
    cutmix_alpha: float = Field(
        0.0,
        ge=0,
        description="CutMix: the pasted box's area share is drawn from Beta(alpha, "
        "alpha); 0 turns CutMix off (torchvision --cutmix-alpha, timm --cutmix; 1.0 is usual).",
    )
    prob: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Probability that a batch (mode=batch) or a sample (mode=elem) is "
        "mixed at all (timm --mixup-prob).",
    )
    switch_prob: float = Field(
        0.5,
        ge=0,
        le=1,
        description="With both alphas > 0: probability of CutMix rather than Mixup (timm --mixup-switch-prob).",
    )
    mode: Literal["batch", "elem"] = Field(
        "batch",
        description="batch: one draw (kind, weight, box) per batch, as "
        "torchvision and timm's default; elem: one per sample (timm --mixup-mode elem).",
    )


class TeacherConfig(Section):
    """Where distill's teacher comes from: a run folder, a weights file, or a model name with its weights."""

    run: str | None = Field(
        None,
        description="A torchsprint run folder: the teacher's model (name and args) comes from its config.yaml and "
        "its weights from <run>/<weights>.safetensors (weights: best, the default, last or ema).",
    )
    model: str | None = Field(
        None,
        description="The teacher's architecture, a name from the MODELS registry (built-in, torchvision, "
        "timm/...), with `weights`. Not with `run` (its config names the model); optional for a torchsprint "
        ".safetensors file, whose metadata names it.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the teacher's model builder (with `model`, as model.args).",
    )
    weights: str | None = Field(
        None,
        description="With `run`: best | last | ema (None: best). Otherwise the teacher's weights: a file "
        "(.safetensors, .pt, .pth: a state dict, a torchsprint checkpoint or weights file), or a library's published "
        "weights or a URL's, as model.pretrained: torchvision:ResNet50_Weights.IMAGENET1K_V2, torchvision:DEFAULT, "
        "timm:resnet50.a1_in1k, hf-hub:<org>/<name>, https://... (downloaded into the library's cache unless "
        "there; docs/pretrained.md). Loaded strictly: every key, every shape.",
    )


class DistillConfig(Section):
    """Knowledge distillation (train/distill.py): Hinton et al.'s logit distillation from a frozen teacher."""

    teacher: TeacherConfig = Field(
        default_factory=TeacherConfig,
        description="The teacher; distillation is on when teacher.run, teacher.model or teacher.weights is set.",
    )
    temperature: float = Field(
        4.0,
        gt=0,
        description="T: both models' logits are divided by T before the softmax of "
        "the distillation term (softer targets for T > 1; timm's --kd-temperature).",
    )
    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Weight of the distillation term: loss = (1 - alpha) x task loss "
        "+ alpha x T^2 x KL(softmax(teacher/T) || softmax(student/T)), the KL a mean over the batch "
        "(timm's LogitDistillationTask with task_loss_weight = 1 - alpha). 1: teacher only.",
    )


class ModelConfig(Section):
    name: str = Field("small_cnn", description="Model name from the MODELS registry (`torchsprint list models`).")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the model builder.")
    pretrained: str | None = Field(
        None,
        description="Weights loaded when not resuming: a file (.pt/.pth/.safetensors), torchvision's "
        "(torchvision:ResNet18_Weights.IMAGENET1K_V1, torchvision:DEFAULT), timm's (timm:resnet18.a1_in1k), a Hugging "
        "Face repo's (hf-hub:<org>/<name>[@rev]) or a URL's (https://...[#sha256=<hex>]), downloaded into the "
        "library's cache unless there (offline: TORCHSPRINT_OFFLINE=1; docs/pretrained.md). A head for another "
        "class count is replaced, and the run says so.",
    )
    strict: bool = Field(
        False, description="Any missing, unexpected or shape-mismatched key in `pretrained` is an error."
    )
    freeze: list[str] = Field(
        default_factory=list, description="Parameter-name patterns (glob, or regex with 're:' prefix) to freeze."
    )
    train_only: list[str] = Field(
        default_factory=list, description="Freeze everything except parameters matching these patterns."
    )
    freeze_bn_stats: bool = Field(
        True, description="Keep BatchNorm layers whose parameters are all frozen in eval mode."
    )
    bn_momentum: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The momentum of every BatchNorm layer (PyTorch's convention: the new batch's "
        "share of the running statistics; PyTorch's default 0.1). torchvision builds MobileNetV3 and EfficientNet "
        "with 0.01, which after a short run from scratch leaves the running statistics far from the trained weights "
        "(evaluation at chance). timm's --bn-momentum. None: the model's own.",
    )
    freeze_epochs: int = Field(
        0,
        ge=0,
        description="Fine-tuning (fastai's freeze-then-unfreeze): the first N epochs train only the head "
        "(model.head, else the last Linear layer), then every trainable parameter. The body is in the optimizer from "
        "the start with no gradient while frozen (not stepped, no weight decay); the learning-rate schedule runs on "
        "over all run.epochs, no restart at the switch. 0: off.",
    )
    head: list[str] = Field(
        default_factory=list,
        description="Parameter-name patterns (as model.freeze) of the head that "
        "model.freeze_epochs trains alone; empty: the last nn.Linear layer's parameters.",
    )

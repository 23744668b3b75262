"""The run schema (pydantic, extra=forbid) and `load(path, overrides)` with `extends` and dotted overrides."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from torchsprint.config_files import (  # noqa: F401  (MAX_DEPTH, deep_merge, read_file: re-exported)
    MAX_DEPTH,
    _field_names,
    _sub_model,
    deep_merge,
    read_file,
    read_with_extends,
)
from torchsprint.config_files import apply_override as _apply_override
from torchsprint.errors import UsageError, did_you_mean


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # inf/NaN: never a setting


# A transform step: "hflip" or {"random_resized_crop": {"size": 224}} or {"resize": 256}.
TransformSpec = str | dict[str, Any]


class RunConfig(Section):
    name: str = Field("default", description="Run name; the run folder is <out_dir>/<name>/<timestamp>.")
    out_dir: str = Field("runs", description="Folder that holds all runs.")
    dir: str | None = Field(None, description="Exact run folder to use instead of <out_dir>/<name>/<timestamp> (resume, tests).")
    seed: int = Field(0, ge=0, description="Seed for Python, NumPy and torch RNGs, data order and augmentation.")
    epochs: int = Field(10, ge=1, description="Number of passes over the training set.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs when reached first).")
    stop_after_steps: int | None = Field(
        None, ge=1, description="Pause after this many optimizer steps of this invocation and save a checkpoint; unlike "
        "max_steps the schedule and run length are unchanged, so resuming continues exactly (time slices, tests).",
    )
    max_time: str | float | None = Field(
        None, description="Wall-clock budget of this invocation: '45m', '2h30m', '90s' or seconds, counted from the "
        "start of `train` (building the data and model included). At the first step boundary past it the run stops "
        "with a checkpoint (like stop_after_steps: no extra evaluation, no last.safetensors; summary.json says "
        "stopped: max_time) and exits 0; resuming continues to run.epochs with a fresh budget. It can overshoot by "
        "about one step, an evaluation due at that step, and the checkpoint write.")
    stop_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"],
        description="Signals that stop the run after the current step with a resumable checkpoint and exit code 75 "
        "(EX_TEMPFAIL: retry later); under DDP every rank stops at the same step even if one got it. A second signal "
        "during the save is ignored. [] keeps the default actions (SIGTERM/SIGUSR1 end the process at once).")
    requeue: bool = Field(
        False, description="After a stop signal, requeue the SLURM job (`scontrol requeue $SLURM_JOB_ID`); the requeued "
        "job runs the same command and continues the run. Needs a SLURM job, run.dir and checkpoint.resume=auto.")
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    deterministic: bool = Field(False, description="Use deterministic algorithms only (slower on GPU; bit-exact reruns); "
                                "an operation without a deterministic implementation stops the run, naming it.")

    @field_validator("max_time")
    @classmethod
    def _duration(cls, v):
        from torchsprint.preempt import parse_duration

        if v is not None:
            parse_duration(v)  # raises ValueError naming the accepted forms
        return v

    @field_validator("stop_signals")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        from torchsprint.preempt import signal_name

        return list(dict.fromkeys(signal_name(n) for n in v))

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # The name is one folder level under out_dir: '../..', an absolute path or a separator would put the run
        # (and --overwrite's moves) outside out_dir. Choosing a path is what run.dir is for.
        if v in ("", ".", "..") or any(c in v for c in "/\\\0"):
            raise ValueError("must be a plain folder name (no / or \\, not '.', '..' or empty); to choose the run "
                             "folder's path, set run.dir instead")
        return v


class SplitConfig(Section):
    transforms: list[TransformSpec] = Field(
        default_factory=list,
        description="Preprocessing steps in order, e.g. [random_resized_crop: {size: 224}, hflip, normalize: imagenet].",
    )


class ProgressiveConfig(Section):
    """Progressive resizing (FFCV's min_res -> max_res, timm's --train-size-schedule): fewer pixels in the early epochs."""

    start_size: int | None = Field(
        None, ge=1, description="Side (pixels) of data.train.transforms' random_resized_crop output in the first epochs; "
        "None: off. The size of epoch e depends on e alone (exact across resume).")
    end_size: int | None = Field(
        None, ge=1, description="Side at and after end_epoch; None: the random_resized_crop's own size (a different "
        "value is refused: the crop's size is the run's final training size).")
    start_epoch: int = Field(1, ge=1, description="Last epoch (counted from 1, as the log prints) at start_size.")
    end_epoch: int | None = Field(
        None, ge=2, description="First epoch (from 1) at end_size; between start_epoch and end_epoch the side grows "
        "linearly, rounded to the nearest multiple of step (halves up). Required with start_size.")
    step: int = Field(32, ge=1, description="Sizes are multiples of this (FFCV's res_step): few distinct sizes, so "
                      "torch.compile builds one graph per size, and 32 keeps ResNet strides whole.")

    @model_validator(mode="after")
    def _schedule(self):
        if self.start_size is None:
            changed = sorted(k for k in self.model_fields_set if getattr(self, k) != type(self).model_fields[k].default)
            if changed:
                raise ValueError(f"{', '.join(changed)} has no effect without data.progressive.start_size; set start_size "
                                 "(the first epochs' crop side) or remove it")
            return self
        if self.end_epoch is None:
            raise ValueError("set end_epoch too (the first epoch at the final size), e.g. data.progressive.end_epoch=8")
        if self.end_epoch <= self.start_epoch:
            raise ValueError(f"end_epoch={self.end_epoch} must come after start_epoch={self.start_epoch} (the ramp runs "
                             "from start_epoch to end_epoch)")
        for name in ("start_size", "end_size"):
            v = getattr(self, name)
            if v is not None and v % self.step:
                raise ValueError(f"{name}={v} is not a multiple of step={self.step}; use {max(self.step, v // self.step * self.step)} "
                                 "or another step")
        if self.end_size is not None and self.end_size < self.start_size:
            raise ValueError(f"end_size={self.end_size} is below start_size={self.start_size}: progressive resizing "
                             "grows the crop; swap them")
        return self


class DataConfig(Section):
    dataset: str = Field("digits", description="Dataset name from the DATASETS registry (`torchsprint list datasets`).")
    root: str | None = Field(None, description="Dataset folder (image_folder: holds train/ and optionally val/).")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the dataset builder.")
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share held out for validation when the dataset has no val split.")
    split_seed: int = Field(0, ge=0, description="Seed of the train/val split (fixed, independent of run.seed).")
    backend: str = Field("auto", description="Loader backend from the LOADERS registry (`torchsprint list loaders`), or "
                         "'auto': memory when the decoded dataset fits (25% of RAM, 50% of the GPU) and the preprocessing "
                         "runs batched, gpu for JPEG files on CUDA, else cpu; the run says which and why.")
    memory_budget_gib: float | None = Field(
        None, gt=0, description="The most memory (GiB) the memory backend may hold the decoded dataset in: auto picks "
        "memory only under it, and data.backend=memory refuses a dataset over it. null: 25% of RAM on CPU, 50% of "
        "the GPU's memory on CUDA.")
    batch_size: int | Literal["auto"] = Field(
        64, description="Training batch size per process, or 'auto': the largest that trains here, found at start-up with "
        "real steps of the run's model, precision and optimizer (CUDA: doubling, then bisecting on out-of-memory; CPU: "
        "50% of the free memory over the measured memory of a step, a power of two, confirmed by a step); at most the "
        "training images per process and 4096. The run says what it found (start-up, decisions.json) and resuming keeps it.")
    effective_batch_size: int | None = Field(
        None, ge=1, description="Images per optimizer step over all processes (batch_size x optim.accum_steps x "
        "processes): optim.accum_steps is derived from it, so with batch_size=auto the effective batch stays the same on "
        "any device (the batch found is lowered to a divisor). None: batch_size x optim.accum_steps x processes.")
    eval_batch_size: int | None = Field(None, ge=1, description="Evaluation batch size (defaults to 2 x batch_size).")

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
    pin_memory: bool = Field(True, description="Pin host memory for faster, asynchronous copies to CUDA (ignored on CPU).")
    persistent_workers: bool = Field(True, description="Keep workers alive between epochs (when num_workers > 0).")
    prefetch_factor: int = Field(2, ge=1, description="Batches prefetched per worker (when num_workers > 0).")
    drop_last: bool = Field(True, description="Drop the last incomplete training batch (keeps shapes static; never in eval).")
    repeated_aug: int = Field(
        1, ge=1, description="Repeated-augmentation sampling (DeiT's RASampler, timm's --aug-repeats): each chosen sample "
        "appears this many times per epoch, differently augmented and spread over the DDP ranks; an epoch keeps the "
        "length of one without repeats (timm's RepeatAugSampler). 1: off.")
    sampler: Literal["shuffle", "balanced"] = Field(
        "shuffle", description="Training order: shuffle (a seeded permutation per epoch) or balanced (class-balanced: "
        "each epoch draws as many samples as the training set holds, with replacement, sample i with probability "
        "proportional to 1 / its class's count, so every class is drawn equally often in expectation; seeded by "
        "run.seed and the epoch, exact across resume, DDP ranks take disjoint shards of one draw). Tasks with one class "
        "per image only.")
    on_bad_sample: Literal["skip", "error"] = Field("error", description="Unreadable image: skip it (counted and logged) or stop.")
    max_image_pixels: int = Field(
        89_478_485, ge=1, description="Images with more pixels (width x height, read from the header) are bad samples; PIL's bomb limit."
    )
    decoder: Literal["auto", "torchvision", "simplejpeg", "pil"] = Field(
        "auto", description="CPU JPEG decoder (auto: the fastest measured that is installed; see BENCHMARKS.md)."
    )
    cpu_fraction: float | Literal["auto"] = Field(
        0.0, description="gpu backend: share of each batch decoded and cropped on the CPU (0..1), or 'auto' to tune it from the data wait."
    )
    fallback: Literal["cpu"] | None = Field(
        None, description="When the gpu/dali backend cannot run here (no CUDA, no DALI): use this backend instead of failing."
    )
    train: SplitConfig = Field(default_factory=SplitConfig, description="Training preprocessing.")
    eval: SplitConfig = Field(default_factory=SplitConfig, description="Evaluation and inference preprocessing.")
    progressive: ProgressiveConfig = Field(
        default_factory=ProgressiveConfig, description="Progressive resizing: the training crop's side per epoch "
        "(data.train.transforms' random_resized_crop), on the cpu, memory and gpu backends; evaluation runs "
        "data.eval.transforms unchanged.")


class MixConfig(Section):
    """Mixup / CutMix on training batches (data/preprocess/mix.py): torchvision v2 MixUp/CutMix arithmetic, timm's switches."""

    mixup_alpha: float = Field(0.0, ge=0, description="Mixup: the mixing weight is drawn from Beta(alpha, alpha); 0 turns "
                               "Mixup off (torchvision references --mixup-alpha, timm --mixup; 0.2 is usual for ImageNet).")
    cutmix_alpha: float = Field(0.0, ge=0, description="CutMix: the pasted box's area share is drawn from Beta(alpha, "
                                "alpha); 0 turns CutMix off (torchvision --cutmix-alpha, timm --cutmix; 1.0 is usual).")
    prob: float = Field(1.0, ge=0, le=1, description="Probability that a batch (mode=batch) or a sample (mode=elem) is "
                        "mixed at all (timm --mixup-prob).")
    switch_prob: float = Field(0.5, ge=0, le=1, description="With both alphas > 0: probability of CutMix rather than "
                               "Mixup (timm --mixup-switch-prob).")
    mode: Literal["batch", "elem"] = Field("batch", description="batch: one draw (kind, weight, box) per batch, as "
                                           "torchvision and timm's default; elem: one per sample (timm --mixup-mode elem).")


class TeacherConfig(Section):
    """Where distill's teacher comes from: a run folder, a weights file, or a model name with its weights."""

    run: str | None = Field(
        None, description="A torchsprint run folder: the teacher's model (name and args) comes from its config.yaml and "
        "its weights from <run>/<weights>.safetensors (weights: best, the default, last or ema).")
    model: str | None = Field(
        None, description="The teacher's architecture, a name from the MODELS registry (built-in, torchvision, "
        "timm/...), with `weights`. Not with `run` (its config names the model); optional for a torchsprint "
        ".safetensors file, whose metadata names it.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the teacher's model builder "
                                 "(with `model`, as model.args).")
    weights: str | None = Field(
        None, description="With `run`: best | last | ema (None: best). Otherwise the teacher's weights: a file "
        "(.safetensors, .pt, .pth: a state dict, a torchsprint checkpoint or weights file), or a library's published "
        "weights from its local cache, as model.pretrained: torchvision:ResNet50_Weights.IMAGENET1K_V2, "
        "torchvision:DEFAULT, timm:resnet50.a1_in1k (never downloaded: a missing file is refused, naming where to "
        "put it). Loaded strictly: every key, every shape.")


class DistillConfig(Section):
    """Knowledge distillation (distill.py): Hinton et al.'s logit distillation from a frozen teacher."""

    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="The teacher; distillation is on when "
                                   "teacher.run, teacher.model or teacher.weights is set.")
    temperature: float = Field(4.0, gt=0, description="T: both models' logits are divided by T before the softmax of "
                               "the distillation term (softer targets for T > 1; timm's --kd-temperature).")
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of the distillation term: loss = (1 - alpha) x task loss "
                         "+ alpha x T^2 x KL(softmax(teacher/T) || softmax(student/T)), the KL a mean over the batch "
                         "(timm's LogitDistillationTask with task_loss_weight = 1 - alpha). 1: teacher only.")


class ModelConfig(Section):
    name: str = Field("small_cnn", description="Model name from the MODELS registry (`torchsprint list models`).")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the model builder.")
    pretrained: str | None = Field(
        None, description="Weights loaded when not resuming: a file (.pt/.pth/.safetensors), torchvision's "
        "(torchvision:ResNet18_Weights.IMAGENET1K_V1, torchvision:DEFAULT) or timm's (timm:resnet18.a1_in1k) from "
        "the library's local cache (never downloaded). A head for another class count is replaced, and the run says so.")
    strict: bool = Field(False, description="Any missing, unexpected or shape-mismatched key in `pretrained` is an error.")
    freeze: list[str] = Field(default_factory=list, description="Parameter-name patterns (glob, or regex with 're:' prefix) to freeze.")
    train_only: list[str] = Field(default_factory=list, description="Freeze everything except parameters matching these patterns.")
    freeze_bn_stats: bool = Field(True, description="Keep BatchNorm layers whose parameters are all frozen in eval mode.")
    freeze_epochs: int = Field(
        0, ge=0, description="Fine-tuning (fastai's freeze-then-unfreeze): the first N epochs train only the head "
        "(model.head, else the last Linear layer), then every trainable parameter. The body is in the optimizer from "
        "the start with no gradient while frozen (not stepped, no weight decay); the learning-rate schedule runs on "
        "over all run.epochs, no restart at the switch. 0: off.")
    head: list[str] = Field(
        default_factory=list, description="Parameter-name patterns (as model.freeze) of the head that "
        "model.freeze_epochs trains alone; empty: the last nn.Linear layer's parameters.")


class ParamGroupRule(Section):
    pattern: str = Field(description="Parameter-name pattern: a glob (`backbone.*`, `layer[12].*`) or a regex with a 're:' "
                         "prefix, as model.freeze; the first rule that matches a parameter applies.")
    lr_scale: float = Field(1.0, gt=0, description="This group's learning rate is optim.lr x lr_scale (the schedule "
                            "scales it like every group's).")
    weight_decay: float | None = Field(None, ge=0, description="This group's weight decay (None: optim.weight_decay); "
                                       "biases and norm weights still get none with optim.no_decay_norm_bias.")


class OptimConfig(Section):
    name: str = Field("sgd", description="Optimizer: sgd, adam, adamw, rmsprop, or any torch.optim class name.")
    lr: float = Field(0.1, gt=0, description="Peak learning rate.")
    momentum: float = Field(0.9, ge=0, description="Momentum (SGD, RMSprop).")
    nesterov: bool = Field(True, description="Nesterov momentum (SGD).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="Adam/AdamW/RMSprop epsilon.")
    weight_decay: float = Field(5e-4, ge=0, description="Weight decay.")
    no_decay_norm_bias: bool = Field(True, description="Exclude normalization weights and biases from weight decay.")
    impl: Literal["auto", "foreach", "fused", "for_loop"] = Field(
        "auto", description="Kernel implementation of the update (auto: fused for sgd/adam/adamw on CUDA, PyTorch's choice elsewhere).")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the optimizer class.")
    clip_grad_norm: float | None = Field(None, gt=0, description="Clip the global gradient norm to this value.")
    accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step (derived from "
                             "data.effective_batch_size when that is set).")
    param_groups: list[ParamGroupRule] = Field(
        default_factory=list, description="Per-parameter-group settings, e.g. [{pattern: 'backbone.*', lr_scale: 0.1}]: "
        "the first matching rule sets a parameter's lr scale and weight decay; unmatched parameters keep optim.lr.")
    layer_decay: float | None = Field(
        None, gt=0, le=1, description="Layer-wise lr decay (BEiT/timm): layer i of L gets lr x layer_decay ** (L-1-i), "
        "the head the full rate. Layers: timm's group_matcher for timm models, blocks in module order for others "
        "(docs: README 'Recipe switches').")


class SchedConfig(Section):
    name: str = Field("cosine", description="Schedule: cosine, step, multistep, exponential, onecycle, constant.")
    interval: Literal["step", "epoch"] = Field("step", description="Update the learning rate every optimizer step or every epoch.")
    warmup_epochs: float = Field(0.0, ge=0, description="Linear warm-up length in epochs (fractions allowed).")
    warmup_start: float = Field(0.1, ge=0, le=1, description="Warm-up starts at this fraction of the peak learning rate.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine: final learning rate as a fraction of the peak.")
    step_size: float = Field(10, gt=0, description="step: epochs between decays.")
    milestones: list[float] = Field(default_factory=lambda: [30, 60, 90], description="multistep: epochs at which to decay.")
    gamma: float = Field(0.1, gt=0, description="step/multistep/exponential: decay factor.")
    pct_start: float = Field(0.25, gt=0, lt=1, description="onecycle: share of training spent increasing the learning rate.")


class LossTerm(Section):
    name: str = Field(description="Loss name from the LOSSES registry.")
    weight: float = Field(1.0, description="Weight of this term in the sum.")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for this loss.")


class LossConfig(Section):
    name: str = Field("cross_entropy", description="Loss name from the LOSSES registry (ignored when `terms` is set).")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Cross-entropy label smoothing.")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the loss.")
    terms: list[LossTerm] = Field(default_factory=list, description="Weighted sum of several losses (overrides `name`).")
    class_weights: Literal["auto"] | None = Field(
        None, description="auto: cross_entropy's per-class weight from the training set's class counts, inverse frequency "
        "normalised to mean 1 (w_c = (1/n_c) / mean_k(1/n_k)); the start-up log prints them. None: unweighted (or "
        "loss.args.weight, one value per class). Tasks with one class per image only.")


_PRECISION_ALIASES = {"O0": "fp32", "O1": "amp_fp16", "O2": "fp16", "amp": "amp_fp16", "bf16_amp": "amp_bf16"}


def _shorthand(field: str):
    """Accept `precision: amp_bf16` as `precision: {mode: amp_bf16}` (same for strategy)."""

    def before(cls, data):
        return {field: data} if isinstance(data, str) else data

    return model_validator(mode="before")(classmethod(before))


class PrecisionConfig(Section):
    mode: Literal["fp32", "amp_fp16", "amp_bf16", "fp16", "bf16"] = Field(
        "fp32", description="fp32 | amp_fp16 | amp_bf16 | fp16 | bf16; apex levels O0/O1/O2 are aliases."
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "stop",
        description="A NaN/inf loss or gradient: stop the run (checked at log steps; no per-step cost) or skip the step "
        "(counted; costs a gradient check per step, and a host sync per step on CUDA in fp32/bf16). Loss-scaled fp16 "
        "always skips overflowing steps.",
    )
    _short = _shorthand("mode")

    @field_validator("mode", mode="before")
    @classmethod
    def _alias(cls, v):
        return _PRECISION_ALIASES.get(v, v) if isinstance(v, str) else v


class StrategyConfig(Section):
    name: Literal["single", "dp", "ddp"] = Field("single", description="single device, nn.DataParallel, or DistributedDataParallel.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="Process-group backend (auto: NCCL on GPU, gloo on CPU).")
    sync_bn: bool = Field(False, description="Convert BatchNorm layers to SyncBatchNorm under DDP.")
    find_unused_parameters: bool = Field(False, description="DDP: look for parameters that got no gradient.")
    static_graph: bool = Field(False, description="DDP: the graph is the same every step.")
    bucket_cap_mb: float = Field(25, gt=0, description="DDP: gradient bucket size in MiB.")
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP gradient all-reduce: none (as computed), fp16/bf16 (compressed to half precision: "
        "half the bytes), powersgd (PowerSGD low-rank compression with error feedback; see docs/cluster.md).")
    powersgd_rank: int = Field(1, ge=1, description="comm_hook=powersgd: rank of the low-rank gradient approximation "
                               "(higher: closer to the exact gradient, more bytes).")
    powersgd_start_step: int = Field(1000, ge=2, description="comm_hook=powersgd: plain all-reduce for this many steps first "
                                     "(PyTorch suggests about 10% of training), then PowerSGD.")
    timeout_s: float = Field(300, gt=0, description="Seconds a rank waits for the others before failing (no hangs).")
    _short = _shorthand("name")


class SpeedConfig(Section):
    channels_last: bool | Literal["auto"] = Field(
        "auto", description="channels_last (NHWC) memory format. true: model and input batches; auto: the model when it has "
        "2-D convolutions (oneDNN and cuDNN run them in NHWC; the first convolution reorders the NCHW batch), else off; false: off.")
    compile: bool = Field(False, description="torch.compile the model.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (None: torch's default). reduce-overhead adds CUDA graphs (GPU).")
    compile_backend: str = Field("inductor", description="torch.compile backend: inductor (fast kernels), or aot_eager/eager to debug.")
    fullgraph: bool = Field(False, description="torch.compile fullgraph=True (fail on graph breaks).")
    cudnn_benchmark: bool = Field(True, description="Let cuDNN pick the fastest convolution algorithms (GPU).")
    tf32: bool = Field(True, description="Allow TF32 matmuls and convolutions on Ampere+ GPUs.")
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto", description="Capture the model's training forward/backward in a CUDA graph (loss and optimizer stay eager; "
        "batches of another shape and evaluation run eagerly). auto: on for one CUDA process without compile, dp or "
        "sync_bn, off otherwise (the run says which and why); true: on (refused where it cannot run); false: off.")


class CheckpointConfig(Section):
    every_epochs: int | None = Field(1, ge=1, description="Save a resumable checkpoint every N epochs (None: off).")
    every_steps: int | None = Field(None, ge=1, description="Save a resumable checkpoint every N optimizer steps.")
    keep_last: int = Field(2, ge=1, description="Keep this many most recent checkpoints.")
    keep_best: int = Field(1, ge=0, description="Keep this many best checkpoints by `monitor`.")
    monitor: str = Field("val/top1", description="Metric that defines 'best'.")
    mode: Literal["max", "min"] = Field("max", description="Whether a larger or a smaller `monitor` is better.")
    resume: str | None = Field(None, description="'auto' (newest valid checkpoint of run.dir), a checkpoint path, or None.")


class EmaConfig(Section):
    enabled: bool = Field(False, description="Keep an exponential moving average (EMA) of the weights (timm's ModelEmaV3 "
                          "semantics); it is evaluated (ema/val/...), checkpointed and saved as ema.safetensors.")
    decay: float = Field(0.9998, ge=0, lt=1, description="EMA decay per update: ema = decay * ema + (1 - decay) * weights "
                         "(timm train.py's default 0.9998).")
    warmup: bool = Field(False, description="Warm the decay up: decay_k = min(decay, 1 - (1 + k / warmup_gamma) ** "
                         "-warmup_power) at update k (timm's use_warmup).")
    warmup_gamma: float = Field(1.0, gt=0, description="Decay warm-up: inverse gamma (timm's warmup_gamma).")
    warmup_power: float = Field(2 / 3, gt=0, description="Decay warm-up: power (timm's warmup_power; 3/4 for short runs).")
    every_steps: int = Field(1, ge=1, description="Update the EMA every N optimizer steps (torchvision's --model-ema-steps); "
                             "the decay applies per update.")
    buffers: Literal["average", "copy"] = Field(
        "average", description="BatchNorm running statistics: averaged like the weights (timm ModelEmaV3's default) or "
        "copied from the model (timm's exclude_buffers=True).")
    eval: bool = Field(True, description="Evaluate the EMA weights at every evaluation (metrics ema/val/...; "
                       "checkpoint.monitor may name them).")
    device: Literal["model", "cpu"] = Field("model", description="Where the EMA lives: on the model's device, or on the "
                                            "CPU to save accelerator memory (then not evaluated during training).")


class SwaConfig(Section):
    enabled: bool = Field(False, description="Stochastic weight averaging (torch.optim.swa_utils): from swa.start on, the "
                          "learning rate follows SWALR towards swa.lr and the weights at the end of every epoch are "
                          "averaged (AveragedModel); after the last epoch the average's BatchNorm statistics are "
                          "recomputed over the training data (update_bn), it is evaluated (swa/val/...), saved as "
                          "swa.safetensors and recorded in summary.json under 'swa'. Costs one model copy and one "
                          "training-data forward pass at the end.")
    start: int | float = Field(0.75, gt=0, description="First averaged epoch: an integer is its number (1-based; the "
                               "schedule runs through the epoch before it), a number below 1 a fraction of run.epochs "
                               "trained first (0.75 of 20 epochs: epochs 16-20 are averaged; Lightning's "
                               "swa_epoch_start).")
    lr: float | None = Field(None, gt=0, description="The learning rate SWALR anneals to and then keeps (torch's swa_lr; "
                             "the same for every parameter group). Required with swa.enabled=true; a tenth to a half "
                             "of optim.lr is usual.")
    anneal_epochs: int = Field(10, ge=0, description="Epochs SWALR takes from the learning rate the schedule reached to "
                               "swa.lr (0: at once; torch's default 10).")
    anneal_strategy: Literal["cos", "linear"] = Field("cos", description="Shape of SWALR's annealing: cos or linear.")


class EarlyStopConfig(Section):
    patience: int | None = Field(None, ge=1, description="Stop when checkpoint.monitor has not improved by more than "
                                 "min_delta for this many evaluations (None: off).")
    min_delta: float = Field(0.0, ge=0, description="Smallest change of checkpoint.monitor that counts as an improvement.")


class LogConfig(Section):
    every_steps: int = Field(50, ge=1, description="Log loss, lr and throughput every N optimizer steps.")
    progress: bool = Field(True, description="Show a progress bar (rank 0, interactive terminals).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run folder.")
    csv: bool = Field(False, description="Also write metrics_<kind>.csv (train, epoch, eval) into the run folder.")
    mlflow: bool = Field(False, description="Log parameters and metrics to MLflow (pip install 'torchsprint[mlflow]').")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; None: a local file store at <run.out_dir>/mlruns (open it with "
        "`mlflow ui --backend-store-uri <that folder>`).")
    wandb: bool = Field(False, description="Log parameters and metrics to Weights & Biases (pip install 'torchsprint[wandb]').")
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B mode: online (needs `wandb login`) or offline (synced later with `wandb sync`).")
    project: str = Field("torchsprint", description="Experiment (MLflow) / project (W&B) name the run is logged under.")


class EvalConfig(Section):
    every_epochs: int = Field(1, ge=1, description="Evaluate on the validation set every N epochs (and at the end).")
    every_steps: int | None = Field(
        None, ge=1, description="Also evaluate every N optimizer steps (global steps, so a resumed run evaluates where an "
        "uninterrupted one does), for long epochs; at most one epoch's steps (for longer intervals use every_epochs). "
        "Best weights, early_stop (patience counts evaluations) and checkpoints follow every evaluation; an "
        "evaluation due from both settings at the same step runs once.")
    topk: int = Field(5, ge=2, description="Also report top-k accuracy when the dataset has more than k classes.")
    test_at_end: bool = Field(False, description="After training, evaluate the best weights on the dataset's test split "
                              "(image_folder: test/); the metrics go to summary.json under 'test'.")
    per_class: bool = Field(True, description="Per-class precision/recall/F1 and a confusion matrix (CSV and PNG).")
    threshold: float = Field(0.5, gt=0, lt=1, description="task=multilabel: a label is predicted when its probability is at "
                             "least this (F1 and `torchsprint predict`).")
    tta: Literal["none", "hflip", "five_crop", "ten_crop"] = Field(
        "none", description="Test-time augmentation, the same on every path (validation, `torchsprint eval`, `predict`, "
        "and `export`, whose graph holds it): hflip (the image and its mirror), five_crop (four corners and the centre, "
        "torchvision's FiveCrop), ten_crop (the five crops and their mirrors, TenCrop). Multi-crop cuts crops of the "
        "eval size S (data.eval.transforms' final center_crop: S) from the centre square of the image as the eval spec's "
        "resize leaves it (a resize larger than S must precede the crop; S/0.875 is usual, e.g. resize: 146, "
        "center_crop: 128). Class scores average the views' probabilities (softmax; "
        "sigmoid per label), not their logits: the ensemble's predictive distribution, which one overconfident view "
        "cannot dominate; the outputs are the logits of those averaged probabilities, so val/loss is its NLL. "
        "image_to_image: hflip only, outputs flipped back and averaged. Costs one forward pass per view.")


class Config(Section):
    """One run. Every key has a default, so an empty file is a valid run (digits + small CNN)."""

    imports: list[str] = Field(default_factory=list, description="Python modules to import first (register your own models, datasets...).")
    task: str = Field(
        "classification", description="What the run learns, from the TASKS registry: classification (one class per image), "
        "multilabel (any number of labels per image), image_to_image (paired restoration), video (clip classification). "
        "It sets the default loss, metrics, checkpoint.monitor/mode, artifacts and predict output.",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, length and device.")
    data: DataConfig = Field(default_factory=DataConfig, description="Dataset, loader backend and preprocessing.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model, initialisation and freezing.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer, gradient clipping and accumulation.")
    sched: SchedConfig = Field(default_factory=SchedConfig, description="Learning-rate schedule.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Loss function(s).")
    mix: MixConfig = Field(default_factory=MixConfig, description="Mixup and CutMix on training batches (soft targets; "
                           "loss.label_smoothing applies to them).")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="Knowledge distillation from a frozen "
                                   "teacher's logits (off unless distill.teacher is set).")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Numeric precision (AMP).")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig, description="Single device, DataParallel or DDP.")
    speed: SpeedConfig = Field(default_factory=SpeedConfig, description="Speed switches.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving, keeping and resuming.")
    ema: EmaConfig = Field(default_factory=EmaConfig, description="Exponential moving average of the weights.")
    swa: SwaConfig = Field(default_factory=SwaConfig, description="Stochastic weight averaging over the last epochs "
                           "(torch.optim.swa_utils: AveragedModel, SWALR, update_bn).")
    early_stop: EarlyStopConfig = Field(default_factory=EarlyStopConfig, description="Stop when checkpoint.monitor stops improving.")
    log: LogConfig = Field(default_factory=LogConfig, description="Console, JSONL and TensorBoard logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation metrics.")

    @model_validator(mode="after")
    def _task_defaults(self):
        # The task's default loss and monitor apply only where the config leaves them unset.
        from torchsprint.tasks import apply_defaults

        apply_defaults(self)
        return self

    # What torchsprint chose for settings the config leaves unset and the data decides (data/detect.py): a list of
    # Choice dicts (setting, value, why, override), for the start-up summary and decisions.json. Not a config key:
    # the chosen values themselves are written into the config (config.yaml), so a resumed run reads them as set.
    _chosen: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _data_defaults(self):
        # Only with a data.root: the default run (digits) and saved run configs (everything set) never scan files.
        if self.data.root is not None:
            from torchsprint.data.detect import resolve

            # A later re-validation (validate_assignment) finds the chosen values set and keeps the first record.
            have = {c["setting"] for c in self._chosen}
            self._chosen = [*self._chosen, *(c.as_dict() for c in resolve(self) if c.setting not in have)]
        return self

    def chosen(self) -> list[dict]:
        """The settings chosen from the data (data/detect.py), each {setting, value, why, override}."""
        return list(self._chosen)


# ---------------------------------------------------------------- loading
# Reading files (YAML/JSON/TOML, extends, duplicate keys, depth) and dotted overrides live in config_files.py;
# read_file, read_with_extends, deep_merge and MAX_DEPTH are re-exported here, where callers have always found them.


def apply_override(data: dict[str, Any], item: str) -> dict[str, Any]:
    """Apply one `a.b.c=value` to the raw dict; the key must exist in the schema (Config)."""
    return _apply_override(data, item, Config)


def _format_validation_error(err: ValidationError, source: str) -> str:
    """One line: '<source>: invalid config: <key>: <problem> (got <value>); <key>: ...'."""
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            # Suggest the closest valid key in the same section.
            model: type[BaseModel] | None = Config
            for part in e["loc"][:-1]:
                model = _sub_model(model, str(part)) if model is not None and str(part) in model.model_fields else None
            names = _field_names(model) if model else []
            parent = ".".join(str(p) for p in e["loc"][:-1])
            full = [f"{parent}.{n}" if parent else n for n in names]
            problems.append(f"{loc}: unknown key.{did_you_mean(loc, full)}")
        else:
            got = e.get("input")
            got_s = f" (got {got!r})" if not isinstance(got, dict | list) else ""
            problems.append(f"{loc}: {e['msg']}{got_s}")
    return f"{source}: invalid config: " + "; ".join(problems)


def validate(data: dict[str, Any], source: str = "config") -> Config:
    """Turn a raw dict into a Config; errors name each bad key and the closest valid one."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise UsageError(_format_validation_error(e, source)) from None


def import_modules(names: list[str] | tuple[str, ...]) -> None:
    """Import user modules that register models, datasets, tasks... (`imports:` / --import).

    The working folder is searched for them after the installed packages (appended to sys.path, never
    put first) and only when a module is named, so a stray sklearn.py or torch.py there never shadows a
    library. An error inside the module is one line naming it (--debug shows the traceback).
    """
    if names and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of a user module is reported the same way
            raise UsageError(f"cannot import '{name}' (imports: / --import): {type(e).__name__}: {e}") from e


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
         imports: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a config file (or the defaults when `path` is None), apply dotted overrides, validate.

    The config's `imports:` and `imports` (--import) are imported first, so that names they register
    (a task, a loss...) validate; the returned config lists both.
    """
    data = read_with_extends(path) if path is not None else {}
    for item in overrides:
        data = apply_override(data, item)
    listed = data.get("imports") if isinstance(data.get("imports"), list) else []
    import_modules(list(dict.fromkeys(n for n in [*listed, *imports] if isinstance(n, str))))
    if imports:  # keep what the file lists as it is (validation reports a bad entry), then the flags' modules
        data["imports"] = [*listed, *[m for m in imports if m not in listed]] if listed or "imports" not in data \
            else data["imports"]
    source = str(path) if path is not None else "defaults"
    if overrides:
        source += " + overrides"
    return validate(data, source)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain JSON-able dict of a config (the resolved config written into the run folder)."""
    return cfg.model_dump(mode="json")


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def json_schema() -> dict[str, Any]:
    """JSON Schema of the config, for editor completion."""
    return Config.model_json_schema()


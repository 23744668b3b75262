"""The config schema's sections of how a run trains and what it keeps: optim (with its parameter groups), sched,
loss, precision, strategy, speed, checkpoint, ema, swa, early_stop, log and eval."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from torchsprint.config.sections import Section


class ParamGroupRule(Section):
    pattern: str = Field(
        description="Parameter-name pattern: a glob (`backbone.*`, `layer[12].*`) or a regex with a 're:' "
        "prefix, as model.freeze; the first rule that matches a parameter applies."
    )
    lr_scale: float = Field(
        1.0,
        gt=0,
        description="This group's learning rate is optim.lr x lr_scale (the schedule scales it like every group's).",
    )
    weight_decay: float | None = Field(
        None,
        ge=0,
        description="This group's weight decay (None: optim.weight_decay); "
        "biases and norm weights still get none with optim.no_decay_norm_bias.",
    )


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
        "auto",
        description=(
            "Kernel implementation of the update (auto: fused for sgd/adam/adamw on CUDA, PyTorch's choice elsewhere)."
        ),
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the optimizer class.")
    clip_grad_norm: float | None = Field(None, gt=0, description="Clip the global gradient norm to this value.")
    accum_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches accumulated per optimizer step (derived from "
        "data.effective_batch_size when that is set).",
    )
    param_groups: list[ParamGroupRule] = Field(
        default_factory=list,
        description="Per-parameter-group settings, e.g. [{pattern: 'backbone.*', lr_scale: 0.1}]: "
        "the first matching rule sets a parameter's lr scale and weight decay; unmatched parameters keep optim.lr.",
    )
    layer_decay: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Layer-wise lr decay (BEiT/timm): layer i of L gets lr x layer_decay ** (L-1-i), "
        "the head the full rate. Layers: timm's group_matcher for timm models, blocks in module order for others "
        "(docs: README 'Recipe switches').",
    )


class SchedConfig(Section):
    name: str = Field("cosine", description="Schedule: cosine, step, multistep, exponential, onecycle, constant.")
    interval: Literal["step", "epoch"] = Field(
        "step", description="Update the learning rate every optimizer step or every epoch."
    )
    warmup_epochs: float = Field(0.0, ge=0, description="Linear warm-up length in epochs (fractions allowed).")
    warmup_start: float = Field(
        0.1, ge=0, le=1, description="Warm-up starts at this fraction of the peak learning rate."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine: final learning rate as a fraction of the peak.")
    step_size: float = Field(10, gt=0, description="step: epochs between decays.")
    milestones: list[float] = Field(
        default_factory=lambda: [30, 60, 90], description="multistep: epochs at which to decay."
    )
    gamma: float = Field(0.1, gt=0, description="step/multistep/exponential: decay factor.")
    pct_start: float = Field(
        0.25, gt=0, lt=1, description="onecycle: share of training spent increasing the learning rate."
    )


class LossTerm(Section):
    name: str = Field(description="Loss name from the LOSSES registry.")
    weight: float = Field(1.0, description="Weight of this term in the sum.")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for this loss.")


class LossConfig(Section):
    name: str = Field("cross_entropy", description="Loss name from the LOSSES registry (ignored when `terms` is set).")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Cross-entropy label smoothing.")
    args: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the loss.")
    terms: list[LossTerm] = Field(
        default_factory=list, description="Weighted sum of several losses (overrides `name`)."
    )
    class_weights: Literal["auto"] | None = Field(
        None,
        description="auto: cross_entropy's per-class weight from the training set's class counts, inverse frequency "
        "normalised to mean 1 (w_c = (1/n_c) / mean_k(1/n_k)); the start-up log prints them. None: unweighted (or "
        "loss.args.weight, one value per class). Tasks with one class per image only.",
    )
    logit_adjust: float = Field(
        0.0,
        ge=0,
        description="Logit-adjusted loss (Menon et al. 2021, 'Long-tail learning via logit adjustment'): "
        "cross_entropy of logits + tau * log(prior), tau this value and prior each class's share of the training "
        "images, so rare classes need a larger margin to be right; predictions (argmax of the plain logits) are "
        "unchanged, and validation's loss is the adjusted one. 1.0 is the paper's choice; 0: off. Tasks with one "
        "class per image, loss.name=cross_entropy only.",
    )


_PRECISION_ALIASES = {"O0": "fp32", "O1": "amp_fp16", "O2": "fp16", "amp": "amp_fp16", "bf16_amp": "amp_bf16"}


def _shorthand(field: str):
    """Accept `precision: amp_bf16` as `precision: {mode: amp_bf16}` (same for strategy)."""

    def before(cls, data):
        return {field: data} if isinstance(data, str) else data

    return model_validator(mode="before")(classmethod(before))


class PrecisionConfig(Section):
    mode: Literal["auto", "fp32", "amp_fp16", "amp_bf16", "fp16", "bf16", "fp64"] = Field(
        "auto",
        description="auto | fp32 | amp_fp16 | amp_bf16 | fp16 | bf16 | fp64; apex levels O0/O1/O2 are aliases. "
        "auto: fp32 on CUDA; on a CPU, fp32 unless a few real training steps of the run's own model and batch measured "
        "amp_bf16 faster by a margin (only on a CPU with native bf16, AVX-512 BF16 or AMX, and only in a run long "
        "enough for the measurement to pay); the run's config.yaml records the mode that ran, decisions.json why. fp64 "
        "(Lightning's precision='64-true'): weights, activations and loss in float64, many times slower; for checking "
        "that two computations agree where fp32 rounding, amplified over training steps, would blur them.",
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "stop",
        description="A NaN/inf loss or gradient: stop the run (checked at log steps; no per-step cost) or skip the "
        "step (counted; costs a gradient check per step, and a host sync per step on CUDA in fp32/bf16). Loss-scaled "
        "fp16 always skips overflowing steps.",
    )
    _short = _shorthand("mode")

    @field_validator("mode", mode="before")
    @classmethod
    def _alias(cls, v):
        return _PRECISION_ALIASES.get(v, v) if isinstance(v, str) else v


class StrategyConfig(Section):
    name: Literal["single", "dp", "ddp"] = Field(
        "single", description="single device, nn.DataParallel, or DistributedDataParallel."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend (auto: NCCL on GPU, gloo on CPU)."
    )
    sync_bn: bool = Field(False, description="Convert BatchNorm layers to SyncBatchNorm under DDP.")
    find_unused_parameters: bool = Field(False, description="DDP: look for parameters that got no gradient.")
    static_graph: bool = Field(False, description="DDP: the graph is the same every step.")
    bucket_cap_mb: float = Field(25, gt=0, description="DDP: gradient bucket size in MiB.")
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description="DDP gradient all-reduce: none (as computed), fp16/bf16 (compressed to half precision: "
        "half the bytes), powersgd (PowerSGD low-rank compression with error feedback; see docs/cluster.md).",
    )
    powersgd_rank: int = Field(
        1,
        ge=1,
        description="comm_hook=powersgd: rank of the low-rank gradient approximation "
        "(higher: closer to the exact gradient, more bytes).",
    )
    powersgd_start_step: int = Field(
        1000,
        ge=2,
        description="comm_hook=powersgd: plain all-reduce for this many steps first "
        "(PyTorch suggests about 10% of training), then PowerSGD.",
    )
    timeout_s: float = Field(300, gt=0, description="Seconds a rank waits for the others before failing (no hangs).")
    _short = _shorthand("name")


class SpeedConfig(Section):
    channels_last: bool | Literal["auto"] = Field(
        "auto",
        description="channels_last (NHWC) memory format. true: model and input batches; auto: the model when it has "
        "2-D convolutions (oneDNN and cuDNN run them in NHWC; the first convolution reorders the NCHW batch), else "
        "off, except where precision=auto's measurement on a CPU (see precision.mode) found NCHW faster by its margin "
        "(then off, and config.yaml says false); false: off.",
    )
    compile: bool = Field(False, description="torch.compile the model.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (None: torch's default). reduce-overhead adds CUDA graphs (GPU)."
    )
    compile_backend: str = Field(
        "inductor", description="torch.compile backend: inductor (fast kernels), or aot_eager/eager to debug."
    )
    fullgraph: bool = Field(False, description="torch.compile fullgraph=True (fail on graph breaks).")
    cudnn_benchmark: bool = Field(True, description="Let cuDNN pick the fastest convolution algorithms (GPU).")
    tf32: bool = Field(True, description="Allow TF32 matmuls and convolutions on Ampere+ GPUs.")
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="Capture the model's training forward/backward in a CUDA graph (loss and optimizer stay eager; "
        "batches of another shape and evaluation run eagerly). auto: on for one CUDA process without compile, dp or "
        "sync_bn, off otherwise (the run says which and why); true: on (refused where it cannot run); false: off.",
    )


class CheckpointConfig(Section):
    every_epochs: int | None = Field(1, ge=1, description="Save a resumable checkpoint every N epochs (None: off).")
    every_steps: int | None = Field(None, ge=1, description="Save a resumable checkpoint every N optimizer steps.")
    keep_last: int = Field(2, ge=1, description="Keep this many most recent checkpoints.")
    keep_best: int = Field(1, ge=0, description="Keep this many best checkpoints by `monitor`.")
    monitor: str = Field("val/top1", description="Metric that defines 'best'.")
    mode: Literal["max", "min"] = Field("max", description="Whether a larger or a smaller `monitor` is better.")
    resume: str | None = Field(
        None, description="'auto' (newest valid checkpoint of run.dir), a checkpoint path, or None."
    )


class EmaConfig(Section):
    enabled: bool = Field(
        False,
        description="Keep an exponential moving average (EMA) of the weights (timm's ModelEmaV3 "
        "semantics); it is evaluated (ema/val/...), checkpointed and saved as ema.safetensors.",
    )
    decay: float = Field(
        0.9998,
        ge=0,
        lt=1,
        description="EMA decay per update: ema = decay * ema + (1 - decay) * weights (timm train.py's default 0.9998).",
    )
    warmup: bool = Field(
        False,
        description="Warm the decay up: decay_k = min(decay, 1 - (1 + k / warmup_gamma) ** "
        "-warmup_power) at update k (timm's use_warmup).",
    )
    warmup_gamma: float = Field(1.0, gt=0, description="Decay warm-up: inverse gamma (timm's warmup_gamma).")
    warmup_power: float = Field(
        2 / 3, gt=0, description="Decay warm-up: power (timm's warmup_power; 3/4 for short runs)."
    )
    every_steps: int = Field(
        1,
        ge=1,
        description="Update the EMA every N optimizer steps (torchvision's --model-ema-steps); "
        "the decay applies per update.",
    )
    buffers: Literal["average", "copy"] = Field(
        "average",
        description="BatchNorm running statistics: averaged like the weights (timm ModelEmaV3's default) or "
        "copied from the model (timm's exclude_buffers=True).",
    )
    eval: bool = Field(
        True,
        description="Evaluate the EMA weights at every evaluation (metrics ema/val/...; "
        "checkpoint.monitor may name them).",
    )
    device: Literal["model", "cpu"] = Field(
        "model",
        description="Where the EMA lives: on the model's device, or on the "
        "CPU to save accelerator memory (then not evaluated during training).",
    )


class SwaConfig(Section):
    enabled: bool = Field(
        False,
        description="Stochastic weight averaging (torch.optim.swa_utils): from swa.start on, the "
        "learning rate follows SWALR towards swa.lr and the weights at the end of every epoch are "
        "averaged (AveragedModel); after the last epoch the average's BatchNorm statistics are "
        "recomputed over the training data (update_bn), it is evaluated (swa/val/...), saved as "
        "swa.safetensors and recorded in summary.json under 'swa'. Costs one model copy and one "
        "training-data forward pass at the end.",
    )
    start: int | float = Field(
        0.75,
        gt=0,
        description="First averaged epoch: an integer is its number (1-based; the "
        "schedule runs through the epoch before it), a number below 1 a fraction of run.epochs "
        "trained first (0.75 of 20 epochs: epochs 16-20 are averaged; Lightning's "
        "swa_epoch_start).",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="The learning rate SWALR anneals to and then keeps (torch's swa_lr; "
        "the same for every parameter group). Required with swa.enabled=true; a tenth to a half "
        "of optim.lr is usual.",
    )
    anneal_epochs: int = Field(
        10,
        ge=0,
        description="Epochs SWALR takes from the learning rate the schedule reached to "
        "swa.lr (0: at once; torch's default 10).",
    )
    anneal_strategy: Literal["cos", "linear"] = Field("cos", description="Shape of SWALR's annealing: cos or linear.")


class EarlyStopConfig(Section):
    patience: int | None = Field(
        None,
        ge=1,
        description="Stop when checkpoint.monitor has not improved by more than "
        "min_delta for this many evaluations (None: off).",
    )
    min_delta: float = Field(
        0.0, ge=0, description="Smallest change of checkpoint.monitor that counts as an improvement."
    )


class LogConfig(Section):
    every_steps: int = Field(50, ge=1, description="Log loss, lr and throughput every N optimizer steps.")
    progress: bool = Field(True, description="Show a progress bar (rank 0, interactive terminals).")
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run folder.")
    csv: bool = Field(False, description="Also write metrics_<kind>.csv (train, epoch, eval) into the run folder.")
    mlflow: bool = Field(False, description="Log parameters and metrics to MLflow (pip install 'torchsprint[mlflow]').")
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI; None: a local file store at <run.out_dir>/mlruns (open it with "
        "`mlflow ui --backend-store-uri <that folder>`).",
    )
    wandb: bool = Field(
        False, description="Log parameters and metrics to Weights & Biases (pip install 'torchsprint[wandb]')."
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description="W&B mode: online (needs `wandb login`) or offline (synced later with `wandb sync`)."
    )
    project: str = Field("torchsprint", description="Experiment (MLflow) / project (W&B) name the run is logged under.")


class EvalConfig(Section):
    every_epochs: int = Field(1, ge=1, description="Evaluate on the validation set every N epochs (and at the end).")
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also evaluate every N optimizer steps (global steps, so a resumed run evaluates where an "
        "uninterrupted one does), for long epochs; at most one epoch's steps (for longer intervals use every_epochs). "
        "Best weights, early_stop (patience counts evaluations) and checkpoints follow every evaluation; an "
        "evaluation due from both settings at the same step runs once.",
    )
    topk: int = Field(5, ge=2, description="Also report top-k accuracy when the dataset has more than k classes.")
    test_at_end: bool = Field(
        False,
        description="After training, evaluate the best weights on the dataset's test split "
        "(image_folder: test/); the metrics go to summary.json under 'test'.",
    )
    per_class: bool = Field(True, description="Per-class precision/recall/F1 and a confusion matrix (CSV and PNG).")
    threshold: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="task=multilabel: a label is predicted when its probability is at "
        "least this (F1 and `torchsprint predict`).",
    )
    tta: Literal["none", "hflip", "five_crop", "ten_crop"] = Field(
        "none",
        description="Test-time augmentation, the same on every path (validation, `torchsprint eval`, `predict`, "
        "and `export`, whose graph holds it): hflip (the image and its mirror), five_crop (four corners and the "
        "centre, torchvision's FiveCrop), ten_crop (the five crops and their mirrors, TenCrop). Multi-crop cuts crops "
        "of the eval size S (data.eval.transforms' final center_crop: S) from the centre square of the image as the "
        "eval spec's resize leaves it (a resize larger than S must precede the crop; S/0.875 is usual, e.g. resize: "
        "146, center_crop: 128). Class scores average the views' probabilities (softmax; "
        "sigmoid per label), not their logits: the ensemble's predictive distribution, which one overconfident view "
        "cannot dominate; the outputs are the logits of those averaged probabilities, so val/loss is its NLL. "
        "image_to_image: hflip only, outputs flipped back and averaged. Costs one forward pass per view.",
    )

"""wrap_model: device, SyncBN, precision, CUDA graphs, single/DataParallel/DDP, torch.compile (runtime/collectives.py:
rank agreement).

The order of `wrap_model` is fixed by what each layer needs to see:
device -> channels_last -> SyncBatchNorm -> half weights (Precision.prepare) -> CUDA graphs
(captured on the plain module, before DDP, so gradient all-reduces stay outside the graph)
-> DataParallel/DDP -> torch.compile (outermost, so dynamo's DDPOptimizer can split the graph
at DDP bucket boundaries and overlap all-reduce with backward).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from torchsprint.errors import UsageError

# SyncBatchNorm for gloo lives in runtime/sync_bn.py.
from torchsprint.runtime.sync_bn import convert_sync_batchnorm

# ---------------------------------------------------------------- CUDA graphs


def _fresh_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


class CudaGraphed(nn.Module):
    """Replays a captured CUDA graph of the module's forward and backward for training batches of the
    captured shape, dtype and layout; runs the module eagerly otherwise (eval, a last partial batch).

    Partial-network capture (torch.cuda.make_graphed_callables): the loss, the optimizer step and
    DDP's gradient all-reduce stay eager, so GradScaler and the non-finite skip work unchanged.
    PyTorch's CUDA-graph notes: capture the network before wrapping it in DDP.

    Gradient accumulation: the graphed backward returns its static gradient buffers (detached views),
    and autograd's AccumulateGrad steals an incoming gradient into `param.grad` when that is None, so
    `param.grad` would alias the buffer the next replay overwrites: micro-batch 1's gradients lost,
    micro-batch 2's doubled. A gradient hook on every parameter hands autograd a copy instead (one
    parameter-sized copy per micro-batch), so accumulation adds as in eager mode.

    The module's train/eval state at capture is baked into the graph: frozen BatchNorm layers
    (model.freeze_bn_stats) must be in eval mode before capture (capture_cuda_graphs does it).
    `replays` counts graphed training calls, so a test can tell a graph ran from a silent eager run.
    """

    _torchsprint_wrapper = True

    def __init__(self, module: nn.Module, example: torch.Tensor, prec):
        super().__init__()
        self.key = (tuple(example.shape), example.dtype, example.stride())
        # Warm-up and capture run real forwards; keep BatchNorm statistics as they were before.
        saved = {k: v.clone() for k, v in module.state_dict().items()}
        sample = example.detach().clone().requires_grad_(False)
        with prec.autocast() if prec is not None else nullcontext():  # the graph holds autocast's casts (cache off)
            graphed = torch.cuda.make_graphed_callables(module, (sample,))
        module.load_state_dict(saved)
        self.module = graphed
        self.replays = 0
        self._grad_hooks = [p.register_hook(_fresh_grad) for p in module.parameters() if p.requires_grad]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and (tuple(x.shape), x.dtype, x.stride()) == self.key:
            self.replays += 1
            return self.module(x)  # graphed (make_graphed_callables checks module.training too)
        return type(self.module).forward(self.module, x)  # the class's eager forward


def capture_cuda_graphs(
    model: nn.Module,
    example: Callable[[], torch.Tensor] | None,
    prec,
    frozen_norms: Callable[[nn.Module], list[nn.Module]] | None = None,
    chosen_by_auto: bool = False,
) -> nn.Module:
    """Capture `model`'s training forward/backward as CUDA graphs for a batch like `example()`.

    `frozen_norms(model)`: the normalisation layers the engine keeps in eval mode while training
    (model.freeze_bn_stats); they are captured in eval mode (running statistics used and left alone),
    since a replay cannot switch modes later. `chosen_by_auto`: the user did not ask for graphs
    (speed.cuda_graphs=auto), so a model that cannot be captured (a host sync or data-dependent branch in
    its forward, unused parameters, non-tensor outputs) stops the run with one line naming the switch,
    not a CUDA traceback. It is refused, not run eagerly instead: after a failed capture the device state is
    not known good, and the run's decisions would no longer say what ran.
    """
    if example is None:
        raise UsageError("speed.cuda_graphs needs an example batch (pass example= to wrap_model).")
    model.train()
    for m in frozen_norms(model) if frozen_norms is not None else []:
        m.eval()
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device]):  # drawing a batch must not shift the model's RNG stream
        batch = example()
    if not chosen_by_auto:
        return CudaGraphed(model, batch, prec)
    try:
        return CudaGraphed(model, batch, prec)
    except (RuntimeError, TypeError, AssertionError) as e:  # torch's capture raises these for non-static modules
        raise UsageError(
            f"speed.cuda_graphs=auto turned CUDA graphs on, but capturing {type(model).__name__} failed "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}): its forward is not static. Set "
            "speed.cuda_graphs=false to train it eagerly."
        ) from e


# ---------------------------------------------------------------- checks


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's inductor would use on CPU (CXX, else g++/clang++/cl), if present."""
    default = "cl" if sys.platform == "win32" else "clang++" if sys.platform == "darwin" else "g++"
    return shutil.which(os.environ.get("CXX") or default)


# torch.compile modes that capture CUDA graphs (inductor's triton.cudagraphs).
CUDAGRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def check_speed(speed_cfg, strategy_cfg, device: torch.device, accum_steps: int = 1) -> None:
    """Refuse speed switches this machine or combination cannot run, naming what to use instead."""
    if (
        speed_cfg.compile
        and speed_cfg.compile_mode in CUDAGRAPH_COMPILE_MODES
        and accum_steps > 1
        and device.type == "cuda"
    ):
        # CUDA-graph trees reuse their static outputs on the next replay; gradients of accumulated
        # micro-batches are such outputs (not verified exact on a GPU yet: refused, not risked).
        raise UsageError(
            f"speed.compile_mode={speed_cfg.compile_mode} captures CUDA graphs, which do not accumulate "
            f"gradients over optim.accum_steps={accum_steps} micro-batches exactly. Use speed.compile_mode="
            "default (or max-autotune-no-cudagraphs), speed.cuda_graphs=true, or optim.accum_steps=1."
        )
    if speed_cfg.compile:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            raise UsageError(
                f"speed.compile=true: torch.compile does not support this platform (Python "
                f"{sys.version_info.major}.{sys.version_info.minor} on {sys.platform}, torch {torch.__version__}). "
                "Set speed.compile=false (channels_last and AMP still apply)."
            )
        backend = getattr(speed_cfg, "compile_backend", "inductor")
        if backend == "inductor" and device.type == "cuda":
            from torch.utils._triton import has_triton

            if not has_triton():
                raise UsageError(
                    "speed.compile=true on CUDA needs Triton (pip install triton) for the inductor "
                    "backend. Install it, or set speed.compile=false."
                )
        if backend == "inductor" and device.type == "cpu" and cpp_compiler() is None:
            raise UsageError(
                "speed.compile=true on CPU needs a C++ compiler for the inductor backend (g++ or "
                "clang++ on PATH, or CXX); none was found. Install one, or set speed.compile=false."
            )
    if speed_cfg.cuda_graphs is True:  # auto never refuses: decide_cuda_graphs turns it off where these refuse
        if device.type != "cuda":
            raise UsageError("speed.cuda_graphs=true needs a CUDA device; on CPU set speed.cuda_graphs=false.")
        if speed_cfg.compile:
            raise UsageError(
                "speed.cuda_graphs and speed.compile both capture the model: use one. For CUDA graphs "
                "inside torch.compile, set speed.compile_mode=reduce-overhead and speed.cuda_graphs=false."
            )
        if strategy_cfg.name == "dp":
            raise UsageError(
                "speed.cuda_graphs does not work with strategy=dp (DataParallel replicates the model "
                "every step). Use strategy=ddp."
            )
        if strategy_cfg.sync_bn:
            raise UsageError(
                "speed.cuda_graphs cannot capture SyncBatchNorm's all-reduces inside the forward. "
                "Set strategy.sync_bn=false or speed.cuda_graphs=false."
            )


@dataclass(frozen=True)
class GraphsDecision:
    """speed.cuda_graphs resolved for one run: whether the training forward/backward is captured, and why."""

    on: bool
    why: str


def decide_cuda_graphs(
    speed_cfg,
    strategy_cfg,
    device: torch.device,
    world_size: int = 1,
    drop_last: bool = True,
    freeze_epochs: int = 0,
    progressive: bool = False,
) -> GraphsDecision:
    """The one place speed.cuda_graphs is resolved (DESIGN rule 12): wrap_model captures, Precision disables
    autocast's cache, and decisions.json / the start-up summary report from this result.

    true/false: as set (check_speed refuses true where it cannot run). auto: on exactly where the capture is
    known to be safe and `true` would be accepted: one process on a CUDA device, no torch.compile, no
    DataParallel, no SyncBatchNorm. Why on by default there: the default run (digits + small_cnn) is
    launch-bound on a GPU, and bench on an H200 measured the defaults at 24,720 images/s against 52,429 with
    CUDA graphs (../shared/gpu-runs/2026-11-26-h200/m5_default_run.log). What keeps it safe: only the model's
    forward/backward is captured (loss, optimizer, scaler, clipping, EMA, mixing stay eager); a batch of
    another shape (the last partial batch with data.drop_last=false) and evaluation run eagerly; gradient
    accumulation adds exactly (measured rel. diff 0.0 on the H200, tests/e2e/gpu/test_gpu.py). A model whose forward
    is not static (a host sync, data-dependent Python branches) fails at capture, and the run says how to
    turn the switch off (capture_cuda_graphs). Several processes (DDP) are left off by auto until measured
    on GPUs; speed.cuda_graphs=true captures under DDP as before.

    Args:
        speed_cfg: the `speed` section; strategy_cfg: the `strategy` section.
        device: the training device; world_size: the number of training processes.
        drop_last: data.drop_last (only changes the explanation: partial batches run eagerly).
        freeze_epochs: model.freeze_epochs; auto stays off with it (a graph fixes which parameters get gradients).
        progressive: data.progressive is on (the input size changes between epochs): true is refused, auto stays off.
    """
    setting = speed_cfg.cuda_graphs
    if setting is False:
        return GraphsDecision(False, "speed.cuda_graphs=false")
    if setting is True and progressive:
        raise UsageError(
            "speed.cuda_graphs=true captures one input shape, and data.progressive changes the training "
            "crop's size between epochs (the other sizes would run eagerly). Set speed.cuda_graphs=false, "
            "or remove data.progressive."
        )
    if setting is True:
        return GraphsDecision(True, "speed.cuda_graphs=true")
    off = (
        "a CUDA device (this run is on " + device.type + ")"
        if device.type != "cuda"
        else "no torch.compile (it captures the model itself; compile_mode=reduce-overhead adds CUDA graphs inside it)"
        if speed_cfg.compile
        else "no DataParallel (strategy=dp replicates the model every step)"
        if strategy_cfg.name == "dp"
        else "no SyncBatchNorm (its all-reduces cannot be captured)"
        if strategy_cfg.sync_bn
        else "no model.freeze_epochs (it changes which parameters get gradients between epochs; a graph fixes them)"
        if freeze_epochs
        else "no data.progressive (it changes the input size between epochs; a graph fixes it)"
        if progressive
        else f"one process (not yet measured under DDP on GPUs; {world_size} processes here; speed.cuda_graphs=true "
        "captures anyway)"
        if world_size > 1
        else None
    )
    if off is not None:
        return GraphsDecision(False, f"speed.cuda_graphs=auto: off, needs {off}")
    tail = (
        "every training batch has the same shape"
        if drop_last
        else "the last partial batch of an epoch runs eagerly (data.drop_last=false)"
    )
    return GraphsDecision(
        True,
        f"speed.cuda_graphs=auto: on (one CUDA process, forward/backward captured, loss and optimizer eager; {tail})",
    )


# ---------------------------------------------------------------- wrapping


def _compile(model: nn.Module, speed) -> nn.Module:
    kwargs = {"fullgraph": speed.fullgraph, "backend": speed.compile_backend}
    if speed.static_shapes:
        # data.progressive: one graph specialised to each input shape. Its sizes are few (multiples of
        # data.progressive.step) and each one lasts whole epochs; torch's default would make the spatial sizes
        # symbolic at the second size (automatic dynamic shapes), kernels no longer specialised to any of them.
        kwargs["dynamic"] = False
    if speed.compile_mode:
        kwargs["mode"] = speed.compile_mode
    return torch.compile(model, **kwargs)


def channels_last_on(setting: bool | str, model: nn.Module) -> bool:
    """speed.channels_last resolved for this model: true/false as set; auto: on when it has 2-D convolutions.

    Why auto is on for convolutional models: small_cnn on digits (the default run) trains 1.15-1.19x (two threads)
    and 1.22x (one thread) faster on CPU in NHWC, and NHWC is the layout cuDNN's tensor-core convolutions
    use under AMP; the figures, and the model where it is slower (torchvision resnet18 at 32 px on CPU,
    0.95-1.00x), are in BENCHMARKS.md ("channels_last by default"). A model without Conv2d (linear, MLPs, most
    transformers' bodies) gains nothing from it, so auto leaves it alone.
    """
    return has_conv2d(model) if setting == "auto" else bool(setting)


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def wrap_model(
    model: nn.Module,
    strategy_cfg,
    rt,
    *,
    speed=None,
    prec=None,
    example: Callable[[], torch.Tensor] | None = None,
    log: Callable[[str], None] | None = None,
    frozen_norms: Callable[[nn.Module], list[nn.Module]] | None = None,
) -> nn.Module:
    """Make the model ready to train: device, memory format, SyncBN, precision, CUDA graphs, strategy, compile.

    Args:
        model: the initialised, unwrapped model.
        strategy_cfg: the `strategy` section (name, sync_bn, DDP options).
        rt: the Runtime; several processes mean DDP (strategy single or ddp).
        speed: the run's plan.SpeedPlan (channels_last, compile, CUDA graphs: decided and checked once, by
            plan.decide_speed, and reported from the same object); None: all off.
        prec: the Precision; its `prepare` gives half-weight modes their fp16/bf16 model.
        example: returns one training input batch (only called to capture CUDA graphs).
        log: where to say what was chosen and why (rank 0's logger.info); None: silent.
        frozen_norms: returns the layers the engine keeps in eval mode (model.freeze_bn_stats), which a CUDA
            graph must capture in eval mode too; None: none.
    """
    log = log or (lambda msg: None)
    model = model.to(rt.device)
    if speed is not None and speed.channels_last:
        model = model.to(memory_format=torch.channels_last)
    name = strategy_cfg.name
    if name == "dp":
        if rt.device.type != "cuda":
            raise UsageError(
                "strategy=dp (nn.DataParallel) needs CUDA GPUs; on CPU use strategy=single, or "
                "strategy=ddp with --nproc-per-node N for several processes."
            )
        log(
            "[yellow]strategy=dp: nn.DataParallel is slower than DDP[/]: one Python process drives every GPU "
            "(GIL-bound), replicates the model and scatters inputs every step, and gathers outputs on GPU 0. "
            "DDP runs one process per GPU and overlaps the gradient all-reduce with backward: "
            "use strategy=ddp with `torchsprint train --nproc-per-node N`."
        )
    check_comm_hook(strategy_cfg)
    if strategy_cfg.sync_bn:
        if rt.distributed:
            model = convert_sync_batchnorm(model, rt.device)
        else:
            log("strategy.sync_bn: one process, nothing to synchronise (BatchNorm left as is)")
    if strategy_cfg.comm_hook != "none" and not rt.distributed:
        log(f"strategy.comm_hook={strategy_cfg.comm_hook}: one process, no gradient all-reduce to compress")
    if prec is not None:
        model = prec.prepare(model)
    if speed is not None and speed.cuda_graphs.on:  # what was decided and why: the start-up summary says it
        model = capture_cuda_graphs(model, example, prec, frozen_norms, chosen_by_auto=speed.graphs_by_auto)
    if name == "dp":
        if torch.cuda.device_count() < 2:
            log("[yellow]strategy=dp with one GPU: DataParallel adds overhead and no speed; use strategy=single[/]")
        model = nn.DataParallel(model)
    elif rt.distributed:
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
            find_unused_parameters=strategy_cfg.find_unused_parameters,
            static_graph=strategy_cfg.static_graph,
            bucket_cap_mb=strategy_cfg.bucket_cap_mb,
        )
        register_comm_hook(model, strategy_cfg, log)
        if prec is not None:
            prec.broadcast_masters()  # DDP broadcast rank 0's parameters; fp32 masters must follow
    if speed is not None and speed.compile:
        model = _compile(model, speed)
    return model


def check_comm_hook(strategy_cfg) -> None:
    """Refuse PowerSGD settings without comm_hook=powersgd (they would be ignored)."""
    if strategy_cfg.comm_hook != "powersgd":
        for name, default in (("powersgd_rank", 1), ("powersgd_start_step", 1000)):
            if getattr(strategy_cfg, name) != default:
                raise UsageError(
                    f"strategy.{name} applies to strategy.comm_hook=powersgd, but comm_hook is "
                    f"{strategy_cfg.comm_hook}. Set strategy.comm_hook=powersgd, or remove strategy.{name}."
                )


def register_comm_hook(ddp: nn.parallel.DistributedDataParallel, strategy_cfg, log) -> None:
    """strategy.comm_hook -> one of PyTorch's DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks).

    fp16/bf16 halve the bytes of every gradient all-reduce (the sum is taken in half precision and divided
    by the world size before it, so it cannot overflow); PowerSGD (Vogels et al., NeurIPS 2019) sends two
    rank-r factors per gradient matrix instead of the matrix, with error feedback and warm start, after
    `powersgd_start_step` steps of plain all-reduce.
    """
    name = strategy_cfg.comm_hook
    if name == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=strategy_cfg.powersgd_rank,
            start_powerSGD_iter=strategy_cfg.powersgd_start_step,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        ddp.register_comm_hook(
            None, {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]
        )
    log(
        f"strategy.comm_hook={name}: DDP gradients are all-reduced "
        + (
            "in half precision"
            if name != "powersgd"
            else f"as rank-{strategy_cfg.powersgd_rank} PowerSGD factors from step {strategy_cfg.powersgd_start_step}"
        )
    )


def rebuild_ddp_reducer(model: nn.Module) -> bool:
    """Rebuild the DDP wrapper's gradient reducer over the parameters that require a gradient now (model.freeze_epochs).

    DDP builds its reducer (gradient buckets and one autograd hook per parameter) over the parameters with
    requires_grad at construction, and from then on waits for a gradient of each of them every step. model.
    freeze_epochs changes that set at the switch epoch (and a resumed run sets it again at its start), so the
    reducer is rebuilt there, in place: the same wrapper object (the engine, the evaluation and torch.compile
    hold it), a new reducer. Why rebuild rather than register every parameter once with
    strategy.find_unused_parameters=true: that option walks the autograd graph after every forward for the
    whole run, to find the body's missing gradients of a few head-only epochs; a rebuild costs one bucket
    assignment per switch and nothing per step (the first step after it also re-orders the buckets, as DDP's
    first step always does). How: DDP's own pickle path, __getstate__ / __setstate__, which drops the reducer
    and builds a new one from the module's current requires_grad flags (DistributedDataParallel._build_params_
    for_reducer) with the same bucket size, static_graph and find_unused_parameters; the old reducer removes
    its autograd hooks when it is freed. Nothing is broadcast: the ranks' parameters are already equal. The
    communication hooks (strategy.comm_hook, with a PowerSGD state and its step count) belong to the reducer,
    so the same hook objects are registered on the new one. Returns False (nothing to do) without DDP.
    """
    ddp = getattr(model, "_orig_mod", model)  # torch.compile sits outside DDP
    if not isinstance(ddp, nn.parallel.DistributedDataParallel):
        return False
    hooks = list(ddp._comm_hooks)
    ddp.__setstate__(ddp.__getstate__())
    ddp._comm_hooks = []
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)
    return True


def no_sync(model: nn.Module):
    """DDP's no_sync() (skip the gradient all-reduce on accumulation micro-steps); a null context otherwise.

    Looks through torch.compile's wrapper, which sits outside DDP.
    """
    inner = getattr(model, "_orig_mod", model)
    return inner.no_sync() if isinstance(inner, nn.parallel.DistributedDataParallel) else nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DataParallel / DDP / torch.compile / torchsprint's precision and graph wrappers."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel) or getattr(
            model, "_torchsprint_wrapper", False
        ):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model

"""SyncBatchNorm for every process-group backend: torch's SyncBatchNorm runs on NCCL only, so under gloo (DDP on
CPU) BatchNorm layers become GlooSyncBatchNorm, which all-reduces the batch statistics with autograd through them.
Used by parallel.wrap_model (strategy.sync_bn)."""

from __future__ import annotations

import torch
from torch import nn

from torchsprint.errors import UsageError


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose backward sums the gradient over ranks (each rank's loss depends on every
    rank's input through the sum). Written out because torch.distributed.nn's is deprecated and the
    functional collectives' autograd support is recent."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        torch.distributed.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are reduced over all ranks, for CPU tensors (gloo).

    torch.nn.SyncBatchNorm only runs on GPUs (its kernels are CUDA-only), so CPU DDP gets this
    one: per-channel sums go through an autograd-aware all-reduce whose backward all-reduces the
    gradient, which gives exactly the gradients of one BatchNorm over
    the global batch. The mean and the variance are reduced in two passes (sum, then sum of
    squared deviations) to avoid E[x^2] - E[x]^2 cancellation. It subclasses _BatchNorm only to
    keep the same parameters, buffers and state_dict keys as the layer it replaces.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not (self.training and distributed and torch.distributed.get_world_size() > 1):
            return super().forward(x)
        all_reduce = _AllReduceSum.apply
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Statistics in at least fp32 whatever the activation dtype (bf16 weights keep BN in fp32); fp64 stays fp64
        # (x.float() rounded it to fp32, so a float64 model's DDP run left one process's by 1e-8).
        stat = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(stat)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=stat, device=x.device)
        sums = all_reduce(torch.cat([xf.sum(dims), count]))
        n = sums[-1]
        mean = sums[:-1] / n
        centered = xf - mean.view(shape)
        var = all_reduce(centered.square().sum(dims)) / n  # biased, as BatchNorm normalises with
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.to(stat).view(shape) + self.bias.to(stat).view(shape)
        return y.to(x.dtype)


_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def to_gloo_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every torch BatchNorm1d/2d/3d by GlooSyncBatchNorm, sharing parameters and buffers."""
    if type(module) in _PLAIN_BN:
        out = GlooSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        return out
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, GlooSyncBatchNorm | nn.SyncBatchNorm
    ):
        raise UsageError(
            f"strategy.sync_bn on CPU cannot convert {type(module).__name__} (only torch's BatchNorm1d/2d/3d have a "
            "CPU SyncBatchNorm). Train on GPUs for SyncBatchNorm with this model, or set strategy.sync_bn=false."
        )
    for name, child in module.named_children():
        new = to_gloo_sync_batchnorm(child)
        if new is not child:
            setattr(module, name, new)
    return module


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """BatchNorm -> SyncBatchNorm: timm's converter when timm is installed (it also converts timm's
    BatchNormAct layers, which torch's converter would turn into plain SyncBatchNorm and lose the
    activation), torch's otherwise; GlooSyncBatchNorm on CPU."""
    if device.type == "cpu":
        return to_gloo_sync_batchnorm(model)
    try:
        from timm.layers import convert_sync_batchnorm as timm_convert
    except ImportError:  # timm is optional; torch's converter handles every torch BatchNorm
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return timm_convert(model)

"""On-device normalisation of uint8 batches, shared by every loader backend, predict and data tools.

The loaders move uint8 across the bus (a quarter of fp32's bytes) and normalise on the device, as one
fused multiply-add with the constants of the spec's `normalize` step (data/preprocess/transforms.py).
"""

from __future__ import annotations

import torch


class BufferPool:
    """fp32 batch buffers on the CPU that are handed out again once nothing references them.

    A fresh 38 MB batch (64x3x224x224 fp32) is a fresh mmap: the first write page-faults every 4 KB,
    which costs more than the normalisation itself (BENCHMARKS.md, "Data loading"). A buffer is
    reused only when its storage's reference count is back to what the pool alone holds, so a batch
    the caller still has (or a view of it, a numpy array on it, an autograd graph that saved it) is
    never overwritten. Without torch's use-count hook every call allocates, as before.
    """

    def __init__(self, keep: int = 3):
        self.keep = keep
        self.buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, use count when only the pool holds it)
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)

    def _uses(self, t: torch.Tensor) -> int:
        return self._use_count(t.untyped_storage()._cdata)

    def get(self, shape: torch.Size) -> torch.Tensor:
        """An uninitialised fp32 CPU tensor of `shape`, reused when a pooled one is free."""
        for buf, alone in self.buffers:
            if buf.shape == shape and self._uses(buf) == alone:
                return buf.detach()  # a new tensor object on the same storage: it counts as a reference
        buf = torch.empty(shape)
        if self._use_count is None or len(self.buffers) >= self.keep:
            return buf
        self.buffers.append((buf, self._uses(buf)))
        return buf.detach()


class DeviceNormalize:
    """uint8 NCHW on the device -> float (x / 255 - mean) / std as one fused multiply-add.

    Args:
        recycle: reuse fp32 output buffers the caller has let go of (BufferPool); for CPU devices,
            where fresh batch-sized allocations are slow. Same values either way.
    """

    def __init__(
        self,
        mean,
        std,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        recycle: bool = False,
    ):
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -mean_t / std_t
        self.dtype = dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        plain = dtype == torch.float32 and not channels_last
        self.pool = BufferPool() if recycle and plain and torch.device(device).type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.ndim != 4:
            x = torch.addcmul(self.shift, x.float(), self.scale)
        else:
            # In place on the float copy: one batch-sized allocation instead of two (none with a pool).
            # On a CPU device the page faults of a new 38 MB buffer (64x3x224x224 fp32) cost more than
            # the arithmetic (BENCHMARKS.md, "Data loading"). Same values, same arithmetic as
            # export.WithNormalize.
            if self.pool is not None and x.device.type == "cpu":
                xf = self.pool.get(x.shape).copy_(x)
            else:
                xf = x.float()
            x = torch.addcmul(self.shift, xf, self.scale, out=xf)
        return x.to(dtype=self.dtype, memory_format=self.memory_format)

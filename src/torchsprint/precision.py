"""Precision: autocast(), backward(loss), step(opt) and a checkpointable gradient scaler, for every mode.

Off is a no-op object, not a branch: fp32 autocast is a null context and its scaler is disabled.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from torchsprint.errors import UsageError

_AUTOCAST = {"amp_fp16": torch.float16, "amp_bf16": torch.bfloat16}


class Precision:
    """Numeric precision of one run.

    Args:
        mode: fp32 | amp_fp16 | amp_bf16 (fp16/bf16 half-weight modes are refused for now).
        device: the training device.
    """

    def __init__(self, mode: str, device: torch.device):
        if mode in ("fp16", "bf16"):
            raise UsageError(
                f"precision={mode} (half weights, apex O2) is not implemented yet; use amp_fp16 (O1) or amp_bf16."
            )
        if mode == "amp_fp16" and device.type == "cpu":
            raise UsageError("precision=amp_fp16 needs a CUDA device; on CPU use precision=amp_bf16 or fp32.")
        self.mode, self.device = mode, device
        self.dtype = _AUTOCAST.get(mode)
        # Only fp16 needs loss scaling: bf16 has fp32's exponent range.
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "amp_fp16")

    def autocast(self):
        """Context for forward + loss: torch.autocast in AMP modes, a null context in fp32."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, opt: torch.optim.Optimizer) -> None:
        """Make .grad hold true gradients (before clipping); no-op when the scaler is off."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(opt)

    def step(self, opt: torch.optim.Optimizer) -> None:
        """opt.step() (skipped by the scaler when fp16 gradients overflowed), then update the scale."""
        self.scaler.step(opt)
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)

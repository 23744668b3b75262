"""How `predict` and `serve` run a trained torch model: its precision and memory format (`--precision`,
`serve.precision`).

  fp32  the model as saved, NCHW, float32: what predict did before this setting existed.
  bf16  bfloat16 autocast (torch.autocast, as the run's validation used it under precision=amp_bf16), the model and
        batches in channels_last where the run trained so (speed.channels_last true, or auto on a model with 2-D
        convolutions): on a CPU with
        native bf16 this is what the run's own validation figures were measured in.
  auto  (the default) bf16 where the run trained and validated in bf16 (precision amp_bf16 or bf16) and this CPU
        computes bf16 natively (AVX-512 BF16 or AMX: runtime/machine.py's native_bf16), else fp32. On CUDA fp32:
        bf16 inference there is not yet measured on a GPU (the GPU issue's window), so the existing choice stands.
        A run too short for the speed probe trained in fp32 (the default digits run), so it predicts in fp32.

Why a choice and not always fp32: on a CPU with native bf16 a convolutional net forwards far more images a second
in bf16 + channels_last (ResNet-18 at 224: BENCHMARKS.md "torchsprint serve under load"), and a run trained with
precision=auto there reports validation accuracy measured in bf16. Logits then differ from fp32's
by bf16's rounding (~1e-2), so an answer can differ from an fp32 predict's on a near-tie; predict and serve share
this choice, so serve's answers equal predict's (tests/e2e/serve/test_inference_precision.py states the bound).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from torchsprint.errors import UsageError

PRECISIONS = ("auto", "fp32", "bf16")
BF16_TRAINED = ("amp_bf16", "bf16")


@dataclass(frozen=True)
class Inference:
    """The decided precision (fp32 or bf16), whether inputs go channels_last, and one line saying why."""

    precision: str
    channels_last: bool
    note: str


FP32 = Inference("fp32", False, "precision fp32")  # an ONNX graph in onnxruntime, a Predictor built by hand


def choose(
    asked: str,
    run_precision: str,
    run_channels_last,
    device: torch.device,
    native: bool | None = None,
    conv2d: bool = True,
) -> Inference:
    """`asked`: auto, fp32 or bf16; `run_precision`: the run's resolved precision.mode; `run_channels_last`: its
    speed.channels_last as saved (true, false, or auto: the rule, on for a model with 2-D convolutions, `conv2d`);
    `native`: whether this CPU computes bf16 natively (None: read /proc/cpuinfo)."""
    if asked not in PRECISIONS:
        raise UsageError(f"precision={asked}: use one of {', '.join(PRECISIONS)}.")
    if native is None:
        from torchsprint.runtime.machine import native_bf16

        native = native_bf16()
    cl = run_channels_last is True or (run_channels_last == "auto" and conv2d)
    if asked == "fp32":
        return Inference("fp32", False, "precision fp32 (asked)")
    if asked == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(f"precision=bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp32 or auto.")
        slow = device.type == "cpu" and not native
        return Inference(
            "bf16",
            cl,
            "precision bf16 (asked)"
            + ("; this CPU has no native bf16 (no avx512_bf16/amx_bf16): slower than fp32 here" if slow else ""),
        )
    if run_precision not in BF16_TRAINED:
        return Inference("fp32", False, f"precision fp32 (auto: the run trained in {run_precision})")
    if device.type != "cpu":
        return Inference(
            "fp32",
            False,
            f"precision fp32 (auto: on {device.type} fp32 until bf16 inference is measured "
            "there; --precision bf16 to use it)",
        )
    if not native:
        return Inference(
            "fp32", False, f"precision fp32 (auto: the run trained in {run_precision}, but this CPU has no native bf16)"
        )
    return Inference(
        "bf16",
        cl,
        f"precision bf16 (auto: the run trained and validated in {run_precision} and this "
        "CPU computes bf16 natively; --precision fp32 for float32 logits)",
    )


def forward_of(model: torch.nn.Module, device: torch.device, how: Inference):
    """The model's eval forward under `how`: float32 logits out, whatever ran inside."""
    if how.channels_last:
        model = model.to(memory_format=torch.channels_last)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if how.precision == "bf16" else nullcontext()

    @torch.inference_mode()
    def forward(x):
        if how.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast():
            return model(x).float()

    return forward

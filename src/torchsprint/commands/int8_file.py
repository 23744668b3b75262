"""What an int8 ONNX file says about itself: its `quantization` metadata record (written by commands/quantize.py),
the one line describing it, and how predict and serve run it."""

from __future__ import annotations

import json
from pathlib import Path

from torchsprint.commands.inference import Inference
from torchsprint.errors import UsageError


def describe_quantization(q: dict, asked: int | None = None) -> str:
    """One line: how a file was quantized (its `quantization` metadata record); `asked`: the --calibration given."""
    split = {"train": "training"}.get(q.get("calibration_split"), q.get("calibration_split"))
    line = (
        f"int8 static {q.get('format')}: {q.get('activations')} activations, {q.get('weights')} weights"
        f"{' per channel' if q.get('per_channel') else ''}, calibrated on {q.get('calibration_images')} {split} "
        f"images (seed {q.get('seed')})"
    )
    if q.get("pre_process") != "full":
        line += f"; onnxruntime's pre-processing: {q.get('pre_process')}"
    if asked is not None and asked > q.get("calibration_images", asked):
        line += f": all of them (--calibration {asked} asked for more)"
    return line


def int8_inference(meta: dict, path: Path, precision: str):
    """The Inference of an int8 ONNX file (its `quantization` record, commands/quantize.py); precision=fp32 is
    refused: the graph's weights are int8, there is no fp32 model in it to run."""
    if precision == "fp32":
        raise UsageError(
            f"precision=fp32: {path.name} is an int8 graph (export --int8); use precision auto, or the "
            "fp32 export (model.onnx) or the run folder for fp32."
        )
    return Inference("int8", False, f"onnxruntime, {describe_quantization(quantization_record(meta, path))}")


def quantization_record(meta: dict, path) -> dict | None:
    """The `quantization` entry of an ONNX file's metadata (None: not an int8 export); a damaged one is one line."""
    if "quantization" not in meta:
        return None
    try:
        record = json.loads(meta["quantization"])
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise UsageError(
            f"{path}: its metadata entry 'quantization' is not the JSON object torchsprint writes: the "
            "file is damaged or was edited. Export it again with `torchsprint export --int8`."
        )
    return record

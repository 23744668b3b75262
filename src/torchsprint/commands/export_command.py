"""`torchsprint export`: its flags to an export (commands/export.py) or an int8 export (commands/quantize.py), and the
lines it prints."""

from __future__ import annotations

from torchsprint.commands.export import export
from torchsprint.commands.int8_file import describe_quantization
from torchsprint.commands.quantize import (
    DEFAULT_ACTIVATIONS,
    DEFAULT_CALIBRATION,
    check_int8_settings,
    export_int8,
)
from torchsprint.errors import UsageError


def export_cli(args) -> int:
    if getattr(args, "benchmark", None) is not None:
        from torchsprint.commands.export_bench import benchmark_cli

        return benchmark_cli(args)
    if getattr(args, "int8", False):
        return export_int8_cli(args)
    given = [
        flag
        for flag, value in (
            ("--calibration", getattr(args, "calibration", None)),
            ("--int8-activations", getattr(args, "int8_activations", None)),
            ("--force", getattr(args, "force", None) or None),
        )
        if value is not None
    ]
    if given:
        raise UsageError(
            f"{' and '.join(given)} set(s) how --int8 quantizes, and --int8 is not given: add --int8 "
            "(with --format onnx), or leave them out."
        )
    r = export(
        args.run,
        args.format or "onnx",
        weights=args.weights,
        out=args.out,
        uint8_input=args.uint8_input,
        opset=args.opset,
        tolerance=args.tolerance,
        tta=getattr(args, "tta", None),
        overwrite=args.overwrite,
    )
    diff = "n/a" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"
    print(
        f"exported {r['format']}: {r['path']}{'' if r['tta'] == 'none' else ' (eval.tta=' + r['tta'] + ')'}\n"
        f"parity: max |logits difference| vs PyTorch = {diff} "
        f"on {r['images_checked']} validation images (tolerance {args.tolerance})"
    )
    return 0


def export_int8_cli(args) -> int:
    """`export --int8` (commands/quantize.py): the int8 file, how it was quantized, the fp32 graph's parity."""
    calibration = DEFAULT_CALIBRATION if args.calibration is None else args.calibration
    activations = args.int8_activations or DEFAULT_ACTIVATIONS
    check_int8_settings(args.format or "onnx", calibration, activations)  # before the run is loaded
    r = export_int8(
        args.run,
        weights=args.weights,
        out=args.out,
        uint8_input=args.uint8_input,
        opset=args.opset,
        tolerance=args.tolerance,
        tta=getattr(args, "tta", None),
        calibration=calibration,
        activations=activations,
        force=args.force,
        overwrite=args.overwrite,
    )
    check = r["check"]
    verdict = (
        "int8 check passed"
        if check.passed
        else f"[--force] int8 check FAILED ({'; '.join(check.refusals)}), written anyway"
    )
    print(
        f"exported onnx int8: {r['path']}{'' if r['tta'] == 'none' else ' (eval.tta=' + r['tta'] + ')'}\n"
        f"{describe_quantization(r['quantization'], calibration)}\n"
        f"{verdict}: {check.figures()}\n"
        f"parity of the fp32 graph it comes from: max |logits difference| vs PyTorch = {r['max_abs_diff']:.3g} "
        f"on {r['images_checked']} validation images (tolerance {args.tolerance})"
    )
    return 0

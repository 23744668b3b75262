"""Export a run's model (ONNX, safetensors, TorchScript, TensorRT) with its preprocessing, and prove parity."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.registry import Registry

EXPORTERS = Registry("exporter")


class WithNormalize(nn.Module):
    """uint8 NCHW in, logits out: the eval normalisation folded into the graph (one multiply-add)."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        # (1, C, 1, 1) broadcasts against the trailing (C, H, W) of images (N, C, H, W) and clips (N, T, C, H, W).
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        # Same constants and arithmetic as data.normalize.DeviceNormalize, so outputs match training.
        self.register_buffer("scale", 1.0 / (255.0 * std_t))
        self.register_buffer("shift", -mean_t / std_t)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(torch.addcmul(self.shift, images.float(), self.scale))


def sample_batch(trained, n: int = 8) -> torch.Tensor:
    """A uint8 batch of validation images after the eval spec (the exact input the model saw in eval)."""
    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.tasks import get_task

    cfg = trained.cfg.model_copy(deep=True)
    cfg.data.backend, cfg.data.num_workers = "cpu", 0  # the reference CPU path; its raw uint8 batches
    rt = runtime.Runtime(device=torch.device("cpu"))
    loaders = build_loaders(cfg.data, rt, seed=cfg.run.seed)
    loaders.val.set_epoch(0)
    task = get_task(cfg.task)
    for batch in loaders.val.loader:
        return task.example(batch[0][:n], trained.in_channels)  # the raw batch as the model's uint8 input
    raise UsageError("the validation split is empty: nothing to check the export against.")


def normalize(x_uint8: torch.Tensor, pipeline) -> torch.Tensor:
    from torchsprint.data.normalize import DeviceNormalize

    return DeviceNormalize(pipeline.mean, pipeline.std, x_uint8.device)(x_uint8)


@EXPORTERS.register("onnx")
def export_onnx(trained, out: Path, *, uint8_input: bool, opset: int | None, example: torch.Tensor) -> Path:
    """ONNX with a dynamic batch dimension and torchsprint metadata (classes, input size, eval spec)."""
    import onnx

    p = trained.pipeline
    module = WithNormalize(trained.model, p.mean, p.std).eval() if uint8_input else trained.model
    x = example if uint8_input else normalize(example, p)
    batch = torch.export.Dim("batch", min=1)
    kw = dict(input_names=["images"], output_names=["logits"], opset_version=opset)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates every phase on stdout
        try:
            torch.onnx.export(module, (x,), str(out), dynamo=True, dynamic_shapes=({0: batch},), external_data=False, **kw)
        except Exception as e:  # noqa: BLE001 - fall back to the TorchScript-based exporter, then report
            try:
                torch.onnx.export(module, (x,), str(out), dynamo=False,
                                  dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, **kw)
            except Exception as e2:
                raise UsageError(f"ONNX export failed: {type(e).__name__}: {str(e)[:300]}; legacy exporter: {e2}") from None
    model = onnx.load(str(out))
    meta = trained.metadata() | {"input_dtype": "uint8" if uint8_input else "float32", "normalized_in_graph": str(uint8_input)}
    del model.metadata_props[:]
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(out))
    return out


@EXPORTERS.register("safetensors")
def export_safetensors(trained, out: Path, *, uint8_input: bool, opset, example) -> Path:
    """Weights + metadata (classes, config, eval spec): loadable by safetensors alone or by torchsprint predict."""
    from torchsprint.checkpoint import save_weights

    save_weights(out, trained.model, trained.metadata())
    return out


@EXPORTERS.register("torchscript")
def export_torchscript(trained, out: Path, *, uint8_input: bool, opset, example) -> Path:
    """A traced TorchScript module (uint8 input when asked) with metadata in `_extra_files['torchsprint.json']`."""
    p = trained.pipeline
    module = WithNormalize(trained.model, p.mean, p.std).eval() if uint8_input else trained.model
    x = example if uint8_input else normalize(example, p)
    with torch.no_grad():
        traced = torch.jit.trace(module, (x,))
    meta = trained.metadata() | {"input_dtype": "uint8" if uint8_input else "float32"}
    torch.jit.save(traced, str(out), _extra_files={"torchsprint.json": json.dumps(meta)})
    return out


@EXPORTERS.register("tensorrt")
def export_tensorrt(trained, out: Path, *, uint8_input: bool, opset, example) -> Path:
    """A TensorRT engine through onnxruntime's TensorRT provider (builds and caches the engine)."""
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    if ort is None or "TensorrtExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
        have = ort.get_available_providers() if ort else "onnxruntime not installed"
        raise UsageError(
            "--format tensorrt needs a CUDA GPU and onnxruntime-gpu with the TensorRT execution provider "
            f"(available providers here: {have}). Install onnxruntime-gpu and TensorRT on a GPU machine, "
            "or export --format onnx and build an engine with trtexec."
        )
    onnx_path = out.with_suffix(".onnx")
    export_onnx(trained, onnx_path, uint8_input=uint8_input, opset=opset, example=example)
    cache = out.parent / "trt_cache"
    cache.mkdir(exist_ok=True)
    ort.InferenceSession(str(onnx_path), providers=[("TensorrtExecutionProvider", {
        "trt_engine_cache_enable": True, "trt_engine_cache_path": str(cache)})])
    return cache


def onnx_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


def parity(fmt: str, path: Path, trained, example: torch.Tensor, uint8_input: bool) -> float | None:
    """max |logits(PyTorch) - logits(exported)| on the same batch; None where no runtime check applies."""
    with torch.no_grad():
        ref = trained.model(normalize(example, trained.pipeline))
    x = example if uint8_input else normalize(example, trained.pipeline)
    if fmt == "onnx":
        got = onnx_logits(path, x)
    elif fmt == "torchscript":
        with torch.no_grad():
            got = torch.jit.load(str(path))(x)
    elif fmt == "safetensors":
        from torchsprint.trained import load_weights_file

        with torch.no_grad():
            got = load_weights_file(path).model(normalize(example, trained.pipeline))
    else:
        return None
    return (ref - got).abs().max().item()


EXTENSIONS = {"onnx": ".onnx", "safetensors": ".safetensors", "torchscript": ".pt", "tensorrt": ".engine"}


def export(run_dir: str | Path, fmt: str = "onnx", *, weights: str = "best", out: str | Path | None = None,
           uint8_input: bool = False, opset: int | None = None, tolerance: float = 1e-3) -> dict:
    """Export a run's weights and check them against PyTorch on a validation batch.

    Returns {"path", "format", "max_abs_diff"}; raises UsageError when the difference exceeds `tolerance`.
    """
    from torchsprint.tasks import get_task
    from torchsprint.trained import load_run

    trained = load_run(run_dir, weights)
    get_task(trained.cfg.task).check_export(fmt)
    from torchsprint.rundir import writable_file

    out = Path(out) if out else Path(run_dir) / "export" / f"model{'-uint8' if uint8_input else ''}{EXTENSIONS[fmt]}"
    writable_file(out, "--out")  # before the (slow) export, not after it
    example = sample_batch(trained)
    try:
        path = EXPORTERS.get(fmt)(trained, out, uint8_input=uint8_input, opset=opset, example=example)
    except OSError as e:  # the disk filled up or the folder changed under us
        raise UsageError(f"could not write {out}: {e.strerror or e}. Free disk space or choose another --out.") from None
    diff = parity(fmt, path, trained, example, uint8_input)
    if diff is not None and not diff <= tolerance:
        raise UsageError(f"export parity check failed: max |logits difference| = {diff:.3g} > tolerance {tolerance} "
                         f"between PyTorch and {fmt} on {len(example)} validation images ({path}).")
    return {"path": str(path), "format": fmt, "max_abs_diff": diff, "images_checked": len(example)}


def export_cli(args) -> int:
    r = export(args.run, args.format, weights=args.weights, out=args.out, uint8_input=args.uint8_input,
               opset=args.opset, tolerance=args.tolerance)
    diff = "n/a" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"
    print(f"exported {r['format']}: {r['path']}\nparity: max |logits difference| vs PyTorch = {diff} "
          f"on {r['images_checked']} validation images (tolerance {args.tolerance})")
    return 0

"""Export a run's model (ONNX, safetensors, TorchScript, TensorRT) with its preprocessing, and prove parity."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchsprint.errors import UsageError
from torchsprint.registry import Registry
from torchsprint.state.checkpoint import atomic_path

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
    """A uint8 batch of validation images after the eval spec (the exact input the model saw in eval; with
    multi-crop eval.tta, the larger image the crops come from: tta.loading_spec)."""
    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import with_loading_spec

    cfg = trained.cfg.model_copy(deep=True)
    cfg.data.backend, cfg.data.num_workers = "cpu", 0  # the reference CPU path; its raw uint8 batches
    rt = runtime.Runtime(device=torch.device("cpu"))
    loaders = build_loaders(with_loading_spec(cfg.data, cfg.eval.tta), rt, seed=cfg.run.seed, allowed=("cpu", "gpu"))
    loaders.val.set_epoch(0)
    task = get_task(cfg.task)
    for batch in loaders.val.loader:
        return task.example(batch[0][:n], trained.in_channels)  # the raw batch as the model's uint8 input
    raise UsageError("the validation split is empty: nothing to check the export against.")


def normalize(x_uint8: torch.Tensor, pipeline) -> torch.Tensor:
    from torchsprint.data.preprocess.normalize import DeviceNormalize

    return DeviceNormalize(pipeline.mean, pipeline.std, x_uint8.device)(x_uint8)


def graph_module(trained, uint8_input: bool, tta) -> nn.Module:
    """What a graph format exports: the model, with the normalisation folded in for uint8 input, and eval.tta's
    views and combination around it (`tta`: a tta.TtaPlan or None)."""
    from torchsprint.tasks.tta import wrap_tta

    p = trained.pipeline
    module = WithNormalize(trained.model, p.mean, p.std).eval() if uint8_input else trained.model
    return wrap_tta(module, tta).eval()


def export_onnx(trained, out: Path, *, uint8_input: bool, opset: int | None, example: torch.Tensor, tta=None) -> Path:
    """ONNX with a dynamic batch dimension and torchsprint metadata (classes, input size, eval spec, eval.tta: the
    graph holds `tta`'s views and combination, so ONNX Runtime's output is torchsprint's with it)."""
    import onnx

    p = trained.pipeline
    module = graph_module(trained, uint8_input, tta)
    x = example if uint8_input else normalize(example, p)
    batch = torch.export.Dim("batch", min=1)
    kw = dict(input_names=["images"], output_names=["logits"], opset_version=opset)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates every phase on stdout
        try:
            torch.onnx.export(
                module, (x,), str(out), dynamo=True, dynamic_shapes=({0: batch},), external_data=False, **kw
            )
        except Exception as e:  # noqa: BLE001 - fall back to the TorchScript-based exporter, then report
            try:
                torch.onnx.export(
                    module,
                    (x,),
                    str(out),
                    dynamo=False,
                    dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
                    **kw,
                )
            except Exception as e2:
                raise UsageError(
                    f"ONNX export failed: {type(e).__name__}: {str(e)[:300]}; legacy exporter: {e2}"
                ) from None
    model = onnx.load(str(out))
    meta = trained.metadata() | {
        "input_dtype": "uint8" if uint8_input else "float32",
        "normalized_in_graph": str(uint8_input),
        "tta": tta.name if tta else "none",
    }
    del model.metadata_props[:]
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(out))
    return out


def export_safetensors(trained, out: Path, *, uint8_input: bool, opset, example, tta=None) -> Path:
    """Weights + metadata (classes, config, eval spec): loadable by safetensors alone or by torchsprint predict.
    The weights are the plain model's; eval.tta travels in the config (predict applies it)."""
    from torchsprint.state.checkpoint import save_weights

    save_weights(out, trained.model, trained.metadata())
    return out


def export_torchscript(trained, out: Path, *, uint8_input: bool, opset, example, tta=None) -> Path:
    """A traced TorchScript module (uint8 input when asked; eval.tta in the graph) with metadata in
    `_extra_files['torchsprint.json']`."""
    p = trained.pipeline
    module = graph_module(trained, uint8_input, tta)
    x = example if uint8_input else normalize(example, p)
    with torch.no_grad():
        traced = torch.jit.trace(module, (x,))
    meta = trained.metadata() | {
        "input_dtype": "uint8" if uint8_input else "float32",
        "tta": tta.name if tta else "none",
    }
    torch.jit.save(traced, str(out), _extra_files={"torchsprint.json": json.dumps(meta)})
    return out


def export_tensorrt(trained, out: Path, *, uint8_input: bool, opset, example, tta=None) -> Path:
    """A serialized TensorRT engine (`out`, .engine) built from the ONNX export with TensorRT's own builder
    and ONNX parser, for batches of 1 to max(64, len(example)) images. Refused, with the reason, where
    TensorRT or a GPU is missing or the parser/builder fails; `export` then runs the engine and checks
    its top-1 classes against PyTorch's."""
    try:
        import tensorrt as trt
    except ImportError:
        raise UsageError(
            "--format tensorrt needs NVIDIA TensorRT's Python package (pip install tensorrt) and a CUDA "
            "GPU; it is not installed here. Or export --format onnx and build an engine with trtexec."
        ) from None
    if not torch.cuda.is_available():
        raise UsageError(
            "--format tensorrt builds an engine for the GPU it runs on, and this machine has no CUDA GPU. "
            "Export --format onnx here and build the engine on the target GPU (trtexec --onnx=...)."
        )
    # The ONNX the engine is built from, beside the engine (`out` is export()'s temp name of it; removed with it).
    onnx_path = out.with_name(out.name + ".onnx")
    export_onnx(trained, onnx_path, uint8_input=uint8_input, opset=opset, example=example, tta=tta)
    try:
        return _build_engine(trt, onnx_path, out, example)
    finally:
        onnx_path.unlink(missing_ok=True)


def _build_engine(trt, onnx_path: Path, out: Path, example: torch.Tensor) -> Path:
    """TensorRT's builder and ONNX parser: `onnx_path` -> a serialized engine in `out`."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode of TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UsageError(f"TensorRT cannot parse this run's ONNX export: {errors[:500]}. Export --format onnx instead.")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    name, shape = network.get_input(0).name, tuple(example.shape[1:])
    profile.set_shape(name, (1, *shape), (len(example), *shape), (max(64, len(example)), *shape))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise UsageError(
            "TensorRT could not build an engine from this run's ONNX export (its log above says why). "
            "Export --format onnx instead."
        )
    out.write_bytes(bytes(engine))
    return out


def tensorrt_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    """Run a serialized engine on one batch (CUDA tensors through TensorRT's named-tensor API) -> CPU logits."""
    import tensorrt as trt

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(path.read_bytes())
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inp = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
    outp = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
    xd = x.cuda().contiguous()
    context.set_input_shape(inp, tuple(xd.shape))
    dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16}
    y = torch.empty(tuple(context.get_tensor_shape(outp)), dtype=dtypes[engine.get_tensor_dtype(outp)], device="cuda")
    context.set_tensor_address(inp, xd.data_ptr())
    context.set_tensor_address(outp, y.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise UsageError(f"TensorRT failed to run the engine {path}.")
    stream.synchronize()
    return y.float().cpu()


def onnx_logits(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


def _onnx(path: Path, x, normalized, ref, trained, tta) -> torch.Tensor:
    return onnx_logits(path, x)


def _torchscript(path: Path, x, normalized, ref, trained, tta) -> torch.Tensor:
    with torch.no_grad():
        return torch.jit.load(str(path))(x)


def _tensorrt(path: Path, x, normalized, ref, trained, tta) -> torch.Tensor:
    """The engine's logits, held to top-1 agreement with PyTorch on every image whose top-1 is not a near tie.
    TensorRT picks its own kernels, TF32 by default (10-bit mantissa, ~1e-3 relative), so a class within 1% of the
    image's logit range of the top one may swap. 1% is 10x TF32's rounding, not a measured figure: TensorRT has not
    run in this project's tests yet (no GPU session has had it)."""
    got = tensorrt_logits(path, x)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.01 * (ref.max(-1).values - ref.min(-1).values)
    wrong = (got.argmax(-1) != ref.argmax(-1)) & clear
    if wrong.any():
        raise UsageError(
            f"TensorRT engine {path}: its top-1 class differs from PyTorch's on {int(wrong.sum())} of "
            f"{int(clear.sum())} validation images whose top-1 is clear (max |logits difference| "
            f"{(ref - got).abs().max():.3g}); the engine is wrong. Export --format onnx instead."
        )
    return got


def _safetensors(path: Path, x, normalized, ref, trained, tta) -> torch.Tensor:
    from torchsprint.commands.trained import load_weights_file
    from torchsprint.tasks.tta import wrap_tta

    with torch.no_grad():
        return wrap_tta(load_weights_file(path).model, tta)(normalized)


@dataclass(frozen=True)
class Format:
    """One export format: how it is written (`write`), its file's extension, and the other side of the parity
    check (`logits`: the exported file run on the check's batch)."""

    write: Callable[..., Path]
    extension: str
    logits: Callable[..., torch.Tensor]


EXPORTERS.register("onnx")(Format(export_onnx, ".onnx", _onnx))
EXPORTERS.register("safetensors")(Format(export_safetensors, ".safetensors", _safetensors))
EXPORTERS.register("torchscript")(Format(export_torchscript, ".pt", _torchscript))
EXPORTERS.register("tensorrt")(Format(export_tensorrt, ".engine", _tensorrt))


def parity(fmt: str, path: Path, trained, example: torch.Tensor, uint8_input: bool, tta=None) -> float:
    """max |logits(PyTorch) - logits(exported)| on the same batch (the format's own check may refuse first).
    `tta` (tta.TtaPlan or None): both sides with eval.tta (the torch side through the same tasks/tta.py wrapper)."""
    from torchsprint.tasks.tta import wrap_tta

    normalized = normalize(example, trained.pipeline)
    with torch.no_grad():
        ref = wrap_tta(trained.model, tta)(normalized)
    got = EXPORTERS.get(fmt).logits(path, example if uint8_input else normalized, normalized, ref, trained, tta)
    return (ref - got).abs().max().item()


def default_out(run_dir: str | Path, fmt: str, uint8_input: bool, tta: str) -> Path:
    """`<run>/export/model[-uint8][-tta-NAME].<ext>`: one file per input type and eval.tta (a graph holds its TTA)."""
    return (
        Path(run_dir) / "export" / f"model{'-uint8' if uint8_input else ''}{'' if tta == 'none' else '-tta-' + tta}"
        f"{EXPORTERS.get(fmt).extension}"
    )


def export(
    run_dir: str | Path,
    fmt: str = "onnx",
    *,
    weights: str = "best",
    out: str | Path | None = None,
    uint8_input: bool = False,
    opset: int | None = None,
    tolerance: float = 1e-3,
    tta: str | None = None,
    overwrite: bool = True,
) -> dict:
    """Export a run's weights and check them against PyTorch on a validation batch.

    `tta`: eval.tta for the export (None: the run's own): graph formats (onnx, torchscript, tensorrt) hold its
    views and combination, safetensors carries it in its config. Returns {"path", "format", "max_abs_diff", "tta"};
    raises UsageError when the difference exceeds `tolerance`. `out` may replace an existing file only with
    `overwrite` (the CLI's --overwrite), and never a file of a run (rundir.writable_file).
    """
    from torchsprint.state.rundir import writable_file

    if out is not None:  # before the run is loaded: a bad --out costs nothing
        out = writable_file(out, "--out", overwrite=overwrite)
    from torchsprint.commands.trained import load_run
    from torchsprint.config.saved import naming_imports
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import plan_tta

    trained = load_run(run_dir, weights)
    task = get_task(trained.cfg.task)
    task.check_export(fmt)
    tta = tta or trained.cfg.eval.tta
    plan = plan_tta(tta, task, trained.cfg.data.eval.transforms)
    trained.cfg.eval.tta = tta  # the config in the metadata says which TTA was exported
    if (
        out is None
    ):  # before the (slow) export; the run's export/ folder is export's own: a new export replaces the last
        out = writable_file(default_out(run_dir, fmt, uint8_input, tta), "--out")
    with naming_imports(trained.cfg.imports, run_dir):  # the run's dataset may come from a module it lists
        example = sample_batch(trained)
    # Every format is written under a temp name of this process, checked, and only then renamed over `out`:
    # two exports of one run at once each check their own whole file (one of them wins the name), a crash
    # never leaves a torn file, and a file under the final name has passed its parity check.
    try:
        with atomic_path(out) as tmp:
            EXPORTERS.get(fmt).write(trained, tmp, uint8_input=uint8_input, opset=opset, example=example, tta=plan)
            diff = parity(fmt, tmp, trained, example, uint8_input, plan)
            # A TensorRT engine is held to top-1 agreement (parity raises otherwise); its logits difference is reported.
            if fmt != "tensorrt" and not diff <= tolerance:
                raise UsageError(
                    f"export parity check failed: max |logits difference| = {diff:.3g} > tolerance "
                    f"{tolerance} between PyTorch and {fmt} on {len(example)} validation images; {out} "
                    "was not written."
                )
    except OSError as e:  # the disk filled up or the folder changed under us
        raise UsageError(
            f"could not write {out}: {e.strerror or e}. Free disk space or choose another --out."
        ) from None
    return {"path": str(out), "format": fmt, "max_abs_diff": diff, "images_checked": len(example), "tta": tta}

"""`torchsprint export --int8`: an ONNX graph statically quantized by onnxruntime (QDQ, per-channel int8 weights),
calibrated on a fixed, seeded sample of the run's own training images through its eval preprocessing.

Why onnxruntime.quantization and not torch.ao.quantization: torch.ao.quantization (eager and FX graph mode) is
deprecated in PyTorch 2.x (its successor, PT2E quantization, moved to the separate torchao package), and its
product is a torch model, not the ONNX file that `predict` and `serve` run. onnxruntime quantizes the graph that is
served, into the QDQ form its own CPU kernels fuse into integer convolutions and matrix products.

Activations: uint8 (QUInt8) by default, int8 weights (U8S8). Measured on an Intel Xeon: int8 activations (S8S8,
onnxruntime's default) ran SLOWER than fp32 there, U8S8 3.2x faster; onnxruntime's own guidance for x86-64 is
U8S8 too (quantize_static's docstring, "Choosing parameters for CPU inference"). `--int8-activations s8`
chooses S8S8 (ARM cores handle it well). Every choice is recorded in the file's `quantization` metadata entry.

Bit for bit: the same run, weights, N and seed give the same file. The sample is a seeded permutation of the
training split, the eval preprocessing draws nothing, MinMax calibration is a min and a max, and the metadata
holds no time (tests/e2e/export/test_int8.py checks two exports' bytes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from torchsprint.errors import UsageError

# --int8-activations: the name a user writes -> (onnxruntime QuantType name, the element type's name)
ACTIVATIONS = {"u8": ("QUInt8", "uint8"), "s8": ("QInt8", "int8")}
DEFAULT_ACTIVATIONS = "u8"  # U8S8: 3.2x fp32 on an Intel Xeon, where S8S8 was slower than fp32 (module docstring)
DEFAULT_CALIBRATION = 256  # training images; a few hundred is what onnxruntime's examples calibrate on


def calibration_indices(n_train: int, n: int, seed: int) -> list[int]:
    """The first min(n, n_train) positions of a permutation of the training split seeded with `seed`: a sample
    of every class in proportion, the same for the same run and n (a generator of its own: no global RNG)."""
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed))
    return order[: min(n, n_train)].tolist()


class Sample(torch.utils.data.Subset):
    """Some samples of a split, read as the split reads them: image files keep the eval loader's decode hint (the
    cpu backend asks the evaluation split for `with_min_size`: JPEGs scaled in the DCT where the spec shrinks 2x+)."""

    def with_min_size(self, min_size_for) -> Sample:
        return Sample(self.dataset.with_min_size(min_size_for), self.indices)


def calibration_batches(trained, n: int, seed: int, uint8_input: bool, tta: str) -> list[np.ndarray]:
    """`n` training images (calibration_indices) through the run's eval preprocessing, as the exported graph takes
    them: uint8 NCHW for a --uint8-input graph, else normalised float32 (what the eval loader gives the model);
    with a multi-crop eval.tta, the larger image the graph cuts its crops from (tta.loading_spec). Batches of the
    run's eval batch size, in sample order."""
    from torchsprint import runtime
    from torchsprint.data import build_loaders
    from torchsprint.data.core import DATASETS
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import with_loading_spec

    cfg = trained.cfg.model_copy(deep=True)
    cfg.data.backend, cfg.data.num_workers = "cpu", 0  # the reference CPU path (as export's parity batch)
    data_cfg = with_loading_spec(cfg.data, tta)
    splits = DATASETS.get(data_cfg.dataset)(data_cfg)
    if getattr(splits.train, "streaming", False):  # webdataset shards: no sample indices to draw from
        raise UsageError(
            f"export --int8: data.dataset={data_cfg.dataset} streams its training split, and calibration "
            "draws a seeded sample of its indices; calibrate from an image folder of the same data."
        )
    if len(splits.train) == 0:
        raise UsageError("export --int8: the training split is empty: nothing to calibrate the activations' ranges on.")
    sample = Sample(splits.train, calibration_indices(len(splits.train), n, seed))
    # The sample takes the evaluation loader's place: the eval spec, no shuffle, no augmentation.
    loaders = build_loaders(
        data_cfg,
        runtime.Runtime(device=torch.device("cpu")),
        seed=cfg.run.seed,
        splits=replace(splits, val=sample, test=None),
        allowed=("cpu",),
    )
    loaders.val.set_epoch(0)
    task = get_task(cfg.task)
    if uint8_input:
        return [task.example(images, trained.in_channels).numpy() for images, *_ in loaders.val.loader]
    return [images.numpy() for images, _ in loaders.val]


def make_reader(input_name: str, batches: list[np.ndarray]):
    """onnxruntime's CalibrationDataReader over `batches` (one feed per batch, then None)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.left = iter(batches)

        def get_next(self):
            x = next(self.left, None)
            return None if x is None else {input_name: x}

        def rewind(self):
            self.left = iter(batches)

    return Batches()


def pre_process(fp32: Path, out: Path) -> str:
    """onnxruntime's quantization pre-processing of `fp32` into `out`: shape inference and graph optimisation
    (Conv + BatchNorm folded, so the folded weights are quantized once, per channel). Returns what ran: "full";
    "no symbolic shapes" where its symbolic shape inference fails on the graph (it does on eval.tta=hflip's:
    a TypeError inside symbolic_shape_infer.py, onnxruntime 1.32), onnx's shape inference and the optimisation
    still run; "none" (`out` a copy of `fp32`) where neither runs."""
    import shutil

    from onnxruntime.quantization.shape_inference import quant_pre_process

    for how, skip_symbolic in (("full", False), ("no symbolic shapes", True)):
        try:
            with quiet_onnxruntime():
                quant_pre_process(str(fp32), str(out), skip_symbolic_shape=skip_symbolic)
            return how
        except Exception:  # noqa: BLE001 - an optimisation, not a requirement: the next way, or the graph as it is
            continue
    shutil.copyfile(fp32, out)
    return "none"


@contextlib.contextmanager
def quiet_onnxruntime():
    """onnxruntime.quantization warns through the root logger (`logging.warning`): "please consider pre-processing"
    (what pre_process returned says whether it ran) and one "Axis 1 is out-of-range" per rank-1 weight (a
    BatchNorm scale, quantized per tensor). Silenced below ERROR while it runs; the record says what ran."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_onnx(fp32: Path, out: Path, batches: list[np.ndarray], activations: str, record: dict) -> dict:
    """Static QDQ quantization of `fp32` into `out` (int8 weights per output channel, `activations` u8 or s8,
    MinMax ranges over `batches`), carrying fp32's metadata plus `quantization`: `record` (what the sample
    was) with how it was quantized. Returns that quantization record."""
    import onnx
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    act_type, act_name = ACTIVATIONS[activations]
    with tempfile.TemporaryDirectory(prefix="torchsprint-int8-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        pre_processed = pre_process(fp32, pre)
        input_name = onnx.load(str(pre), load_external_data=False).graph.input[0].name
        with quiet_onnxruntime():
            quantize_static(
                str(pre),
                str(out),
                make_reader(input_name, batches),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                reduce_range=False,
                activation_type=getattr(QuantType, act_type),
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
            )
    quantization = {
        "type": "static",
        "format": "QDQ",
        "activations": act_name,
        "weights": "int8",
        "per_channel": True,
        "calibration": "minmax",
        **record,
        "pre_process": pre_processed,
        "onnxruntime": onnxruntime.__version__,
    }
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in onnx.load(str(fp32), load_external_data=False).metadata_props}
    del model.metadata_props[:]
    for k, v in (meta | {"quantization": json.dumps(quantization)}).items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(out))
    return quantization


def default_int8_out(run_dir, uint8_input: bool, tta: str) -> Path:
    """`<run>/export/model[-uint8][-tta-NAME]-int8.onnx`: beside the fp32 export it comes from."""
    from torchsprint.commands.export import default_out

    fp32 = default_out(run_dir, "onnx", uint8_input, tta)
    return fp32.with_name(fp32.stem + "-int8.onnx")


def check_int8_settings(fmt: str, calibration: int, activations: str) -> None:
    """Refuse what --int8 cannot honour: another format, no calibration image, an unknown activation type."""
    if fmt != "onnx":
        raise UsageError(
            f"--int8 quantizes an ONNX graph (onnxruntime); --format {fmt} is not quantized. Use "
            "--format onnx --int8, or leave --int8 out."
        )
    if calibration < 1:
        raise UsageError(
            f"--calibration {calibration}: static quantization needs at least 1 training image to measure "
            f"the activations' ranges on; use the default {DEFAULT_CALIBRATION} or more."
        )
    if activations not in ACTIVATIONS:
        raise UsageError(f"--int8-activations {activations}: choose u8 (uint8 activations, the default) or s8 (int8).")


def export_int8(
    run_dir: str | Path,
    *,
    weights: str = "best",
    out: str | Path | None = None,
    uint8_input: bool = False,
    opset: int | None = None,
    tolerance: float = 1e-3,
    tta: str | None = None,
    calibration: int = DEFAULT_CALIBRATION,
    activations: str = DEFAULT_ACTIVATIONS,
    force: bool = False,
    overwrite: bool = True,
) -> dict:
    """An int8 ONNX export of a run: its fp32 ONNX export (parity-checked against PyTorch, as `export` does),
    quantized on `calibration` training images (calibration_batches; the sample seeded with the run's seed), and
    written only where commands/int8_gate.py's check passes (within 1 point of fp32's top-1 on the validation
    split, and faster at the serving batch) or with `force`.

    Returns {"path", "format", "tta", "quantization" (the record in its metadata), "check" (Int8Check),
    "written" (False: refused and not forced, raised instead), "max_abs_diff"/"images_checked" (the fp32 graph's
    parity)}. Raises UsageError when refused without `force`. `out` (default default_int8_out) may replace a
    file only with `overwrite`.
    """
    import shutil

    from torchsprint.commands.export import export
    from torchsprint.commands.int8_gate import check_int8, refusal
    from torchsprint.commands.trained import load_run
    from torchsprint.config.saved import naming_imports
    from torchsprint.state.checkpoint import atomic_path
    from torchsprint.state.rundir import writable_file

    check_int8_settings("onnx", calibration, activations)
    if out is not None:
        out = writable_file(out, "--out", overwrite=overwrite)
    trained = load_run(run_dir, weights)
    if trained.cfg.task != "classification":
        raise UsageError(
            f"--int8: task={trained.cfg.task} is not quantized (its accuracy check is top-1 of a classifier); "
            "export it in fp32 (leave --int8 out)."
        )
    tta = tta or trained.cfg.eval.tta
    trained.cfg.eval.tta = tta  # the speed batch loads images as the graph takes them (multi-crop: the larger image)
    if out is None:
        out = writable_file(default_int8_out(run_dir, uint8_input, tta), "--out")
    with tempfile.TemporaryDirectory(prefix="torchsprint-int8-") as tmp:
        fp32 = export(
            run_dir,
            "onnx",
            weights=weights,
            out=Path(tmp) / "fp32.onnx",
            uint8_input=uint8_input,
            opset=opset,
            tolerance=tolerance,
            tta=tta,
        )
        seed = trained.cfg.run.seed
        with naming_imports(trained.cfg.imports, run_dir):
            batches = calibration_batches(trained, calibration, seed, uint8_input, tta)
            record = {"calibration_images": sum(len(b) for b in batches), "calibration_split": "train", "seed": seed}
            int8 = Path(tmp) / "int8.onnx"
            quantization = quantize_onnx(Path(fp32["path"]), int8, batches, activations, record)
            check = check_int8(Path(fp32["path"]), int8, trained, uint8_input)
        if not check.passed and not force:
            raise UsageError(refusal(check, out))
        try:
            with atomic_path(out) as tmp_out:
                shutil.copyfile(int8, tmp_out)
        except OSError as e:
            raise UsageError(
                f"could not write {out}: {e.strerror or e}. Free disk space or choose another --out."
            ) from None
    return {
        "path": str(out),
        "format": "onnx",
        "tta": tta,
        "quantization": quantization,
        "check": check,
        "written": True,
        "forced": not check.passed,
        "max_abs_diff": fp32["max_abs_diff"],
        "images_checked": fp32["images_checked"],
    }

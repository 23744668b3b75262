"""`torchsprint eval` on an exported model file: a .onnx (fp32 or int8, in onnxruntime), a .pt (TorchScript) or a
.safetensors export (torch), over the validation (or test) split of the data its run trained on, with the run's own
loss and metrics (tasks' evaluators): the figures `eval` gives the run folder, measured on what is served.

The data comes from the file itself: every export carries the run's resolved config (trained.Trained.metadata),
whose `data` section names the dataset, its root and the eval spec, as `predict` reads it. Evaluation runs on the
CPU (onnxruntime's CPU provider; torch on the CPU), with the cpu data backend. The eval.tta an exported graph
holds is the one it runs; another (an override) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchsprint.errors import UsageError

EXPORTED = (".onnx", ".pt", ".safetensors")


@dataclass
class Exported:
    """An exported model opened for evaluation: `forward` takes a batch as the file's input (uint8 NCHW where
    `uint8_input`, else normalised float32) and returns logits on the CPU."""

    path: Path
    forward: Callable[[torch.Tensor], torch.Tensor]
    uint8_input: bool
    cfg: object  # config.Config: the run's, from the file's metadata (with the overrides)
    classes: list
    in_channels: int
    tta: str  # the eval.tta it runs: held in a graph, or applied around a torch model
    runtime: str  # onnxruntime, torchscript or torch
    quantization: dict | None = None  # an int8 ONNX file's record (commands/quantize.py)
    autocast: Callable = field(default=nullcontext)  # a torch model's precision (the run's); graphs run as exported


def is_exported(path) -> bool:
    """Whether `eval -r PATH` names a model file (by its suffix) rather than a run folder."""
    p = Path(path)
    return p.suffix in EXPORTED and not p.is_dir()


def file_cfg(meta: dict, path: Path, overrides) -> object:
    """The run's config stored in a file's metadata, with `overrides` (e.g. data.root=... where the data moved)."""
    from torchsprint import config as config_mod
    from torchsprint.config.saved import file_config, metadata_entry

    raw = metadata_entry(meta, "config", path)
    for item in overrides:
        raw = config_mod.apply_override(raw, item)
    return file_config(raw, path)


def held_tta(meta: dict, cfg, path: Path) -> str:
    """The eval.tta a graph holds (export --tta). The config in its metadata says the same (export writes the
    exported one there), so a different cfg.eval.tta is an override asking for another: refused."""
    held = meta.get("tta", "none")  # files exported before eval.tta existed hold none
    if cfg.eval.tta != held:
        raise UsageError(
            f"{path} holds eval.tta={held} in its graph, not {cfg.eval.tta}: export the run again with "
            f"`torchsprint export --tta {cfg.eval.tta}`, or leave the eval.tta override out."
        )
    return held


def open_onnx(path: Path, overrides) -> Exported:
    """A .onnx export in onnxruntime (CPU provider): fp32, or int8 with its `quantization` record."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: one line
        raise UsageError(f"{path} is not a readable ONNX file ({type(e).__name__}: {str(e)[:200]}).") from None
    meta = sess.get_modelmeta().custom_metadata_map
    if "classes" not in meta:
        raise UsageError(f"{path} has no torchsprint metadata; export it with `torchsprint export`.")
    from torchsprint.config.saved import metadata_entry

    cfg = file_cfg(meta, path, overrides)
    name = sess.get_inputs()[0].name

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(sess.run(None, {name: x.cpu().contiguous().numpy()})[0])

    forward.session = sess
    from torchsprint.commands.int8_file import quantization_record

    quantization = quantization_record(meta, path)
    return Exported(
        path,
        forward,
        meta.get("input_dtype") == "uint8",
        cfg,
        metadata_entry(meta, "classes", path),
        metadata_entry(meta, "in_channels", path),
        held_tta(meta, cfg, path),
        "onnxruntime",
        quantization,
    )


def open_torchscript(path: Path, overrides) -> Exported:
    """A .pt TorchScript export (its metadata in `_extra_files['torchsprint.json']`)."""
    import warnings

    from torchsprint.config.saved import metadata_entry

    extra = {"torchsprint.json": ""}
    try:
        with (
            warnings.catch_warnings()
        ):  # torch.jit.load's FutureWarning: TorchScript is deprecated, and the file is one
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra).eval()
        meta = json.loads(extra["torchsprint.json"] or "{}")
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{path} is not a readable TorchScript file ({type(e).__name__}: {str(e)[:200]}).") from None
    if "classes" not in meta:
        raise UsageError(
            f"{path} has no torchsprint metadata; export it with `torchsprint export --format torchscript`."
        )
    cfg = file_cfg(meta, path, overrides)
    return Exported(
        path,
        module,
        meta.get("input_dtype") == "uint8",
        cfg,
        metadata_entry(meta, "classes", path),
        metadata_entry(meta, "in_channels", path),
        held_tta(meta, cfg, path),
        "torchscript",
    )


def open_safetensors(path: Path, overrides) -> Exported:
    """A .safetensors export: the model rebuilt from its config and run in torch with the run's precision
    (autocast where the run validated under it) and eval.tta (an override applies: the weights hold none)."""
    from torchsprint.commands.trained import load_weights_file
    from torchsprint.runtime.parallel import channels_last_on
    from torchsprint.state.checkpoint import read_safetensors_metadata
    from torchsprint.state.precision import Precision, concrete_mode
    from torchsprint.tasks.core import get_task
    from torchsprint.tasks.tta import plan_tta, wrap_tta

    try:
        meta = read_safetensors_metadata(path)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}).") from None
    if "config" not in meta:
        raise UsageError(f"{path} carries no config; evaluate its run folder instead (`torchsprint eval -r RUN`).")
    cfg = file_cfg(meta, path, overrides)
    trained = load_weights_file(path, "cpu", cfg)
    prec = Precision(concrete_mode(cfg.precision.mode), torch.device("cpu"))
    model = trained.model
    if channels_last_on(cfg.speed.channels_last, model):  # the run's memory format: its own eval's figures exactly
        model = model.to(memory_format=torch.channels_last)
    if cfg.precision.mode == "fp64":  # as the run's own evaluation: float64 weights, batches cast on the way in
        model = prec.prepare(model.double())
    plan = plan_tta(cfg.eval.tta, get_task(cfg.task), cfg.data.eval.transforms)
    return Exported(
        path,
        wrap_tta(model, plan),
        False,
        cfg,
        trained.classes,
        trained.in_channels,
        cfg.eval.tta,
        "torch",
        autocast=prec.autocast,
    )


OPENERS = {".onnx": open_onnx, ".pt": open_torchscript, ".safetensors": open_safetensors}


def open_exported(path: str | Path, overrides=()) -> Exported:
    """The model file at `path` (.onnx, .pt or .safetensors) ready to evaluate; one-line errors otherwise."""
    path = Path(path)
    if path.suffix not in OPENERS:
        raise UsageError(f"{path}: eval takes a run folder or an exported {', '.join(EXPORTED)} file.")
    if not path.is_file():
        raise UsageError(f"model file not found: {path}")
    return OPENERS[path.suffix](path, list(overrides))


def exported_batches(loaders, task, uint8_input: bool, in_channels: int):
    """The evaluation split's (inputs, targets) as the file takes them: the eval loader's normalised batches (what
    the run's model sees in `eval`), or its uint8 batches (the same pixels, before the device normalisation)."""
    loaders.val.set_epoch(0)
    if not uint8_input:
        return iter(loaders.val)
    return ((task.example(images, in_channels), targets) for images, targets, *_ in loaders.val.loader)


def evaluate_exported(models: dict[str, Exported], split: str = "val") -> dict[str, dict]:
    """Evaluate one or more exports of the same run (same input type and eval.tta) in one pass over `split`: each
    its own metrics (task.make_metrics, the run's loss: evaluation.build_run_loss). Returns {name: metrics}."""
    from torchsprint import runtime
    from torchsprint.config.saved import naming_imports
    from torchsprint.data import build_loaders
    from torchsprint.state.resume import check_same_classes
    from torchsprint.tasks.core import check_data_task, get_task
    from torchsprint.tasks.tta import with_loading_spec
    from torchsprint.train.evaluation import EVAL_BACKENDS, build_run_loss
    from torchsprint.train.plan import decide_input_format

    first = next(iter(models.values()))
    assert len({(m.uint8_input, m.tta) for m in models.values()}) == 1, "exports of one input type and eval.tta"
    cfg = first.cfg.model_copy(deep=True)
    cfg.data.backend = "cpu"  # the CPU evaluation's reference path (export's parity batch reads it too)
    rt = runtime.Runtime(device=torch.device("cpu"))
    with naming_imports(cfg.imports, first.path):  # a dataset or loss the run's unimported module registers
        task = get_task(cfg.task)
        task.check(cfg)
        if first.uint8_input and task.name not in ("classification", "multilabel"):
            raise UsageError(
                f"{first.path}: a --uint8-input graph of task={task.name} is not evaluated here (its "
                "batches are assembled from pairs or clips); evaluate its float export or its run folder."
            )
        # The run's input format (plan.decide_input_format), as evaluate_run builds it; a graph's forward takes
        # any layout (it makes its input contiguous NCHW).
        loaders = build_loaders(
            with_loading_spec(cfg.data, first.tta),
            rt,
            seed=cfg.run.seed,
            split=split,
            allowed=EVAL_BACKENDS,
            channels_last=decide_input_format(cfg.speed)[0],
        )
        info = loaders.info
        check_data_task(cfg, info)
        check_same_classes(
            first.classes,
            info.classes,
            first.path,
            "evaluate on the data the run trained on (restore "
            "those class folders, or give its copy with data.root=...).",
        )
        loss_fn = build_run_loss(cfg, task.targets, info)
    metrics = {name: task.make_metrics(info, cfg.eval, rt.device) for name in models}
    with torch.no_grad():
        for images, targets in exported_batches(loaders, task, first.uint8_input, first.in_channels):
            for name, m in models.items():
                with m.autocast():
                    logits = m.forward(images)
                    loss = loss_fn(logits, targets)
                metrics[name].update(logits, targets, loss)
    return {name: metrics[name].compute() | facts(m, split) for name, m in models.items()}


def facts(m: Exported, split: str) -> dict:
    """What evaluate_run adds beside the metrics (weights, split, tta, epoch, step), for a file."""
    return {
        "weights": str(m.path),
        "split": split,
        "tta": m.tta,
        "epoch": None,
        "step": None,
        "runtime": m.runtime,
        "quantization": m.quantization,
    }


def evaluate_file(path: str | Path, split: str = "val", overrides=()) -> dict:
    """`torchsprint eval -r FILE`: an exported file's figures over `split` of its run's data (evaluate_run's dict,
    plus "runtime" and, for an int8 file, "quantization")."""
    return evaluate_exported({"model": open_exported(path, overrides)}, split)["model"]


def describe_file(out: dict) -> str:
    """The header line of `eval` on a file: which file, run how."""
    from torchsprint.commands.int8_file import describe_quantization

    q = out.get("quantization")
    how = out["runtime"] + (f", {describe_quantization(q)}" if q else "")
    tta = "" if out.get("tta", "none") == "none" else f", test-time augmentation {out['tta']}"
    return f"{out['split']} split, {Path(out['weights']).name} ({how}){tta}:"

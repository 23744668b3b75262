"""A trained model with everything inference needs: classes, channels, config and the eval preprocessing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchsprint import config as config_mod
from torchsprint.config.saved import file_config, load_run_config, metadata_entry, naming_imports
from torchsprint.errors import UsageError
from torchsprint.state.checkpoint import read_safetensors_metadata

__all__ = ["Trained", "file_config", "load_run", "load_weights_file"]


@dataclass
class Trained:
    """A model in eval mode plus the metadata that travels with it into exports and predictions."""

    model: nn.Module
    classes: list[str]
    in_channels: int
    cfg: config_mod.Config
    weights_path: Path

    @property
    def pipeline(self):
        """The compiled eval spec (CPU uint8 part + normalisation constants + output size)."""
        from torchsprint.data.preprocess.transforms import compile_spec

        return compile_spec(self.cfg.data.eval.transforms, "data.eval.transforms", self.in_channels)

    def metadata(self) -> dict[str, str]:
        """String metadata stored in every export (ONNX metadata_props, safetensors header)."""
        from torchsprint.data.preprocess.transforms import compile_spec
        from torchsprint.tasks.tta import loading_spec

        p = self.pipeline
        loaded = compile_spec(
            loading_spec(self.cfg.data.eval.transforms, self.cfg.eval.tta), "data.eval.transforms", self.in_channels
        )
        return {
            "format": "torchsprint",
            "classes": json.dumps(self.classes),
            "in_channels": str(self.in_channels),
            # The size predict loads images at: with multi-crop eval.tta, the larger image the crops come from.
            "input_size": json.dumps(list(loaded.out_size) if loaded.out_size else None),
            "mean": json.dumps(list(p.mean)),
            "std": json.dumps(list(p.std)),
            "eval_transforms": json.dumps(self.cfg.data.eval.transforms),
            "model": self.cfg.model.name,
            "config": json.dumps(config_mod.to_dict(self.cfg)),
        }


def load_weights_file(
    path: str | Path, device: str | torch.device = "cpu", cfg: config_mod.Config | None = None
) -> Trained:
    """Rebuild a model from a torchsprint .safetensors file (its metadata holds classes and config).

    `cfg`: the run's config when loading a run folder's weights; None reads the file's own (never
    importing what it lists, see file_config).
    """
    from safetensors.torch import load_file

    from torchsprint.models import build_model

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"weights file not found: {path}")
    try:
        meta = read_safetensors_metadata(path)
    except Exception as e:
        raise UsageError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e}). Re-export or re-train it."
        ) from None
    if "classes" not in meta:
        raise UsageError(f"{path} has no torchsprint metadata (classes); export it with `torchsprint export`.")
    if cfg is None:
        if "config" not in meta:
            raise UsageError(f"{path} carries no config; pass the run folder instead.")
        cfg = file_config(metadata_entry(meta, "config", path), path)
    classes, in_channels = metadata_entry(meta, "classes", path), metadata_entry(meta, "in_channels", path)
    with naming_imports(cfg.imports, path):
        model = build_model(cfg.model, len(classes), in_channels)
    try:
        state = load_file(str(path))
        model.load_state_dict(state)
    except Exception as e:  # a truncated/corrupt file or weights of another model
        raise UsageError(
            f"{path}: cannot load its weights into {cfg.model.name} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). The file is corrupt or from another model; re-train "
            "or re-export it."
        ) from None
    return Trained(model.to(device).eval(), classes, in_channels, cfg, path)


def load_run(run_dir: str | Path, weights: str = "best", device: str | torch.device = "cpu") -> Trained:
    """The best or last weights of a run folder, with the run's resolved config (its `imports:` not imported:
    run.load_run_config)."""
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    from torchsprint.train.evaluation import weights_file

    wpath = weights_file(run_dir, weights)
    if not wpath.is_file():
        raise UsageError(
            f"{wpath} not found: the run has not saved {weights} weights yet. Try --weights last or best"
            f"{' (ema.safetensors exists only for runs with ema.enabled=true)' if weights == 'ema' else ''}"
            f"{' (swa.safetensors exists only for runs with swa.enabled=true)' if weights == 'swa' else ''}."
        )
    return load_weights_file(wpath, device, cfg)

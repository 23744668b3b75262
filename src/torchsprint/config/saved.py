"""Opening a run folder or a model file runs no code: the config saved with it, validated without importing the
modules its `imports:` lists (the user names the ones they trust with --import; errors say which flag to pass)."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from torchsprint import config as config_mod
from torchsprint.config.schema import import_modules
from torchsprint.errors import UsageError

#
# A run folder or model file may come from someone else. The `imports:` its config lists would import whatever
# module of that name lies in the working folder (config.import_modules searches it), so opening one never
# imports them: the user names the modules they trust with --import, and an error that a missing module
# explains (an unknown model, dataset, task...) says which flag to pass.


def untrusted_imports(listed) -> list[str]:
    """The modules a saved config lists that this process has not imported (through --import or otherwise)."""
    return [m for m in (listed if isinstance(listed, list) else []) if isinstance(m, str) and m not in sys.modules]


def needs_imports(source, missing: list[str]) -> str:
    """The hint appended to an error of a run folder or model file whose config lists `missing` modules."""
    if not missing:
        return ""
    flags = " ".join(f"--import {m}" for m in missing)
    return (
        f" {source} was trained with `imports: {missing}`; a run folder or model file never imports code by "
        f"itself: if you trust these modules, pass {flags}."
    )


@contextmanager
def naming_imports(listed, source):
    """Append `needs_imports` to a UsageError raised inside, when the saved config lists unimported modules."""
    try:
        yield
    except UsageError as e:
        missing = untrusted_imports(listed)
        if not missing or needs_imports(source, missing) in str(e):
            raise
        raise UsageError(f"{e}{needs_imports(source, missing)}") from None


_REQUIRED = object()
# The type each JSON entry of a model file's metadata holds (torchsprint writes them: trained.Trained.metadata).
METADATA_TYPES = {
    "classes": list,
    "config": dict,
    "eval_transforms": list,
    "in_channels": int,
    "input_size": (list, type(None)),
    "mean": list,
    "std": list,
}


def metadata_entry(meta: dict, key: str, source, default=_REQUIRED):
    """The value of `key` in a model file's text metadata (a .safetensors header, an ONNX file's metadata_props),
    which torchsprint writes as JSON: classes, config, eval_transforms, in_channels... The one place that parses
    them: an entry that is not valid JSON, or not the type it must be (a damaged or hand-edited file), is one
    UsageError naming the file and the key, never a JSONDecodeError traceback. `default`: the value when the file
    has no such entry (without one, a missing entry is refused too)."""
    if key not in meta:
        if default is not _REQUIRED:
            return default
        raise UsageError(
            f"{source} has no '{key}' entry in its metadata: it was not written by torchsprint, or was "
            "edited. Export it again with `torchsprint export` (or re-train the run)."
        )
    try:
        value = json.loads(meta[key])
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise UsageError(
            f"{source}: its metadata entry '{key}' is not valid JSON ({str(e)[:80]}): the file is damaged "
            "or was edited. Export it again with `torchsprint export` (or re-train the run)."
        ) from None
    kind = METADATA_TYPES.get(key, object)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UsageError(
            f"{source}: its metadata entry '{key}' holds {type(value).__name__} {str(value)[:40]!r}, not "
            f"the {getattr(kind, '__name__', 'list')} torchsprint writes: the file is damaged or was edited. "
            "Export it again with `torchsprint export` (or re-train the run)."
        )
    return value


def file_config(raw: dict, source: str | Path) -> config_mod.Config:
    """A config saved in a run folder or a model file's metadata, validated WITHOUT importing the modules it lists."""
    with naming_imports(raw.get("imports") if isinstance(raw, dict) else None, source):
        return config_mod.validate(raw, str(source))


def load_run_config(run_dir: Path, overrides: list[str] = ()) -> config_mod.Config:
    """The resolved config saved in a run folder, with overrides; its `imports:` are not imported (see above)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UsageError(
            f"{run_dir} is not a torchsprint run folder (no config.yaml). Pass the folder `train` printed."
        )
    data = config_mod.read_with_extends(path)
    for item in overrides:
        data = config_mod.apply_override(data, item)
    return file_config(data, path)


def resumed_run_config(run_dir: str | Path, overrides: list[str], imports: list[str]) -> config_mod.Config:
    """The config of `train --resume RUN_DIR` without -c: the run folder's saved config plus `overrides`.

    Only `imports` (the user's --import) are imported; a module the saved config lists and the user did not
    name is refused, naming the flag to pass (the run would import it when it starts training).
    """
    import_modules(imports)
    cfg = load_run_config(Path(run_dir), overrides)
    missing = untrusted_imports(cfg.imports)
    if missing:
        flags = " ".join(f"--import {m}" for m in missing)
        raise UsageError(
            f"--resume {run_dir}: its config.yaml lists `imports: {missing}`, and a run folder never imports "
            f"code by itself: if you trust these modules, pass {flags} (or give the config with -c)."
        )
    if imports:  # as config.load does: the flags' modules join the run's list (the config.yaml written next)
        cfg.imports = [*cfg.imports, *[m for m in imports if m not in cfg.imports]]
    return cfg

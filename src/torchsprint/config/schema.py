"""The run schema's root `Config` (pydantic, extra=forbid), `validate`, and `load(path, overrides)` with `extends`
and dotted overrides. The sections live in config/sections.py (run, data, mix, distill, model), config/training.py
(optim ... eval) and config/serve.py; callers import a section from the module that defines it."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from torchsprint.config.files import (
    _field_names,
    _sub_model,
    read_with_extends,
)
from torchsprint.config.files import apply_override as _apply_override
from torchsprint.config.sections import (
    DataConfig,
    DistillConfig,
    MixConfig,
    ModelConfig,
    RunConfig,
    Section,
)
from torchsprint.config.serve import ServeConfig
from torchsprint.config.training import (
    CheckpointConfig,
    EarlyStopConfig,
    EmaConfig,
    EvalConfig,
    LogConfig,
    LossConfig,
    OptimConfig,
    PrecisionConfig,
    SchedConfig,
    SpeedConfig,
    StrategyConfig,
    SwaConfig,
)
from torchsprint.config.tune import SHORTCUTS, TuneConfig, settable
from torchsprint.errors import UsageError, did_you_mean


class Config(Section):
    """One run. Every key has a default, so an empty file is a valid run (digits + small CNN)."""

    imports: list[str] = Field(
        default_factory=list, description="Python modules to import first (register your own models, datasets...)."
    )
    task: str = Field(
        "classification",
        description="What the run learns, from the TASKS registry: classification (one class per image), "
        "multilabel (any number of labels per image), image_to_image (paired restoration), video (clip "
        "classification). It sets the default loss, metrics, checkpoint.monitor/mode, artifacts and predict output.",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, length and device.")
    data: DataConfig = Field(default_factory=DataConfig, description="Dataset, loader backend and preprocessing.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model, initialisation and freezing.")
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer, gradient clipping and accumulation."
    )
    sched: SchedConfig = Field(default_factory=SchedConfig, description="Learning-rate schedule.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Loss function(s).")
    mix: MixConfig = Field(
        default_factory=MixConfig,
        description="Mixup and CutMix on training batches (soft targets; loss.label_smoothing applies to them).",
    )
    distill: DistillConfig = Field(
        default_factory=DistillConfig,
        description="Knowledge distillation from a frozen teacher's logits (off unless distill.teacher is set).",
    )
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Numeric precision (AMP).")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig, description="Single device, DataParallel or DDP.")
    speed: SpeedConfig = Field(default_factory=SpeedConfig, description="Speed switches.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving, keeping and resuming.")
    ema: EmaConfig = Field(default_factory=EmaConfig, description="Exponential moving average of the weights.")
    swa: SwaConfig = Field(
        default_factory=SwaConfig,
        description="Stochastic weight averaging over the last epochs "
        "(torch.optim.swa_utils: AveragedModel, SWALR, update_bn).",
    )
    early_stop: EarlyStopConfig = Field(
        default_factory=EarlyStopConfig, description="Stop when checkpoint.monitor stops improving."
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Console, JSONL and TensorBoard logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation metrics.")
    tune: TuneConfig = Field(
        default_factory=TuneConfig,
        description="`torchsprint tune`: the search space and objective (read by tune only; docs/tune.md).",
    )
    serve: ServeConfig = Field(
        default_factory=ServeConfig,
        description="`torchsprint serve`: the HTTP server's address, "
        "dynamic batching, limits and token (docs/serve.md).",
    )

    @model_validator(mode="after")
    def _unfreeze_within_the_run(self):
        # The start-up line promises the body's unfreeze after freeze_epochs; at or past run.epochs it never comes.
        if self.model.freeze_epochs and self.model.freeze_epochs >= self.run.epochs:
            raise UsageError(
                f"model.freeze_epochs={self.model.freeze_epochs} is not below run.epochs={self.run.epochs}: "
                "the body would never be unfrozen. Lower model.freeze_epochs or raise run.epochs; to train "
                "only the head for the whole run, set model.train_only to its parameter patterns."
            )
        return self

    @model_validator(mode="after")
    def _tune_keys_are_settings(self):
        for key in self.tune.space:
            if key not in SHORTCUTS and not settable(key, Config):
                raise UsageError(
                    f"tune.space.{key}: not a setting of the config (a dotted key such as optim.lr or "
                    f"loss.label_smoothing, or one of {', '.join(SHORTCUTS)})"
                )
        return self

    @model_validator(mode="after")
    def _train_time_sets_the_length(self):
        # run.train_time fits run.max_steps to the time: a max_steps of the user's would be overridden, and the fitted
        # schedule is per step (an epoch schedule has no step to end at; SWA starts at an epoch of a fixed length).
        if self.run.train_time is None:
            return self
        clash = (
            "run.max_steps"
            if self.run.max_steps is not None
            else "sched.interval=epoch"
            if self.sched.interval == "epoch"
            else "swa.enabled=true"
            if self.swa.enabled
            else None
        )
        if clash:
            raise UsageError(
                f"run.train_time={self.run.train_time} fits the run's length (its optimizer steps, the schedule per "
                f"step) to the time, which {clash} fixes otherwise: unset one of them."
            )
        return self

    # What torchsprint chose for settings the config leaves unset and the data decides (data/detect.py): a list of
    # Choice dicts (setting, value, why, override), for the start-up summary and decisions.json. Not a config key:
    # the chosen values themselves are written into the config (config.yaml), so a resumed run reads them as set.
    # Validation never fills it: loading a config reads files and overrides only (no scan of data.root, no weights
    # cache, no network); train/resolve.py's `resolve` is the phase that decides and records, once per config.
    _chosen: list = PrivateAttr(default_factory=list)
    _resolved: bool = PrivateAttr(default=False)

    def set_by_user(self, dotted: str) -> bool:
        """Whether the config (a file, an override) set `dotted` (section.field), not the schema or the task's default
        (tasks/core.py's apply_defaults, in the resolve phase, fills those without marking them set)."""
        section, name = dotted.split(".")
        return name in getattr(self, section).model_fields_set

    def chosen(self) -> list[dict]:
        """The settings chosen from the data (data/detect.py), each {setting, value, why, override}."""
        return list(self._chosen)

    def record_chosen(self, chosen: list[dict]) -> None:
        """Add settings chosen for this config (a setting recorded before keeps its first record)."""
        have = {c["setting"] for c in self._chosen}
        self._chosen = [*self._chosen, *(c for c in chosen if c["setting"] not in have)]

    @property
    def resolved(self) -> bool:
        """Whether train/resolve.py's phase has filled what the task and the data decide."""
        return self._resolved

    def mark_resolved(self) -> None:
        self._resolved = True


# ---------------------------------------------------------------- loading
# Reading files (YAML/JSON/TOML, extends, duplicate keys, depth) and dotted overrides live in config/files.py.


def apply_override(data: dict[str, Any], item: str) -> dict[str, Any]:
    """Apply one `a.b.c=value` to the raw dict; the key must exist in the schema (Config)."""
    return _apply_override(data, item, Config)


def _format_validation_error(err: ValidationError, source: str) -> str:
    """One line: '<source>: invalid config: <key>: <problem> (got <value>); <key>: ...'."""
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            # Suggest the closest valid key in the same section.
            model: type[BaseModel] | None = Config
            for part in e["loc"][:-1]:
                model = _sub_model(model, str(part)) if model is not None and str(part) in model.model_fields else None
            names = _field_names(model) if model else []
            parent = ".".join(str(p) for p in e["loc"][:-1])
            full = [f"{parent}.{n}" if parent else n for n in names]
            problems.append(f"{loc}: unknown key.{did_you_mean(loc, full)}")
        else:
            got = e.get("input")
            got_s = f" (got {got!r})" if not isinstance(got, dict | list) else ""
            problems.append(f"{loc}: {e['msg']}{got_s}")
    return f"{source}: invalid config: " + "; ".join(problems)


def validate(data: dict[str, Any], source: str = "config") -> Config:
    """Turn a raw dict into a Config; errors name each bad key and the closest valid one."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise UsageError(_format_validation_error(e, source)) from None


def import_modules(names: list[str] | tuple[str, ...]) -> None:
    """Import user modules that register models, datasets, tasks... (`imports:` / --import).

    The working folder is searched for them after the installed packages (appended to sys.path, never
    put first) and only when a module is named, so a stray sklearn.py or torch.py there never shadows a
    library. An error inside the module is one line naming it (--debug shows the traceback).
    """
    if names and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of a user module is reported the same way
            raise UsageError(f"cannot import '{name}' (imports: / --import): {type(e).__name__}: {e}") from e


def load(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    imports: list[str] | tuple[str, ...] = (),
) -> Config:
    """Load a config file (or the defaults when `path` is None), apply dotted overrides, validate.

    The config's `imports:` and `imports` (--import) are imported first, so that names they register
    (a task, a loss...) validate; the returned config lists both.
    """
    data = read_with_extends(path) if path is not None else {}
    for item in overrides:
        data = apply_override(data, item)
    listed = data.get("imports") if isinstance(data.get("imports"), list) else []
    import_modules(list(dict.fromkeys(n for n in [*listed, *imports] if isinstance(n, str))))
    if imports:  # keep what the file lists as it is (validation reports a bad entry), then the flags' modules
        data["imports"] = (
            [*listed, *[m for m in imports if m not in listed]] if listed or "imports" not in data else data["imports"]
        )
    source = str(path) if path is not None else "defaults"
    if overrides:
        source += " + overrides"
    return validate(data, source)


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain JSON-able dict of a config (the resolved config written into the run folder)."""
    return cfg.model_dump(mode="json")


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def json_schema() -> dict[str, Any]:
    """JSON Schema of the config, for editor completion."""
    return Config.model_json_schema()

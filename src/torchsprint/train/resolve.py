"""The first phase of building a run: what the config leaves unset and the task, the data or the machine decide.

`config.load` only reads and validates (files, overrides, the schema); this phase does the rest, before anything is
built and before config.yaml is written, so every choice lands in config.yaml and decisions.json:
- the task's default loss and checkpoint.monitor/mode (tasks/core.py `apply_defaults`), where the config sets none;
- for a `data.root`: the dataset its files are and the defaults that fit its images (data/detect.py), including how a
  model on photos starts (models/start.py `photo_start`: the weights cache, and the network where allowed).

Every command that builds a run from a user's config calls `resolve` first (train, lr-find, bench, data check and
compare, `config show --resolved`); a config resolved once is not resolved again (the scan of data.root runs once).
"""

from __future__ import annotations

from torchsprint.config.schema import Config
from torchsprint.data.detect import resolve as data_defaults
from torchsprint.models.start import photo_start
from torchsprint.tasks.core import apply_defaults


def resolve(cfg: Config, *, weights: bool = True) -> Config:
    """Fill `cfg` in place with the task's and the data's defaults, record each data choice (`cfg.chosen()`), and
    return it. A no-op for a config already resolved. weights=False: the data's defaults only, never how a model
    starts (no weights cache, no network: `data cache` needs the transforms alone)."""
    if cfg.resolved:
        return cfg
    apply_defaults(cfg)
    # Only with a data.root: the default run (digits) never scans files. A saved run's config has every setting set,
    # so detection finds nothing left to choose.
    if cfg.data.root is not None:
        cfg.record_chosen([c.as_dict() for c in data_defaults(cfg, photo_start if weights else None)])
    cfg.mark_resolved()
    return cfg

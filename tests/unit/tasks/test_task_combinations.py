"""Every task x (backend, speed switch, export format, predict): it is supported, or refused with a UsageError naming
it."""

from __future__ import annotations

import pytest

from conftest import load_resolved
from torchsprint.errors import UsageError
from torchsprint.tasks.core import TASKS, get_task


@pytest.mark.parametrize("task", TASKS.names())
@pytest.mark.parametrize("backend", ["cpu", "memory", "gpu", "dali"])
def test_backend_supported_or_refused_by_name(task, backend):
    cfg = load_resolved(None, [f"task={task}", f"data.backend={backend}"])
    t = get_task(task)
    if t.backends is None or backend in t.backends:
        t.check(cfg)
    else:
        with pytest.raises(UsageError, match=rf"task={task} does not support data.backend={backend}"):
            t.check(cfg)


@pytest.mark.parametrize("task", TASKS.names())
@pytest.mark.parametrize("fmt", ["onnx", "safetensors", "torchscript", "tensorrt"])
def test_export_supported_or_refused_by_name(task, fmt):
    t = get_task(task)
    if fmt in t.export_formats:
        t.check_export(fmt)
    else:
        with pytest.raises(UsageError, match=rf"task={task}: export --format {fmt} is not supported"):
            t.check_export(fmt)


@pytest.mark.parametrize("task", TASKS.names())
def test_channels_last_and_predict(task):
    from torchsprint.commands.predict import Predictor

    t = get_task(task)
    cfg = load_resolved(None, [f"task={task}", "speed.channels_last=true"])
    if t.channels_last:
        t.check(cfg)
    else:
        with pytest.raises(UsageError, match="channels_last"):
            t.check(cfg)
    if "predict" in t.unsupported:
        with pytest.raises(UsageError, match=rf"task={task}: predict is not supported"):
            Predictor(lambda x: x, ["a"], 3, [], cfg.data, None, task=task)


@pytest.mark.parametrize("task", TASKS.names())
def test_defaults_name_a_metric_the_task_reports(task):
    cfg = load_resolved(None, [f"task={task}"])
    assert cfg.checkpoint.monitor.startswith("val/") and cfg.checkpoint.mode in ("max", "min")
    assert cfg.loss.name == get_task(task).loss

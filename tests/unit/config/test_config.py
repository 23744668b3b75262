"""Config: three formats, extends, overrides, and every user error with a clear message."""

import json

import pytest

from torchsprint import config
from torchsprint.errors import UsageError

YAML = "run:\n  epochs: 3\n  name: y\noptim:\n  lr: 0.05\n"
JSON = json.dumps({"run": {"epochs": 3, "name": "y"}, "optim": {"lr": 0.05}})
TOML = "[run]\nepochs = 3\nname = 'y'\n[optim]\nlr = 0.05\n"


@pytest.mark.parametrize("suffix,text", [(".yaml", YAML), (".yml", YAML), (".json", JSON), (".toml", TOML)])
def test_formats_load_the_same(tmp_path, suffix, text):
    p = tmp_path / f"run{suffix}"
    p.write_text(text)
    cfg = config.load(p)
    assert (cfg.run.epochs, cfg.run.name, cfg.optim.lr) == (3, "y", 0.05)
    assert cfg.model.name == "small_cnn"  # untouched defaults stay


def test_extends_merges_deeply_and_child_wins(tmp_path):
    (tmp_path / "base.toml").write_text("[optim]\nlr = 0.1\nmomentum = 0.8\n[run]\nepochs = 7\n")
    (tmp_path / "stage2.yaml").write_text("extends: base.toml\noptim: {lr: 0.01}\n")
    cfg = config.load(tmp_path / "stage2.yaml")
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.run.epochs) == (0.01, 0.8, 7)


def test_extends_chain_and_list(tmp_path):
    (tmp_path / "a.json").write_text('{"run": {"seed": 5}}')
    (tmp_path / "b.yaml").write_text("extends: a.json\nrun: {epochs: 2}\n")
    (tmp_path / "c.yaml").write_text("extends: [b.yaml]\noptim: {name: adamw}\n")
    cfg = config.load(tmp_path / "c.yaml")
    assert (cfg.run.seed, cfg.run.epochs, cfg.optim.name) == (5, 2, "adamw")


def test_overrides_are_typed():
    cfg = config.load(
        None,
        [
            "optim.lr=0.05",
            "run.epochs=3",
            "model.args={width: 8}",
            "sched.milestones=[1, 2]",
            "precision=O1",
            "data.train.transforms=[hflip]",
        ],
    )
    assert cfg.optim.lr == 0.05 and cfg.run.epochs == 3 and cfg.model.args == {"width": 8}
    assert cfg.sched.milestones == [1, 2] and cfg.precision.mode == "amp_fp16"
    assert cfg.data.train.transforms == ["hflip"]


def test_precision_and_strategy_shorthands(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("precision: O2\nstrategy: ddp\n")
    cfg = config.load(p, ["precision.on_nonfinite=stop"])
    assert cfg.precision.mode == "fp16" and cfg.precision.on_nonfinite == "stop" and cfg.strategy.name == "ddp"


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(None, ["optim.lr=0.02", "run.name=rt"])
    p = tmp_path / "resolved.yaml"
    p.write_text(config.dump_yaml(cfg))
    assert config.load(p) == cfg


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, config.BaseModel):
                walk(sub, f"{prefix}{name}.")

    walk(config.Config)
    schema = config.json_schema()
    assert "properties" in schema and "optim" in schema["properties"]


# ---------------------------------------------------------------- errors


def error(fn, *a):
    with pytest.raises(UsageError) as e:
        fn(*a)
    return str(e.value)


def test_missing_file(tmp_path):
    msg = error(config.load, tmp_path / "nope.yaml")
    assert "not found" in msg and "nope.yaml" in msg


@pytest.mark.parametrize(
    "suffix,text,line",
    [
        (".yaml", "run:\n  epochs: 3\n optim: [\n", 3),
        (".json", '{"run": {"epochs": 3,}}', 1),
        (".toml", "[run]\nepochs = = 3\n", 2),
    ],
)
def test_syntax_errors_name_the_line(tmp_path, suffix, text, line):
    p = tmp_path / f"bad{suffix}"
    p.write_text(text)
    msg = error(config.load, p)
    assert str(p) in msg and f"line {line}" in msg


def test_unknown_key_suggests_closest(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("optim:\n  lrr: 0.1\n")
    msg = error(config.load, p)
    assert "optim.lrr" in msg and "optim.lr" in msg and "unknown key" in msg


def test_unknown_section_suggests_closest(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("optimizer:\n  lr: 0.1\n")
    assert "optim" in error(config.load, p)


def test_unknown_override_key():
    msg = error(config.load, None, ["optim.lrr=0.1"])
    assert "optim.lrr" in msg and "Did you mean: optim.lr" in msg


def test_override_without_equals():
    assert "key=value" in error(config.load, None, ["optim.lr"])


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("optim.lr=-1", "optim.lr"),
        ("run.epochs=abc", "run.epochs"),
        ("run.epochs=0", "greater than or equal"),
        ("precision=fp8", "precision.mode"),
        ("data.on_bad_sample=maybe", "data.on_bad_sample"),
    ],
)
def test_wrong_type_or_range(override, fragment):
    msg = error(config.load, None, [override])
    assert fragment in msg and "invalid config" in msg


def test_extends_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    msg = error(config.load, tmp_path / "a.yaml")
    assert "cycle" in msg and "a.yaml" in msg and "b.yaml" in msg


def test_top_level_must_be_mapping(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("- 1\n- 2\n")
    assert "mapping" in error(config.load, p)


def test_load_is_pure_and_resolve_is_the_phase_that_reads_the_data(tmp_path, monkeypatch):
    """`config.load` reads the config's files and overrides only: no scan of data.root, no weights cache, no socket,
    nothing written into its own sections; train/resolve.py's `resolve` is where the folder is read and the choices
    recorded, once. Fails if a validator of the schema calls detection or the weights lookup again (the audit hook
    sees the folder listed, or a socket opened), or if resolve forgets to record what it chose."""
    import sys

    from conftest import make_image_folder
    from torchsprint.train.resolve import resolve

    root = make_image_folder(tmp_path / "photos", size=(160, 120))  # photo-sized: the photo defaults run too
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # an empty cache: the lookup would try the network
    monkeypatch.setenv("TORCHSPRINT_OFFLINE", "1")  # ...and is told not to, where resolve runs below
    events: list[tuple[str, str]] = []
    watching = [True]

    def hook(event, args):
        if not watching[0]:
            return
        if event in ("open", "os.listdir", "os.scandir") and args and str(root) in str(args[0]):
            events.append((event, str(args[0])))
        elif event in ("os.listdir", "os.scandir", "open") and args and str(tmp_path / "torch") in str(args[0]):
            events.append((event, str(args[0])))
        elif event.startswith("socket.") and event != "socket.__new__":
            events.append((event, str(args)))

    sys.addaudithook(hook)  # cannot be removed: `watching` switches it off at the end
    try:
        cfg = config.load(None, [f"data.root={root}"])
        assert events == []
        assert cfg.chosen() == [] and not cfg.resolved
        assert "dataset" not in cfg.data.model_fields_set and cfg.data.dataset == config.DataConfig().dataset
        again = resolve(cfg)
        assert again is cfg and cfg.resolved
        assert any(str(root) in path for _, path in events)  # the phase read the folder
        assert cfg.data.dataset == "image_folder"
        chosen = {c["setting"]: c for c in cfg.chosen()}
        assert chosen["data.dataset"]["value"] == "image_folder" and chosen["data.dataset"]["why"].startswith(
            "detected"
        )
        seen = len(events)
        resolve(cfg)  # once per config: a second call reads nothing
        assert len(events) == seen
    finally:
        watching[0] = False


def test_an_unknown_task_is_refused_by_the_resolve_phase():
    """config.load cannot know the task registry (config sits below tasks/); the phase before any run refuses it in
    one line with the closest name. Fails if an unknown task name reached a run."""
    from torchsprint.train.resolve import resolve

    cfg = config.load(None, ["task=multilabl"])
    with pytest.raises(UsageError, match="multilabel"):
        resolve(cfg)

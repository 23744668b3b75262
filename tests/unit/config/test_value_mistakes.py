"""Values taken for what they are not: each is refused in one line naming the setting, or said at start-up.
Bugs caught (c32f344): booleans read as numbers (run.max_time=true a 1-second budget, run.epochs=true 1 epoch,
optim.lr=true 1.0); data.effective_batch_size=2048 accepted on 1,437 training images; data.progressive.start_size=1
blamed the eval batches' size; data.sampler=balanced accepted a class with no training image; model.freeze_epochs
>= run.epochs promised an unfreeze that never came; `data shard SRC SRC` wrote shards among the images; a class of
2 images among 100 got no validation image and nothing said so. The real CLI runs in this process."""

from __future__ import annotations

import pytest

from conftest import make_image_folder
from torchsprint import config

FAST = ["run.epochs=1", "log.tensorboard=false", "log.progress=false", "model.args={width: 4}"]


def refused(r, *fragments) -> str:
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in errors[0], (f, errors[0])
    return errors[0]


def numeric_fields() -> list[tuple[str, str]]:
    """(dotted key, a value holding `true` where a number is meant) of every number field of the schema, read from
    its JSON Schema (not from the validator under test): a field whose types include integer or number but not
    boolean, and lists and tuples of numbers (optim.betas, sched.milestones)."""
    schema = config.Config.model_json_schema()
    defs = schema.get("$defs", {})

    def resolve(s):
        return defs[s["$ref"].split("/")[-1]] if "$ref" in s else s

    def types(s) -> set[str]:
        s = resolve(s)
        out = {s["type"]} if isinstance(s.get("type"), str) else set(s.get("type", []))
        out |= {
            {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(v), "null")
            for v in s.get("enum", []) + ([s["const"]] if "const" in s else [])
        }
        for member in s.get("anyOf", []) + s.get("oneOf", []):
            out |= types(member)
        return out

    def numbers(ts):
        return bool(ts & {"integer", "number"}) and "boolean" not in ts

    found = []

    def walk(s, prefix):
        for name, prop in resolve(s).get("properties", {}).items():
            key, target = f"{prefix}{name}", resolve(prop)
            if "properties" in target:
                walk(target, key + ".")
            elif numbers(types(prop)):
                found.append((key, "true"))
            else:
                for member in [prop, *prop.get("anyOf", [])]:
                    member = resolve(member)
                    items = member.get("prefixItems") or ([member["items"]] if "items" in member else [])
                    if member.get("type") == "array" and items and all(numbers(types(i)) for i in items):
                        found.append((key, "[" + ", ".join(["true", *["0.5"] * (len(items) - 1)]) + "]"))
                        break

    walk(schema, "")
    return found


NUMERIC = numeric_fields()


def test_the_schema_walk_finds_the_number_fields():
    keys = {k for k, _ in NUMERIC}
    assert {
        "run.epochs",
        "run.max_time",
        "optim.lr",
        "optim.betas",
        "sched.milestones",
        "data.progressive.start_size",
        "data.batch_size",
        "data.max_file_mb",
        "swa.start",
    } <= keys, keys
    assert not keys & {"run.deterministic", "speed.channels_last", "log.csv"}  # booleans (or bool | 'auto') stay
    assert len(keys) >= 60, len(keys)


@pytest.mark.parametrize("key,value", NUMERIC, ids=[k for k, _ in NUMERIC])
def test_true_is_not_a_number(cli_in_process, key, value):
    line = refused(cli_in_process("config", "show", f"{key}={value}"), f"{key}:")
    assert "not true/false" in line or "(got True)" in line, line


def test_numbers_still_load_as_numbers(tmp_path, cli_in_process):
    """1 is a float's 1.0, YAML ints and floats load, and the booleans of flag fields stay booleans."""
    (tmp_path / "c.yaml").write_text(
        "optim: {lr: 1, betas: [0.9, 1]}\nsched: {milestones: [1, 2.5]}\nrun: {max_time: 90}\n"
        "speed: {channels_last: true}\nlog: {csv: false}\n"
    )
    r = cli_in_process("config", "show", "-c", tmp_path / "c.yaml")
    assert r.returncode == 0, r.stderr
    for text in ("lr: 1.0", "betas: [0.9, 1.0]", "milestones: [1.0, 2.5]", "max_time: 90", "channels_last: true"):
        assert text in r.stdout, text


def test_an_effective_batch_larger_than_the_training_set(tmp_path, cli_in_process):
    """Digits: 1,437 training images; 2048 made every optimizer step average an epoch's 1,408."""
    refused(
        cli_in_process("train", *FAST, "data.effective_batch_size=2048", f"run.dir={tmp_path / 'r'}"),
        "data.effective_batch_size=2048 is more than the 1,437 training images",
    )
    assert not (tmp_path / "r").exists()


def test_balanced_sampling_with_a_class_without_training_images(tmp_path, cli_in_process):
    """Integer labels 0 and 2 make three classes; class 1 has no image. loss.class_weights=auto refused it,
    data.sampler=balanced drew the other two and called it balanced."""
    root = make_image_folder(tmp_path / "imgs", per_class=4, splits=("train",))
    files = sorted((root / "train").rglob("*.jpg"))
    (tmp_path / "list.csv").write_text("".join(f"{p},{2 * (i % 2)}\n" for i, p in enumerate(files)))
    base = [
        *FAST,
        "data.dataset=file_list",
        f"data.root={tmp_path / 'list.csv'}",
        "data.val_fraction=0.5",
        "data.train.transforms=[resize: [16, 16]]",
        "data.eval.transforms=[resize: [16, 16]]",
    ]
    refused(
        cli_in_process("train", *base, "data.sampler=balanced", f"run.dir={tmp_path / 'r'}"),
        "data.sampler=balanced: class(es) ['1'] have no training images",
    )
    refused(
        cli_in_process("train", *base, "loss.class_weights=auto", f"run.dir={tmp_path / 'r2'}"),
        "class(es) ['1'] have no training images",
    )


@pytest.mark.parametrize("freeze,epochs", [(3, 3), (5, 2)])
def test_freeze_epochs_that_never_unfreeze(cli_in_process, freeze, epochs):
    refused(
        cli_in_process("config", "show", f"model.freeze_epochs={freeze}", f"run.epochs={epochs}"),
        f"model.freeze_epochs={freeze} is not below run.epochs={epochs}",
        "never be unfrozen",
    )
    assert cli_in_process("config", "show", "model.freeze_epochs=2", "run.epochs=3").returncode == 0


def test_shards_are_not_written_into_their_source(tmp_path, cli_in_process):
    pytest.importorskip("webdataset")
    root = make_image_folder(tmp_path / "imgs", per_class=2)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    refused(cli_in_process("data", "shard", root, root), "is SRC itself", "outside SRC")
    refused(cli_in_process("data", "shard", root, root / "shards"), "is inside SRC")
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


@pytest.mark.parametrize(
    ("model", "key", "value"),
    [
        ("resnet18", "zero_init_residual", "maybe"),
        ("resnet18", "zero_init_residual", 2),
        ("resnet18", "zero_init_residual", "false"),
        ("timm/resnet18", "zero_init_last", "no"),
        ("small_cnn", "width", 8.5),
        ("small_cnn", "width", True),
        ("small_cnn", "dropout", "0.1"),
    ],
)
def test_model_args_of_the_wrong_kind_are_refused(model, key, value):
    """torchvision tests `if zero_init_residual:`, so a string or 2 turned the zero init on without a word. A key the
    builder declares as a boolean (or a number) is read as one: the builder's own signature, or the library class
    that its **kwargs reach (ResNet.__init__). Bugs caught: no check (the model builds), a check of the builder's
    signature only (torchvision's **kwargs), truthiness instead of a type."""
    from torchsprint.errors import UsageError
    from torchsprint.models.core import build_model

    cfg = config.load(None, [f"model.name={model}"]).model
    cfg.args = {key: value}
    with pytest.raises(
        UsageError, match=rf"^model\.args\.{key}=.*: model '{model}' takes (a boolean|an integer|a number)"
    ):
        build_model(cfg, 3, 3)


def test_model_args_of_the_right_kind_still_reach_the_library():
    """The check must not refuse a real boolean or an int where a float is declared; zero_init_residual=True then does
    what torchvision says (each block's last BatchNorm weight at zero), False leaves it at one."""
    from torch import nn

    from torchsprint.models.core import build_model

    cfg = config.load(None, ["model.name=resnet18"]).model
    for on in (True, False):
        cfg.args = {"zero_init_residual": on}
        last_bn = build_model(cfg, 3, 3).layer1[0].bn2
        assert isinstance(last_bn, nn.BatchNorm2d) and float(last_bn.weight.abs().sum()) == (0.0 if on else 64.0)
    small = config.load(None, ["model.args={width: 8, dropout: 0}"]).model
    assert build_model(small, 3, 3) is not None

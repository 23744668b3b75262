"""Property-based: random overrides and malformed config files never end in a traceback.

`torchsprint config show` and the validation path of `torchsprint train` (--dry-run: everything is built
and checked, nothing is written) get hundreds of random dotted overrides (real keys, near-miss keys,
sections replaced by values, values of every YAML type and none) and malformed YAML/JSON/TOML files. Each
must exit 0 or 2, and a 2 must come with one 'error:' line and no traceback. main() runs in-process, so
an exception escaping it (what a user would see as a traceback) fails the test with that exception.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchsprint import cli, config

SECTIONS = {
    name: list(field.annotation.model_fields)
    for name, field in config.Config.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, config.Section)
}
TOP = list(config.Config.model_fields)
KEYS = [f"{s}.{k}" for s, ks in SECTIONS.items() for k in ks] + TOP

scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "inf",
            "-inf",
            "nan",
            "1e400",
            "[1, 2",
            "{a: 1}",
            "~",
            "''",
            "- x",
            "!!python/name:os.system",
            "[]",
            "{}",
            "0x10",
            "yes",
            "null",
        ]
    ),
)
value = st.recursive(
    scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def key_strategy():
    typo = st.builds(lambda k, i: k[:i] + k[i + 1 :], st.sampled_from(KEYS), st.integers(0, 6))
    deep = st.builds(
        lambda k, t: f"{k}.{t}", st.sampled_from(KEYS), st.text(alphabet="abcxyz_.", min_size=1, max_size=6)
    )
    return st.one_of(st.sampled_from(KEYS), typo, deep, st.text(max_size=10))


def render(v) -> str:
    """A value as the text after '=' (YAML flow for containers, raw strings as typed)."""
    import yaml

    if isinstance(v, str):
        return v
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").removesuffix("...").strip()


override = st.one_of(
    st.builds(lambda k, v: f"{k}={render(v)}", key_strategy(), value), st.text(max_size=20)
)  # no '=' at all, or '=' anywhere


def run_main(capsys, argv) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors exit 2 (and print usage, not a traceback)
        code = e.code
    return code, capsys.readouterr().err


def assert_clean(code, err, argv):
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2 and "usage:" not in err:
        assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, (argv, err)


FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(overrides=st.lists(override, max_size=4))
def test_config_show_with_random_overrides(capsys, overrides):
    argv = ["config", "show", *overrides]
    assert_clean(*run_main(capsys, argv), argv)


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    overrides=st.lists(
        st.one_of(
            override,
            st.builds(
                lambda k, v: f"{k}={v}",
                st.sampled_from(
                    [
                        "model.name",
                        "optim.name",
                        "sched.name",
                        "loss.name",
                        "data.backend",
                        "data.dataset",
                        "precision",
                        "strategy",
                    ]
                ),
                st.sampled_from(
                    [
                        "small_cnn",
                        "linear",
                        "sgd",
                        "adamw",
                        "cosine",
                        "onecycle",
                        "cross_entropy",
                        "mse",
                        "cpu",
                        "memory",
                        "gpu",
                        "dali",
                        "digits",
                        "image_folder",
                        "amp_bf16",
                        "fp16",
                        "dp",
                        "ddp",
                        "resnet19",
                        "",
                    ]
                ),
            ),
        ),
        max_size=4,
    )
)
def test_train_validation_path_with_random_overrides(capsys, tmp_path_factory, overrides):
    out = tmp_path_factory.mktemp("fuzz")
    argv = ["train", "--dry-run", *overrides, f"run.out_dir={out}", "run.dir=null"]
    assert_clean(*run_main(capsys, argv), argv)
    assert not any(out.iterdir()), "a dry run wrote into the output folder"


documents = st.one_of(
    st.text(max_size=200),
    st.builds(lambda d: __import__("json").dumps(d), st.dictionaries(st.sampled_from(TOP + ["x"]), value, max_size=4)),
    st.builds(
        lambda d: __import__("yaml").safe_dump(d), st.dictionaries(st.sampled_from(TOP + ["x"]), value, max_size=4)
    ),
    st.binary(max_size=100).map(lambda b: b.decode("latin-1")),
)


@FUZZ
@given(text=documents, suffix=st.sampled_from([".yaml", ".json", ".toml", ".yml", ".txt"]))
def test_config_show_with_malformed_files(capsys, tmp_path_factory, text, suffix):
    path = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    argv = ["config", "show", "-c", str(path)]
    assert_clean(*run_main(capsys, argv), argv)


def _deep(n: int, kind: str) -> str:
    return {
        "flow": "run: " + "[" * n + "]" * n,
        "json": '{"a": ' + "[" * n + "]" * n + "}",
        "block": "".join("  " * i + f"k{i}:\n" for i in range(n)),
        "toml": "x = " + "[" * n + "]" * n,
    }[kind]


raw_documents = st.one_of(
    st.binary(max_size=200),  # junk: not UTF-8, NUL bytes, a cut multi-byte sequence
    st.builds(
        lambda d, enc: __import__("yaml").safe_dump(d, allow_unicode=True).encode(enc, errors="replace"),
        st.dictionaries(st.sampled_from(TOP + ["x"]), value, max_size=4),
        st.sampled_from(["latin-1", "utf-16", "cp1252"]),
    ),
    st.builds(
        lambda n, kind: _deep(n, kind).encode(),
        st.sampled_from([50, 101, 400, 1200, 5000]),
        st.sampled_from(["flow", "json", "block", "toml"]),
    ),
    st.builds(
        lambda k, a, b: f"{k}: {render(a)}\n{k}: {render(b)}\n".encode(), st.sampled_from(TOP), value, value
    ),  # a key twice
    st.builds(lambda v: f"extends: {render(v)}\n".encode(), value),  # extends of every type
    st.builds(
        lambda t, cut: t[:cut],
        st.sampled_from([b"run:\n  name: caf\xc3\xa9\n", b'{"optim": {"lr": 0.1}}']),
        st.integers(0, 24),
    ),  # cut anywhere, also inside a UTF-8 sequence
)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@given(raw=raw_documents, suffix=st.sampled_from([".yaml", ".json", ".toml"]))
def test_config_show_with_damaged_bytes(capsys, tmp_path_factory, raw, suffix):
    """Bytes as a damaged or foreign file holds them (the test above writes only valid UTF-8): not UTF-8,
    nested past Python's recursion limit, a key written twice, `extends` of any type, cut anywhere."""
    path = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    path.write_bytes(raw)
    argv = ["config", "show", "-c", str(path)]
    assert_clean(*run_main(capsys, argv), argv)

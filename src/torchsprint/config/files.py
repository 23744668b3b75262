"""Config files as raw dicts: YAML/JSON/TOML read strictly (a key twice, nesting too deep, bytes that are not
UTF-8: one line each), `extends` chains merged, and `a.b.c=value` overrides checked against a schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from torchsprint.errors import UsageError, did_you_mean

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# Deeper than any real config (the schema nests 3 levels; options dicts a few more), shallow enough that
# merging, validation and `config show`'s dump never reach Python's recursion limit (1000 frames).
MAX_DEPTH = 100
# More values (dict entries, list items) than any real config holds (the default config has 179): a YAML file whose
# aliases repeat a list inside a list (9 aliases of 9, 9 levels: ~390 million values from 90 lines) would otherwise
# hang validating and dumping it. Counted with the depth, so the count stops at the limit, never expanding the rest.
MAX_VALUES = 100_000


class _DuplicateKey(Exception):
    """A key written twice in one mapping: (key, line of the repeat or None, line of the first or None)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last one silently).

    Keys brought in by a `<<: *anchor` merge may be overridden: that is what a merge key is for.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue  # merges are resolved by flatten_mapping; a non-scalar key is refused by PyYAML itself
                key = self.construct_object(key_node)
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _unique_json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a dict, refusing a key written twice (json.loads keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k, None, None)
        out[k] = v
    return out


def _shape_problem(data: Any, limit: int = MAX_DEPTH, most: int = MAX_VALUES) -> str | None:
    """Why dicts/lists of `data` cannot be a config: nested deeper than `limit`, or more than `most` values in all
    (iterative and bounded, so a cyclic or exponential YAML alias ends at a limit too); None when neither."""
    stack, count = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return f"nested too deeply (over {MAX_DEPTH} levels of lists/mappings); a config nests a few levels."
            count += len(node)
            if count > most:
                return (
                    f"holds over {most:,} values once its YAML aliases (*name) are expanded; a config holds a few "
                    "hundred. Write the values out, or repeat fewer aliases."
                )
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return None


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse one YAML/JSON/TOML file into a dict; syntax errors name the file and line.

    Refused, each in one line: a file that is not UTF-8, a key written twice in one mapping (YAML and JSON
    keep the last one silently; TOML refuses it itself), nesting deeper than MAX_DEPTH, more than MAX_VALUES
    values (YAML aliases expanded).
    """
    path = Path(path)
    try:
        if not path.is_file():
            raise UsageError(f"config file not found: {path}. Pass an existing .yaml, .json or .toml file with -c.")
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the config file {path}: {e.strerror or e}.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UsageError(
            f"{path}: line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; config files are read as UTF-8 "
            "(re-save it as UTF-8, e.g. iconv -f latin1 -t utf-8)."
        ) from None
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_json_pairs)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise UsageError(f"{path}: unsupported config format '{suffix}'. Use .yaml, .yml, .json or .toml.")
    except _DuplicateKey as e:
        key, line, first = e.args
        where = f" line {line}:" if line else ""
        also = f" (first on line {first})" if first else ""
        raise UsageError(
            f"{path}:{where} key {key!r} is written twice in one mapping{also}; only one value can "
            "hold. Remove the other."
        ) from None
    except RecursionError:
        raise UsageError(
            f"{path}: nested too deeply to read (hundreds of levels of lists/mappings; a config nests a few)."
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}:{where}: YAML syntax error: {getattr(e, 'problem', e)}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: line {e.lineno}, column {e.colno}: JSON syntax error: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: TOML syntax error: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: the top level must be a mapping of sections (run:, data:, ...), not {type(data).__name__}."
        )
    if (problem := _shape_problem(data)) is not None:
        raise UsageError(f"{path}: {problem}")
    return data


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, recursing into nested dicts (lists and scalars are replaced)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_with_extends(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config and the files it `extends` (relative to itself), the child's keys winning."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise UsageError(f"`extends` cycle: {cycle}. Remove one of these `extends` keys.")
    data = read_file(path)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) and p for p in parents):
        raise UsageError(
            f"{path}: `extends` must be a file name or a list of file names (relative to this file), not {parents!r}."
        )
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, read_with_extends(path.parent / parent, (*_chain, path)))
    return deep_merge(merged, data)


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _sub_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The section model behind `model.key`, or None when the field is free-form (dict, scalar)."""
    ann = model.model_fields[key].annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def apply_override(data: dict[str, Any], item: str, root: type[BaseModel]) -> dict[str, Any]:
    """Apply one `a.b.c=value` to the raw dict; the key must exist in the schema `root` (the run schema)."""
    if "=" not in item:
        raise UsageError(f"override '{item}' must look like key=value, e.g. optim.lr=0.05")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    model: type[BaseModel] | None = root
    node = data
    for i, part in enumerate(parts):
        if model is not None:
            names = _field_names(model)
            if part not in names:
                prefix = ".".join(parts[:i])
                full = [f"{prefix}.{n}" if prefix else n for n in names]
                raise UsageError(f"override '{key}': unknown key.{did_you_mean(key, full)}")
        if i == len(parts) - 1:
            break
        sub = node.get(part)
        if not isinstance(sub, dict | str | None):
            where = ".".join(parts[: i + 1])
            raise UsageError(
                f"override '{item}': {where} is a section, but it was set to {sub!r}. Set its keys "
                f"({where}.<key>=value) instead of the whole section."
            )
        if not isinstance(sub, dict):
            sub = {} if sub is None or isinstance(sub, str) else sub
            if isinstance(node.get(part), str) and model is not None:
                # `precision: amp_bf16` shorthand followed by `precision.on_nonfinite=stop`.
                first = next(iter(_sub_model(model, part).model_fields))
                sub = {first: node[part]}
            node[part] = sub
        node = sub
        model = _sub_model(model, part) if model is not None else None
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node[parts[-1]] = value
    return data

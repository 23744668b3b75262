"""Reading settings sections: what the schema would have given, to tell a value the user set from none."""

from __future__ import annotations


def default_of(section, field: str):
    """The schema's default of `section.field` (default factories called), to tell a set value from none."""
    value = type(section).model_fields[field].get_default(call_default_factory=True)
    return tuple(value) if isinstance(getattr(section, field), tuple) and isinstance(value, list) else value

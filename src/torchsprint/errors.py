"""Errors a user can fix: the CLI prints them without a traceback and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(Exception):
    """Bad input from the user (config, names, paths). Printed as-is; exit code 2."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The registered names closest to `name`, best first (case-insensitive)."""
    candidates = list(candidates)
    lower = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(name.lower(), list(lower), n=n, cutoff=0.5)
    # Substring hits catch "resnet" -> "resnet18" that ratio-based matching ranks low.
    subs = [c for c in candidates if name.lower() in c.lower() and lower.get(c.lower()) not in hits]
    return [lower[h] for h in hits] + sorted(subs, key=len)[: max(0, n - len(hits))]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' Did you mean: a, b?' or '' when nothing is close."""
    hits = closest(name, candidates)
    return f" Did you mean: {', '.join(hits)}?" if hits else ""

"""Statistics over seeds: mean and spread, Welch's comparison of two sides' means, strict JSON of the figures
(numerics/backend_agreement.py, numerics/bf16_parity.py)."""

from __future__ import annotations

import math
import statistics


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for one value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def compare(results: dict[str, list[float]]) -> list[dict]:
    """Each pair of sides: difference of means against its standard error (Welch), |t| > 2.78 (the
    two-sided 5% point of t with 4 degrees of freedom, the fewest 5 + 5 seeds can have) flags it."""
    rows, names = [], list(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (ma, sa), (mb, sb) = mean_std(results[a]), mean_std(results[b])
            se = math.sqrt(sa**2 / len(results[a]) + sb**2 / len(results[b])) if len(results[a]) > 1 else float("nan")
            t = (ma - mb) / se if se > 0 else (0.0 if ma == mb else float("inf"))
            rows.append({"a": a, "b": b, "diff": ma - mb, "se": se, "t": t, "beyond_spread": abs(t) > 2.78})
    return rows


def strict(obj):
    """`obj` with non-finite floats (the std of one seed, the t of equal means) as None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict(v) for v in obj]
    return obj

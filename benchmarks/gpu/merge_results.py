"""Merge the results.json of several run_all.sh calls into the one file committed under benchmarks/results/.

    python -m benchmarks.gpu.merge_results call1/results.json call2/results.json call3/results.json \\
        -o benchmarks/results/measure_<device>_<date>.json

device, torch, cuda and the other environment fields come from the first file (all calls must report the
same device and torch, else it stops); measurements are merged key by key at every depth (run_all.sh dali
adds M2's DALI figure and M3's by_backend.dali to an earlier call's M2 and M3), later calls winning except
that a missing figure (None) never replaces a measured one; tests and figures are merged; `command` lists
every call's command. M2["fastest_backend"] (the backend of M2["by_backend"] with the most images/s: the figure
data.backend: auto's rule reads for a folder of JPEGs) is set here, from every call's figures together.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ENV = ("device", "torch", "cuda", "torchvision", "cudnn", "python", "cpu_count", "nvidia_smi", "git_revision")


def deep_merge(into: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        elif v is not None or into.get(k) is None:
            into[k] = v
    return into


def merge(parts: list[dict]) -> dict:
    out = {k: parts[0].get(k) for k in ENV if k in parts[0]}
    for p in parts[1:]:
        for k in ("device", "torch"):
            if p.get(k) and out.get(k) and p[k] != out[k]:
                sys.exit(f"results from different {k}s: {out[k]} vs {p[k]}; keep one device and torch per file")
    out["date"] = min(p["date"] for p in parts if p.get("date"))
    out["command"] = [c for p in parts for c in (p.get("commands") or ([p["command"]] if p.get("command") else []))]
    out["measurements"], out["tests"], out["figures"] = {}, {}, []
    for p in parts:
        deep_merge(out["measurements"], json.loads(json.dumps(p.get("measurements", {}))))
        out["tests"].update(p.get("tests", {}))
        out["figures"] += p.get("figures", [])
    m2 = out["measurements"].get("M2")
    if isinstance(m2, dict) and isinstance(m2.get("by_backend"), dict):
        # Only here, after the merge: DALI's figure comes from a later call than the cpu and gpu backends'.
        rates = {k: v for k, v in m2["by_backend"].items() if isinstance(v, (int, float))}
        m2["fastest_backend"] = max(rates, key=rates.get) if rates else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    merged = merge([json.loads(Path(f).read_text()) for f in args.files])
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out}: measurements {sorted(merged['measurements'])}, tests {sorted(merged['tests'])}")


if __name__ == "__main__":
    main()

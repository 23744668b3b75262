"""Merge the results.json of several run_all.sh calls into the one file committed under benchmarks/results/.

    python benchmarks/gpu/merge_results.py call1/results.json call2/results.json call3/results.json \\
        -o benchmarks/results/2026-11-24-h100.json

device, torch, cuda and the other environment fields come from the first file (all calls must report the
same device and torch, else it stops); measurements are merged key by key at every depth (run_all.sh dali
adds M2's DALI figure and M3's by_backend.dali to an earlier call's M2 and M3), later calls winning except
that a missing figure (None) never replaces a measured one; tests and figures are merged; `command` lists
every call's command.
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
    out["command"] = [p["command"] for p in parts if p.get("command")]
    out["measurements"], out["tests"], out["figures"] = {}, {}, []
    for p in parts:
        deep_merge(out["measurements"], json.loads(json.dumps(p.get("measurements", {}))))
        out["tests"].update(p.get("tests", {}))
        out["figures"] += p.get("figures", [])
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

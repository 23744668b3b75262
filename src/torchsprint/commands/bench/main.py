"""`torchsprint bench`: the speedup matrix. Each variant is the user's config plus one change, timed side by side.

Timing: warm-up steps excluded; GPU time from CUDA events recorded around the timed steps (one
synchronisation at the end, airbench's method), CPU time from a monotonic clock. Each variant is
repeated and reported as median with min-max. Variants that cannot run here are listed with the reason.

The pieces: commands/bench/variants.py (the matrix), commands/bench/measure.py (running and timing one variant in its
process), commands/bench/report.py (rows, best combination, bench.{json,csv,md,png}); import their names from them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torchsprint import config as config_mod
from torchsprint.commands.bench.measure import (
    _worker,
    measure,
    measure_variant,
    time_to_accuracy,
)
from torchsprint.commands.bench.report import (
    best_combination,
    device_name,
    keep_the_faster,
    print_table,
    summarize,
    write_outputs,
)
from torchsprint.commands.bench.variants import (
    Variant,
    _gpus,
    decodes_files,
    seeds_baseline,
    variants,
)
from torchsprint.errors import UsageError
from torchsprint.runtime.machine import cpu_info
from torchsprint.state.rundir import writable_file
from torchsprint.train.resolve import resolve


def bench(
    config_path: str | None,
    overrides: list[str],
    *,
    steps: int = 30,
    warmup: int = 5,
    repeats: int = 3,
    only: list[str] | None = None,
    to_accuracy: float | None = None,
    out: str | Path | None = None,
    isolate: bool = True,
    overwrite: bool = False,
) -> list[dict]:
    """Measure the matrix for a config; returns the rows and writes bench.{md,csv,json,png} into `out`.

    `isolate`: measure each variant in its own process (the CLI's way: memory figures are the variant's own,
    with its process tree's peak RSS). False measures in this process (the Python API for names registered
    here rather than through `imports:`); the tree memory column is then empty. An `out` given holding an earlier
    bench's files is refused unless `overwrite` (the CLI's --overwrite); the default bench/<timestamp> is new.
    """
    import torch

    user = resolve(config_mod.load(config_path, overrides))
    decodes = decodes_files(user)
    base_overrides = list(overrides) + seeds_baseline(decodes)
    keep = out is not None and not overwrite  # a run folder as --out: its config.yaml is the run's own, refused
    out = Path(out or Path("bench") / time.strftime("%Y%m%d-%H%M%S"))
    for target in (out, out / "config.yaml", *(out / f"bench.{x}" for x in ("json", "csv", "md", "png"))):
        writable_file(target, "--out", folder=target == out, overwrite=not keep)
    all_variants = variants(user, decodes)
    if only:
        names = {v.name for v in all_variants}
        unknown = [n for n in only if n not in names and n not in ("best", "your config")]
        if unknown:
            raise UsageError(f"--variants: unknown {unknown}; choose from {sorted(names | {'best', 'your config'})}")
        all_variants = [v for v in all_variants if v.name in only or v.name == "baseline (seeds)"]
    resolved = out / "config.yaml"
    resolved.write_text(config_mod.dump_yaml(user))

    def run_variant(v: Variant, extra: list[str]) -> None:
        cfg_over = base_overrides + extra
        try:
            cfg = resolve(config_mod.load(config_path, cfg_over))
            (out / "variants").mkdir(exist_ok=True)
            path = out / "variants" / f"{slug(v.name)}.yaml"
            path.write_text(config_mod.dump_yaml(cfg))
            if isolate or v.processes > 1:
                v.results = measure_variant(
                    path, steps, warmup, repeats, v.processes, out / "variants" / f".{slug(v.name)}.json"
                )
            else:
                v.results = [measure(cfg, steps, warmup) for _ in range(repeats)]
            if to_accuracy is not None:
                v.results[0]["time_to_accuracy_s"] = time_to_accuracy(cfg, to_accuracy, out / "runs" / slug(v.name))
        except (UsageError, RuntimeError, NotImplementedError, subprocess.TimeoutExpired) as e:
            v.skip = f"could not run here: {str(e).splitlines()[0][:200]}"
            v.results.clear()

    meta = {
        "config": config_path or "defaults (digits + small_cnn)",
        "overrides": list(overrides),
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device_name(),
        "cpu_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
    }
    base = next(v for v in all_variants if v.name == "baseline (seeds)")
    for i, v in enumerate(all_variants):
        if not v.skip:
            run_variant(v, v.overrides)
        # bench.json after every variant: a bench stopped midway (a caller's time limit) keeps what it measured
        base_ips = statistics.median(r["images_per_s"] for r in base.results) if base.results else None
        (out / "bench.json").write_text(
            json.dumps(
                {"meta": meta | {"partial": True}, "rows": [summarize(x, base_ips) for x in all_variants[: i + 1]]},
                indent=1,
            )
        )
    rows = [summarize(v, base_ips) for v in all_variants]
    if base_ips and (not only or "best" in only):
        best = best_combination(rows)
        v = Variant(
            "best combination",
            best,
            " + ".join(r["variant"][2:] for r in rows if r.get("overrides") and all(o in best for o in r["overrides"]))
            or "baseline",
        )
        run_variant(v, best)
        rows.append(keep_the_faster(summarize(v, base_ips), rows))
    if not only or "your config" in only:
        v = Variant("your config", [], "the config as given")
        try:
            procs = max(2, _gpus()) if user.strategy.name == "ddp" else 1
            if isolate or procs > 1:
                v.results = measure_variant(
                    resolved, steps, warmup, repeats, procs, out / "variants" / ".your_config.json"
                )
            else:
                v.results = [measure(user, steps, warmup) for _ in range(repeats)]
        except (UsageError, RuntimeError, subprocess.TimeoutExpired) as e:
            v.skip = f"could not run here: {str(e).splitlines()[0][:200]}"
        rows.append(summarize(v, base_ips))
    write_outputs(rows, out, meta)
    print_table(rows, meta)
    print(f"wrote {out}/bench.md, bench.csv, bench.json, bench.png")
    return rows


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def bench_cli(args) -> int:
    only = [s.strip() for s in args.variants.split(",")] if args.variants else None
    bench(
        args.config,
        args.overrides,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        only=only,
        to_accuracy=args.to_accuracy,
        out=args.out,
        overwrite=args.overwrite,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))

"""`torchsprint bench`: the speedup matrix. Each variant is the user's config plus one change, timed side by side.

Timing: warm-up steps excluded; GPU time from CUDA events recorded around the timed steps (one
synchronisation at the end, airbench's method), CPU time from a monotonic clock. Each variant is
repeated and reported as median with min-max. Variants that cannot run here are listed with the reason.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from torchsprint import config as config_mod
from torchsprint.errors import UsageError

INPUT_BOUND = 0.20  # data-wait share above which a variant is input-bound (same threshold as the training log)


@dataclass
class Variant:
    """One row of the matrix: a name, the overrides it applies to the baseline, and why it may not run here."""

    name: str
    overrides: list[str]
    what: str
    skip: str | None = None
    processes: int = 1  # > 1: measured under DDP with this many processes (torchrun)
    results: list[dict] = field(default_factory=list)


def _cuda():
    import torch

    return torch.cuda.is_available()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def decodes_files(cfg) -> bool:
    """Whether the dataset is image files decoded while loading (image_folder...) rather than already in memory
    (digits, CIFAR): the baseline's PIL decoder and the decoder choice only exist for the former."""
    from torchsprint.data import DATASETS

    return hasattr(DATASETS.get(cfg.data.dataset)(cfg.data).train, "samples")


def seeds_baseline(decodes: bool = True) -> list[str]:
    """The seeds' setup: fp32, a plain DataLoader (with PIL decoding when there are files), no speed switches
    (seed 004's loop). Backend-specific settings of the user's config are reset with the backend."""
    workers = min(8, os.cpu_count() or 1)  # seed 004 uses num_workers=8; never more than the cores here
    return ["precision.mode=fp32", "strategy.name=single", "data.backend=cpu", "data.cpu_fraction=0.0",
            "data.fallback=null", *(["data.decoder=pil"] if decodes else []),
            f"data.num_workers={workers}", "data.persistent_workers=false", "speed.channels_last=false",
            "speed.compile=false", "speed.cuda_graphs=false", "speed.cudnn_benchmark=false", "speed.tf32=false",
            "optim.impl=for_loop"]


def variants(cfg, decodes: bool = True) -> list[Variant]:
    """Every variant, in report order; each `skip` says why it cannot run on this machine. `decodes`: the
    dataset is files decoded while loading (see decodes_files); the rows say what they really do."""
    cuda, gpus = _cuda(), _gpus()
    no_gpu = "needs a CUDA GPU; none here"
    cores = os.cpu_count() or 1
    v = [
        Variant("baseline (seeds)", [], "fp32, plain DataLoader + PIL decoding, no switches" if decodes else
                "fp32, plain DataLoader over the in-memory images (nothing to decode), no switches"),
        Variant("+ tuned cpu loader", [*(["data.decoder=auto"] if decodes else []), "data.persistent_workers=true",
                                       f"data.num_workers={cores}"],
                "fastest installed decoder, persistent workers, one worker per core" if decodes else
                "persistent workers, one worker per core"),
        Variant("+ gpu loader", ["data.backend=gpu"], "nvJPEG decode + GPU augmentation", None if cuda else no_gpu),
        Variant("+ memory loader", ["data.backend=memory"], "decoded dataset on the device, batched augmentation"),
        Variant("+ dali", ["data.backend=dali"], "NVIDIA DALI pipeline",
                None if cuda and _has("nvidia.dali") else ("needs NVIDIA DALI (pip install torchsprint[dali]) and a GPU")),
        Variant("+ channels_last", ["speed.channels_last=true"], "NHWC memory format"),
        Variant("+ amp_bf16", ["precision.mode=amp_bf16"], "bfloat16 autocast"),
        Variant("+ amp_fp16", ["precision.mode=amp_fp16"], "float16 autocast + loss scaling",
                None if cuda else "fp16 autocast needs a CUDA GPU (on CPU use amp_bf16)"),
        Variant("+ compile", ["speed.compile=true"], "torch.compile"),
        Variant("+ cuda graphs", ["speed.cuda_graphs=true"], "CUDA graph of the train step", None if cuda else no_gpu),
        Variant("+ foreach optimizer", ["optim.impl=foreach"], "multi-tensor optimizer update"),
        Variant("+ dp", ["strategy.name=dp"], f"nn.DataParallel over {gpus} GPUs",
                None if gpus >= 2 else f"needs >= 2 GPUs; {gpus} here"),
    ]
    n = gpus if gpus >= 2 else (2 if not cuda and cores >= 2 else 0)
    v.append(Variant(f"+ ddp x{n or 2}", ["strategy.name=ddp"], f"DistributedDataParallel, {n or 2} processes",
                     None if n else "needs >= 2 GPUs (or a CPU-only machine with >= 2 cores)", processes=max(n, 2)))
    return v


def peak_memory_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) of this process
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory_mb(device) -> float | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure(cfg, steps: int, warmup: int) -> dict:
    """Time `steps` optimizer steps of `cfg` after `warmup` untimed ones, with the real engine step."""
    import torch

    from torchsprint import runtime
    from torchsprint.config import import_modules
    from torchsprint.engine import set_train_mode, train_step
    from torchsprint.run import build_training

    import_modules(cfg.imports)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        t_build = time.perf_counter()
        b = build_training(cfg, rt, log=lambda *_: None)
        build_s = time.perf_counter() - t_build
        set_train_mode(b.model, b.frozen_norms)
        epoch = [0]

        def batches():
            while True:
                b.loaders.train.set_epoch(epoch[0])
                yield from b.loaders.train
                epoch[0] += 1

        it = batches()
        accum = cfg.optim.accum_steps

        def one_step():
            t = time.perf_counter()
            micro = [next(it) for _ in range(accum)]
            wait = time.perf_counter() - t
            train_step(b.model, micro, b.loss_fn, b.opt, b.prec, cfg.optim.clip_grad_norm)
            return wait, sum(m[0].shape[0] for m in micro)

        for _ in range(warmup):
            one_step()
        cuda = rt.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(rt.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        peak_memory_reset(rt.device)
        wait = 0.0
        images = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            w, n = one_step()
            wait += w
            images += n
        if cuda:
            end.record()
            torch.cuda.synchronize(rt.device)  # note: the one sync point of the timed region
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = time.perf_counter() - t0
        images *= rt.world_size
        return {"images_per_s": images / seconds, "step_ms": 1000 * seconds / steps, "data_wait_share": wait / seconds,
                "peak_mem_mb": peak_memory_mb(rt.device), "build_s": build_s, "device": str(rt.device)}
    finally:
        runtime.teardown(rt)


def measure_ddp(config_path: Path, overrides: list[str], processes: int, steps: int, warmup: int, out: Path) -> dict:
    """Measure a DDP variant in `processes` worker processes through torchrun; rank 0 writes the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
           "-m", "torchsprint.bench", str(config_path), str(out), str(steps), str(warmup), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // processes)))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"ddp workers failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return json.loads(out.read_text())


def time_to_accuracy(cfg, target: float, folder: Path) -> float | None:
    """Seconds from the start of training until the monitored validation metric first reaches `target` (None: never).

    The metric is checkpoint.monitor, the task's by default (top-1, multilabel mAP, PSNR in dB), and
    "reaches" follows checkpoint.mode (>= for max, <= for min): val/top1 does not exist for every task.
    """
    from torchsprint.run import train

    cfg = cfg.model_copy(deep=True)
    cfg.run.dir = str(folder)
    cfg.log.tensorboard = False
    t0 = time.time()
    train(cfg, quiet=True)
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        value = row.get(cfg.checkpoint.monitor) if row["kind"] == "eval" else None
        if value is not None and (value >= target if cfg.checkpoint.mode == "max" else value <= target):
            return row["time"] - t0
    return None


def summarize(v: Variant, baseline_ips: float | None) -> dict:
    if v.skip:
        return {"variant": v.name, "what": v.what, "status": "skipped", "reason": v.skip}
    ips = [r["images_per_s"] for r in v.results]
    med = statistics.median(ips)
    share = statistics.median(r["data_wait_share"] for r in v.results)
    mem = [r["peak_mem_mb"] for r in v.results if r.get("peak_mem_mb") is not None]
    row = {
        "variant": v.name, "what": v.what, "status": "ok", "images_per_s": med, "images_per_s_min": min(ips),
        "images_per_s_max": max(ips), "step_ms": statistics.median(r["step_ms"] for r in v.results),
        "data_wait_share": share, "peak_mem_mb": max(mem) if mem else None,
        "bottleneck": "input-bound" if share > INPUT_BOUND else "compute-bound",
        "speedup": med / baseline_ips if baseline_ips else None, "overrides": v.overrides,
    }
    tta = [r["time_to_accuracy_s"] for r in v.results if "time_to_accuracy_s" in r]
    if tta:
        row["time_to_accuracy_s"] = tta[0]
    return row


COLUMNS = ["variant", "status", "images_per_s", "images_per_s_min", "images_per_s_max", "speedup", "step_ms",
           "data_wait_share", "bottleneck", "peak_mem_mb", "time_to_accuracy_s", "reason", "what"]


def write_outputs(rows: list[dict], out: Path, meta: dict) -> None:
    """bench.json (everything), bench.csv, bench.md and bench.png (speedup over the baseline)."""
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    lines = [f"# torchsprint bench: {meta['config']}", "",
             f"device: {meta['device']}; torch {meta['torch']}; {meta['steps']} timed steps after {meta['warmup']} warm-up, "
             f"{meta['repeats']} repeats (median, min-max); {meta['date']}", "",
             "| variant | images/s | speedup | step ms | data wait | bottleneck | peak MB | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | - | - | - | - | - | - | skipped: {r.get('reason', '')} |")
            continue
        tta = f"to-accuracy {r['time_to_accuracy_s']:.1f} s" if r.get("time_to_accuracy_s") is not None else ""
        lines.append(f"| {r['variant']} | {r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}) | "
                     f"{r['speedup']:.2f}x | {r['step_ms']:.2f} | {r['data_wait_share']:.0%} | {r['bottleneck']} | "
                     f"{r['peak_mem_mb']:.0f} | {tta} |" if r["peak_mem_mb"] is not None else
                     f"| {r['variant']} | {r['images_per_s']:.0f} | {r['speedup']:.2f}x | {r['step_ms']:.2f} | "
                     f"{r['data_wait_share']:.0%} | {r['bottleneck']} | - | {tta} |")
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r.get("speedup")]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(ok) + 1.2))
    ax.barh([r["variant"] for r in ok][::-1], [r["speedup"] for r in ok][::-1],
            color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in ok][::-1])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speedup over the seeds' baseline (images/s ratio)")
    ax.set_title(f"torchsprint bench on {meta['device']}")
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=100)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="torchsprint bench")
    for c in ("variant", "images/s (min-max)", "speedup", "step ms", "data wait", "bottleneck", "peak MB"):
        t.add_column(c)
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["variant"], f"[dim]skipped: {r['reason']}[/]", "", "", "", "", "")
            continue
        t.add_row(r["variant"], f"{r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f})",
                  f"{r['speedup']:.2f}x", f"{r['step_ms']:.2f}", f"{r['data_wait_share']:.0%}", r["bottleneck"],
                  f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "-")
    Console(soft_wrap=True).print(t)


def bench(config_path: str | None, overrides: list[str], *, steps: int = 30, warmup: int = 5, repeats: int = 3,
          only: list[str] | None = None, to_accuracy: float | None = None, out: str | Path | None = None) -> list[dict]:
    """Measure the matrix for a config; returns the rows and writes bench.{md,csv,json,png} into `out`."""
    import torch

    user = config_mod.load(config_path, overrides)
    decodes = decodes_files(user)
    base_overrides = list(overrides) + seeds_baseline(decodes)
    out = Path(out or Path("bench") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
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
            cfg = config_mod.load(config_path, cfg_over)
            (out / "variants").mkdir(exist_ok=True)
            (out / "variants" / f"{slug(v.name)}.yaml").write_text(config_mod.dump_yaml(cfg))
            for i in range(repeats):
                if v.processes > 1:
                    res = measure_ddp(resolved, seeds_baseline(decodes) + extra, v.processes, steps, warmup, out / f".{slug(v.name)}-{i}.json")
                else:
                    res = measure(cfg, steps, warmup)
                v.results.append(res)
            if to_accuracy is not None:
                v.results[0]["time_to_accuracy_s"] = time_to_accuracy(cfg, to_accuracy, out / "runs" / slug(v.name))
        except (UsageError, RuntimeError, NotImplementedError, subprocess.TimeoutExpired) as e:
            v.skip = f"could not run here: {str(e).splitlines()[0][:200]}"
            v.results.clear()

    for v in all_variants:
        if not v.skip:
            run_variant(v, v.overrides)
    base = next(v for v in all_variants if v.name == "baseline (seeds)")
    base_ips = statistics.median(r["images_per_s"] for r in base.results) if base.results else None
    rows = [summarize(v, base_ips) for v in all_variants]
    if base_ips and (not only or "best" in only):
        best = best_combination(rows)
        v = Variant("best combination", best, " + ".join(r["variant"][2:] for r in rows if r.get("overrides") and
                                                         all(o in best for o in r["overrides"])) or "baseline")
        run_variant(v, best)
        rows.append(summarize(v, base_ips))
    if not only or "your config" in only:
        v = Variant("your config", [], "the config as given")
        try:
            v.results = [measure(user, steps, warmup) for _ in range(repeats)]
        except (UsageError, RuntimeError) as e:
            v.skip = f"could not run here: {e}"
        rows.append(summarize(v, base_ips))
    meta = {"config": config_path or "defaults (digits + small_cnn)", "overrides": list(overrides), "steps": steps,
            "warmup": warmup, "repeats": repeats, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": device_name(), "cpu_threads": torch.get_num_threads()}
    write_outputs(rows, out, meta)
    print_table(rows)
    print(f"wrote {out}/bench.md, bench.csv, bench.json, bench.png")
    return rows


def best_combination(rows: list[dict]) -> list[str]:
    """The fastest data backend plus every non-data switch that beat the baseline by more than 3%."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("overrides") and r["speedup"] is not None]
    data = [r for r in ok if any(o.startswith("data.") for o in r["overrides"])]
    other = [r for r in ok if r not in data and r["speedup"] > 1.03 and not any(o.startswith("strategy.") for o in r["overrides"])]
    chosen = []
    if data:
        top = max(data, key=lambda r: r["speedup"])
        if top["speedup"] > 1.03:
            chosen += top["overrides"]
    precisions = [r for r in other if any(o.startswith("precision.") for o in r["overrides"])]
    for r in other:
        if r in precisions and r is not max(precisions, key=lambda r: r["speedup"]):
            continue  # one precision mode only
        chosen += r["overrides"]
    return chosen


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def bench_cli(args) -> int:
    only = [s.strip() for s in args.variants.split(",")] if args.variants else None
    bench(args.config, args.overrides, steps=args.steps, warmup=args.warmup, repeats=args.repeats, only=only,
          to_accuracy=args.to_accuracy, out=args.out)
    return 0


def _ddp_worker(argv: list[str]) -> None:
    """Entry point of one DDP bench worker (launched by measure_ddp through torchrun)."""
    config_path, out, steps, warmup, *overrides = argv
    cfg = config_mod.load(config_path, overrides)
    res = measure(cfg, int(steps), int(warmup))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    _ddp_worker(sys.argv[1:])

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
        Variant("+ gpu loader", ["data.backend=gpu"], "nvJPEG decode + GPU augmentation",
                None if cuda and decodes else no_gpu if not cuda else "decodes image files; this dataset is in memory"),
        Variant("+ memory loader", ["data.backend=memory"], "decoded dataset on the device, batched augmentation"),
        Variant("+ dali", ["data.backend=dali"], "NVIDIA DALI pipeline",
                None if cuda and _has("nvidia.dali") else ("needs NVIDIA DALI (pip install torchsprint[dali]) and a GPU")),
        Variant("+ tf32 + cudnn autotune", ["speed.tf32=true", "speed.cudnn_benchmark=true"],
                "TF32 matrix products and convolutions, cuDNN algorithm search (torchsprint's defaults on CUDA)",
                None if cuda else "CUDA-only switches"),
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
        cfg = b.cfg  # data.batch_size=auto / effective_batch_size resolved
        build_s = time.perf_counter() - t_build
        set_train_mode(b.model, b.frozen_norms)
        epoch = [0]

        def batches():
            while True:
                b.loaders.train.set_epoch(epoch[0])
                yield from b.loaders.train
                epoch[0] += 1

        it = batches()
        accum = b.plan.accum_steps
        done = [0]  # optimizer steps so far (the EMA's update count)

        def one_step():
            t = time.perf_counter()
            micro = [next(it) for _ in range(accum)]
            wait = time.perf_counter() - t
            train_step(b.model, micro, b.loss_fn, b.opt, b.prec, b.plan.clip_grad_norm)
            done[0] += 1
            b.ema.update(done[0])  # what training pays for ema.enabled (a no-op object when off)
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


class TreeRss:
    """Peak resident memory (MB) of a process and all its descendants (DataLoader workers, DDP ranks), sampled
    every `interval_s` from the parent by a thread reading /proc (Linux; None elsewhere). Sampling from
    outside keeps the measured process undisturbed; what it misses is a spike shorter than the interval."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        import threading

        self.pid, self.interval_s, self.peak_kb = pid, interval_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                try:
                    todo += [int(c) for c in task.read_text().split()]
                except OSError:
                    pass
        return out

    @staticmethod
    def _rss_kb(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(self._rss_kb(p) for p in self._tree(self.pid))
            self.peak_kb = max(self.peak_kb or 0, total) if total else self.peak_kb
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if Path(f"/proc/{self.pid}/status").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def peak_mb(self) -> float | None:
        return None if self.peak_kb is None else self.peak_kb / 1024


def measure_variant(config_path: Path, steps: int, warmup: int, repeats: int, processes: int, out: Path) -> list[dict]:
    """Measure one variant `repeats` times in its own process (or `processes` DDP processes through torchrun):
    its memory is its own (no allocator state or caches from the variants before it), and the peak RSS of
    the whole process tree is sampled from here. Returns rank 0's per-repeat results, each with
    peak_tree_mb (the variant's lifetime peak, data loading included)."""
    worker = ["-m", "torchsprint.bench", str(config_path), str(out), str(steps), str(warmup), str(repeats)]
    env = dict(os.environ)
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *worker]
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    else:
        cmd = [sys.executable, *worker]
    out.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    with TreeRss(proc.pid) as rss:
        try:
            _, err = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    out.with_suffix(".log").write_text(err)  # the variant's own output, kept beside its config
    if proc.returncode != 0 or not out.is_file():
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
        if lines:  # a UsageError: its one-line message
            raise RuntimeError(lines[-1].removeprefix("error: "))
        last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
        # A crash: its last line in the row too, so the reason travels with bench.json (the log may not).
        raise RuntimeError(f"exit code {proc.returncode}: {last[:300]} (full log: {out.with_suffix('.log')})")
    results = json.loads(out.read_text())
    for r in results:
        r["peak_tree_mb"] = rss.peak_mb
    return results


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
    tree = [r["peak_tree_mb"] for r in v.results if r.get("peak_tree_mb") is not None]
    row = {
        "variant": v.name, "what": v.what, "status": "ok", "images_per_s": med, "images_per_s_min": min(ips),
        "images_per_s_max": max(ips), "step_ms": statistics.median(r["step_ms"] for r in v.results),
        "data_wait_share": share, "peak_mem_mb": max(mem) if mem else None, "peak_tree_mb": max(tree) if tree else None,
        "bottleneck": "input-bound" if share > INPUT_BOUND else "compute-bound",
        "speedup": med / baseline_ips if baseline_ips else None, "overrides": v.overrides,
    }
    tta = [r["time_to_accuracy_s"] for r in v.results if "time_to_accuracy_s" in r]
    if tta:
        row["time_to_accuracy_s"] = tta[0]
    return row


COLUMNS = ["variant", "status", "images_per_s", "images_per_s_min", "images_per_s_max", "speedup", "step_ms",
           "data_wait_share", "bottleneck", "peak_tree_mb", "peak_mem_mb", "time_to_accuracy_s", "reason", "what"]


def _mb(value) -> str:
    return f"{value:.0f}" if value is not None else "-"


def markdown_table(rows: list[dict], meta: dict) -> list[str]:
    """bench.md's lines: what ran where, then one row per variant (plain text, readable in any log)."""
    lines = [f"# torchsprint bench: {meta['config']}", "",
             f"device: {meta['device']}; torch {meta['torch']}; {meta['steps']} timed steps after {meta['warmup']} warm-up, "
             f"{meta['repeats']} repeats (median, min-max); {meta['date']}. Peak tree MB: resident memory of the "
             "variant's whole process tree (workers included); peak MB: CUDA memory allocated (GPU) or the main process.", "",
             "| variant | images/s | speedup | step ms | data wait | bottleneck | peak tree MB | peak MB | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | - | - | - | - | - | - | - | skipped: {r.get('reason', '')} |")
            continue
        note = f"to-accuracy {r['time_to_accuracy_s']:.1f} s" if r.get("time_to_accuracy_s") is not None else ""
        if r["variant"] == "best combination":
            note = (note + "; " if note else "") + r.get("what", "")
        lines.append(f"| {r['variant']} | {r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f}) | "
                     f"{r['speedup']:.2f}x | {r['step_ms']:.2f} | {r['data_wait_share']:.0%} | {r['bottleneck']} | "
                     f"{_mb(r.get('peak_tree_mb'))} | {_mb(r.get('peak_mem_mb'))} | {note} |")
    return lines


def write_outputs(rows: list[dict], out: Path, meta: dict) -> None:
    """bench.json (everything), bench.csv, bench.md and bench.png (speedup over the baseline)."""
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    (out / "bench.md").write_text("\n".join(markdown_table(rows, meta)) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r.get("speedup")][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(ok) + 1.6))
    bars = ax.barh([r["variant"] for r in ok], [r["speedup"] for r in ok],
                   color=["tab:green" if r["speedup"] >= 1 else "tab:red" for r in ok])
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}x  ({r['images_per_s']:.0f}/s)" for r in ok], padding=3, fontsize=8)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, max([r["speedup"] for r in ok] + [1.0]) * 1.35)  # room for the labels
    ax.set_xlabel("speedup over the seeds' baseline (images/s ratio)")
    ax.set_title("torchsprint bench: training throughput by variant", fontsize=11)
    fig.text(0.01, 0.005, f"{meta['device']}, torch {meta['torch']}, {meta['date']}; config: {meta['config']}",
             fontsize=7, color="0.35", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], meta: dict | None = None) -> None:
    """A rich table on a terminal; the markdown table when stdout is a file or a pipe (a rich table there is
    cut to 80 columns and folds every cell)."""
    if not sys.stdout.isatty():
        print("\n".join(markdown_table(rows, meta or {"config": "", "device": "", "torch": "", "steps": "", "warmup": "",
                                                      "repeats": "", "date": ""})))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="torchsprint bench")
    for c in ("variant", "images/s (min-max)", "speedup", "step ms", "data wait", "bottleneck", "peak tree MB", "peak MB"):
        t.add_column(c)
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["variant"], f"[dim]skipped: {r['reason']}[/]", "", "", "", "", "", "")
            continue
        t.add_row(r["variant"], f"{r['images_per_s']:.0f} ({r['images_per_s_min']:.0f}-{r['images_per_s_max']:.0f})",
                  f"{r['speedup']:.2f}x", f"{r['step_ms']:.2f}", f"{r['data_wait_share']:.0%}", r["bottleneck"],
                  _mb(r.get("peak_tree_mb")), _mb(r.get("peak_mem_mb")))
    Console(soft_wrap=True).print(t)


def bench(config_path: str | None, overrides: list[str], *, steps: int = 30, warmup: int = 5, repeats: int = 3,
          only: list[str] | None = None, to_accuracy: float | None = None, out: str | Path | None = None,
          isolate: bool = True) -> list[dict]:
    """Measure the matrix for a config; returns the rows and writes bench.{md,csv,json,png} into `out`.

    `isolate`: measure each variant in its own process (the CLI's way: memory figures are the variant's own,
    with its process tree's peak RSS). False measures in this process (the Python API for names registered
    here rather than through `imports:`); the tree memory column is then empty.
    """
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
            path = out / "variants" / f"{slug(v.name)}.yaml"
            path.write_text(config_mod.dump_yaml(cfg))
            if isolate or v.processes > 1:
                v.results = measure_variant(path, steps, warmup, repeats, v.processes, out / "variants" / f".{slug(v.name)}.json")
            else:
                v.results = [measure(cfg, steps, warmup) for _ in range(repeats)]
            if to_accuracy is not None:
                v.results[0]["time_to_accuracy_s"] = time_to_accuracy(cfg, to_accuracy, out / "runs" / slug(v.name))
        except (UsageError, RuntimeError, NotImplementedError, subprocess.TimeoutExpired) as e:
            v.skip = f"could not run here: {str(e).splitlines()[0][:200]}"
            v.results.clear()

    meta = {"config": config_path or "defaults (digits + small_cnn)", "overrides": list(overrides), "steps": steps,
            "warmup": warmup, "repeats": repeats, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": device_name(), "cpu_threads": torch.get_num_threads()}
    base = next(v for v in all_variants if v.name == "baseline (seeds)")
    for i, v in enumerate(all_variants):
        if not v.skip:
            run_variant(v, v.overrides)
        # bench.json after every variant: a bench stopped midway (a caller's time limit) keeps what it measured
        base_ips = statistics.median(r["images_per_s"] for r in base.results) if base.results else None
        (out / "bench.json").write_text(json.dumps({"meta": meta | {"partial": True},
                                                    "rows": [summarize(x, base_ips) for x in all_variants[: i + 1]]},
                                                   indent=1))
    rows = [summarize(v, base_ips) for v in all_variants]
    if base_ips and (not only or "best" in only):
        best = best_combination(rows)
        v = Variant("best combination", best, " + ".join(r["variant"][2:] for r in rows if r.get("overrides") and
                                                         all(o in best for o in r["overrides"])) or "baseline")
        run_variant(v, best)
        rows.append(keep_the_faster(summarize(v, base_ips), rows))
    if not only or "your config" in only:
        v = Variant("your config", [], "the config as given")
        try:
            procs = max(2, _gpus()) if user.strategy.name == "ddp" else 1
            if isolate or procs > 1:
                v.results = measure_variant(resolved, steps, warmup, repeats, procs, out / "variants" / ".your_config.json")
            else:
                v.results = [measure(user, steps, warmup) for _ in range(repeats)]
        except (UsageError, RuntimeError, subprocess.TimeoutExpired) as e:
            v.skip = f"could not run here: {str(e).splitlines()[0][:200]}"
        rows.append(summarize(v, base_ips))
    write_outputs(rows, out, meta)
    print_table(rows, meta)
    print(f"wrote {out}/bench.md, bench.csv, bench.json, bench.png")
    return rows


def keep_the_faster(combined: dict, rows: list[dict]) -> dict:
    """The best combination's row, unless one single change measured faster: then that change's own row,
    relabelled, with the combination's figure in its description. Switches that each help do not always
    add up (e.g. compile on top of a memory-bound loader); a "best" slower than a single change is not."""
    singles = [r for r in rows if r["status"] == "ok" and r.get("overrides") and r["variant"] != "baseline (seeds)"
               and not any(o.startswith("strategy.") for o in r["overrides"])]
    if combined["status"] != "ok" or not singles:
        return combined
    fastest = max(singles, key=lambda r: r["images_per_s"])
    if combined["images_per_s"] >= fastest["images_per_s"]:
        return combined
    return fastest | {"variant": "best combination", "what": f"{fastest['variant'][2:]} alone: the measured combination "
                      f"({combined['what']}) ran at {combined['images_per_s']:.0f} images/s, slower"}


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
    # torch.compile and a CUDA graph both capture the model: refused together (parallel.check_speed)
    captures = [r for r in other if {"speed.compile=true", "speed.cuda_graphs=true"} & set(r["overrides"])]
    for r in other:
        if r in precisions and r is not max(precisions, key=lambda r: r["speedup"]):
            continue  # one precision mode only
        if r in captures and r is not max(captures, key=lambda r: r["speedup"]):
            continue  # one way of capturing the model only
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


def _worker(argv: list[str]) -> int:
    """Entry point of the process that measures one variant (measure_variant): `repeats` measurements of the
    config file, rank 0 writes their results. A UsageError is one 'error:' line and exit code 2."""
    config_path, out, steps, warmup, repeats = argv
    import torch

    from torchsprint import runtime

    try:
        cfg = config_mod.load(config_path)
        launched = runtime.launch_env()
        if launched.world_size > 1:
            # One process group for every repeat: re-creating the default group in a process under torchrun
            # reuses the rendezvous store's keys, and was seen to hang 1 time in 2-3 (300 s, then a timeout).
            device = runtime.resolve_device(cfg.run.device, launched.local_rank)
            torch.distributed.init_process_group(runtime.resolve_backend(cfg.strategy, device), rank=launched.rank,
                                                 world_size=launched.world_size)
        try:
            res = [measure(cfg, int(steps), int(warmup)) for _ in range(int(repeats))]
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))

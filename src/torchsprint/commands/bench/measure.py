"""`torchsprint bench`: running and timing one variant. `measure` times the real engine step in this process;
`measure_variant` runs it in a process of its own (or DDP processes through torchrun) and samples the process
tree's peak memory (`TreeRss`); `_worker` is that process's entry point (`python -m torchsprint.commands.bench.main`).

Timing: warm-up steps excluded; GPU time from CUDA events recorded around the timed steps (one
synchronisation at the end, airbench's method), CPU time from a monotonic clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from torchsprint import config as config_mod
from torchsprint.errors import UsageError
from torchsprint.train.resolve import resolve


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
    from torchsprint.config.schema import import_modules
    from torchsprint.train.build import build_training
    from torchsprint.train.engine import set_train_mode, train_step

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
            train_step(b, micro, b.plan.clip_grad_norm)
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
        return {
            "images_per_s": images / seconds,
            "step_ms": 1000 * seconds / steps,
            "data_wait_share": wait / seconds,
            "peak_mem_mb": peak_memory_mb(rt.device),
            "build_s": build_s,
            "device": str(rt.device),
        }
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
    worker = [
        "-m",
        "torchsprint.commands.bench.main",
        str(config_path),
        str(out),
        str(steps),
        str(warmup),
        str(repeats),
    ]
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
    from torchsprint.train.run import train

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


def _worker(argv: list[str]) -> int:
    """Entry point of the process that measures one variant (measure_variant): `repeats` measurements of the
    config file, rank 0 writes their results. A UsageError is one 'error:' line and exit code 2."""
    config_path, out, steps, warmup, repeats = argv
    import torch

    from torchsprint import runtime

    try:
        cfg = resolve(config_mod.load(config_path))
        launched = runtime.launch_env()
        if launched.world_size > 1:
            # One process group for every repeat: re-creating the default group in a process under torchrun
            # reuses the rendezvous store's keys, and was seen to hang 1 time in 2-3 (300 s, then a timeout).
            device = runtime.resolve_device(cfg.run.device, launched.local_rank)
            torch.distributed.init_process_group(
                runtime.resolve_backend(cfg.strategy, device), rank=launched.rank, world_size=launched.world_size
            )
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

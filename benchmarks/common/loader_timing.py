"""Timing a loader: images/s over an epoch, and CPU seconds per image of the cpu backend's whole per-image path
(data/data_throughput.py, gpu/measure.py's M2)."""

from __future__ import annotations

import time


def time_epoch(loader, epoch: int, warmup: int = 2, stats: dict | None = None) -> float:
    """Images/s over one epoch after `warmup` batches (workers started, queues filled); on CUDA the clock
    stops after the device has finished the last batch. `stats` (a dict) receives
    `thread_cpu_ms_per_batch`: the consuming thread's own CPU time (time.thread_time) inside each next() of
    the loader after the warm-up, per batch: the host work a training step waits on (the gpu
    backend's assembly ran there, 29 ms a batch of 256 on an H200's host; its producer thread now)."""
    import torch

    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    n, t0, x, i, cpu = 0, None, None, 0, []
    it = iter(loader)
    while True:
        c0 = time.thread_time()
        batch = next(it, None)
        spent = time.thread_time() - c0
        if batch is None:
            break
        x = batch[0]
        x.sum()  # touch the batch, as a training step would
        if i == warmup - 1:
            if x.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        elif i >= warmup:
            n += x.shape[0]
            cpu.append(spent)
        i += 1
    if x is not None and x.is_cuda:
        torch.cuda.synchronize()
    if stats is not None:
        stats["thread_cpu_ms_per_batch"] = 1e3 * sum(cpu) / len(cpu) if cpu else None
    return n / (time.perf_counter() - t0)


def cpu_backend_parts(loader):
    """(dataset, collate_fn, split) behind a cpu-backend loader: train and eval share one DataLoader and its
    workers (data/backends/cpu.py SharedBatches); its dataset takes (split, index, seed) keys."""
    batches = loader.loader
    return batches.shared.dataset, batches.shared.collate_fn, batches.split


def cpu_seconds_per_image(loader, naive: bool, n: int = 256, batch: int = 64) -> float:
    """CPU seconds per image of the whole per-image path (decode, augment, collate, normalize) in this
    process on one thread. Unlike wall-clock images/s this barely moves when other processes load the
    machine, so it is the per-core figure to trust on a shared box."""
    import torch

    if naive:
        ds = loader.dataset
    else:
        ds, collate, split = cpu_backend_parts(loader)
        if loader.device.type != "cpu":
            raise ValueError("cpu_seconds_per_image: build the loader on a CPU Runtime (it normalizes in this process)")
    n = min(n, len(ds) if naive else len(ds.raws[split]))  # a smoke run's folder can be smaller than n
    batch = min(batch, n)
    n -= n % batch
    t0 = time.process_time()
    for start in range(0, n, batch):
        if naive:
            xs = [ds[i][0] for i in range(start, start + batch)]
            torch.stack(xs).sum()
        else:
            items = [ds[(split, i, 1000 + i)] for i in range(start, start + batch)]
            images, _, _ = collate(items)
            loader.normalize(images).sum()
    return (time.process_time() - t0) / n

"""RNG state of a process (what a checkpoint must carry to continue exactly) and RNG isolation of data loading."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """RNG states of Python, NumPy, torch CPU and the CUDA training device, as weights_only-loadable types.

    Args:
        device: the training device; its CUDA generator is saved when it is a CUDA device. Only the
            training device's generator is kept (not get_rng_state_all) so that a checkpoint resumes
            on a machine with another number of visible GPUs.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # uint32 -> int64 is lossless and a plain tensor type for the weights_only unpickler.
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` saved (the CUDA part only when training on CUDA)."""
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list | tuple) else x


def rng_isolated(iterable, device: torch.device, every_batch: bool = False):
    """Iterate `iterable` on its own torch RNG stream, leaving the global one to the model.

    A DataLoader without its own `generator` draws a base seed from the global generator every time
    an iterator is created (persistent workers: only in a process's first epoch), so a resumed run
    would see another dropout/stochastic-depth stream than an uninterrupted one. Data order and
    augmentation have their own seeds (data.core.sample_seed), and torchsprint's loaders pass their
    DataLoaders a seeded generator; this wrapper protects loaders that do not (user-registered ones).
    It isolates the iterator's creation and first batch, where DataLoaders draw; `every_batch=True`
    isolates every batch too, for a loader that draws from the global RNG per batch (two CPU RNG state
    copies of ~5 KB per batch, plus the device's on CUDA: measurable for tiny steps, hence opt-in).
    The loader's stream is seeded from the global seed plus a constant, not copied from the global
    state, so a loader that draws per batch never replays the numbers the model stream will draw.
    """
    cuda = device.type == "cuda"

    def get():
        return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None)

    def put(state) -> None:
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1], device)

    with torch.random.fork_rng(devices=[device] if cuda else []):
        # Deterministic per run seed and rank. Only the generators fork_rng restores: torch.manual_seed would
        # also seed every accelerator, and on a CUDA build without a GPU it queues a lazy CUDA seeding that
        # formats a Python stack trace, three times per call (~2 ms per epoch: a tiny model's half step).
        seed = (torch.initial_seed() + 0x5EED) % 2**63
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        loader_rng = get()
    it, isolate = None, True
    while True:
        if not isolate:
            yield from it
            return
        model_rng = get()
        put(loader_rng)
        try:
            if it is None:
                it = iter(iterable)
            item = next(it)
        except StopIteration:
            return
        finally:
            loader_rng = get()
            put(model_rng)
        isolate = every_batch
        yield item

"""Collectives over the ranks of a run (no-ops in one process): sums, maxima, objects, and the AgreedLoader that
keeps every DDP rank at the same step count."""

from __future__ import annotations

import torch


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Max of a tensor over ranks in place (no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t


def broadcast_object(obj, rt, src: int = 0):
    """rank `src`'s object on every rank (identity in one process). All ranks wait here."""
    if not rt.distributed:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj, rt) -> list:
    """Every rank's object, in rank order (a one-element list in one process)."""
    if not rt.distributed:
        return [obj]
    out = [None] * rt.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def agree_min(n: int, rt) -> int:
    """The smallest `n` over all ranks, through the host-side control group; `n` itself in one process.

    Costs one small gloo all-reduce of a CPU tensor: no GPU stream sync (see Runtime.control_group).
    """
    if not rt.distributed:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=rt.control_group)
    return int(t.item())


class AgreedLoader:
    """A training loader whose ranks agree, batch by batch, that every rank still has data.

    DDP hangs when one rank runs out of batches while another starts a step that all-reduces
    gradients. Before yielding each batch, the ranks agree (one MIN all-reduce of a 0/1 flag) that
    all of them got one; the first rank without data ends the epoch for all. `len` is the smallest
    length over ranks, agreed once at construction, so every rank counts the same steps per epoch.

    The same all-reduce carries a vote (`vote()`: a positive int, the minimum over ranks kept in `agreed`):
    preempt.Stopper's stop request, agreed with every batch at no extra cost, so every rank stops after the
    same step when a signal reached one of them only.
    """

    def __init__(self, loader, rt):
        self.loader, self.rt = loader, rt
        self.length = agree_min(len(loader), rt)
        self.vote = lambda: 1  # any positive number: "I have a batch" (preempt.Stopper.attach replaces it)
        self.agreed = None  # the minimum vote of the last batch agreed on

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.loader.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        it = iter(self.loader)
        while True:
            batch = next(it, None)
            agreed = agree_min(0 if batch is None else self.vote(), self.rt)
            if agreed == 0:
                return
            self.agreed = agreed
            yield batch

    def __getattr__(self, name):  # skipped-sample lists and other backend attributes
        return getattr(self.loader, name)


def agree_on_data(loader, rt):
    """Wrap a training loader so that uneven per-rank loaders cannot hang DDP; the loader itself in one process."""
    return AgreedLoader(loader, rt) if rt.distributed else loader

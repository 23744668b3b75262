"""Getting batches ready ahead of the training step: prefetch_to_device (the next batch prepared on a side CUDA
stream while this one trains), AheadIterator (batches assembled by a producer thread, the training thread only
waiting on an event) and stage (small host tensors to the device in one pinned copy)."""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator

import torch


def prefetch_to_device(items, prepare, device: torch.device):
    """Yield `prepare(item)` for each item; on CUDA, batch i+1 is prepared (copied, decoded, normalised)
    on a side stream while batch i computes (timm's PrefetchLoader idea), with the stream
    synchronisation and `record_stream` that make handing tensors across streams safe."""
    if device.type != "cuda":
        for item in items:
            yield prepare(item)
        return
    stream = torch.cuda.Stream(device)
    nxt = None
    for item in items:
        with torch.cuda.stream(stream):
            cur = prepare(item)
        if nxt is not None:
            yield nxt
        torch.cuda.current_stream(device).wait_stream(stream)
        for t in cur:
            t.record_stream(torch.cuda.current_stream(device))
        nxt = cur
    if nxt is not None:
        yield nxt


STAGE_ALIGN = 16  # bytes: every tensor starts where a view as any dtype (up to complex128) is allowed


def stage(tensors: list[torch.Tensor], device: torch.device, pack: bool | None = None) -> list[torch.Tensor]:
    """Small host tensors -> the same tensors on `device`, through one pinned buffer and one copy.

    Each tensor's bytes go to a 16-byte aligned place in one uint8 buffer (pinned on CUDA), the buffer
    crosses in one non_blocking copy, and views of it as each dtype and shape come back: one transfer
    per batch instead of one per tensor. On a CPU device they come back as they are; `pack=True` packs
    anyway (tests check the byte arithmetic on the CPU)."""
    if not (device.type != "cpu" if pack is None else pack):
        return list(tensors)
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    starts, pieces, total = [], [], 0
    for b in flat:
        starts.append(total)
        pad = -len(b) % STAGE_ALIGN
        pieces += [b, torch.zeros(pad, dtype=torch.uint8)] if pad else [b]
        total += len(b) + pad
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if pieces:
        torch.cat(pieces, out=buf)
    moved = buf.to(device, non_blocking=True)  # pinned: the host allocator keeps buf until the copy is done
    return [moved[s : s + len(b)].view(t.dtype).view(t.shape) for t, s, b in zip(tensors, starts, flat)]


def stage_params(
    params: list[dict], extra: list[torch.Tensor], device: torch.device
) -> tuple[list[dict], list[torch.Tensor]]:
    """The tail's parameter dicts and `extra` tensors on `device` in one `stage` (keys starting with "_" stay on
    the host, as augment.to_device leaves them; run_tail's .to(device) is then a no-op)."""
    keys = [(i, k) for i, d in enumerate(params) for k, v in d.items() if not k.startswith("_") and torch.is_tensor(v)]
    moved = stage([*extra, *(params[i][k] for i, k in keys)], device)
    out = [dict(d) for d in params]
    for (i, k), v in zip(keys, moved[len(extra) :]):
        out[i][k] = v
    return out, moved[: len(extra)]


class _Failed:
    """A producer's exception, handed to the training thread to raise there."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()  # the producer's last item: the epoch is complete


def _put(q: queue.Queue, obj, stop: threading.Event) -> bool:
    """Put `obj` unless the consumer stopped (checked every 50 ms while the queue is full); False: stopped."""
    while not stop.is_set():
        try:
            q.put(obj, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(items, assemble, q: queue.Queue, stop: threading.Event, device: torch.device) -> None:
    """The producer thread: assemble each item, on CUDA on a stream of its own with an event recorded after
    each batch. Holds no reference to the AheadIterator, so dropping that closes it (its __del__)."""
    end = _END
    try:
        try:
            with contextlib.ExitStack() as ctx:
                ctx.enter_context(torch.no_grad())  # grad mode is per thread: tensors built here never need a graph
                stream = None
                if device.type == "cuda":
                    ctx.enter_context(torch.cuda.device(device))
                    # Default priority: decode_stream's pool is the high-priority one, so never that stream.
                    stream = torch.cuda.Stream(device)
                    ctx.enter_context(torch.cuda.stream(stream))
                for item in items:
                    if stop.is_set():
                        return
                    batch = assemble(item)
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not _put(q, (batch, event), stop):
                        return
        finally:
            items.close()  # the DataLoader iterator goes with it (non-persistent workers shut down)
    except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
        end = _Failed(e)
    _put(q, end, stop)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # iterators whose producer may still run


@atexit.register
def _close_live() -> None:
    """Stop every producer before the interpreter finalises: a daemon thread it kills inside a torch call
    would abort the process ("terminate called without an active exception")."""
    for it in list(_LIVE):
        it.close()


class AheadIterator:
    """The training thread's side of a loader whose batches one producer thread assembles ahead (the gpu backend).

    The first `next` makes the DataLoader's iterator here (its worker processes fork from the training
    thread, never from the producer while this thread runs) and starts the producer; each `next` then only
    takes an item from a queue of `depth` batches and, on CUDA, makes the current stream wait on the
    item's event and record_streams its tensors: no host sync, no tensor work, no per-sample Python.
    """

    def __init__(self, make_items: Callable[[], Iterator], assemble: Callable, device: torch.device, depth: int):
        self._make_items, self._assemble, self._device = make_items, assemble, device
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            items = self._make_items()
            self._thread = threading.Thread(
                target=_produce,
                name="torchsprint-loader",
                daemon=True,
                args=(items, self._assemble, self._queue, self._stop, self._device),
            )
            self._thread.start()
            _LIVE.add(self)
        while True:
            try:
                got = self._queue.get(timeout=1.0)
                break
            except queue.Empty:  # the producer always ends with an item; a thread gone without one is a bug
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("the loader's producer thread ended without a batch or an error") from None
        if got is _END or isinstance(got, _Failed):
            self.close()
            if got is _END:
                raise StopIteration
            raise got.error  # the producer's exception, same type and message (a UsageError stays one line)
        batch, event = got
        if event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(event)  # the device waits for the batch; the host does not
            for t in batch:
                t.record_stream(current)  # allocated on the producer's stream, used on this one
        return batch

    def close(self) -> None:
        """Stop the producer and wait for it (it finishes at most the batch in hand); idempotent."""
        self._done = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get_nowait()  # unblock a put; batches nobody takes are dropped
            thread.join(0.05)
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

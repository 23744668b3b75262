"""`torchsprint serve`'s engine: the model thread that gathers waiting images into batches (max_batch / max_wait_ms,
one shape per batch, at most the batch pixel budget of commands/serve_limits.py, power-of-two buckets), runs them and
answers each request's future, and its warm-up. Images arrive decoded by commands/serve_decode.py (exactly as
predict reads a file; its docstring says how), or as bytes that the model thread decodes itself when it is idle.
Nothing here knows HTTP (commands/serve_app.py does), and no decode or forward pass runs on the event loop: the
event loop answers /health and /ready while the model thread works.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import deque

import torch

from torchsprint.commands.serve_decode import Decoder, ImageError, Job


class Overloaded(Exception):
    """The queue is full or the server is stopping: 503 with Retry-After."""


def powers_of_two(limit: int) -> list[int]:
    """The batch buckets: 1, 2, 4, ... below `limit`, and `limit` itself (the largest batch)."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


def bucket(n: int, limit: int) -> int:
    """The smallest bucket that holds n images."""
    return next(b for b in powers_of_two(limit) if b >= n)


class Batcher:
    """The model thread and its queue. `reserve(n)` admits n images or says the queue is full; `put(job)` queues a
    reserved image; the thread takes up to max_batch images of one shape (fewer where their pixels would pass
    batch_pixels) once that many wait, or the first waited max_wait_s, or nothing more is on its way (no request
    being read, no image being decoded), runs them as one batch and answers each Job's future. A Job whose future was
    cancelled (the request timed out or its client left) before its batch formed is dropped, never run."""

    def __init__(
        self, decoder: Decoder, *, max_batch: int, max_wait_s: float, queue_limit: int, buckets: bool, metrics
    ):
        self.decoder, self.predictor = decoder, decoder.predictor
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self.batch_pixels = decoder.limits.batch_pixels  # most pixels in one forward pass (serve_limits.Limits)
        self.queue_limit, self.buckets, self.metrics = queue_limit, buckets, metrics
        self._cond = threading.Condition()
        self._waiting: deque[tuple[float, Job]] = deque()
        self._reserved = 0  # admitted images not yet taken into a batch: decoding or waiting
        self._arriving = 0  # requests being read, not yet admitted
        self._stopping = False
        self._busy = False  # a batch is being run
        self._forming = False  # the model thread waits for images on their way to join a batch
        self._thread = threading.Thread(target=self._loop, name="torchsprint-serve-model", daemon=True)
        self._warm = threading.Event()
        self.warm_note = ""
        self.torch_threads: dict[int, int] = {}  # batch size -> torch threads, measured at warm-up on a CPU

    def start(self) -> str:
        """Start the model thread; it warms up first. Returns once warm, with what the warm-up did."""
        self._thread.start()
        self._warm.wait()
        return self.warm_note

    def stop(self) -> None:
        """Answer every queued image, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def reserve(self, n: int) -> None:
        """Admit n images, or raise Overloaded (the queue would pass queue_limit, or the server is stopping)."""
        with self._cond:
            if self._stopping:
                raise Overloaded("the server is stopping; retry on another replica or later")
            if self._reserved + n > self.queue_limit:
                raise Overloaded(
                    f"the queue is full ({self._reserved} images waiting, serve.queue_limit="
                    f"{self.queue_limit}); retry later"
                )
            self._reserved += n
            self.metrics.queue_depth.set(self._reserved)

    def release(self, n: int) -> None:
        """Give back reserved places that will never be queued (an image that failed to decode)."""
        with self._cond:
            self._reserved -= n
            self.metrics.queue_depth.set(self._reserved)
            if self._forming:
                self._cond.notify_all()

    def arriving(self, n: int) -> None:
        """A request started (+1) or stopped (-1) being read: while one is, a waiting batch may wait for it. Only a
        batch being formed cares that one stopped (it may stop waiting): the model thread is woken for nothing
        else, which at concurrency 1 were two context switches a request on a 2-core machine."""
        with self._cond:
            self._arriving += n
            if n < 0 and self._forming:
                self._cond.notify_all()

    def put_if_idle(self, job: Job) -> bool:
        """Queue a not-yet-decoded job (its bytes) if the model thread has nothing else to do: no batch running or
        waiting, no other image admitted or request arriving. The model thread then decodes it itself: a lone
        client's request touches two threads (the event loop's and the model's), not three, as a hand-written
        endpoint's does, and the event loop never decodes nor runs the model. Otherwise False: the decode pool takes
        it (under load, decoding overlaps the model). Counted by torchsprint_serve_lone_images_total."""
        with self._cond:
            if self._stopping or self._busy or self._waiting or self._reserved != 1 or self._arriving:
                return False
            self._waiting.append((time.monotonic(), job))
            self._cond.notify_all()
        self.metrics.lone.inc()
        return True

    def put(self, job: Job) -> Job:
        with self._cond:
            self._waiting.append((time.monotonic(), job))
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return job

    def _take(self) -> list[Job] | None:
        """The next batch: up to max_batch live jobs of the first waiting job's shape; None when stopped and empty."""
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if not self._waiting:
                return None
            since, head = self._waiting[0]
            deadline, most = since + self.max_wait_s, self.most(head)
            self._forming = True
            while not self._stopping:
                ready = sum(1 for _, j in self._waiting if j.key() == head.key())
                left = deadline - time.monotonic()
                # Wait only for images on their way (a request being read, an image being decoded): with
                # nothing coming, waiting out max_wait_ms is latency for nothing (a lone client's every request).
                coming = self._arriving > 0 or self._reserved > len(self._waiting)
                if ready >= most or left <= 0 or not coming:
                    break
                self._cond.wait(left)
            self._forming = False
            batch, keep, dropped = [], deque(), 0
            for item in self._waiting:
                if len(batch) < most and item[1].key() == head.key():
                    if item[1].future.set_running_or_notify_cancel():
                        batch.append(item[1])
                    else:
                        dropped += 1  # cancelled while waiting: its place goes back, it never runs
                else:
                    keep.append(item)
            self._waiting = keep
            self._busy = bool(batch)
            self._reserved -= len(batch) + dropped
            self.metrics.queue_depth.set(self._reserved)
            self.metrics.waiting.set(len(keep))
            return batch

    def most(self, head: Job) -> int:
        """The most images of head's shape in one batch: max_batch, fewer where their pixels would pass batch_pixels
        (an eval spec that keeps each file's size: 32 images near serve.max_model_pixels never share a forward)."""
        if head.image is None:  # bytes (a lone job) or JPEG bytes for nvJPEG (a fixed-size spec): max_batch
            return self.max_batch
        pixels = head.image.shape[-2] * head.image.shape[-1]
        return max(1, min(self.max_batch, self.batch_pixels // max(1, pixels)))

    def _loop(self) -> None:
        try:
            self.warm_note = self.warm_up()
        finally:
            self._warm.set()
        while (batch := self._take()) is not None:
            if batch:
                self.metrics.in_model.set(len(batch))
                try:
                    self._answer(batch)
                except Exception as e:  # noqa: BLE001 - the model thread never dies: the batch gets the error
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(e)
                self.metrics.in_model.set(0)
            with self._cond:
                self._busy = False

    def _answer(self, batch: list[Job]) -> None:
        """Run a batch; if it fails, run its images one at a time, so an image the model refuses fails alone."""
        try:
            results = self.run(batch)
        except Exception as e:  # noqa: BLE001 - isolated below; a single image's failure is that image's answer
            if len(batch) > 1:
                for job in batch:
                    self._answer([job])
                return
            results = [self._refused(batch[0], e)]
        for job, r in zip(batch, results):
            if isinstance(r, Exception):
                job.future.set_exception(r)
            else:
                job.future.set_result(r)

    @staticmethod
    def _refused(job: Job, e: Exception) -> Exception:
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return Overloaded("the GPU ran out of memory; retry later (or lower serve.max_batch)")
        shape = "x".join(map(str, job.image.shape)) if job.image is not None else "a JPEG"
        return ImageError(
            f"the model cannot take this image ({shape} after the eval preprocessing): "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
            "model_refused",
        )

    def images(self, batch: list[Job]) -> list[torch.Tensor | Exception]:
        """Each job's uint8 CHW eval input: the CPU path's tensor, or nvJPEG + the GPU spec for JPEG bytes (a file
        nvJPEG rejects decodes on the CPU here, as predict does). A job that came as bytes is decoded first, here."""
        for j in batch:
            if j.data is not None:
                try:
                    ready = self.decoder.prepare(j.data, j.topk)
                    j.image, j.jpeg = ready.image, ready.jpeg
                except ImageError as e:
                    j.error = e
                j.data = None
        out: list = [j.error or j.image for j in batch]
        jpegs = [i for i, j in enumerate(batch) if j.image is None and j.error is None]
        if jpegs:
            p = self.predictor
            decoded = p._decode_gpu([f"request image {i}" for i in jpegs], [batch[i].jpeg for i in jpegs])
            for i, img in zip(jpegs, decoded):
                if img is None:
                    try:
                        out[i] = self.decoder.cpu_path(bytes(batch[i].jpeg.numpy()))
                    except ImageError as e:
                        out[i] = e
                else:
                    out[i] = img
        return out

    def run(self, batch: list[Job]) -> list[dict | Exception]:
        """One forward pass for the batch (padded to its bucket), each row through the task's postprocess."""
        return self.infer(batch, record=True)

    def infer(self, batch: list[Job], record: bool = False) -> list[dict | Exception]:
        """The batch's answers (record: a request's batch, timed and counted; the warm-up's is not)."""
        images = self.images(batch)
        good = [i for i, x in enumerate(images) if torch.is_tensor(x)]
        results: list = list(images)
        if not good:
            return results
        device = self.predictor.device
        rows = [images[i].to(device) for i in good]
        n = len(rows)
        size = bucket(n, self.max_batch) if self.buckets else n
        x = torch.stack(rows + [torch.zeros_like(rows[0])] * (size - n))  # pad rows: never read back
        if self.torch_threads and torch.get_num_threads() != (want := self.threads_for(n)):
            torch.set_num_threads(want)  # this thread's OpenMP team size for this batch size (choose_threads)
        started = time.perf_counter()
        logits = self.predictor.logits(x)[:n]
        if record:
            self.metrics.forward_seconds.observe(time.perf_counter() - started)
            self.metrics.batch_size.observe(n)
        # The task's own postprocess, once for the batch (softmax and top-k are per row) at the largest top-k
        # asked; each request keeps its own first k (top-k is sorted).
        p = self.predictor
        outs = p.task.postprocess(
            logits, p.classes, {"topk": max(batch[i].topk for i in good), "threshold": p.threshold}
        )
        for row, i in enumerate(good):
            r = outs[row]
            results[i] = {**r, "top": r["top"][: batch[i].topk]} if "top" in r else r
        return results

    def warm_up(self) -> str:
        """Decode a generated PNG and JPEG (the decoders' first call imports and allocates: seconds), choose the CPU
        thread count, and run every batch size the model will see (each bucket, or 1 and max_batch). Runs on the
        model thread (OpenMP's thread count is per thread), before /ready says yes."""
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(0)
        files = []
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            # 32x32 (an ONNX graph's fixed size, or less within serve.max_model_pixels; serve_limits.Limits.warm):
            # the eval input when the spec fixes no size (small-image runs); a fixed-size spec resizes it
            Image.fromarray(rng.integers(0, 256, (*self.decoder.limits.warm, 3), dtype=np.uint8)).save(buf, fmt)
            files.append(buf.getvalue())
        sizes = powers_of_two(self.max_batch) if self.buckets else sorted({1, self.max_batch})
        try:
            jobs = [self.decoder.prepare(data, 1) for data in files]
            threads = self.choose_threads(jobs[0]) if self.predictor.device.type == "cpu" else ""
            for n in sizes:
                self.infer([jobs[n % 2]] * n)
        except Exception as e:  # noqa: BLE001 - e.g. a model that takes only its training size: requests still run
            return f"warm-up stopped ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        return f"warmed up on batches of {', '.join(map(str, sizes))}{threads}"

    def choose_threads(self, job: Job) -> str:
        """Choose torch's intra-op threads for this (the model) thread per batch size: the fastest of 1, half and all
        the cores on a batch of one and on a batch of max_batch of the warm-up image (the eval spec's size; 32x32
        when it fixes none); a batch takes the choice of the measured size nearer its own (threads_for). Measured,
        not assumed, and per size: a ResNet-18 batch gains from every core (on 2 busy cores: 74 ms an image with 1
        thread, 44 with 2), while a small net's kernels can be too short to share, most of all at batch 1, where a
        lone client's every request runs (the digits CNN: 2 threads won at a batch of 32, 1 thread at a batch of 1,
        where its second thread's spinning took the core the client needed)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        counts = sorted({1, max(1, cores // 2), cores})
        notes, chosen = [], {}
        for size in sorted({1, self.max_batch}):
            batch, times = [job] * size, {}
            for n in counts:
                torch.set_num_threads(n)
                self.infer(batch)  # the first call at a thread count allocates
                started, reps = time.perf_counter(), 0
                while reps < 2 or (reps < 50 and time.perf_counter() - started < 0.05):  # short batches: repeated
                    self.infer(batch)
                    reps += 1
                times[n] = (time.perf_counter() - started) / reps
            chosen[size] = min(times, key=times.get)
            notes.append(
                f"{chosen[size]} for a batch of {size} ("
                + ", ".join(f"{1000 * t:.2f} ms with {n}" for n, t in times.items())
                + ")"
            )
        self.torch_threads = chosen  # infer follows it from now on (during the measurement: the count being timed)
        torch.set_num_threads(self.threads_for(self.max_batch))
        return "; torch threads " + ", ".join(notes)

    def threads_for(self, n: int) -> int:
        """The thread count chosen for the measured batch size nearer n (by ratio: n <= sqrt(max_batch) -> 1's)."""
        if not self.torch_threads:
            return torch.get_num_threads()
        small = n * n <= self.max_batch
        return self.torch_threads[1 if small or self.max_batch == 1 else self.max_batch]

"""Faults a test injects into a torchsprint process it starts: a SIGKILL after a given step, a slow disk under the
checkpoint writes, a slow shard writer, a gate before serve's forward passes. Production code has no test hook.

Python imports `sitecustomize` at start-up from the first folder of sys.path that has one: a test puts this folder
first on PYTHONPATH (`tests/faults.py`'s `fault_env`) together with the fault's variable below, and every Python
process of that command (torchrun's agent and its workers too) installs the faults named, by monkeypatching the
function the fault belongs in. A test in pytest's own process calls the same functions with `patch=monkeypatch.setattr`
(tests/fault_env.py `faults`), undone after the test. Without one of the variables this module imports nothing.

- FAULT_KILL_AT=RANK:STEP: the process of that RANK (torchrun's variable, 0 alone) SIGKILLs itself right after
  optimizer step STEP, before the step's stop check (Stopper.after_step), on a torchrun group's first attempt only
  (TORCHELASTIC_RESTART_COUNT 0 or unset): a worker lost mid-epoch exactly where the test wants it.
- FAULT_SLOW_WRITE_S=SECONDS: every checkpoint file write goes in 4 KiB chunks, each flushed and followed by that
  sleep, so the temp file on disk is partly written while the test signals or kills the process.
- FAULT_SHARD_PAUSE_S=SECONDS: `data shard` sleeps that long after each sample it writes into a shard.
- FAULT_SERVE_GATE=PATH: serve's model thread waits, before each forward pass of a request's batch (its images
  decoded; never the warm-up's), until PATH exists: a test holds a batch in the model and knows, without timing,
  that later requests queue.
"""

from __future__ import annotations

import os
import signal
import time

CHUNK = 4096


def kill_after(spec: str, patch=setattr) -> None:
    from torchsprint.runtime.preempt import Stopper

    rank, _, step = spec.partition(":")
    if rank != os.environ.get("RANK", "0") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    original = Stopper.after_step

    def after_step(self, global_step: int) -> bool:
        if global_step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, global_step)

    patch(Stopper, "after_step", after_step)


def slow_writes(delay_s: float, patch=setattr) -> None:
    from torchsprint.state import checkpoint

    original = checkpoint._GuardedFile.write

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), CHUNK):
            original(self, view[i : i + CHUNK])
            self.f.flush()  # the temp file on disk really is partly written during the sleep
            time.sleep(delay_s)
        return len(view)

    patch(checkpoint._GuardedFile, "write", write)


def slow_shards(pause_s: float, patch=setattr) -> None:
    from torchsprint.commands.data import shard

    original = shard.digest

    def digest(data):
        time.sleep(pause_s)
        return original(data)

    patch(shard, "digest", digest)


def serve_gate(path: str, patch=setattr) -> None:
    import torch

    from torchsprint.commands.serve_engine import Batcher

    original_infer, original_images = Batcher.infer, Batcher.images

    def infer(self, batch, record: bool = False):
        self._fault_recording = record  # the model thread's own batch: the warm-up's is not held
        return original_infer(self, batch, record)

    def images(self, batch):
        out = original_images(self, batch)
        if getattr(self, "_fault_recording", False) and any(torch.is_tensor(x) for x in out):
            while not os.path.exists(path):
                time.sleep(0.01)
        return out

    patch(Batcher, "infer", infer)
    patch(Batcher, "images", images)


def install(environ=os.environ) -> None:
    if environ.get("FAULT_KILL_AT"):
        kill_after(environ["FAULT_KILL_AT"])
    if environ.get("FAULT_SLOW_WRITE_S"):
        slow_writes(float(environ["FAULT_SLOW_WRITE_S"]))
    if environ.get("FAULT_SHARD_PAUSE_S"):
        slow_shards(float(environ["FAULT_SHARD_PAUSE_S"]))
    if environ.get("FAULT_SERVE_GATE"):
        serve_gate(environ["FAULT_SERVE_GATE"])


install()

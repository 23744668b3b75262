"""predict reads and decodes files ahead of the model: the same outputs as loading everything first,
bit for bit, and the reading overlaps the model."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import make_image_folder
from torchsprint import config
from torchsprint.commands.predict import Predictor
from torchsprint.commands.trained import Trained
from torchsprint.models import build_model
from torchsprint.state.checkpoint import save_weights


def make_run(root: Path, eval_spec: list) -> Path:
    """A run folder with random weights (what `train` leaves behind; predictions do not depend on training)."""
    torch.manual_seed(0)
    cfg = config.load(None, ["model.name=small_cnn", "model.args={width: 4}", f"data.eval.transforms={eval_spec}"])
    trained = Trained(build_model(cfg.model, 3, 3).eval(), ["a", "b", "c"], 3, cfg, root / "best.safetensors")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(config.dump_yaml(cfg))
    save_weights(root / "best.safetensors", trained.model, trained.metadata())
    return root


def load_all_then_batch(p: Predictor, inputs: list, topk: int) -> list[dict]:
    """The reference: predict as it was before streaming: every file decoded first, then batches of batch_size per
    image shape in input order (tensors first), the model on each batch."""
    results, ready = [], []
    for i, x in enumerate(inputs):
        results.append({"input": "<tensor>" if torch.is_tensor(x) else str(x)})
        if torch.is_tensor(x):
            ready.append((i, x))
    for i, x in enumerate(inputs):
        if not torch.is_tensor(x):
            try:
                ready.append((i, p._load_cpu(str(x))))
            except Exception as e:  # noqa: BLE001
                results[i]["error"] = str(e) or type(e).__name__
    groups: dict = {}
    for i, img in ready:
        groups.setdefault(tuple(img.shape), []).append((i, img))
    for group in groups.values():
        for s in range(0, len(group), p.batch_size):
            chunk = group[s : s + p.batch_size]
            out = p.logits(torch.stack([img for _, img in chunk]))
            for (i, _), r in zip(chunk, p.task.postprocess(out, p.classes, {"topk": topk, "threshold": 0.5})):
                results[i].update(r)
    return results


def test_streamed_predict_equals_loading_everything_first(tmp_path):
    """Mixed image sizes (no resize in the eval spec: two shape groups whose batches straddle the read-ahead
    chunks), a bad file, a tensor input, a batch size that divides nothing: every probability identical."""
    run = make_run(tmp_path / "run", [])
    small = make_image_folder(tmp_path / "small", per_class=5, size=(24, 20), splits=("train",))
    large = make_image_folder(tmp_path / "large", per_class=4, size=(32, 28), splits=("train",))
    files = sorted((small / "train").rglob("*.jpg")) + sorted((large / "train").rglob("*.jpg"))
    files = [f for pair in zip(files, reversed(files)) for f in pair][: len(files)]  # interleave the two sizes
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    inputs = [*files[:7], tmp_path / "bad.jpg", torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8), *files[7:]]
    p = Predictor.from_run(run, batch_size=3)
    got = p.predict([str(x) if not torch.is_tensor(x) else x for x in inputs], topk=3)
    want = load_all_then_batch(p, inputs, topk=3)
    assert len({tuple(p._load_cpu(str(f)).shape) for f in files}) == 2  # both shape groups exercised
    assert got == want  # floats compared exactly: same batches, same pixels, same model calls
    assert "error" in got[7] and "top" in got[8]


def test_reading_overlaps_the_model(tmp_path, monkeypatch, figure):
    """Files that take 20 ms each to read and a model that takes as long per batch of 4: loading everything
    first costs the sum (8 batches x 2 x 80 ms = 1.28 s); reading ahead hides the model behind the reads.
    One reader thread, so the overlap measured is reading vs model, not readers vs each other.

    The proof is the two clocks' intervals, not the wall time: reads that run while the model runs. A loader that
    reads before the model (or between its calls) leaves no read inside a model call however slow the machine;
    reading ahead keeps the reader busy during every call but the last (7 of 8 calls). The wall time against the
    sleeps' sum moved from 0.63-0.68 (quiet machine) to 0.72 with 3 busy processes on the 2 cores, too close to
    a bound for CI; it is printed, not asserted."""
    run = make_run(tmp_path / "run", [{"resize": 16}])
    folder = make_image_folder(tmp_path / "imgs", per_class=16, size=(24, 20), splits=("train",))
    files = [str(f) for f in sorted((folder / "train").rglob("*.jpg"))][:32]
    assert len(files) == 32
    p = Predictor.from_run(run, batch_size=4)
    read, model = 0.020, 0.080
    reads, calls = [], []  # (start, end) of every read and every model call, perf_counter

    def timed(spans, sleep_s, f):
        def g(x):
            t = time.perf_counter()
            time.sleep(sleep_s)
            out = f(x)
            spans.append((t, time.perf_counter()))
            return out

        return g

    monkeypatch.setattr(p, "_load_cpu", timed(reads, read, p._load_cpu))
    p.forward = timed(calls, model, p.forward)
    monkeypatch.setattr(Predictor, "READERS", 1)
    p.predict(files[:4])  # warm-up
    reads.clear()
    calls.clear()
    t = time.perf_counter()
    out = p.predict(files)
    wall = time.perf_counter() - t
    serial = len(files) * read + len(files) / 4 * model
    assert all("top" in r for r in out)
    assert len(reads) == 32 and len(calls) == 8
    overlap = sum(max(0.0, min(ce, re) - max(cs, rs)) for cs, ce in calls for rs, re in reads)
    model_s = sum(e - s for s, e in calls)
    print(
        f"predict overlap: wall {wall:.3f} s, serial {serial:.3f} s, "
        f"reads inside model calls {overlap:.3f} s of {model_s:.3f} s"
    )
    figure("predict wall / sleeps' sum", wall / serial)
    figure("predict reading inside model calls / model time", overlap / model_s)
    # Ideal 7/8 = 0.875; measured 0.86-0.87 with 3 busy processes on the 2 cores, 0.75 once with other agents' runs
    # on top; bound a third of the worst. A loader that reads before the model (or between its calls): exactly 0.
    assert overlap >= 0.25 * model_s, (overlap, model_s)


@pytest.mark.parametrize("ahead", [1, 3])
def test_read_ahead_is_bounded(tmp_path, monkeypatch, ahead):
    """At most AHEAD batches are read before the model consumes one (memory does not grow with the file count)."""
    run = make_run(tmp_path / "run", [{"resize": 16}])
    folder = make_image_folder(tmp_path / "imgs", per_class=8, size=(24, 20), splits=("train",))
    files = [str(f) for f in sorted((folder / "train").rglob("*.jpg"))][:16]
    p = Predictor.from_run(run, batch_size=2)
    monkeypatch.setattr(Predictor, "AHEAD", ahead)
    started, load = [], p._load_cpu
    monkeypatch.setattr(p, "_load_cpu", lambda path: (started.append(path), load(path))[1])
    most = []
    fwd = p.forward
    p.forward = lambda x: (most.append(len(started) - 2 * (len(most) + 1)), fwd(x))[1]  # files read beyond this batch
    p.predict(files)
    assert 0 <= max(most) <= 2 * ahead, most

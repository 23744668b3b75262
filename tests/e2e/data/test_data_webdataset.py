"""The webdataset dataset: shards planned so every sample is seen exactly once per epoch on any rank x worker
layout, reproducible shuffles, exact mid-epoch resume, and the same pixels as the same files in a folder
through the cpu, gpu (CPU-run) and memory backends. Shards are written with webdataset's own TarWriter."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from paths import REPO, WORKERS  # noqa: E402
from torchsprint import config
from torchsprint.data import build_loaders
from torchsprint.data.sources.shard_stream import rank_batches, stream_plan
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime

COUNTS = [5, 3, 7, 4, 6, 2, 8]  # 7 uneven shards, 35 samples


def jpeg(rng: np.random.Generator, size=(16, 12)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_shards(root: Path, counts=COUNTS, *, split="train", index=True, bad: set[int] = frozenset(), start=0) -> Path:
    """Shards `split`-000000.tar ... whose sample i (global) is class i; `bad` ids get truncated JPEG bytes."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(start)
    gid = start
    for s, n in enumerate(counts):
        with wds.TarWriter(str(root / f"{split}-{s:06d}.tar")) as w:
            for _ in range(n):
                data = jpeg(rng)
                w.write({"__key__": f"s{gid:05d}", "jpg": data[:40] if gid in bad else data, "cls": str(gid)})
                gid += 1
    if index:
        (root / "index.json").write_text(json.dumps([f"c{i}" for i in range(max(100, gid))]))
    return root


def cfg_for(root, *extra):
    return config.load(
        None,
        [
            "data.dataset=webdataset",
            f"data.root={root}",
            "data.train.transforms=[normalize]",
            "data.eval.transforms=[normalize]",
            *extra,
        ],
    ).data


def epoch_targets(loader, epoch, start=0):
    loader.set_epoch(epoch, start)
    return [y.tolist() for _, y in loader]


@pytest.mark.parametrize(
    "world,workers,batch,drop",
    [(2, 2, 4, False), (3, 2, 5, False), (2, 3, 2, False), (4, 1, 3, True), (2, 2, 4, True), (1, 1, 64, False)],
)
def test_plan_every_sample_once_equal_steps(world, workers, batch, drop):
    """The plan alone (no I/O): every sample in exactly one stream (drop_last: fewer than batch + 1 per rank
    dropped), every rank the same number of batches, no batch empty or over batch_size, a shard read by a
    second stream only where a stretch boundary falls inside it."""
    n = sum(COUNTS)
    for epoch in range(3):
        seen, steps, readers = [], set(), Counter()
        for rank in range(world):
            sizes = rank_batches(n, rank, world, batch, drop)[1]
            steps.add(len(sizes))
            assert all(1 <= s <= batch for s in sizes)
            for w in range(workers):
                p = stream_plan(
                    COUNTS,
                    seed=3,
                    epoch=epoch,
                    shuffle=True,
                    buffer=4,
                    rank=rank,
                    world_size=world,
                    workers=workers,
                    stream=w,
                    batch_size=batch,
                    drop_last=drop,
                )
                assert sum(p.sizes) == len(p.order)
                seen += p.order.tolist()
                readers.update(s for s, _, _ in p.pieces)
        assert len(steps) == 1
        assert len(seen) == len(set(seen))
        if drop:
            assert n - len(seen) <= world * batch
        else:
            assert sorted(seen) == list(range(n))
        assert sum(v - 1 for v in readers.values()) <= world * workers - 1  # one extra reader per stretch boundary


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_two_ranks_two_workers_seven_shards_every_sample_once(tmp_path):
    """Real 2-process gloo run, 2 loader workers each, 7 uneven shards: every sample exactly once per epoch,
    equal step counts, a new order each epoch."""
    root = write_shards(tmp_path / "shards")
    out = tmp_path / "res.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO / 'tests'}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(WORKERS / "webdataset_worker.py"),
            str(root),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    orders = []
    for epoch, ranks in enumerate(res["epochs"]):
        ids = [t for batches in ranks for b in batches for t in b]
        assert sorted(ids) == list(range(sum(COUNTS))), f"epoch {epoch}: {Counter(ids).most_common(3)}"
        steps = res["steps"][epoch]
        assert steps[0] == steps[1] and steps[0][0] == steps[0][1] == 5  # ceil(ceil(35 / 2) / 4) on both ranks
        orders.append(ranks)
    assert orders[0] != orders[1]


def test_reproducible_and_exact_resume(tmp_path):
    """Same seed -> same batches; set_epoch(e, k) yields exactly batches k.. of the uninterrupted epoch
    (pixels and labels), across 2 loader workers and a shuffle buffer spanning shards."""
    root = write_shards(tmp_path / "shards")
    rt = Runtime(torch.device("cpu"))
    data = cfg_for(
        root, "data.num_workers=2", "data.batch_size=3", "data.drop_last=false", "data.options.shuffle_buffer=5"
    )

    def batches(start=0, epoch=1):
        loaders = build_loaders(data, rt, seed=11)
        loaders.train.set_epoch(epoch, start)
        return [(x.clone(), y.tolist()) for x, y in loaders.train]

    full = batches()
    assert len(full) == 12 and sorted(t for _, y in full for t in y) == list(range(35))
    again = batches()
    assert [y for _, y in again] == [y for _, y in full]
    for k in (1, 4, 7):
        resumed = batches(k)
        assert [y for _, y in resumed] == [y for _, y in full[k:]]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, full[k:]))
    assert [y for _, y in batches(epoch=2)] != [y for _, y in full]


def make_folder(root: Path, shards: Path, counts=COUNTS):
    """The same JPEG bytes as the shards, as an image folder with class folder c<id> per sample."""
    import webdataset as wds

    for s in range(len(counts)):
        for sample in wds.WebDataset(str(shards / f"val-{s:06d}.tar"), shardshuffle=False):
            gid = int(sample["cls"])
            (root / "val" / f"c{gid:03d}").mkdir(parents=True, exist_ok=True)
            (root / "train" / f"c{gid:03d}").mkdir(parents=True, exist_ok=True)
            for split in ("val", "train"):
                (root / split / f"c{gid:03d}" / "0.jpg").write_bytes(sample["jpg"])
    return root


@pytest.mark.parametrize("backend", ["cpu", "gpu_on_cpu", "memory", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_same_pixels_as_the_same_files_in_a_folder(tmp_path, backend):
    """Eval preprocessing on shards == on the same files in an image folder, per sample, through each backend
    (gpu: nvJPEG decodes the JPEG bytes handed straight from the tar)."""
    from torchsprint.data.backends.gpu import build_gpu_loaders
    from torchsprint.data.core import DATASETS

    shards = write_shards(tmp_path / "shards", split="val")
    write_shards(tmp_path / "shards", [3], split="train", index=False, start=100)
    folder = make_folder(tmp_path / "folder", shards)
    spec = "[{resize: {size: 10}}, {center_crop: {size: 8}}, normalize]"
    rt = Runtime(torch.device("cuda" if backend == "gpu" else "cpu"))
    out = {}
    for name, extra in (
        ("wds", ["data.dataset=webdataset", f"data.root={shards}"]),
        ("folder", ["data.dataset=image_folder", f"data.root={folder}"]),
    ):
        data = config.load(
            None,
            [
                *extra,
                f"data.eval.transforms={spec}",
                f"data.train.transforms={spec}",
                "data.decoder=torchvision",
                f"data.backend={'gpu' if backend == 'gpu_on_cpu' else backend}",
                "data.num_workers=0",
            ],
        ).data
        if backend == "gpu_on_cpu":  # the gpu backend's code with CPU decoding (gpu_loader itself needs CUDA)
            loaders = build_gpu_loaders(data, DATASETS.get(data.dataset)(data), rt, seed=0)
        else:
            loaders = build_loaders(data, rt, seed=0)
        loaders.val.set_epoch(0)
        xs, ys = zip(*loaders.val)
        x, y = torch.cat(xs), torch.cat(ys)
        names = [loaders.info.classes[i] for i in y.tolist()]
        out[name] = {n: x[i].cpu() for i, n in enumerate(names)}
    assert len(out["wds"]) == sum(COUNTS)
    for i in range(sum(COUNTS)):
        assert torch.equal(out["wds"][f"c{i}"], out["folder"][f"c{i:03d}"])


def test_bad_samples_skip_or_error(tmp_path):
    """A truncated JPEG in a shard: skipped and named (shard#key) with on_bad_sample=skip; an error otherwise."""
    root = write_shards(tmp_path / "shards", bad={4, 20})
    rt = Runtime(torch.device("cpu"))
    data = cfg_for(root, "data.batch_size=5", "data.drop_last=false", "data.on_bad_sample=skip")
    loaders = build_loaders(data, rt, seed=0)
    ids = [t for b in epoch_targets(loaders.train, 0) for t in b]
    assert sorted(ids) == sorted(set(range(35)) - {4, 20})
    assert len(loaders.train.skipped) == 2 and all("#s000" in s and ".tar" in s for s in loaders.train.skipped)
    loaders = build_loaders(cfg_for(root, "data.batch_size=5"), rt, seed=0)
    loaders.train.set_epoch(0)
    with pytest.raises(UsageError, match="unreadable sample .*train-0000"):
        list(loaders.train)


def test_pipe_urls_brace_expansion_and_index_counts(tmp_path):
    """`pipe:cat ...` shards named by brace expansion, counted from the index: the same samples as local files."""
    root = write_shards(tmp_path / "shards", index=False)
    names = [f"train-{s:06d}.tar" for s in range(7)]
    (root / "index.json").write_text(
        json.dumps(
            {"classes": [f"c{i}" for i in range(35)], "shards": {n: {"count": c} for n, c in zip(names, COUNTS)}}
        )
    )
    rt = Runtime(torch.device("cpu"))
    local = build_loaders(cfg_for(root, "data.drop_last=false", "data.batch_size=8"), rt, seed=1)
    piped = build_loaders(
        cfg_for(
            root,
            "data.drop_last=false",
            "data.batch_size=8",
            f"data.options.train=pipe:cat {root}/train-{{000000..000006}}.tar",
        ),
        rt,
        seed=1,
    )
    assert epoch_targets(piped.train, 0) == epoch_targets(local.train, 0)
    # A pipe: shard the index does not count cannot be planned: refused at start-up, naming the fix.
    (root / "index.json").write_text(json.dumps([f"c{i}" for i in range(35)]))
    with pytest.raises(UsageError, match="no sample count for 'pipe:cat"):
        build_loaders(cfg_for(root, f"data.options.train=pipe:cat {root}/train-000000.tar"), rt, seed=1)
    # A shard shorter than its index says stops the epoch with a clear error, not a hang or a short epoch.
    (root / "index.json").write_text(
        json.dumps(
            {"classes": [f"c{i}" for i in range(35)], "shards": {n: {"count": c + 1} for n, c in zip(names, COUNTS)}}
        )
    )
    bad = build_loaders(
        cfg_for(root, "data.drop_last=false", f"data.options.train=pipe:cat {root}/train-000000.tar"), rt, seed=1
    )
    bad.train.set_epoch(0)
    with pytest.raises(UsageError, match="holds 5 samples but the index says 6"):
        list(bad.train)


def test_refusals(tmp_path):
    root = write_shards(tmp_path / "shards")
    rt = Runtime(torch.device("cpu"))
    with pytest.raises(UsageError, match="does not take data.options"):
        build_loaders(cfg_for(root, "data.options.shards=x"), rt, seed=0)
    with pytest.raises(UsageError, match="val_fraction"):
        build_loaders(cfg_for(root, "data.val_fraction=0.1"), rt, seed=0)
    (root / "index.json").unlink()
    with pytest.raises(UsageError, match="no class index"):
        build_loaders(cfg_for(root), rt, seed=0)


def test_data_check_reads_shards(tmp_path):
    """`data check` on shards: every sample read, the bad one named by shard#key, the sample grid drawn."""
    from torchsprint.commands.data.check import check

    root = write_shards(tmp_path / "shards", [4, 3], bad={2})
    write_shards(root, [3], split="val", index=False, start=7)
    (root / "index.json").write_text(json.dumps([f"c{i}" for i in range(10)]))
    cfg = config.load(
        None,
        [
            "data.dataset=webdataset",
            f"data.root={root}",
            "data.batch_size=2",
            "data.train.transforms=[normalize]",
            "data.eval.transforms=[normalize]",
        ],
    )
    r = check(cfg, 1, tmp_path / "check")
    assert r["splits"]["train"]["samples"] == 7 and r["splits"]["val"]["samples"] == 3
    assert len(r["bad"]) == 1 and "train-000000.tar#s00002" in json.dumps(r["bad"])
    assert (tmp_path / "check" / "samples.png").is_file()


def test_repeated_aug_on_shards_is_refused(tmp_path):
    """data.repeated_aug repeats sample indices; shards stream, so it would be accepted and ignored."""
    root = write_shards(tmp_path / "shards")
    with pytest.raises(UsageError, match="data.repeated_aug=2 repeats sample indices"):
        build_loaders(cfg_for(root, "data.backend=cpu", "data.repeated_aug=2"), Runtime(torch.device("cpu")), seed=0)


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_train_paused_and_resumed_on_shards_matches_uninterrupted(tmp_path):
    """A real training run on shards (2 loader workers, shuffle buffer across shards), paused mid-epoch
    (run.stop_after_steps) and resumed, ends with exactly the weights of the uninterrupted run."""
    from safetensors.torch import load_file

    from torchsprint.train.run import train

    root = write_shards(tmp_path / "shards")
    write_shards(root, [4, 3], split="val", index=False, start=35)
    common = [
        "data.dataset=webdataset",
        f"data.root={root}",
        "data.num_workers=2",
        "data.batch_size=3",
        "data.options.shuffle_buffer=5",
        "data.train.transforms=[hflip, normalize]",
        "data.eval.transforms=[normalize]",
        "model.args={width: 4}",
        "run.epochs=2",
        "log.tensorboard=false",
        "log.progress=false",
        "checkpoint.every_epochs=null",
        "data.drop_last=false",
        "log.every_steps=1",
    ]
    full = train(config.load(None, [*common, f"run.dir={tmp_path / 'full'}"]), quiet=True)
    train(config.load(None, [*common, f"run.dir={tmp_path / 'paused'}", "run.stop_after_steps=5"]), quiet=True)
    train(config.load(None, [*common, f"run.dir={tmp_path / 'paused'}", "checkpoint.resume=auto"]), quiet=True)
    a, b = (
        load_file(str(tmp_path / "full" / "last.safetensors")),
        load_file(str(tmp_path / "paused" / "last.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # exact: same batches, same augmentation
    # resumed at step 5, not started over (which would train the same weights): every step logged once
    lines = [json.loads(x) for x in (tmp_path / "paused" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == list(range(1, full["global_step"] + 1))

"""Loader backends: per-sample seeded augmentation, determinism, exact resume, the CPU/GPU split,
refusals and fallbacks. CUDA-only checks are marked `gpu`."""

import math

import pytest
import torch

from torchsprint import config
from torchsprint.data import DATASETS, LOADERS, build_loaders
from torchsprint.data.backends.gpu import FractionTuner, build_gpu_loaders, cpu_rows
from torchsprint.data.core import sample_seed, sample_seeds
from torchsprint.data.preprocess.augment import compile_batch_spec, uniforms
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime

CPU = Runtime(torch.device("cpu"))
MEM_SPEC = "[{random_crop: {size: 8, padding: 2}}, hflip, {cutout: {size: 3}}, {normalize: half}]"


def mem_cfg(*extra):
    return config.load(
        None,
        [
            "data.backend=memory",
            "data.batch_size=32",
            f"data.train.transforms={MEM_SPEC}",
            "data.eval.transforms=[{normalize: half}]",
            *extra,
        ],
    ).data


def test_vectorised_seeds_match_scalar_and_uniforms_look_uniform():
    idx = torch.arange(0, 3000, 7)
    assert [int(s) for s in sample_seeds(42, 3, idx)] == [sample_seed(42, 3, int(i)) for i in idx]
    u = uniforms(sample_seeds(0, 0, torch.arange(20000)), 4)
    assert u.min() >= 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.std()) - math.sqrt(1 / 12)) < 0.01
    assert abs(float(torch.corrcoef(u.T)[0, 1])) < 0.03  # columns independent


def test_memory_deterministic_per_seed_and_epoch_and_exact_resume():
    loaders = build_loaders(mem_cfg(), CPU, seed=5)
    tr = loaders.train
    tr.set_epoch(2)
    full = list(tr)
    tr.set_epoch(2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, tr))
    tr.set_epoch(2, start_batch=3)
    resumed = list(tr)
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[3:], resumed))
    tr.set_epoch(3)
    assert not torch.equal(next(iter(tr))[0], full[0][0])


def test_memory_crop_flip_cutout_match_a_per_sample_reference():
    """Each sample of one batch gets its own parameters; the batched ops equal a plain per-image loop."""
    p = compile_batch_spec(
        [{"random_crop": {"size": 8, "padding": 2}}, "hflip", {"cutout": {"size": 3}}], "t", 3, "memory"
    )
    x = torch.randint(0, 255, (64, 3, 8, 8), dtype=torch.uint8)
    seeds = sample_seeds(1, 0, torch.arange(64))
    out = p(x, seeds)
    u = uniforms(seeds, p.k)
    for i in range(64):
        padded = torch.nn.functional.pad(x[i], (2, 2, 2, 2))
        top, left = int(u[i, 0] * 5), int(u[i, 1] * 5)
        ref = padded[:, top : top + 8, left : left + 8]
        if u[i, 2] < 0.5:
            ref = ref.flip(-1)
        cy, cx = int(u[i, 3] * 8), int(u[i, 4] * 8)
        ref = ref.clone()
        ref[:, max(0, cy - 1) : cy + 2, max(0, cx - 1) : cx + 2] = 0
        assert torch.equal(out[i], ref), i
    flips = (u[:, 2] < 0.5).sum()
    assert 10 < flips < 54  # per-sample coins, not one for the batch


def test_batched_random_resized_crop_params_are_valid_and_cover_the_range():
    p = compile_batch_spec([{"random_resized_crop": {"size": 16}}], "t", 3, "gpu")
    n = 4000
    hs, ws = torch.full((n,), 375), torch.full((n,), 500)
    (prm,) = p.params(p.draw(sample_seeds(0, 0, torch.arange(n))), hs, ws)
    area = (prm["h"] * prm["w"]).double() / (375 * 500)
    ratio = prm["w"].double() / prm["h"].double()
    assert bool(
        (prm["top"] >= 0).all() and (prm["top"] + prm["h"] <= 375).all() and (prm["left"] + prm["w"] <= 500).all()
    )
    assert area.min() > 0.07 and area.max() <= 1.0 and ratio.min() > 0.74 and ratio.max() < 1.35
    # same distribution as torchvision's own sampler (independent reference), 4,000 draws each
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    img = torch.zeros(3, 375, 500)
    ref = [RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
    ref_area = torch.tensor([h * w / (375 * 500) for _, _, h, w in ref], dtype=torch.float64)
    ref_top = torch.tensor([t for t, _, _, _ in ref], dtype=torch.float64)
    assert abs(float(area.mean() - ref_area.mean())) < 0.02 and abs(float(area.std() - ref_area.std())) < 0.02
    assert abs(float(prm["top"].double().mean() - ref_top.mean())) < 5


def test_memory_refuses_unsupported_steps_by_name():
    with pytest.raises(UsageError, match=r"random_rotation' is not supported by data.backend=memory"):
        build_loaders(mem_cfg("data.train.transforms=[{random_rotation: 10}]"), CPU, seed=0)


def test_cpu_backend_cutout_and_memory_have_the_same_geometry():
    """For every centre of a 10x7 image (odd and even sides, h != w), the CPU backend's Cutout (torch RNG)
    zeroes exactly the pixels the memory backend's compiled batch pipeline zeroes for that centre."""
    from torchsprint.data.preprocess.transforms import TRANSFORMS

    h, w, size = 10, 7, 4
    img = torch.full((3, h, w), 200, dtype=torch.uint8)
    # memory backend: its compiled pipeline on a batch, each sample's centre read from its own uniforms
    p = compile_batch_spec([{"cutout": {"size": size}}], "t", 3, "memory")
    seeds = sample_seeds(3, 0, torch.arange(800))
    out = p(img.expand(800, -1, -1, -1).contiguous(), seeds)
    u = uniforms(seeds, p.k)
    mem = {}
    for i in range(800):
        mem.setdefault((int(u[i, 0] * h), int(u[i, 1] * w)), out[i])
    # CPU backend: the registered transform; its centre replayed from the same torch seed
    cpu = TRANSFORMS.get("cutout")(size=size)
    seen = {}
    for s in range(800):
        torch.manual_seed(s)
        centre = (int(torch.randint(h, ())), int(torch.randint(w, ())))
        torch.manual_seed(s)
        seen.setdefault(centre, cpu(img))
    assert set(mem) == set(seen) == {(y, x) for y in range(h) for x in range(w)}
    for centre, a in seen.items():
        assert torch.equal(a, mem[centre]), centre
        zeros = (a[0] == 0).sum()
        assert 4 <= zeros <= size * size and bool((a == 0).all(0).eq(a[0] == 0).all())
    assert (seen[(5, 3)][0] == 0).sum() == size * size  # an inner centre zeroes the whole square


def gpu_cfg(root, frac, *extra):
    return config.load(
        None,
        [
            "data.dataset=synthetic_jpeg",
            f"data.root={root}",
            "data.options={num_images: 12, val_images: 4, size: [40, 30], classes: 3}",
            "data.batch_size=5",
            f"data.cpu_fraction={frac}",
            "data.decoder=torchvision",
            "data.drop_last=false",
            "data.train.transforms=[{random_resized_crop: {size: "
            "16}}, hflip, {cutout: {size: 4}}, {normalize: imagenet}]",
            "data.eval.transforms=[{resize: 20}, {center_crop: 16}, {normalize: imagenet}]",
            *extra,
        ],
    ).data


IMAGENET_STD_LEVELS = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255  # normalised units -> uint8 levels


def test_gpu_backend_split_changes_who_decodes_not_what(tmp_path):
    """Run on the CPU device (decode_jpeg on CPU, the same decoder for both shares): any cpu_fraction gives
    the same crops, flips and cutouts. The GPU share resizes with resample_batch (torchvision's float
    arithmetic), the CPU share with torchvision's uint8 CPU kernel: pixels within one level, on a share
    of the pixels measured at 4-17% here (a different crop or flip moves most pixels by tens of levels)."""
    outs = {}
    for frac in (0.0, 0.3, 1.0):
        d = gpu_cfg(tmp_path, frac)
        loaders = build_gpu_loaders(d, DATASETS.get("synthetic_jpeg")(d), CPU, seed=3)
        loaders.train.set_epoch(1)
        outs[frac] = list(loaders.train)
        assert len(outs[frac]) == len(loaders.train) == 3
    for frac in (0.3, 1.0):
        for a, b in zip(outs[0.0], outs[frac]):
            levels = ((a[0] - b[0]) * IMAGENET_STD_LEVELS).abs()
            assert torch.equal(a[1], b[1]) and levels.max() < 1.01
            assert (levels > 0.5).float().mean() < 0.5  # measured 0.04-0.17 per batch (3x the largest)


def test_gpu_backend_resume_mid_epoch(tmp_path):
    d = gpu_cfg(tmp_path, 0.3)
    tr = build_gpu_loaders(d, DATASETS.get("synthetic_jpeg")(d), CPU, seed=3).train
    tr.set_epoch(0)
    full = list(tr)
    tr.set_epoch(0, start_batch=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[1:], list(tr)))


def test_cpu_share_split_rounding():
    assert [cpu_rows(10, f) for f in (0.0, 0.25, 0.3, 0.35, 1.0)] == [0, 3, 3, 4, 10]
    assert cpu_rows(7, 0.5) == 4


def test_auto_fraction_moves_toward_balance():
    """The tuner's two moves at a steady batch rate (one batch per clock tick; its rule on whole pipelines is in
    tests/e2e/gpu/test_data_gpu_host.py): up while the workers keep up, down while they make the producer wait."""
    t = FractionTuner(start=0.2, step=0.05, window=4)
    clock = iter(range(100))
    t.update(0.0, next(clock))  # the first batch starts the clock
    for _ in range(8):
        t.update(0.0, next(clock))  # workers always ready: give them more
    assert t.fraction == pytest.approx(0.3)
    for _ in range(12):
        t.update(0.01, next(clock))  # 10 ms waits: the CPU is the bottleneck
    assert t.fraction == pytest.approx(0.15)


@pytest.mark.parametrize("backend", ["gpu", "dali"], ids=["backend-gpu", "backend-dali"])
def test_gpu_backends_without_cuda_fail_clearly_or_fall_back(tmp_path, backend):
    d = gpu_cfg(tmp_path, 0.0, f"data.backend={backend}")
    with pytest.raises(UsageError, match="data.fallback=cpu"):
        build_loaders(d, CPU, seed=0)
    d = gpu_cfg(tmp_path, 0.0, f"data.backend={backend}", "data.fallback=cpu")
    with pytest.warns(UserWarning, match="using data.fallback=cpu"):
        loaders = build_loaders(d, CPU, seed=0)
    loaders.train.set_epoch(0)
    x, y = next(iter(loaders.train))
    assert x.shape == (5, 3, 16, 16)


def test_dali_is_registered_and_says_why_it_cannot_run():
    """dali is always a known name; where DALI does not import, cannot_run says so (build_loaders then refuses or
    falls back, as for gpu without CUDA)."""
    from torchsprint.data.backends.dali import NOT_INSTALLED, dali_available
    from torchsprint.data.core import as_backend

    why_not = as_backend(LOADERS.get("dali")).cannot_run(CPU)
    assert "dali" in LOADERS and why_not == (
        NOT_INSTALLED if not dali_available() else "needs a CUDA GPU: this machine has no CUDA device"
    )


@pytest.mark.gpu
def test_gpu_backend_on_cuda_matches_cpu_decode(tmp_path, figure):
    d = gpu_cfg(tmp_path, 0.0)
    splits = DATASETS.get("synthetic_jpeg")(d)
    cuda = build_gpu_loaders(d, splits, Runtime(torch.device("cuda")), seed=3).train
    host = build_gpu_loaders(d, splits, CPU, seed=3).train
    cuda.set_epoch(0)
    host.set_epoch(0)
    diffs = []
    for (a, ya), (b, yb) in zip(cuda, host):
        assert torch.equal(ya.cpu(), yb)
        diffs.append(((a.cpu() - b) * IMAGENET_STD_LEVELS).abs().flatten())
    mean = float(torch.cat(diffs).mean())
    figure("gpu_backend_cuda_vs_cpu_mean_levels", mean, "synthetic 40x30 JPEGs, random_resized_crop 16")
    # nvJPEG's IDCT/upsampling and float-vs-uint8 resize differ by a few levels; same crops and flips.
    # Provisional (no GPU in this session to measure it): the same bound as test_gpu.py's parity test, in
    # grey levels; it was 0.1 normalised units, i.e. ~6 levels, which a wrong chroma upsampling passes.
    assert mean < 2.0


@pytest.mark.gpu
def test_memory_backend_on_cuda_equals_cpu():
    cpu = build_loaders(mem_cfg(), CPU, seed=1).train
    gpu = build_loaders(mem_cfg(), Runtime(torch.device("cuda")), seed=1).train
    cpu.set_epoch(0)
    gpu.set_epoch(0)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a[0], b[0].cpu())


def test_uniforms_are_splitmix64_known_answers():
    """Against a plain-Python splitmix64 (uint64 arithmetic), the reference the vectorised int64 version must
    equal bit for bit: a changed constant, shift or counter moves every value (statistics would not notice)."""
    M = (1 << 64) - 1

    def ref(seed, k):
        out = []
        for i in range(1, k + 1):
            z = (seed + i * 0x9E3779B97F4A7C15) & M
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
            z ^= z >> 31
            out.append((z >> 11) / float(1 << 53))
        return out

    seeds = torch.tensor([0, 1, 42, -7, 2**62 + 12345], dtype=torch.int64)
    u = uniforms(seeds, 3)
    assert u.dtype == torch.float64 and u.shape == (5, 3)
    assert u.tolist() == [ref(int(s) & M, 3) for s in seeds]
    empty = uniforms(seeds, 0)
    assert empty.shape == (5, 0) and empty.dtype == torch.float64


def test_cpu_backend_train_and_eval_share_two_workers_and_match_a_worker_free_run():
    """One DataLoader (one set of persistent workers) serves both splits; batches equal those of a
    num_workers=0 run, an evaluation between epochs changes nothing, and an interrupted iteration refuses
    to resume once the other split took the workers."""
    import os

    def cfg(workers):
        return config.load(
            None,
            [
                "data.backend=cpu",
                "data.batch_size=64",
                f"data.num_workers={workers}",
                "data.train.transforms=[{random_crop: {size: 8, padding: 2}}, hflip, {normalize: half}]",
                "data.eval.transforms=[{normalize: half}]",
            ],
        ).data

    ref, shared = build_loaders(cfg(0), CPU, seed=3), build_loaders(cfg(2), CPU, seed=3)
    assert shared.train.loader.shared is shared.val.loader.shared
    want = []
    for loaders, out in ((ref, want), (shared, got := [])):
        for epoch in (0, 1):
            loaders.train.set_epoch(epoch)
            out += list(loaders.train)
            loaders.val.set_epoch(0)
            out += list(loaders.val)
    assert len(got) == len(want) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    workers = shared.train.loader.shared._iterator._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)  # persistent: the same two, for both splits
    assert {w.pid for w in workers} <= {int(p) for p in os.listdir("/proc") if p.isdigit()}
    shared.train.set_epoch(2)
    it = iter(shared.train)
    next(it)
    next(iter(shared.val))
    with pytest.raises(RuntimeError, match="share their worker processes"):
        next(it)


def test_cpu_backend_gathers_decoded_batches_at_once_with_the_same_values():
    """Already-decoded images without per-sample transforms are fetched as one gather per batch
    (SeededTransform.__getitems__); the batches equal the per-sample path's, exactly."""
    from torchsprint.data.backends.cpu import KeyBatch, SeededTransform, collate

    loaders = build_loaders(config.load(None, ["data.backend=cpu", "data.batch_size=32"]).data, CPU, seed=0)
    ds = loaders.train.loader.shared.dataset
    assert isinstance(ds, SeededTransform) and ds.transforms[0] is None  # digits' default spec: normalize only
    indices = [7, 0, 500, 3, 1000]
    fast = collate(ds.__getitems__(KeyBatch((0, indices, [1000 + i for i in indices]))))
    slow = collate([ds[(0, i, 1000 + i)] for i in indices])
    assert torch.equal(fast[0], slow[0]) and fast[0].dtype == slow[0].dtype == torch.uint8
    assert torch.equal(fast[1], slow[1]) and fast[1].dtype == slow[1].dtype == torch.int64

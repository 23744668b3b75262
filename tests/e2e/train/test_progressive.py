"""Progressive resizing (data.progressive): the training crop's side per epoch on every backend.

References: FFCV's get_resolution formula (the schedule), the same backend configured with a fixed crop of that
epoch's size (each batch), an uninterrupted run (resume mid-ramp), a counting torch.compile backend (graphs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_folder
from torchsprint import config, runtime
from torchsprint.data import DATASETS, LOADERS, build_loaders
from torchsprint.data.backends.gpu import build_gpu_loaders
from torchsprint.data.core import Backend
from torchsprint.data.preprocess.progressive import Schedule, train_schedule
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime
from torchsprint.train.build import build_training
from torchsprint.train.run import train

CPU = Runtime(torch.device("cpu"))

# start 8, end 16, step 4, ramp from epoch 1 to epoch 4: 8 + 8 * (e - 1) / 3 = 8, 10.67, 13.33, 16, 16 -> nearest
# multiples of 4. Worked out by hand: the reference the loaders and the compile test are held to.
RAMP = "data.progressive={start_size: 8, end_epoch: 4, step: 4}"
SIZES = [8, 12, 12, 16, 16]


# ---------------------------------------------------------------- the schedule


def ffcv_resolution(epoch: int, min_res: int, max_res: int, start_ramp: int, end_ramp: int, res_step: int) -> int:
    """ffcv-imagenet train_imagenet.py get_resolution (epochs from 0), copied with its 32 made `res_step`: the
    independent reference."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / res_step)) * res_step


def test_schedule_is_ffcvs_formula_with_halves_rounded_up():
    cases = [
        (160, 192, 65, 76, 32, 88),
        (128, 224, 2, 12, 32, 16),
        (64, 256, 0, 9, 32, 12),
        (8, 16, 0, 3, 4, 5),
        (96, 160, 4, 20, 16, 24),
        (32, 64, 1, 2, 8, 4),
    ]
    ties = 0
    for lo, hi, start_ramp, end_ramp, step, epochs in cases:
        s = Schedule(lo, hi, start_ramp + 1, end_ramp + 1, step)  # ours counts epochs from 1, as the log prints
        for e in range(epochs):
            exact = lo + (hi - lo) * (e - start_ramp) / (end_ramp - start_ramp)
            if start_ramp < e < end_ramp and math.isclose((exact / step) % 1, 0.5):
                ties += 1  # numpy rounds a tie to even; ours rounds it up (the larger size)
                assert s.size(e) == math.floor(exact / step + 0.5) * step
                continue
            assert s.size(e) == ffcv_resolution(e, lo, hi, start_ramp, end_ramp, step), (lo, hi, e)
    assert ties == 5  # 128 -> 224 at epoch 7 is 176 = 5.5 x 32 (numpy: 160, ours: 192); 96 -> 160 has 4 more
    assert Schedule(8, 16, 1, 4, 4).sizes(5) == SIZES
    assert Schedule(8, 16, 1, 4, 4).describe(5) == "8 (epoch 1), 12 (epochs 2-3), 16 (epochs 4-5)"


# ---------------------------------------------------------------- every backend's batches


def data_cfg(root, *extra, crop=16):
    return config.load(
        None,
        [
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.batch_size=4",
            "data.decoder=torchvision",
            f"data.train.transforms=[random_resized_crop: {{size: {crop}, scale: [0.3, 1]}}, hflip, "
            "normalize: imagenet]",
            "data.eval.transforms=[resize: [16, 16], normalize: imagenet]",
            # the files themselves: the decoded-image cache sizes them for each run's crop, so a
            # fixed small crop's run would read smaller images than the ramp's
            "data.cache=off",
            *extra,
        ],
    ).data


def loaders_of(backend: str, d):
    """The backend's loaders on the CPU device; gpu runs its own code there (torchvision's CPU decoder for nvJPEG)."""
    if backend == "gpu":
        return build_gpu_loaders(d, DATASETS.get(d.dataset)(d), CPU, seed=3, channels_last=True)
    return build_loaders(d.model_copy(update={"backend": backend}), CPU, seed=3, channels_last=True)


def epoch_batches(loader, epoch: int) -> list[torch.Tensor]:
    loader.set_epoch(epoch)
    return [x for x, _ in loader]


# Workers on (persistent, as by default): the side set in the main process must reach them. gpu: half of every
# batch is decoded and cropped by the workers (the CPU share), half by the producer thread (the "GPU" share).
BACKENDS = {"cpu": ["data.num_workers=1"], "memory": [], "gpu": ["data.num_workers=1", "data.cpu_fraction=0.5"]}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_epochs_batches_are_the_fixed_size_runs_crops_at_that_size(tmp_path, backend):
    """Epoch e's batches: SIZES[e] square, channels_last, and pixel for pixel what the same backend gives with a
    fixed random_resized_crop of that size in that epoch; evaluation keeps data.eval.transforms' size."""
    root = make_image_folder(tmp_path / "img", per_class=5, size=(24, 20))
    loaders = loaders_of(backend, data_cfg(root, RAMP, *BACKENDS[backend]))
    fixed = {s: loaders_of(backend, data_cfg(root, *BACKENDS[backend], crop=s)).train for s in sorted(set(SIZES))}
    for epoch, side in enumerate(SIZES):
        got = epoch_batches(loaders.train, epoch)
        want = epoch_batches(fixed[side], epoch)
        assert len(got) == len(want) == 2
        for x, ref in zip(got, want):
            assert tuple(x.shape[-2:]) == (side, side), (epoch, tuple(x.shape))
            assert x.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(x, ref), (backend, epoch)
        assert {tuple(x.shape[-2:]) for x in epoch_batches(loaders.val, 0)} == {(16, 16)}
    # Mid-epoch (a resumed run's start_batch) crops at the epoch's size too, and the same samples as from the start.
    loaders.train.set_epoch(2, start_batch=1)
    assert torch.equal(next(iter(loaders.train))[0], epoch_batches(fixed[SIZES[2]], 2)[1])


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_webdataset_shards_crop_at_the_epochs_size(tmp_path, backend):
    """Streamed shards: DataLoader workers make whole batches from their own shards (sources/shard_stream.py), and
    read the epoch's side like the folder path does; the same samples as a fixed crop of that size."""
    from test_data_webdataset import write_shards

    root = write_shards(tmp_path / "shards", [5, 3, 7, 4], split="train")
    write_shards(root, [3], split="val", index=False, start=100)

    def loader(*extra):
        d = config.load(
            None,
            [
                "data.dataset=webdataset",
                f"data.root={root}",
                "data.batch_size=4",
                "data.num_workers=2",
                "data.decoder=torchvision",
                "data.eval.transforms=[resize: [8, 8]]",
                *extra,
            ],
        ).data
        return loaders_of(backend, d).train

    crop = "data.train.transforms=[random_resized_crop: {size: %d}, hflip]"
    ramp = loader(crop % 8, "data.progressive={start_size: 4, end_epoch: 3, step: 2}")
    for epoch, side in enumerate([4, 6, 8]):
        got, want = epoch_batches(ramp, epoch), epoch_batches(loader(crop % side), epoch)
        assert [tuple(x.shape[-2:]) for x in got] == [(side, side)] * len(want) and len(want) >= 4
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (backend, epoch)


# ---------------------------------------------------------------- resume mid-ramp

STEPS_PER_EPOCH = 7  # digits, half held out: 898 training images // 128
# DDP against one process in float64 (precision=fp64). In fp32 the two differ by float rounding amplified over the
# 21 steps, and by how much depends on the CPU's kernels: 1.13e-6 on an Intel Xeon (AVX2), 1.12e-3 on an AMD EPYC
# (AVX2, and with ATEN_CPU_CAPABILITY=default) and on an AMD EPYC with AVX-512. In fp64 the same runs agree to
# 1.0e-15 (AVX2) and 1.4e-15 (default kernels) on the AMD EPYC: the ranks compute what one process computes, and the
# fp32 gap was amplification of summation order, not a difference. A bug moves them by far more: a DDP run whose
# ramp starts at 6 px instead of 4 differs by 0.19, one that ends an epoch early by 0.073.
DDP_TOLERANCE = 1e-9
BASE = [
    "model.args={width: 8, dropout: 0.2}",
    "run.epochs=3",
    "data.batch_size=128",
    "data.val_fraction=0.5",
    "data.train.transforms=[random_resized_crop: {size: 8, scale: [0.35, 1]}, hflip]",
    "eval.per_class=false",
    "data.progressive={start_size: 4, end_epoch: 3, step: 2}",  # 4, 6, 8: the pause is in the 6 px epoch
    "log.tensorboard=false",
    "log.progress=false",
    "checkpoint.every_steps=5",
    "optim.lr=0.05",
]


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_resume_mid_ramp_is_bit_identical_to_an_uninterrupted_run(tmp_path, backend):
    def run(d, *extra):
        return train(config.load(None, [*BASE, f"data.backend={backend}", f"run.dir={d}", *extra]), quiet=True)

    ref = run(tmp_path / "ref")
    paused = run(tmp_path / "cut", "run.stop_after_steps=10")  # epoch 2 (6 px), step 3 of 7
    assert paused["paused"] and paused["global_step"] == STEPS_PER_EPOCH + 3
    done = run(tmp_path / "cut", "checkpoint.resume=auto")
    assert done["global_step"] == ref["global_step"] == 3 * STEPS_PER_EPOCH
    a, b = load_file(str(tmp_path / "ref" / "last.safetensors")), load_file(str(tmp_path / "cut" / "last.safetensors"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert done["final"] == ref["final"]


@pytest.mark.slow  # 12 s of DDP; the one-process schedule stays in the main suite
@pytest.mark.dist
def test_two_ddp_ranks_follow_the_schedule_as_one_process_does(tmp_path, run_cli):
    """torchrun, 2 gloo processes x 64 images per step against one process x 128: the same samples per step, each
    cropped by its own seed at the epoch's size (4, 6, 8), so with SyncBatchNorm the weights agree up to float64
    rounding. A rank on another size, or another epoch's size, moves them by far more."""
    common = [
        *BASE[1:],
        "model.args={width: 8}",
        "data.backend=memory",
        "strategy.sync_bn=true",
        "checkpoint.every_steps=null",
        "precision=fp64",
    ]
    single = train(config.load(None, [*common, f"run.dir={tmp_path / 'one'}"]), quiet=True)
    proc = run_cli(
        "train", "--nproc-per-node", "2", *common, "data.batch_size=64", f"run.dir={tmp_path / 'ddp'}", timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert single["global_step"] == 3 * STEPS_PER_EPOCH
    a, b = load_file(str(tmp_path / "one" / "last.safetensors")), load_file(str(tmp_path / "ddp" / "last.safetensors"))
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    print(f"max |w_ddp - w_one| = {diff:.2e}")
    assert diff < DDP_TOLERANCE, diff


# ---------------------------------------------------------------- torch.compile: one graph per size


def test_compile_builds_one_static_graph_per_scheduled_size(tmp_path):
    """Over 5 epochs of sizes 8, 12, 12, 16, 16 the training forward is compiled 3 times, once per size, each graph
    specialised (no symbolic sizes); evaluation adds its full and its last partial batch. channels_last on."""
    import torch._dynamo

    graphs: list[tuple] = []

    def counting(gm, example_inputs):
        # The batch among the graph's inputs: the placeholders that are not the module's own parameters and buffers.
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        batch = [
            t
            for n, t in zip(names, example_inputs)
            if "_parameters_" not in n and "_buffers_" not in n and isinstance(t, torch.Tensor)
        ]
        assert len(batch) == 1, names
        # A graph dynamic in a size takes that size as a SymInt input (torch's default from the second size on).
        symbolic = any(isinstance(t, torch.SymInt) for t in example_inputs) or any(
            isinstance(d, torch.SymInt) for d in batch[0].shape
        )
        graphs.append((tuple(batch[0].shape), symbolic))
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.register_backend(counting, name="progressive_count")
    root = make_image_folder(tmp_path / "img", per_class=9, size=(24, 20))  # 18 train (4 batches of 4), 18 val
    train(
        config.load(
            None,
            [
                "data.dataset=image_folder",
                f"data.root={root}",
                "data.batch_size=4",
                "data.eval_batch_size=8",
                "data.train.transforms=[random_resized_crop: {size: 16}, hflip]",
                "data.eval.transforms=[resize: [16, 16]]",
                RAMP,
                "run.epochs=5",
                "model.args={width: 4}",
                "speed.compile=true",
                "speed.compile_backend=progressive_count",
                "speed.fullgraph=true",
                "speed.channels_last=true",
                "log.tensorboard=false",
                "log.progress=false",
                "data.backend=memory",
                f"run.dir={tmp_path / 'run'}",
                "eval.per_class=false",
            ],
        ),
        quiet=True,
    )
    torch._dynamo.reset()
    assert not any(symbolic for _, symbolic in graphs), graphs
    assert sorted(shape for shape, _ in graphs) == [
        (2, 3, 16, 16),
        (4, 3, 8, 8),
        (4, 3, 12, 12),
        (4, 3, 16, 16),
        (8, 3, 16, 16),
    ], graphs  # evaluation: 8 a batch, the last 2 of 18


# ---------------------------------------------------------------- bad input


def refused(*over, match: str, build_it: bool = True):
    base = ["model.args={width: 4}", "log.tensorboard=false", "log.progress=false"]
    with pytest.raises(UsageError, match=match):
        cfg = config.load(None, [*base, *over])
        if build_it:
            rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
            try:
                build_training(cfg, rt, lambda m: None)
            finally:
                runtime.teardown(rt)


CROP = "data.train.transforms=[random_resized_crop: {size: 8}]"


@pytest.mark.parametrize(
    "over, match",
    [
        (["data.progressive={start_size: 8, end_size: 4, end_epoch: 3, step: 4}"], "end_size=4 is below start_size=8"),
        (
            ["data.progressive={start_size: 6, end_epoch: 3, step: 4}"],
            "start_size=6 is not a multiple of step=4; use 4",
        ),
        (["data.progressive={start_size: 4, end_size: 10, end_epoch: 3, step: 4}"], "end_size=10 is not a multiple"),
        (["data.progressive={start_size: 4}"], "set end_epoch too"),
        (["data.progressive={start_size: 4, start_epoch: 3, end_epoch: 3}"], "must come after start_epoch=3"),
        (["data.progressive.end_epoch=5"], "end_epoch has no effect without data.progressive.start_size"),
        (["data.progressive={begin: 4}"], r"data.progressive.begin: unknown key"),
    ],
)
def test_bad_schedules_are_refused_by_the_config(over, match):
    refused(CROP, *over, match=match, build_it=False)


@pytest.mark.parametrize(
    "over, match",
    [
        (
            ["data.train.transforms=[random_crop: {size: 8, padding: 1}]"],
            r"resizes the output of random_resized_crop, and data.train.transforms has none \(\['random_crop'\]\)",
        ),
        (["data.train.transforms=[random_resized_crop: {size: [8, 6]}]"], "not one square side"),
        (
            [CROP, "data.progressive.end_size=16"],
            "end_size=16 differs from data.train.transforms.0. random_resized_crop size 8",
        ),
        (
            [
                "data.train.transforms=[random_resized_crop: {size: 6}]",
                "data.progressive.step=4",
                "data.progressive.start_size=4",
            ],
            r"final size \(data.train.transforms\[0\] random_resized_crop "
            r"size 6\) is not a multiple of data.progressive.step=4",
        ),
        (
            ["data.train.transforms=[random_resized_crop: {size: 4}]", "data.progressive.start_size=8"],
            "start_size=8 is above",
        ),
        ([CROP, "speed.cuda_graphs=true"], "speed.cuda_graphs=true captures one input shape"),
        (
            [
                CROP,
                "data.progressive.step=1",
                "data.progressive.start_size=1",
                "data.progressive.end_epoch=8",
                "run.epochs=8",
                "speed.compile=true",
                "speed.compile_backend=eager",
            ],
            r"8 training sizes .* over torch's 8 per model",
        ),
        (["task=video", CROP], "task=video: data.progressive is not supported"),
        ([CROP, "run.epochs=2"], r"end_epoch=3 comes after the run's last epoch \(run.epochs=2\)"),
    ],
)
def test_settings_it_cannot_honour_are_refused_at_start(over, match):
    import torch._dynamo

    # torch's default limit: importing timm.optim (kron.py) sets it to 1,000,000 for the whole process, and an
    # earlier test in the same worker may have imported it (the check reads the limit in force, as torch does).
    with torch._dynamo.config.patch(recompile_limit=8):
        refused("data.progressive={start_size: 4, end_epoch: 3, step: 2}", *over, match=match)


def test_a_backend_that_does_not_resize_per_epoch_is_refused(tmp_path):
    LOADERS.register("fixed_only")(Backend(LOADERS.get("cpu").build))  # progressive=False: a user's backend
    try:
        refused(
            CROP,
            "data.progressive={start_size: 4, end_epoch: 3, step: 2}",
            "data.backend=fixed_only",
            match=r"data.backend=fixed_only does not resize its crop per epoch \(backends that do: .*cpu",
        )
    finally:
        LOADERS._items.pop("fixed_only", None)


def test_cuda_graphs_auto_stays_off_and_says_why():
    from torchsprint.runtime.parallel import decide_cuda_graphs

    cfg = config.load(None, [CROP, "data.progressive={start_size: 4, end_epoch: 3, step: 2}"])
    d = decide_cuda_graphs(cfg.speed, cfg.strategy, torch.device("cuda"), progressive=True)
    assert not d.on and "no data.progressive" in d.why
    assert train_schedule(cfg.data) == Schedule(4, 8, 1, 3, 2)


def test_the_cli_says_one_line_and_exits_2(cli_in_process):
    p = cli_in_process(
        "train",
        "data.train.transforms=[hflip]",
        "data.progressive={start_size: 4, end_epoch: 3, step: 2}",
        "run.epochs=1",
        "log.progress=false",
    )
    assert p.returncode == 2, p.stderr
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "add random_resized_crop: {size: END} to it, or remove data.progressive" in lines[0], (
        lines
    )

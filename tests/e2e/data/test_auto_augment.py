"""Automatic augmentation: the cpu steps are torchvision's transforms under the same seed; the batched
(memory/gpu) TrivialAugmentWide and RandAugment equal torchvision op by op and draw ops like it."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torchvision.transforms import v2

from torchsprint.data.core import sample_seeds
from torchsprint.data.preprocess.augment import compile_batch_spec, uniforms
from torchsprint.data.preprocess.batch_auto_augment import apply_aug_op
from torchsprint.data.preprocess.transforms import compile_spec
from torchsprint.errors import UsageError

TA, RA = v2.TrivialAugmentWide(), v2.RandAugment()
OPS = list(v2.TrivialAugmentWide._AUGMENTATION_SPACE)


def assert_same_image(got: torch.Tensor, ref: torch.Tensor, what=None) -> None:
    """Equal to torchvision up to its own kernel dependence: at most 1 grey level on at most 1% of the values.
    torchvision's _blend (Color, Contrast, Sharpness: img.mul(r).add_(other, alpha=1 - r)) rounds once where ATen's
    vectorized kernels fuse the multiply-add, twice under ATEN_CPU_CAPABILITY=default; the batched ops round once.
    Measured on an AMD EPYC: AVX2 kernels 0 values differ; default kernels 1 level on 4-118 values of 17,280-61,440.
    A wrong magnitude, sign or op moves most values by several levels."""
    d = (got.int() - ref.int()).abs()
    assert got.shape == ref.shape and int(d.max()) <= 1 and int((d > 0).sum()) <= 0.01 * d.numel(), (
        what,
        int(d.max()),
        int((d > 0).sum()),
    )


def images(shape, n=12, seed=0):
    return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_every_batched_op_equals_torchvision_on_each_image(name, interpolation):
    """Each sample its own magnitude (every 2nd bin, alternating signs): torchvision's own op on that image
    (bit-identical under vectorized kernels; see assert_same_image), for a non-square RGB, a square RGB (rot90 fast
    paths) and a grey image."""
    for shape in [(3, 20, 24), (3, 16, 16), (1, 12, 15)]:
        x = images(shape)
        for t in (TA, RA):
            fn, signed = type(t)._AUGMENTATION_SPACE[name]
            values = fn(31, shape[1], shape[2])
            mags = (
                [0.0] * 12
                if values is None
                else [float(values[2 * i % 31]) * (-1 if signed and i % 2 else 1) for i in range(12)]
            )
            got = apply_aug_op(x, name, mags, interpolation)
            ref = torch.stack(
                [
                    t._apply_image_or_video_transform(
                        x[i], name, mags[i], interpolation=v2.InterpolationMode(interpolation), fill=t._fill
                    )
                    for i in range(12)
                ]
            )
            assert_same_image(got, ref, (shape, type(t).__name__))


@pytest.mark.parametrize(
    "step, ref",
    [
        ("rand_augment", v2.RandAugment()),
        ({"rand_augment": {"num_ops": 3, "magnitude": 14}}, v2.RandAugment(3, 14)),
        ("trivial_augment_wide", v2.TrivialAugmentWide()),
        ("auto_augment", v2.AutoAugment()),
        ({"auto_augment": {"policy": "cifar10"}}, v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10)),
        ("augmix", v2.AugMix()),
    ],
)
def test_cpu_steps_equal_torchvision_under_the_same_generator_state(step, ref):
    pipe = compile_spec([step]).cpu
    img = images((3, 20, 24), n=1)[0]
    for seed in range(30):
        torch.manual_seed(seed)
        a = pipe(img)
        torch.manual_seed(seed)
        assert torch.equal(a, ref(img)), seed


def reference_per_sample(x, u, t, num_ops, magnitude=None):
    """torchvision's ops applied image by image with the op, bin and sign each sample's uniforms chose."""
    out = []
    names = list(type(t)._AUGMENTATION_SPACE)
    for i in range(len(x)):
        img = x[i]
        for j in range(num_ops):
            name = names[int(u[i, 3 * j] * len(names))]
            fn, signed = type(t)._AUGMENTATION_SPACE[name]
            values = fn(31, img.shape[-2], img.shape[-1])
            mag = 0.0
            if values is not None:
                mag = float(values[magnitude if magnitude is not None else int(u[i, 3 * j + 1] * 31)])
                mag = -mag if signed and u[i, 3 * j + 2] <= 0.5 else mag
            img = t._apply_image_or_video_transform(img, name, mag, interpolation=t.interpolation, fill=t._fill)
        out.append(img)
    return torch.stack(out)


@pytest.mark.parametrize(
    "step, t, num_ops, magnitude", [("trivial_augment_wide", TA, 1, None), ("rand_augment", RA, 2, 9)]
)
def test_batched_pipeline_gives_each_sample_its_own_op(step, t, num_ops, magnitude):
    p = compile_batch_spec([step], "data.train.transforms", 3, "memory")
    x = images((3, 16, 20), n=64)
    seeds = sample_seeds(3, 1, torch.arange(64))
    got = p(x, seeds)
    assert_same_image(got, reference_per_sample(x, uniforms(seeds, p.k), t, num_ops, magnitude))
    assert torch.equal(p(x[10:20], seeds[10:20]), got[10:20])  # a sample does not depend on its batch


def test_op_and_magnitude_frequencies_match_torchvisions_trivial_augment():
    """20,000 draws of (op, bin) from the batched params vs 20,000 from torchvision's TrivialAugmentWide
    draw sequence (torch.randint over the table, then over the bins): chi-squared test of homogeneity."""
    p = compile_batch_spec(["trivial_augment_wide"], "t", 3, "memory")
    n = 20000
    (prm,) = p.params(p.draw(sample_seeds(0, 0, torch.arange(n))), torch.full((n,), 32), torch.full((n,), 32))
    ours_op, ours_bin = prm["_op"][:, 0], prm["_bin"][:, 0]
    torch.manual_seed(0)
    ref_op, ref_bin = [], []
    for _ in range(n):
        key, _ = TA._get_random_item(TA._AUGMENTATION_SPACE)
        ref_op.append(OPS.index(key))
        ref_bin.append(int(torch.randint(31, ())))
    for ours, ref, k in ((ours_op, ref_op, 14), (ours_bin, ref_bin, 31)):
        table = [torch.bincount(ours, minlength=k).tolist(), torch.bincount(torch.tensor(ref), minlength=k).tolist()]
        assert stats.chi2_contingency(table).pvalue > 1e-3
        assert min(table[0]) > n / k * 0.8  # every op / bin drawn about equally often


def test_batched_backends_refuse_what_they_cannot_run_naming_cpu():
    for step in ("auto_augment", "augmix"):
        with pytest.raises(UsageError, match=f"step '{step}' is not supported by data.backend=gpu.*data.backend=cpu"):
            compile_batch_spec([step], "data.train.transforms", 3, "gpu")
    for arg, match in (
        ({"fill": 128}, "fill"),
        ({"interpolation": "bicubic"}, "nearest and bilinear"),
        ({"magnitude": 31}, "magnitude=31"),
    ):
        with pytest.raises(UsageError, match=match):
            compile_batch_spec([{"rand_augment": arg}], "t", 3, "memory")
    with pytest.raises(UsageError, match="policy"):
        compile_spec([{"auto_augment": {"policy": "imagenet1k"}}])


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_training_with_auto_augmentation_runs_on_digits(tmp_path, backend):
    from safetensors.torch import load_file

    from torchsprint import config
    from torchsprint.train.run import train

    common = [
        "model.args={width: 8}",
        "log.tensorboard=false",
        "log.progress=false",
        "run.max_steps=3",
        f"data.backend={backend}",
    ]
    cfg = config.load(
        None, [*common, "data.train.transforms=[trivial_augment_wide, rand_augment]", f"run.dir={tmp_path / 'r'}"]
    )
    assert train(cfg, quiet=True)["global_step"] == 3
    # and the steps were applied: the same run without them trains other weights
    train(config.load(None, [*common, f"run.dir={tmp_path / 'plain'}"]), quiet=True)
    a, b = load_file(str(tmp_path / "r" / "last.safetensors")), load_file(str(tmp_path / "plain" / "last.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)

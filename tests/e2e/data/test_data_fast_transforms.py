"""The cpu backend's fast uint8 transforms against torchvision v2 (the independent reference): same random
draws, same pixels; the in-place DeviceNormalize against the plain formula; worker collation into
shared memory against a single-process loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2

from paths import TESTS
from torchsprint import config
from torchsprint.data import build_loaders
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.data.preprocess.transforms import compile_spec
from torchsprint.runtime.core import Runtime


def images():
    """Planar, channels-last and cropped (strided) uint8 images, 1/3/4 channels, odd and tiny sizes
    (7x300 and 300x7 force RandomResizedCrop's central-crop fallback)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for c, h, w in [(3, 75, 100), (3, 7, 300), (3, 300, 7), (1, 33, 17), (4, 20, 20), (3, 120, 18), (6, 40, 30)]:
        x = torch.randint(0, 256, (c, h, w), dtype=torch.uint8, generator=g)
        out += [x, x.permute(1, 2, 0).contiguous().permute(2, 0, 1)]
    big = torch.randint(0, 256, (90, 120, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
    return out + [big, big[:, 5:80, 7:100]]


SPECS = {
    "rrc+hflip": (
        [{"random_resized_crop": {"size": 24}}, "hflip"],
        v2.Compose([v2.RandomResizedCrop(24), v2.RandomHorizontalFlip()]),
    ),
    "rrc rect+vflip": (
        [{"random_resized_crop": {"size": [12, 20], "scale": [0.5, 1.0], "ratio": [0.5, 2.0]}}, {"vflip": 0.3}],
        v2.Compose([v2.RandomResizedCrop([12, 20], scale=(0.5, 1.0), ratio=(0.5, 2.0)), v2.RandomVerticalFlip(0.3)]),
    ),
    "eval resize+center_crop": ([{"resize": 28}, {"center_crop": 24}], v2.Compose([v2.Resize(28), v2.CenterCrop(24)])),
    "resize max_size": ([{"resize": {"size": 16, "max_size": 30}}], v2.Resize(16, max_size=30)),
    "bicubic": (
        [{"resize": {"size": [10, 14], "interpolation": "bicubic"}}],
        v2.Resize([10, 14], interpolation=v2.InterpolationMode.BICUBIC),
    ),
    "nearest": (
        [{"resize": {"size": 9, "interpolation": "nearest"}}],
        v2.Resize(9, interpolation=v2.InterpolationMode.NEAREST),
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_fast_transforms_equal_torchvision_v2_pixels_and_random_draws(name):
    spec, ref = SPECS[name]
    fast = compile_spec(spec, "t", 3).cpu
    for k, x in enumerate(images()):
        for s in range(8):
            torch.manual_seed(1000 * k + s)
            try:
                a = ref(x)
            except RuntimeError:  # e.g. max_size shrinks 7x300 to 0 rows: the fast path must refuse it too
                with pytest.raises(RuntimeError):
                    fast(x)
                continue
            after_a = torch.rand(3)
            torch.manual_seed(1000 * k + s)
            b, after_b = fast(x), torch.rand(3)
            assert a.shape == b.shape and torch.equal(a, b), (name, k, s)
            assert torch.equal(after_a, after_b), "the fast transforms must consume the same random numbers"


def test_fast_transforms_pass_other_inputs_to_torchvision():
    fast = compile_spec([{"random_resized_crop": {"size": 8}}, "hflip"], "t", 3).cpu
    ref = v2.Compose([v2.RandomResizedCrop(8), v2.RandomHorizontalFlip()])
    x = torch.rand(3, 20, 30)
    torch.manual_seed(0)
    a = ref(x)
    torch.manual_seed(0)
    assert torch.equal(fast(x), a)


def test_device_normalize_in_place_equals_the_formula_and_leaves_the_input_alone():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    norm = DeviceNormalize(mean, std, torch.device("cpu"))
    scale = 1.0 / (255.0 * torch.tensor(std).view(1, 3, 1, 1))
    shift = -torch.tensor(mean).view(1, 3, 1, 1) / torch.tensor(std).view(1, 3, 1, 1)
    x = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8)
    x0 = x.clone()
    assert torch.equal(norm(x), torch.addcmul(shift, x.float(), scale))  # export.WithNormalize's arithmetic
    assert torch.equal(x, x0)
    xf = x.float()
    assert torch.equal(norm(xf), torch.addcmul(shift, x.float(), scale)) and torch.equal(xf, x.float())
    assert torch.equal(norm(x[0]), torch.addcmul(shift, x[0].float(), scale))  # one CHW image
    cl = DeviceNormalize(mean, std, torch.device("cpu"), channels_last=True)(x)
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, norm(x))


def cpu_backend_batches(root, workers: int) -> list:
    """Epoch 2's training batches and the validation batches of the cpu backend over `root` (seed 5)."""
    cfg = config.load(
        None,
        [
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.batch_size=4",
            f"data.num_workers={workers}",
            "data.train.transforms=[{random_resized_crop: {size: 16}}, hflip, {normalize: imagenet}]",
            "data.eval.transforms=[{resize: 18}, {center_crop: 16}, {normalize: imagenet}]",
        ],
    )
    loaders = build_loaders(cfg.data, Runtime(torch.device("cpu")), seed=5)
    loaders.train.set_epoch(2)
    return list(loaders.train) + list(loaders.val)


def test_cpu_backend_batches_from_workers_equal_single_process(image_folder, tmp_path):
    """Worker processes give the batches the main process gives. The main-process reference is computed in a fresh
    interpreter: with no workers, each sample's torchvision transforms draw from torch's global CPU generator (seeded
    per sample, then restored), and any other thread of the process drawing from it meanwhile changes that sample's
    augmentation. Shown by experiment (a thread calling torch.rand during the reference: the first three batches
    differ); a thread some earlier test left alive in the pytest process is the one explanation found for the single
    failure in a full -n 2 run, where the first batch's images differed. torchsprint's own threads never draw from
    it (the gpu backend's producer uses the samples' seeds)."""
    import subprocess
    import sys

    out = tmp_path / "ref.pt"
    code = (
        f"import sys, torch; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(TESTS)!r}]; "
        f"from test_data_fast_transforms import cpu_backend_batches; "
        f"torch.save(cpu_backend_batches({str(image_folder)!r}, 0), {str(out)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ref, got = torch.load(out, weights_only=False), cpu_backend_batches(image_folder, 2)
    assert len(ref) == len(got) > 2
    for i, ((a, ya), (b, yb)) in enumerate(zip(ref, got)):
        assert torch.equal(ya, yb), f"batch {i}: labels differ (the order): {ya} vs {yb}"
        assert torch.equal(a, b), f"batch {i}: images differ (the augmentation)"


def test_recycled_normalize_buffers_never_overwrite_a_batch_still_referenced():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    plain = DeviceNormalize(mean, std, torch.device("cpu"))
    rec = DeviceNormalize(mean, std, torch.device("cpu"), recycle=True)
    xs = [
        torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        for i in range(4)
    ]
    held = [rec(x) for x in xs]  # more batches alive than the pool keeps
    for h, x in zip(held, xs):
        assert torch.equal(h, plain(x))
    ptr = held[0].data_ptr()
    view, arr = held[1][0], held[2].numpy()
    del held
    again = [rec(x) for x in xs[:3]]
    assert ptr in {a.data_ptr() for a in again}, "a released buffer is handed out again"
    assert torch.equal(view, plain(xs[1])[0]) and torch.equal(torch.from_numpy(arr), plain(xs[2])), "views stay intact"
    for a, x in zip(again, xs):
        assert torch.equal(a, plain(x))

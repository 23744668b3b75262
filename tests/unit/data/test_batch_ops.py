"""The batched crop + resize (batch_ops.resample_batch) against torchvision's per-image kernels, and the
fused heads of the batched pipelines against running the same steps image by image."""

import pytest
import torch
from torchvision.transforms.v2 import functional as F

from torchsprint.data.core import sample_seeds
from torchsprint.data.preprocess.augment import compile_batch_spec
from torchsprint.data.preprocess.batch_geometry import RandomResizedCrop, resample_batch


def one(v):
    return torch.tensor([v])


def random_windows(g, n):
    """n random (image, window, output size) cases, upsampling and downsampling, odd sizes."""
    for _ in range(n):
        H, W = (int(v) for v in torch.randint(8, 90, (2,), generator=g))
        h, w = int(torch.randint(1, H + 1, (), generator=g)), int(torch.randint(1, W + 1, (), generator=g))
        t, left = int(torch.randint(0, H - h + 1, (), generator=g)), int(torch.randint(0, W - w + 1, (), generator=g))
        oh, ow = (int(v) for v in torch.randint(3, 60, (2,), generator=g))
        yield torch.randint(0, 256, (3, H, W), dtype=torch.uint8, generator=g), (t, left, h, w), (oh, ow)


def off_ties(got: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """(pixels of `got` that differ from round(ref), the farthest such ref value from a .5 rounding tie).

    Differences at ties are float summation order (torch's kernels and resample_batch add the same
    terms in another order); any real error (wrong window, filter or weights) lands far from a tie."""
    off = got.float() != ref.round().clamp(0, 255)
    worst = float((ref[off] - ref[off].floor() - 0.5).abs().max()) if off.any() else 0.0
    return int(off.sum()), worst


@pytest.mark.parametrize("antialias", [True, False])
def test_resample_matches_torchvision_resized_crop(antialias):
    """Reference: torchvision's F.resized_crop. Its float path (what it runs on CUDA for uint8 images) is
    matched except at rounding ties: measured 0.29-0.35% of pixels on these small odd sizes, each within
    4e-4 of a .5 tie. Its CPU uint8 kernel rounds between its two passes and uses fixed-point weights:
    measured +-1 on 13-20% of pixels, never more."""
    g = torch.Generator().manual_seed(0)
    off_float = off_uint8 = total = 0
    for img, (t, left, h, w), (oh, ow) in random_windows(g, 60):
        got = resample_batch(
            img[None],
            (one(t), one(h), one(oh), one(0)),
            (one(left), one(w), one(ow), one(0)),
            (oh, ow),
            (img.shape[1] / oh, img.shape[2] / ow),
            antialias,
        )[0]
        n, worst = off_ties(got, F.resized_crop(img.float(), t, left, h, w, [oh, ow], antialias=antialias))
        assert worst < 2e-3  # measured 4e-4
        d_uint8 = (got.int() - F.resized_crop(img, t, left, h, w, [oh, ow], antialias=antialias).int()).abs()
        assert d_uint8.max() <= 1
        off_float += n
        off_uint8 += int((d_uint8 > 0).sum())
        total += got.numel()
    assert off_float / total < 0.011  # measured 0.0035 (3x)
    assert off_uint8 / total < 0.6  # measured 0.13-0.20 (3x); a wrong window or filter is off by far more


def test_antialias_is_honoured():
    """A 3x downscale of a checkerboard: antialiased it averages to grey; plain bilinear samples single
    pixels (src = 3i + 1) and keeps the full-contrast pattern (aliasing)."""
    board = ((torch.arange(48)[:, None] + torch.arange(48)[None, :]) % 2 * 255).to(torch.uint8).expand(3, 48, 48)[None]
    win = (one(0), one(48), one(16), one(0))
    smooth = resample_batch(board, win, win, (16, 16), (3.0, 3.0), antialias=True)
    sharp = resample_batch(board, win, win, (16, 16), (3.0, 3.0), antialias=False)
    assert smooth.float().std() < 5 and sharp.float().std() > 50
    ref = F.resize(board[0].float(), [16, 16], antialias=False).round()
    assert torch.equal(sharp[0].float(), ref)


def test_a_sample_does_not_depend_on_its_batch_or_padding():
    """Same windows, other neighbours and more padding: bit-identical pixels (composition independence)."""
    g = torch.Generator().manual_seed(1)
    img = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8, generator=g)
    rows, cols = (one(3), one(30), one(24), one(0)), (one(7), one(35), one(24), one(0))
    alone = resample_batch(img[None], rows, cols, (24, 24), (40 / 24, 50 / 24))[0]
    big = torch.randint(0, 256, (5, 3, 90, 120), dtype=torch.uint8, generator=g)
    big[2, :, :40, :50] = img
    r = [torch.full((5,), v) for v in (3, 30, 24, 0)]
    c = [torch.full((5,), v) for v in (7, 35, 24, 0)]
    batched = resample_batch(big, tuple(r), tuple(c), (24, 24), (90 / 24, 120 / 24))
    assert torch.equal(batched[2], alone)


def test_batched_random_resized_crop_matches_the_per_image_path():
    """The memory backend's random_resized_crop (one batched pass, no per-sample Python ints) against the
    per-image torchvision call it replaced, same draws: within one level (measured share above)."""
    op = RandomResizedCrop(24)
    x = torch.randint(0, 256, (64, 3, 32, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    from torchsprint.data.preprocess.augment import uniforms

    p, _, _ = op.params(
        uniforms(sample_seeds(0, 0, torch.arange(64)), op.k), torch.full((64,), 32), torch.full((64,), 40)
    )
    batched = op.apply_batch(x, p)
    per_image = torch.stack([op.apply_one(x[i], p, i) for i in range(64)])
    d = (batched.int() - per_image.int()).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 0.6  # measured 0.16 (3x)
    as_float = torch.stack(
        [
            F.resized_crop(x[i].float(), int(p["top"][i]), int(p["left"][i]), int(p["h"][i]), int(p["w"][i]), [24, 24])
            for i in range(64)
        ]
    )
    n, worst = off_ties(batched, as_float)
    assert worst < 2e-3 and n / batched.numel() < 0.011  # measured: see test_resample_matches_torchvision_resized_crop


@pytest.mark.parametrize(
    "spec",
    [
        [{"random_resized_crop": {"size": [20, 16]}}],
        [{"resize": [18, 22]}],
        [{"center_crop": 12}],
        [{"center_crop": [30, 9]}],  # taller than some images: zero padding, torchvision's placement
        [{"resize": 14}, {"center_crop": 12}],
        [{"resize": 30}, {"center_crop": [12, 33]}],
    ],
    ids=["rrc", "resize-pair", "center-crop", "center-crop-pads", "resize-center", "resize-center-pads"],
)
def test_fused_heads_match_running_the_steps_image_by_image(spec):
    """Images of different sizes padded into one tensor, windows drawn as the gpu backend draws them,
    against the steps' own per-image torchvision path on float images (torchvision's CUDA arithmetic)."""
    p = compile_batch_spec(spec, "t", 3, "gpu")
    geo = p.geometry
    assert geo is not None
    g = torch.Generator().manual_seed(3)
    sizes = [(int(a), int(b)) for a, b in torch.randint(10, 48, (12, 2), generator=g)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    H, W = max(h for h, _ in sizes), max(w for _, w in sizes)
    padded = torch.randint(0, 256, (len(images), 3, H, W), dtype=torch.uint8, generator=g)  # garbage around each image
    for i, img in enumerate(images):
        padded[i, :, : img.shape[1], : img.shape[2]] = img
    hs, ws = torch.tensor([s[0] for s in sizes]), torch.tensor([s[1] for s in sizes])
    u = p.draw(sample_seeds(0, 0, torch.arange(len(images))))
    params = p.params(u, hs, ws, 0, p.head)
    rows, cols = geo.windows(params, hs, ws)
    got = geo.apply(padded, rows, cols, geo.max_scale(H, W))
    ref = torch.stack(p.run_head([img.float() for img in images], params, list(range(len(images)))))
    n, worst = off_ties(got, ref)
    assert got.shape[-2:] == geo.out_size and worst < 2e-3 and n / got.numel() < 0.011  # as above


def test_heads_without_a_fused_form_say_so():
    assert compile_batch_spec([{"random_crop": {"size": 8, "padding": 2}}], "t", 3, "gpu").geometry is None
    assert compile_batch_spec(["hflip", {"center_crop": 8}], "t", 3, "gpu").geometry is None
    assert compile_batch_spec(["hflip"], "t", 3, "gpu").geometry is None  # no head at all


def test_vectorised_resize_sizes_follow_torchvisions_rule():
    """Resize.resized (used for whole batches) against torchvision's own output-size rule, image by image."""
    from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

    from torchsprint.data.preprocess.batch_geometry import Resize

    g = torch.Generator().manual_seed(4)
    hs, ws = torch.randint(5, 900, (2000,), generator=g), torch.randint(5, 900, (2000,), generator=g)
    for size in (37, [37], [20, 31]):
        rh, rw = Resize(size).resized(hs, ws)
        ref = [
            _compute_resized_output_size((int(h), int(w)), size=size if isinstance(size, list) else [size])
            for h, w in zip(hs, ws)
        ]
        assert [[int(a), int(b)] for a, b in zip(rh, rw)] == [list(r) for r in ref]

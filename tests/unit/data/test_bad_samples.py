"""Bad input: a dataset with one file of each kind of trouble, through every file-reading backend.

Handled cases (CMYK, grayscale, 16-bit PNG, PNG with alpha) must decode to RGB uint8 equal to
Pillow's conversion; broken ones (truncated, zero-byte, non-image, huge) are skipped and reported
with their paths, or stop the run; ranks keep equal step counts either way.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from torchsprint import config
from torchsprint.data import DATASETS, build_loaders
from torchsprint.data.backends.gpu import build_gpu_loaders
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime

W, H = 24, 20


def _save(im, path, fmt, **kw):
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    path.write_bytes(b.getvalue())
    return b.getvalue()


def make_bad_folder(root):
    """train/{good,odd}/...: 8 good JPEGs, the 4 convertible oddities, the 4 broken files; val/ 4 good."""
    rng = np.random.default_rng(0)
    refs = {}
    for split, n in (("train", 8), ("val", 4)):
        for c in ("good", "odd"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            _save(
                Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)),
                root / split / "good" / f"{i}.jpg",
                "JPEG",
            )
            if split == "val":
                _save(
                    Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)),
                    root / split / "odd" / f"{i}.jpg",
                    "JPEG",
                )
    odd = root / "train" / "odd"
    arr = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    refs["cmyk.jpg"] = _save(Image.fromarray(arr).convert("CMYK"), odd / "cmyk.jpg", "JPEG", quality=95)
    refs["gray.jpg"] = _save(Image.fromarray(arr).convert("L"), odd / "gray.jpg", "JPEG")
    sixteen = (rng.integers(0, 65535, (H, W))).astype(np.uint16)
    refs["deep16.png"] = _save(Image.fromarray(sixteen), odd / "deep16.png", "PNG")
    refs["alpha.png"] = _save(
        Image.fromarray(np.dstack([arr, rng.integers(0, 255, (H, W), dtype=np.uint8)]), "RGBA"),
        odd / "alpha.png",
        "PNG",
    )
    full = _save(Image.fromarray(arr), odd / "tmp.jpg", "JPEG")
    (odd / "tmp.jpg").unlink()
    (odd / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (odd / "empty.jpg").write_bytes(b"")
    (odd / "notes.png").write_bytes(b"this is a text file, not an image\n" * 4)
    _save(Image.fromarray(np.zeros((80, 80, 3), np.uint8)), odd / "huge.jpg", "JPEG")  # 6,400 px > limit below
    return refs, sixteen


BROKEN = {"truncated.jpg", "empty.jpg", "notes.png", "huge.jpg"}


def data_cfg(root, backend="cpu", policy="skip", bs=4):
    return config.load(
        None,
        [
            "data.dataset=image_folder",
            f"data.root={root}",
            f"data.backend={backend}",
            f"data.on_bad_sample={policy}",
            f"data.batch_size={bs}",
            "data.max_image_pixels=2000",
            "data.decoder=auto",
            f"data.train.transforms=[{{resize: [{H}, {W}]}}, {{normalize: none}}]",
            f"data.eval.transforms=[{{resize: [{H}, {W}]}}, {{normalize: none}}]",
        ],
    ).data


def test_odd_files_decode_like_pillow(tmp_path):
    refs, sixteen = make_bad_folder(tmp_path)
    s = DATASETS.get("image_folder")(data_cfg(tmp_path))
    by_name = {p.split("/")[-1]: i for i, (p, _) in enumerate(s.train.samples)}
    for name in ("cmyk.jpg", "gray.jpg", "alpha.png"):
        img, _, _ = s.train[by_name[name]]
        ref = torch.from_numpy(np.array(Image.open(io.BytesIO(refs[name])).convert("RGB"))).permute(2, 0, 1)
        assert img.dtype == torch.uint8 and img.shape == (3, H, W), name
        assert (img.int() - ref.int()).abs().max() <= 1, name  # CMYK: libjpeg vs Pillow inversion rounding
    img, _, _ = s.train[by_name["deep16.png"]]
    assert img.dtype == torch.uint8 and torch.equal(img[0], torch.from_numpy((sixteen >> 8).astype(np.uint8)))
    for name in BROKEN:
        img, _, reason = s.train[by_name[name]]
        assert img is None and name in reason


def _run_epoch(loaders):
    loaders.train.set_epoch(0)
    batches = list(loaders.train)
    return batches, list(loaders.train.skipped)


@pytest.mark.parametrize("backend", ["cpu", "memory", "gpu-code-on-cpu"])
def test_broken_files_skipped_counted_and_named(tmp_path, backend):
    make_bad_folder(tmp_path)
    rt = Runtime(torch.device("cpu"))
    if backend == "gpu-code-on-cpu":
        d = data_cfg(tmp_path, "cpu")
        loaders = build_gpu_loaders(d, DATASETS.get("image_folder")(d), rt, seed=0)
    else:
        loaders = build_loaders(data_cfg(tmp_path, backend), rt, seed=0)
    batches, skipped = _run_epoch(loaders)
    assert sorted(r.split(":")[0].split("/")[-1] for r in skipped) == sorted(BROKEN)
    n_images = sum(x.shape[0] for x, _ in batches)
    assert n_images == 16 - len(BROKEN)  # 8 good + 4 handled oddities
    assert all(x.dtype == torch.float32 and x.shape[1:] == (3, H, W) for x, _ in batches)


@pytest.mark.parametrize("backend", ["cpu", "memory"])
def test_error_policy_names_the_file(tmp_path, backend):
    make_bad_folder(tmp_path)
    rt = Runtime(torch.device("cpu"))
    with pytest.raises(UsageError, match=r"(truncated|empty|notes|huge)\.(jpg|png)"):
        loaders = build_loaders(data_cfg(tmp_path, backend, "error"), rt, seed=0)
        _run_epoch(loaders)


@pytest.mark.parametrize("backend", ["cpu", "memory", "gpu-code-on-cpu"])
def test_ranks_keep_equal_step_counts_with_bad_files(tmp_path, backend):
    make_bad_folder(tmp_path)
    steps = []
    for rank in (0, 1):
        rt = Runtime(torch.device("cpu"), rank=rank, world_size=2)
        d = data_cfg(tmp_path, "cpu" if backend.startswith("gpu") else backend, bs=3)
        if backend.startswith("gpu"):
            loaders = build_gpu_loaders(d, DATASETS.get("image_folder")(d), rt, seed=0)
        else:
            loaders = build_loaders(d, rt, seed=0)
        batches, _ = _run_epoch(loaders)
        assert len(batches) == len(loaders.train)
        steps.append(len(batches))
    assert steps[0] == steps[1] > 0

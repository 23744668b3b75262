"""The gpu backend's own pieces: one flat buffer per batch, routing by header, the CPU fallback for files
nvJPEG rejects, the ordered decode. Unmarked tests run its code on the CPU device (torchvision's CPU
decoder in place of nvJPEG); `gpu` tests run it on CUDA with nvJPEG."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from paths import DATA
from torchsprint import config
from torchsprint.data import DATASETS
from torchsprint.data.backends.gpu import BytesBatches, GpuLoader, build_gpu_loaders
from torchsprint.data.core import sample_seeds
from torchsprint.data.preprocess.augment import compile_batch_spec
from torchsprint.data.preprocess.decode import decode_bytes, read_header
from torchsprint.data.preprocess.normalize import DeviceNormalize
from torchsprint.data.preprocess.on_device import nvjpeg_ok
from torchsprint.data.sources.folders import ImageFiles
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime

VARIANTS = DATA / "jpeg_variants"  # see make.py there: lossless, 12-bit, arithmetic
CPU = Runtime(torch.device("cpu"))


def pillow_variants(folder: Path) -> dict[str, bytes]:
    """Progressive, CMYK and gray JPEGs (Pillow writes these) of the fixtures' picture, plus the fixtures."""
    import sys

    sys.path.insert(0, str(VARIANTS))
    from make import picture

    img = Image.fromarray(picture())
    out = {}
    for name, im, kw in (
        ("progressive.jpg", img, {"progressive": True, "quality": 90}),
        ("cmyk.jpg", img.convert("CMYK"), {}),
        ("gray.jpg", img.convert("L"), {}),
    ):
        b = io.BytesIO()
        im.save(b, "JPEG", **kw)
        out[name] = b.getvalue()
    for f in sorted(VARIANTS.glob("*.jpg")):
        out[f.name] = f.read_bytes()
    for name, data in out.items():
        (folder / name).write_bytes(data)
    return out


def test_routing_by_header_sends_only_what_nvjpeg_decodes_to_it(tmp_path):
    files = pillow_variants(tmp_path)
    routed = {name: nvjpeg_ok(read_header(data)) for name, data in files.items()}
    assert routed == {
        "baseline.jpg": True,
        "progressive.jpg": True,
        "cmyk.jpg": False,
        "gray.jpg": False,
        "lossless.jpg": False,
        "12bit.jpg": False,
        "arithmetic.jpg": False,
    }
    # what the CPU makes of them: the arithmetic-coded file holds the baseline file's coefficients,
    # the lossless one the exact picture; no CPU decoder here reads 12-bit samples (a bad sample)
    assert torch.equal(decode_bytes(files["arithmetic.jpg"]), decode_bytes(files["baseline.jpg"]))
    import sys

    sys.path.insert(0, str(VARIANTS))
    from make import picture

    assert torch.equal(decode_bytes(files["lossless.jpg"]).permute(1, 2, 0), torch.from_numpy(picture()))


def variant_cfg(root, *extra):
    return config.load(
        None,
        [
            "data.dataset=image_folder",
            f"data.root={root}",
            "data.batch_size=8",
            "data.drop_last=false",
            "data.decoder=torchvision",
            "data.on_bad_sample=skip",
            "data.train.transforms=[{random_resized_crop: {size: 16}}, hflip, {normalize: imagenet}]",
            "data.eval.transforms=[{resize: 20}, {center_crop: 16}, {normalize: imagenet}]",
            *extra,
        ],
    ).data


def test_every_variant_a_cpu_decoder_reads_is_trained_on_and_12bit_is_named(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        pillow_variants(tmp_path / split / "a")
    d = variant_cfg(tmp_path)
    loaders = build_gpu_loaders(d, DATASETS.get("image_folder")(d), CPU, seed=0)
    loaders.train.set_epoch(0)
    batches = list(loaders.train)
    assert sum(len(x) for x, _ in batches) == 6
    assert [s.split(":")[0].split("/")[-1] for s in loaders.train.skipped] == ["12bit.jpg"]
    assert "precision 12" in loaders.train.skipped[0]


def test_workers_send_one_flat_buffer_per_batch(tmp_path):
    files = pillow_variants(tmp_path)
    names = ["baseline.jpg", "progressive.jpg", "cmyk.jpg", "baseline.jpg"]
    raw = ImageFiles([(str(tmp_path / n), 0) for n in names], decoder="torchvision")
    p = compile_batch_spec([{"random_resized_crop": {"size": 16}}], "t", 3, "gpu")
    ds = BytesBatches(raw, p, torch.zeros(1, dtype=torch.float64), 3, "error", 10**8, "torchvision")
    keys = list(zip(range(4), sample_seeds(0, 0, torch.arange(4)).tolist()))
    item = ds[keys]
    flat, offsets = item["gpu_data"], item["gpu_offsets"].tolist()
    assert flat.dtype == torch.uint8 and flat.ndim == 1 and item["gpu_rows"].tolist() == [0, 1, 3]
    assert [bytes(flat[a:b].numpy()) for a, b in zip(offsets, offsets[1:])] == [files[names[i]] for i in (0, 1, 3)]
    assert item["windows"].shape == (2, 4, 3) and item["cpu_rows"].tolist() == [2]  # CMYK: decoded by the worker
    # through a worker process the buffer is created in shared memory: one tensor crosses the queue
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=[keys], num_workers=1)
    got = next(iter(loader))
    assert torch.equal(got["gpu_data"], flat) and got["gpu_data"].is_shared()


def loader_for(p, on_bad_sample="skip", device=torch.device("cpu")):
    norm = DeviceNormalize((0.0,) * 3, (1.0,) * 3, device)
    sampler = torch.utils.data.BatchSampler(range(1), 1, False)
    return GpuLoader(None, sampler, p, device, norm, torch.zeros(1), None, on_bad_sample, 3, "torchvision", 10**8)


def test_cpu_fallback_decodes_what_nvjpeg_rejected_counts_it_and_warns_once(tmp_path):
    """GpuLoader._fallback is what runs when nvJPEG returns no image for a file that passed the header
    check: the CPU decoder reads it (counted, one warning), or it is a bad sample under the policy."""
    files = pillow_variants(tmp_path)
    p = compile_batch_spec([{"center_crop": 16}], "t", 3, "gpu")
    loader = loader_for(p)
    as_tensor = lambda name: torch.frombuffer(bytearray(files[name]), dtype=torch.uint8)  # noqa: E731
    with pytest.warns(UserWarning, match="nvJPEG could not decode .*lossless.jpg"):
        img = loader._fallback(as_tensor("lossless.jpg"), "lossless.jpg")
    assert torch.equal(img, decode_bytes(files["lossless.jpg"]))
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="nvJPEG")  # reported once, not per file
        assert torch.equal(loader._fallback(as_tensor("arithmetic.jpg"), "a.jpg"), decode_bytes(files["baseline.jpg"]))
    assert loader.cpu_fallbacks == 2
    assert loader._fallback(as_tensor("12bit.jpg"), "12bit.jpg") is None
    assert loader.skipped == ["12bit.jpg: Unsupported JPEG data precision 12"]
    with pytest.raises(UsageError, match="12bit.jpg.*on_bad_sample=skip"):
        loader_for(p, "error")._fallback(as_tensor("12bit.jpg"), "12bit.jpg")


def test_decoded_batch_equals_decoding_each_file_and_running_the_spec(tmp_path):
    """The whole gpu-backend path on the CPU device against an independent per-image reference: decode
    each file with decode_bytes, then torchvision's resized_crop in float with the same windows."""
    from torchvision.transforms.v2 import functional as F

    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        for i in range(6):
            h, w = (int(v) for v in rng.integers(20, 60, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
                root / split / "a" / f"{i}.jpg", quality=90
            )
    d = variant_cfg(
        root, "data.train.transforms=[{random_resized_crop: {size: 16}}]", "data.eval.transforms=[{center_crop: 16}]"
    )
    splits = DATASETS.get("image_folder")(d)
    tr = build_gpu_loaders(d, splits, CPU, seed=1).train
    tr.set_epoch(0)
    ((x, _),) = list(tr)
    keys = list(tr.sampler)
    p = tr.pipeline
    for row, (index, seed) in enumerate(keys):
        img = decode_bytes(Path(splits.train.samples[index][0]).read_bytes())
        u = p.draw(torch.tensor([seed]))
        (prm,) = p.params(u, torch.tensor([img.shape[1]]), torch.tensor([img.shape[2]]), 0, 1)
        ref = F.resized_crop(img.float(), int(prm["top"]), int(prm["left"]), int(prm["h"]), int(prm["w"]), [16, 16])
        got = x[row] * 255  # normalize: imagenet is not in this spec: mean 0, std 1 -> x = pixels / 255
        assert (got - ref.round()).abs().max() <= 1.001

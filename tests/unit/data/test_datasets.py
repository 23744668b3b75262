"""Datasets and decoders: file_list, CIFAR pickles, synthetic_jpeg, header sniffing, decoder agreement.

References are independent: Pillow decodes, numpy reshapes of the documented CIFAR layout.
"""

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from torchsprint import config
from torchsprint.data import DATASETS
from torchsprint.data.preprocess.decode import DECODERS, decode_bytes, read_header
from torchsprint.data.preprocess.transforms import decode_hint
from torchsprint.errors import UsageError


def cfg_for(*overrides):
    return config.load(None, list(overrides)).data


def jpeg_bytes(w=48, h=40, seed=0, mode="RGB", quality=90):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    arr[h // 4 : h // 2, w // 4 : w // 2] = (250, 30, 30)
    im = Image.fromarray(arr).convert(mode)
    b = io.BytesIO()
    im.save(b, "JPEG", quality=quality)
    return b.getvalue()


def pil_rgb(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


def test_file_list_names_ints_relative_paths_and_header(tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    blobs = {}
    for i in range(6):
        blobs[f"im {i}.jpg"] = jpeg_bytes(seed=i)
        (imgs / f"im {i}.jpg").write_bytes(blobs[f"im {i}.jpg"])
    (tmp_path / "train.csv").write_text(
        "path,label\n" + "".join(f"imgs/im {i}.jpg,{'cat' if i % 2 else 'dog'}\n" for i in range(4))
    )
    (tmp_path / "val.txt").write_text("# comment\nimgs/im 4.jpg\tdog\nimgs/im 5.jpg cat\n")
    d = cfg_for("data.dataset=file_list", f"data.root={tmp_path}", f"data.options={{val_list: {tmp_path / 'val.txt'}}}")
    s = DATASETS.get("file_list")(d)
    assert s.classes == ["cat", "dog"] and len(s.train) == 4 and len(s.val) == 2
    img, label, path = s.train[1]
    assert label == 0 and path.endswith("im 1.jpg")
    assert torch.equal(img, pil_rgb(blobs["im 1.jpg"]))
    assert [s.val[i][1] for i in range(2)] == [1, 0]
    # integer labels are class indices; one list file is split by val_fraction
    (tmp_path / "ints.csv").write_text("".join(f"imgs/im {i}.jpg,{i % 3}\n" for i in range(6)))
    s = DATASETS.get("file_list")(
        cfg_for("data.dataset=file_list", f"data.root={tmp_path / 'ints.csv'}", "data.val_fraction=0.5")
    )
    assert s.classes == ["0", "1", "2"] and len(s.train) + len(s.val) == 6


def test_file_list_errors_name_the_line(tmp_path):
    (tmp_path / "bad.csv").write_text("only_a_path_no_label\n")
    with pytest.raises(UsageError, match=r"bad.csv:1: expected `path,label`"):
        DATASETS.get("file_list")(cfg_for("data.dataset=file_list", f"data.root={tmp_path / 'bad.csv'}"))


def write_cifar(root, name, n_train=6, n_test=4, k=10):
    rng = np.random.default_rng(1)
    if name == "cifar10":
        files = {f"data_batch_{i}": n_train for i in range(1, 6)} | {"test_batch": n_test}
        meta, names_key, label_key = "batches.meta", b"label_names", b"labels"
    else:
        files = {"train": n_train, "test": n_test}
        meta, names_key, label_key = "meta", b"fine_label_names", b"fine_labels"
    arrays = {}
    for f, n in files.items():
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, k, n).tolist()
        arrays[f] = (data, labels)
        with open(root / f, "wb") as fh:
            pickle.dump(
                {b"batch_label": f.encode(), b"data": data, label_key: labels, b"filenames": [b"x.png"] * n}, fh
            )
    with open(root / meta, "wb") as fh:
        pickle.dump({names_key: [f"c{i}".encode() for i in range(k)]}, fh)
    return arrays


@pytest.mark.parametrize("name,k", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_pickles(tmp_path, name, k):
    arrays = write_cifar(tmp_path, name, k=k)
    s = DATASETS.get(name)(cfg_for(f"data.dataset={name}", f"data.root={tmp_path}"))
    assert s.classes == [f"c{i}" for i in range(k)] and s.in_channels == 3
    train_key = "data_batch_2" if name == "cifar10" else "train"
    offset = 6 if name == "cifar10" else 0
    data, labels = arrays[train_key]
    img, label, _ = s.train[offset + 3]
    # documented layout: 1024 red, 1024 green, 1024 blue values, each 32 rows of 32
    row = data[3]
    assert int(img[1, 5, 7]) == int(row[1024 + 5 * 32 + 7]) and int(img[2, 31, 0]) == int(row[2048 + 31 * 32])
    assert label == labels[3]
    assert len(s.val) == 4


def test_cifar_missing_files_never_download(tmp_path):
    with pytest.raises(UsageError, match="never downloads"):
        DATASETS.get("cifar10")(cfg_for("data.dataset=cifar10", f"data.root={tmp_path}"))


def test_synthetic_jpeg_generated_once_and_reused(tmp_path):
    d = cfg_for(
        "data.dataset=synthetic_jpeg",
        f"data.root={tmp_path}",
        "data.options={num_images: 6, val_images: 3, size: [40, 30], classes: 3}",
    )
    s = DATASETS.get("synthetic_jpeg")(d)
    assert len(s.classes) == 3 and len(s.train) == 6 and len(s.val) == 3
    path = s.train.samples[0][0]
    mtime = __import__("os").path.getmtime(path)
    s2 = DATASETS.get("synthetic_jpeg")(d)
    assert s2.train.samples == s.train.samples and __import__("os").path.getmtime(path) == mtime
    with Image.open(path) as im:
        assert im.format == "JPEG" and im.size == (40, 30)
    img = s.train[0][0]
    assert img.shape == (3, 30, 40) and img.dtype == torch.uint8


def test_read_header_matches_pillow():
    for w, h in [(48, 40), (17, 5)]:
        hd = read_header(jpeg_bytes(w, h))
        assert (hd.format, hd.width, hd.height, hd.components) == ("jpeg", w, h, 3)
    assert read_header(jpeg_bytes(mode="L")).components == 1
    b = io.BytesIO()
    Image.new("RGBA", (9, 7)).save(b, "PNG")
    assert (read_header(b.getvalue()).width, read_header(b.getvalue()).height) == (9, 7)


@pytest.mark.parametrize("decoder", DECODERS.names())
def test_every_decoder_matches_pillow_exactly(decoder):
    data = jpeg_bytes(64, 48)
    assert torch.equal(decode_bytes(data, decoder=decoder).contiguous(), pil_rgb(data))


def test_dct_scaled_decode_is_close_to_full_decode_then_resize():
    from torchvision.transforms.v2 import functional as F

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:480, 0:640]
    arr = np.stack([(xx // 3) % 256, (yy // 2) % 256, (xx + yy) % 256], -1).astype(np.float64) + rng.normal(
        0, 6, (480, 640, 3)
    )
    b = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(b, "JPEG", quality=92)
    data = b.getvalue()
    hint = decode_hint([{"resize": 64}])
    assert (
        hint(480, 640) is not None and hint(375, 500) is not None and decode_hint([{"resize": 256}])(375, 500) is None
    )
    scaled_dec = "pil" if "simplejpeg" not in DECODERS else "simplejpeg"
    small = decode_bytes(data, decoder=scaled_dec, min_size_for=hint)
    assert small.shape[1] < 480  # really decoded at reduced size
    a = F.resize(small.contiguous(), [64], antialias=True).int()
    ref = F.resize(decode_bytes(data, decoder="torchvision"), [64], antialias=True).int()
    assert a.shape == ref.shape
    assert (a - ref).abs().float().mean() < 1.5

"""One image, one tensor, whichever decoder: EXIF orientation and colour modes.

Reference: Pillow (an independent decoder) with ImageOps.exif_transpose for orientation and
Image.convert("RGB") for colour modes. Every CPU decoder here wraps libjpeg-turbo with the same IDCT
and upsampling, so the bound is exact equality (measured max |diff| 0 for baseline, progressive, gray
and CMYK JPEGs and palette/alpha PNGs); 16-bit PNGs are compared with their top byte (v >> 8).
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from torchsprint.data.preprocess.decode import DECODERS, apply_orientation, decode_bytes, read_header

RNG = np.random.default_rng(0)
PICTURE = Image.fromarray((RNG.random((30, 40, 3)) * 255).astype(np.uint8))  # not square: turns are visible


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, format=fmt, **kw)
    return b.getvalue()


def with_orientation(k: int, fmt: str = "JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = k
    return encode(PICTURE, fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))


def upright(data: bytes) -> torch.Tensor:
    """Pillow's decode, turned by exif_transpose: the independent reference (uint8 CHW RGB)."""
    arr = np.array(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    return torch.from_numpy(arr).permute(2, 0, 1)


@pytest.mark.parametrize("decoder", DECODERS.names())
@pytest.mark.parametrize("k", range(1, 9))
def test_every_decoder_applies_each_exif_orientation(decoder, k):
    data = with_orientation(k)
    assert read_header(data).orientation == k
    x = decode_bytes(data, decoder=decoder)
    ref = upright(data)
    assert x.shape == ref.shape, (decoder, k)  # 5-8 turn 30x40 into 40x30
    assert torch.equal(x, ref), (decoder, k, (x.int() - ref.int()).abs().max())


@pytest.mark.parametrize("k", [3, 6, 8])
def test_png_exif_chunk_orientation(k):
    data = with_orientation(k, "PNG")
    assert read_header(data).orientation == k
    for decoder in DECODERS.names():
        assert torch.equal(decode_bytes(data, decoder=decoder), upright(data)), decoder


def test_apply_orientation_matches_pillow_transposes_on_any_layout():
    """The 8 transforms themselves against Pillow's, on a channels-last view too (what simplejpeg returns)."""
    arr = np.asarray(PICTURE)
    chw = torch.from_numpy(arr).permute(2, 0, 1)  # HWC memory, CHW view
    for k, method in {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }.items():
        ref = torch.from_numpy(np.array(PICTURE.transpose(method))).permute(2, 0, 1)
        assert torch.equal(apply_orientation(chw, k), ref), k
    assert apply_orientation(chw, 1) is chw


def test_scaled_decode_hint_sees_the_upright_size():
    """A DCT-scaled decode of a turned image: the hint is asked with the upright size and the result is upright."""
    big = Image.fromarray((RNG.random((1200, 1600, 3)) * 255).astype(np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(big, "JPEG", quality=90, exif=exif)
    asked = []

    def hint(h, w):
        asked.append((h, w))
        return h // 4, w // 4

    for decoder in DECODERS.names():
        asked.clear()
        x = decode_bytes(data, decoder=decoder, min_size_for=hint)
        assert asked == [(1600, 1200)], decoder  # upright: 1600 high, 1200 wide
        assert x.shape[1] > x.shape[2], (decoder, x.shape)  # still upright after scaling


def png16(arr: np.ndarray) -> bytes:
    """A 16-bit PNG (gray or RGB) written by hand: Pillow cannot write 16-bit RGB."""
    h, w = arr.shape[:2]
    color = 2 if arr.ndim == 3 else 0
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def mode_cases():
    gray16 = (RNG.random((30, 40)) * 65535).astype(np.uint16)
    rgb16 = (RNG.random((30, 40, 3)) * 65535).astype(np.uint16)
    pil = lambda data: upright(data)  # noqa: E731
    top_byte = lambda a: (  # noqa: E731
        torch.from_numpy((a >> 8).astype(np.uint8)).reshape(30, 40, -1).permute(2, 0, 1).expand(3, -1, -1)
    )
    return {
        "gray JPEG": (encode(PICTURE.convert("L"), "JPEG", quality=90), pil),
        "CMYK JPEG": (encode(PICTURE.convert("CMYK"), "JPEG", quality=90), pil),
        "progressive JPEG": (encode(PICTURE, "JPEG", quality=90, progressive=True), pil),
        "palette PNG": (encode(PICTURE.convert("P"), "PNG"), pil),
        "RGBA PNG": (encode(PICTURE.convert("RGBA"), "PNG"), pil),  # alpha dropped, not composited
        "gray+alpha PNG": (encode(PICTURE.convert("LA"), "PNG"), pil),
        "16-bit gray PNG": (png16(gray16), lambda _: top_byte(gray16)),
        "16-bit RGB PNG": (png16(rgb16), lambda _: top_byte(rgb16)),
    }


@pytest.mark.parametrize("case", list(mode_cases()))
def test_colour_modes_become_the_same_rgb_uint8_from_every_decoder(case):
    data, reference = mode_cases()[case]
    ref = reference(data)
    for decoder in DECODERS.names():
        x = decode_bytes(data, decoder=decoder)
        assert x.dtype == torch.uint8 and x.shape == (3, 30, 40), (case, decoder, x.shape)
        assert torch.equal(x, ref), (case, decoder, (x.int() - ref.int()).abs().max())


def test_training_eval_predict_and_compare_see_the_same_upright_image(tmp_path):
    """The paths a file takes in training/evaluation (ImageFiles), predict and `data compare`."""
    from torchsprint import config
    from torchsprint.commands.data.compare import _eval_paths
    from torchsprint.commands.predict import Predictor
    from torchsprint.data.sources.folders import ImageFiles

    (tmp_path / "val" / "a").mkdir(parents=True)
    (tmp_path / "val" / "b").mkdir(parents=True)
    for k in range(1, 9):
        (tmp_path / "val" / ("a" if k % 2 else "b") / f"o{k}.jpg").write_bytes(with_orientation(k))
    files = sorted((tmp_path / "val").rglob("*.jpg"))
    refs = {str(f): upright(f.read_bytes()) for f in files}
    for decoder in DECODERS.names():
        ds = ImageFiles([(str(f), 0) for f in files], decoder=decoder)
        for i, f in enumerate(files):
            assert torch.equal(ds[i][0], refs[str(f)]), (decoder, f.name)
    cfg = config.load(
        None, ["data.dataset=image_folder", f"data.root={tmp_path}", "data.eval.transforms=[resize: [24, 24]]"]
    )
    pred = Predictor(lambda x: x, ["a", "b"], 3, cfg.data.eval.transforms, cfg.data, torch.device("cpu"))
    from torchvision.transforms.v2 import functional as F

    for f in files:
        expected = F.resize(refs[str(f)], [24, 24], antialias=True)
        assert torch.equal(pred._load_cpu(str(f)), expected), f.name
    paths = _eval_paths(cfg, ImageFiles([(str(f), 0) for f in files]), 8)["paths"]
    ref = paths["cpu: torchvision decode + torchvision v2"]
    for name, x in paths.items():
        if name.startswith("gpu-backend"):  # batch_ops.resample_batch rounds once: <= 1 level (test_data_batch_ops)
            assert (x.int() - ref.int()).abs().max() <= 1, name
        else:
            assert torch.equal(x, ref), name

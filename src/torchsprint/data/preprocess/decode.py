"""Image bytes -> uint8 CHW tensors: header sniffing, the DECODERS registry, bad-input normalisation.

Every decoder here returns the same pixels for a baseline JPEG: torchvision, simplejpeg and Pillow all
wrap libjpeg-turbo with the accurate integer IDCT and fancy upsampling (measured max |diff| = 0 on the
benchmark images). They differ in speed only (BENCHMARKS.md, "Data loading"): on the 2-core EPYC,
500x375 JPEG, one thread: simplejpeg 0.80 ms, torchvision 0.87 ms, Pillow 1.0 ms (1.2 ms from a file).
Everything that is not a plain 3-channel JPEG (PNG, CMYK/gray JPEG, WebP, ...) goes through
torchvision's `decode_image`, with Pillow as the last resort, so odd files decode the same everywhere.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import torch

from torchsprint.errors import UsageError
from torchsprint.registry import Registry
from torchsprint.runtime.files import MAX_FILE_MB, MB, read_regular

DECODERS = Registry("decoder")


class BadImage(Exception):
    """A file that cannot become an image (empty, truncated, not an image, too large)."""


@dataclass(frozen=True)
class ImageHeader:
    """What the first bytes of a file say: format, stored size in pixels, JPEG colour components and
    coding, and the EXIF orientation every decoder applies (see apply_orientation)."""

    format: str  # "jpeg", "png", or "other" (size unknown until decoded)
    height: int | None  # as stored, before the EXIF orientation turns it
    width: int | None
    components: int | None = None  # JPEG: 1 gray, 3 YCbCr, 4 CMYK/YCCK
    orientation: int = 1  # EXIF tag 0x0112: 1 upright .. 8; 5-8 swap height and width
    sof: int | None = (
        None  # JPEG start-of-frame marker: 0xC0/C1 baseline, C2 progressive, C3 lossless, C9-CF arithmetic
    )
    bits: int | None = None  # JPEG sample precision (8, or 12 for 12-bit JPEGs)


# JPEG start-of-frame markers carrying the size: SOF0..SOF15 except DHT (C4), JPG (C8) and DAC (CC).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def read_header(data: bytes | memoryview) -> ImageHeader:
    """Sniff format, size and EXIF orientation without decoding (a few microseconds). Raises BadImage for empty data."""
    if len(data) == 0:
        raise BadImage("empty file (0 bytes)")
    head = bytes(data[:32])
    if head[:2] == b"\xff\xd8":
        return _jpeg_header(data)
    if head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) >= 24:
        w, h = struct.unpack(">II", head[16:24])  # IHDR is always the first chunk
        return ImageHeader("png", h, w, orientation=_png_orientation(data))
    return ImageHeader("other", None, None)


def _jpeg_header(data) -> ImageHeader:
    i, n = 2, len(data)
    orientation = 1
    while i + 4 <= n:
        if data[i] != 0xFF:
            i += 1  # tolerate fill bytes between segments
            continue
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2  # markers without a length field
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if marker == 0xE1 and bytes(data[i + 4 : i + 10]) == b"Exif\x00\x00":  # APP1: EXIF (comes before the frame)
            orientation = _tiff_orientation(bytes(data[i + 10 : i + 2 + length]))
        if marker in _SOF and i + 9 < n:
            h = (data[i + 5] << 8) | data[i + 6]
            w = (data[i + 7] << 8) | data[i + 8]
            return ImageHeader("jpeg", h, w, data[i + 9], orientation, sof=marker, bits=data[i + 4])
        if marker == 0xDA:  # start of scan before any frame header: broken
            break
        i += 2 + length
    raise BadImage("JPEG without a frame header (truncated or corrupt)")


def _tiff_orientation(tiff: bytes) -> int:
    """The Orientation tag (0x0112) of an EXIF/TIFF block's first IFD; 1 when absent or unreadable."""
    try:
        order = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack(order + "I", tiff[4:8])
        (count,) = struct.unpack(order + "H", tiff[ifd : ifd + 2])
        for k in range(count):
            entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
            tag, kind = struct.unpack(order + "HH", entry[:4])
            if tag == 0x0112 and kind == 3:  # SHORT
                (value,) = struct.unpack(order + "H", entry[8:10])
                return value if 1 <= value <= 8 else 1
    except (KeyError, struct.error, IndexError):
        pass
    return 1


def _png_orientation(data) -> int:
    """EXIF orientation of a PNG's eXIf chunk (which must precede the image data); 1 without one."""
    i, n = 8, len(data)
    while i + 8 <= n:
        length = struct.unpack(">I", bytes(data[i : i + 4]))[0]
        kind = bytes(data[i + 4 : i + 8])
        if kind == b"eXIf":
            return _tiff_orientation(bytes(data[i + 8 : i + 8 + length]))
        if kind in (b"IDAT", b"IEND"):
            return 1
        i += 12 + length
    return 1


def apply_orientation(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """Turn a decoded (..., H, W) image upright as its EXIF orientation says, on any device.

    One policy for every decoder (torchvision, simplejpeg, Pillow, nvJPEG): phone photos store pixels as
    the sensor read them and say in EXIF how to show them, so a decoder that ignored the tag would hand
    the model a sideways picture on one backend and an upright one on another. Same transforms as
    Pillow's ImageOps.exif_transpose (tests/unit/data/test_decode.py checks all 8 tags against it).
    """
    if orientation in (None, 1):
        return img
    t = img.transpose(-1, -2)
    out = {
        2: img.flip(-1),
        3: img.flip((-2, -1)),
        4: img.flip(-2),
        5: t,
        6: t.flip(-1),
        7: t.flip((-2, -1)),
        8: t.flip(-2),
    }.get(orientation, img)
    return out.contiguous()


def swaps_axes(orientation: int) -> bool:
    """Orientations 5-8 turn the image by 90 degrees: the upright image is W x H of the stored one."""
    return orientation in (5, 6, 7, 8)


# First bytes of common files that are not images, for the "not an image" message.
_SIGNATURES = {
    b"%PDF": "a PDF document",
    b"PK\x03\x04": "a ZIP archive (or .docx/.xlsx)",
    b"\x1f\x8b": "a gzip file",
    b"<!DOCTYPE": "an HTML page",
    b"<html": "an HTML page",
    b"<?xml": "an XML file",
    b"\x7fELF": "a program",
}


def describe_bytes(data: bytes | memoryview) -> str:
    """What the first bytes of a non-image file say it is: a known format, text, or its first bytes in hex."""
    head = bytes(data[:64])
    for sig, what in _SIGNATURES.items():
        if head.lstrip().lower().startswith(sig.lower()):
            return what
    try:
        text = head.decode("utf-8")
        if text and all(c.isprintable() or c in "\r\n\t" for c in text):
            return f"text starting {text[:40]!r}"
    except UnicodeDecodeError:
        pass
    return f"its first bytes are {head[:8].hex(' ')}"


def check_size(header: ImageHeader, max_pixels: int) -> None:
    """Refuse images whose header announces more than `max_pixels` (decompression bombs, 100 MP scans)."""
    if header.height is not None and header.width is not None and header.height * header.width > max_pixels:
        raise BadImage(
            f"{header.width}x{header.height} = {header.width * header.height:,} pixels > data.max_image_pixels="
            f"{max_pixels:,}; resize the file or raise the limit"
        )


def to_uint8_channels(img: torch.Tensor, channels: int) -> torch.Tensor:
    """Any decoded CHW tensor -> uint8 with `channels` (1 or 3) channels.

    16-bit PNGs arrive as uint16 (0..65535): the top byte is the 8-bit value (x >> 8, as Pillow's
    I;16 -> L conversion and libpng's strip_16 do). Alpha is dropped, not composited (the colour
    under a transparent pixel is the file's own); gray is repeated to RGB.
    """
    if img.dtype == torch.uint16:
        img = (img.to(torch.int32) >> 8).to(torch.uint8)
    elif img.dtype != torch.uint8:
        raise BadImage(f"unsupported pixel type {img.dtype}")
    c = img.shape[0]
    if c in (2, 4):
        img, c = img[: c - 1], c - 1
    if channels == 3 and c == 1:
        img = img.repeat(3, 1, 1)
    elif channels == 1 and c == 3:
        w = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)  # ITU-R 601-2 luma, as Pillow's convert("L")
        img = (img.float() * w).sum(0, keepdim=True).round_().clamp_(0, 255).to(torch.uint8)
    return img


def _generic(data: bytes, channels: int) -> torch.Tensor:
    """torchvision's decode_image for every format it knows, Pillow otherwise (e.g. BMP, TIFF)."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        # RGB/GRAY modes convert CMYK/YCCK JPEGs and drop alpha inside the decoder; 16-bit stays 16-bit.
        mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        # Orientation is applied once, by decode_bytes, for every decoder alike.
        img = decode_image(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode, apply_exif_orientation=False
        )
        return to_uint8_channels(img, channels)
    except RuntimeError as tv_error:
        try:
            return _pil(data, channels, None)
        except BadImage:
            if read_header(data).format == "other":  # neither library knows the format: say what the file is
                raise BadImage(f"not an image: {describe_bytes(data)}") from None
            raise BadImage(str(tv_error).splitlines()[-1].split(", ")[-1]) from None


def _pil(data: bytes, channels: int, min_size) -> torch.Tensor:
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
        if min_size is not None and im.format == "JPEG":
            im.draft("RGB" if channels == 3 else "L", (min_size[1], min_size[0]))
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            arr = np.asarray(im).astype(np.int64)
            arr = (arr >> 8).clip(0, 255).astype(np.uint8) if arr.max() > 255 else arr.astype(np.uint8)
            im = Image.fromarray(arr)
        im = im.convert("RGB" if channels == 3 else "L")
        arr = np.array(im)  # a writable copy
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadImage(f"not a readable image ({type(e).__name__}: {e})") from None
    t = torch.from_numpy(arr)
    return t.permute(2, 0, 1) if t.ndim == 3 else t.unsqueeze(0)


@DECODERS.register("torchvision")
def decode_torchvision(data: bytes, header: ImageHeader, channels: int, min_size=None) -> torch.Tensor:
    """libjpeg-turbo through torchvision.io (no reduced-size decoding)."""
    return _generic(data, channels)


@DECODERS.register("pil")
def decode_pil(data: bytes, header: ImageHeader, channels: int, min_size=None) -> torch.Tensor:
    """Pillow; JPEGs decode at 1/2, 1/4 or 1/8 scale (draft) when `min_size` allows it."""
    if header.format != "jpeg":
        return _generic(data, channels)
    return _pil(data, channels, min_size)


def _simplejpeg_decode(data: bytes, header: ImageHeader, channels: int, min_size=None) -> torch.Tensor:
    """simplejpeg (libjpeg-turbo's TurboJPEG API); scaled decoding by N/8 when `min_size` allows it."""
    import simplejpeg

    if header.format != "jpeg" or header.components != 3:
        return _generic(data, channels)  # CMYK, gray: torchvision's colour conversion, identical everywhere
    kw = {"min_height": min_size[0], "min_width": min_size[1]} if min_size is not None else {}
    try:
        arr = simplejpeg.decode_jpeg(data, colorspace="RGB" if channels == 3 else "GRAY", **kw)
    except ValueError as e:
        raise BadImage(f"corrupt JPEG ({e})") from None
    # HWC -> a CHW view with channels-last strides: no copy, and torch's uint8 antialiased resize
    # kernel is fastest on exactly this layout.
    return torch.from_numpy(arr).permute(2, 0, 1)


def simplejpeg_available() -> bool:
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return False
    return True


if simplejpeg_available():
    DECODERS.register("simplejpeg")(_simplejpeg_decode)


def resolve_decoder(name: str) -> str:
    """'auto' -> the fastest installed decoder (measured order: simplejpeg, torchvision)."""
    if name == "auto":
        return "simplejpeg" if "simplejpeg" in DECODERS else "torchvision"
    if name not in DECODERS:
        hint = " Install it with `pip install simplejpeg`." if name == "simplejpeg" else ""
        raise UsageError(f"data.decoder={name} is not available here.{hint} Installed: {DECODERS.names()}.")
    return name


# A file's format by its extension, as the loader line names it.
FORMAT_OF_SUFFIX = {
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".png": "PNG",
    ".gif": "GIF",
    ".webp": "WebP",
    ".bmp": "BMP",
    ".tif": "TIFF",
    ".tiff": "TIFF",
}
# What torchvision.io.decode_image reads (torchvision 0.29, checked by decoding one file of each); the rest goes
# to Pillow (_generic's fallback).
TORCHVISION_FORMATS = ("JPEG", "PNG", "GIF", "WebP")


def decoder_for(decoder: str, fmt: str) -> str:
    """The library that decodes files of format `fmt` (FORMAT_OF_SUFFIX's names) under data.decoder `decoder`
    (resolved): the JPEG decoders read JPEGs only and hand every other format to _generic (torchvision,
    then Pillow). simplejpeg also hands over grey and CMYK JPEGs (read_header's components != 3)."""
    if fmt == "JPEG" and decoder in ("simplejpeg", "pil"):
        return decoder
    return "torchvision" if fmt in TORCHVISION_FORMATS else "pil"


def decode_bytes(
    data: bytes, *, channels: int = 3, decoder: str = "torchvision", max_pixels: int = 89_478_485, min_size_for=None
) -> torch.Tensor:
    """Decode file bytes into a uint8 CHW tensor with `channels` channels, or raise BadImage.

    Args:
        data: the file's bytes.
        channels: 3 (RGB) or 1 (gray).
        decoder: a DECODERS name (resolved, not 'auto').
        max_pixels: larger images (by header) are refused.
        min_size_for: optional function (height, width) -> (min_h, min_w) | None: the smallest decoded
            size the preprocessing can use without losing detail; lets JPEG decoders scale in the DCT.
    """
    header = read_header(data)
    check_size(header, max_pixels)
    min_size = None
    if min_size_for is not None and header.height is not None:
        if swaps_axes(header.orientation):  # the hint speaks of the upright image; the decoder of the stored one
            upright = min_size_for(header.width, header.height)
            min_size = None if upright is None else (upright[1], upright[0])
        else:
            min_size = min_size_for(header.height, header.width)
    try:
        img = DECODERS.get(decoder)(data, header, channels, min_size)
    except RuntimeError as e:  # torchvision's decoders raise RuntimeError for corrupt data
        raise BadImage(str(e).splitlines()[-1]) from None
    if img.shape[1] * img.shape[2] > max_pixels:  # formats whose size the header sniffing cannot see
        check_size(ImageHeader("other", img.shape[1], img.shape[2]), max_pixels)
    return apply_orientation(img, header.orientation)


def read_bytes(path: str, max_bytes: int | None = MAX_FILE_MB * MB) -> bytes:
    """A file's bytes (raises OSError with the path on I/O problems). Only a regular file of at most `max_bytes`
    is read (files.RefusedFile, an OSError, otherwise): a FIFO would block, a device or a sparse file never end."""
    return read_regular(path, max_bytes)

"""How the JPEG variants in this folder were made (run once; the files are committed, 40x30 pixels).

nvJPEG rejects these codings, and Pillow cannot write them, so they are generated with other real
encoders and kept as fixtures:
  lossless.jpg    SOF3, 8-bit lossless, predictor 1: imagecodecs 2026.3.6 (libjpeg-turbo 3.1.3),
                  jpeg8_encode(lossless=True, predictor=1)
  12bit.jpg       SOF1, 12-bit DCT: imagecodecs jpeg8_encode(bitspersample=12) of the same picture x 16
  arithmetic.jpg  SOF9, arithmetic-coded: Debian's libjpeg-turbo-progs 2.1.5 `jpegtran -arithmetic` of
                  baseline.jpg (the same DCT coefficients, another entropy coder)
  baseline.jpg    SOF0, Pillow quality 90 (the source of arithmetic.jpg)

    pip install --target /tmp/ic imagecodecs; apt-get download libjpeg-turbo-progs libjpeg62-turbo
    (dpkg -x both into /tmp/x); PYTHONPATH=/tmp/ic python make.py /tmp/x
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).parent


def picture() -> np.ndarray:
    """(30, 40, 3) uint8: smooth gradients plus a bright square (decodable, visibly structured)."""
    y, x = np.mgrid[0:30, 0:40]
    img = np.stack([x * 6, y * 8, (x + y) * 3], axis=-1).astype(np.uint8)
    img[8:20, 10:25] = (240, 200, 40)
    return img


if __name__ == "__main__":
    import imagecodecs

    debian = Path(sys.argv[1])
    img = picture()
    (HERE / "lossless.jpg").write_bytes(imagecodecs.jpeg8_encode(img, lossless=True, predictor=1))
    (HERE / "12bit.jpg").write_bytes(imagecodecs.jpeg8_encode(img.astype(np.uint16) * 16, level=90, bitspersample=12))
    Image.fromarray(img).save(HERE / "baseline.jpg", quality=90)
    lib = debian / "usr/lib/x86_64-linux-gnu"
    out = subprocess.run(
        [str(debian / "usr/bin/jpegtran"), "-arithmetic", str(HERE / "baseline.jpg")],
        check=True,
        capture_output=True,
        env={"LD_LIBRARY_PATH": str(lib)},
    ).stdout
    (HERE / "arithmetic.jpg").write_bytes(out)

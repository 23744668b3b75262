"""`torchsprint serve`'s decoding: image bytes -> the run's exact eval input (`Decoder`, run in a thread pool or on
the model thread), the `Job` that carries one image to the model, and the refusal of an image the server cannot
use (`ImageError`). Nothing here knows HTTP or batching (commands/serve_app.py,
commands/serve_engine.py).

Exactness: an image is decoded by data/preprocess/decode.py's `decode_bytes` with the run's data.decoder and then
the eval spec's CPU pipeline, the calls `Predictor._load_cpu` makes for a file (on CUDA, nvJPEG and the GPU spec:
`Predictor._decode_gpu`, as `predict --device cuda`), normalised and run by the same `Predictor.logits`, and
turned into top-k by the task's own postprocess. Only the batch it shares differs from predict's: the logits of
a row do not depend on the other rows in eval mode, up to float rounding (tests/e2e/serve/test_serve.py states the
bound).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch


class ImageError(Exception):
    """An image the server cannot use (not an image, truncated, too many pixels to decode or for the model, a size
    the model refuses): 422."""

    def __init__(self, message: str, kind: str = "bad_image"):
        super().__init__(message)
        self.kind = kind


@dataclass
class Job:
    """One image waiting for the model: its preprocessed uint8 CHW tensor (or its JPEG bytes for nvJPEG), the
    request's top-k, and the future the model thread answers (a result dict, or an ImageError). A job queued while
    the model thread is idle carries the request's bytes instead (`data`): the model thread decodes it itself."""

    image: torch.Tensor | None
    jpeg: torch.Tensor | None
    topk: int
    future: Future = field(default_factory=Future)
    data: bytes | None = None  # not yet decoded (Batcher.put_if_idle)
    error: Exception | None = None  # its decode's refusal, once decoded on the model thread

    def key(self) -> tuple:
        """Images batch together only with their own shape (an eval spec without a resize keeps each file's)."""
        if self.data is not None:
            return ("bytes",)
        return ("jpeg",) if self.image is None else tuple(self.image.shape)


class Decoder:
    """File bytes -> the run's eval input, exactly as `predict` loads a file (see the module docstring)."""

    def __init__(self, predictor, limits):
        """`limits`: commands/serve_limits.py's Limits (serve.max_pixels, serve.max_model_pixels), or a number of
        pixels: the decode bound alone (benchmarks/serve/serve_load.py's reference endpoints)."""
        from torchsprint.commands.serve_limits import Limits
        from torchsprint.data.preprocess.decode import resolve_decoder

        if isinstance(limits, int):
            limits = Limits.decode_only(limits)
        self.predictor, self.limits, self.max_pixels = predictor, limits, limits.max_pixels
        self.decoder = resolve_decoder(predictor.data_cfg.decoder)
        self.channels = 1 if predictor.in_channels == 1 else 3
        # nvJPEG batches need one output size: only specs that fix it take the GPU path.
        self.gpu = predictor.gpu_pipeline is not None and predictor.pipeline.out_size is not None

    def check_pixels(self, data: bytes, header) -> None:
        """Refuse more than max_pixels, or a model input over serve.max_model_pixels, before decoding: the header's
        size (JPEG, PNG), else Pillow's lazy open."""
        h, w = header.height, header.width
        if h is None:
            from PIL import Image

            try:
                with Image.open(io.BytesIO(data)) as im:  # reads the header only
                    w, h = im.size
            except Exception:  # noqa: BLE001 - not Pillow's format: decode_bytes reports what it is
                return
        if h * w > self.max_pixels:
            raise ImageError(
                f"{w}x{h} = {w * h:,} pixels > serve.max_pixels={self.max_pixels:,}; send a smaller image",
                "too_many_pixels",
            )
        refused = self.limits.too_many(h, w)  # the model input's size, from the header: never decoded to be refused
        if refused is not None:
            raise ImageError(refused, "too_many_pixels")

    def check_model(self, image: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The eval input, or ImageError: its exact pixels against serve.max_model_pixels (a file whose header
        said nothing), and the model's own input size (an ONNX graph's fixed dims: Predictor.input_refusal)."""
        refused = self.limits.too_many(h, w, tuple(image.shape[-2:]))
        if refused is not None:
            raise ImageError(refused, "too_many_pixels")
        refused = self.predictor.input_refusal(tuple(image.shape))
        if refused is not None:
            raise ImageError(refused, "model_refused")
        return image

    def cpu_path(self, data: bytes) -> torch.Tensor:
        """predict's `_load_cpu` on bytes: decode_bytes with data.decoder, then the eval spec's CPU pipeline."""
        from torchsprint.data.preprocess.decode import BadImage, decode_bytes

        try:
            image = decode_bytes(data, channels=self.channels, decoder=self.decoder, max_pixels=self.max_pixels)
        except BadImage as e:
            raise ImageError(str(e).replace("data.max_image_pixels", "serve.max_pixels")) from None
        cpu = self.predictor.pipeline.cpu
        return self.check_model(cpu(image) if cpu is not None else image, *image.shape[-2:])

    def prepare(self, data: bytes, topk: int) -> Job:
        """A Job for these bytes, or ImageError (runs in the decode pool, off the event loop)."""
        from torchsprint.data.preprocess.decode import BadImage, read_header

        try:
            header = read_header(data)
            self.check_pixels(data, header)
            if self.gpu:
                from torchsprint.data.preprocess.on_device import nvjpeg_ok

                if nvjpeg_ok(header):
                    return Job(None, torch.frombuffer(bytearray(data), dtype=torch.uint8), topk)
            return Job(self.cpu_path(data), None, topk)
        except BadImage as e:
            raise ImageError(str(e).replace("data.max_image_pixels", "serve.max_pixels")) from None
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - a file that breaks a decoder or transform is the sender's, never a 500
            raise ImageError(f"cannot read this image ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def decode_threads() -> int:
    """Threads that decode request images: one per core, at most 8 (the model thread's own count is measured at
    warm-up: Batcher.choose_threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


def decode_pool(threads: int) -> ThreadPoolExecutor:
    """The threads that decode and preprocess request images (off the event loop)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="torchsprint-serve-decode")

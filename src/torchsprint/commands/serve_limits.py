"""`torchsprint serve`'s bounds on what one request may cost (`Limits`), resolved once at start-up: the pixels a file
may have to be decoded (serve.max_pixels, read from its header), the pixels of the model input (serve.max_model_pixels,
where the eval spec keeps each file's size), the pixels of one forward pass, and what the server says about them
(and about an ONNX graph's fixed input size) in its start-up lines. commands/serve_decode.py's Decoder applies the
per-image bounds, commands/serve_engine.py's Batcher the per-batch one.

Why a model-input bound apart from max_pixels: a decode costs a few bytes a pixel, a forward pass hundreds (the
default small_cnn, width 32: ~650 bytes a pixel, measured at 512x512 and 1024x1024 on one CPU thread; a 35 KB PNG
of 6000x6000, under max_pixels' 40 M, took 19.4 GB).
An eval spec that fixes the output size (resize: [H, W], a crop) bounds the model input itself; one that keeps each
file's size leaves it to the sender, so the server bounds it from what the run itself trained on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from torchsprint.errors import UsageError

AUTO_FACTOR = 4  # auto: this many times the pixels of the largest training image (twice its width and height)
AUTO_FLOOR = 512 * 512  # and at least this: a small-image run (8x8 digits, 32x32 CIFAR) still takes a small photo
WARM_SIDE = 32  # the warm-up's generated images (serve_engine.Batcher.warm_up), within the limit


@dataclass(frozen=True)
class Limits:
    """What one image and one batch may cost. `fixed`: the eval spec's (H, W) when it fixes the model input (then
    `model_pixels` is its pixels); `why`: where `model_pixels` comes from; `warm`: the warm-up images' (H, W)."""

    max_pixels: int
    fixed: tuple[int, int] | None
    model_pixels: int
    batch_pixels: int
    why: str
    steps: tuple
    warm: tuple[int, int] = (WARM_SIDE, WARM_SIDE)

    @classmethod
    def decode_only(cls, max_pixels: int) -> Limits:
        """max_pixels and no bound on the model input nor the batch (a reference endpoint, not the server)."""
        return cls(max_pixels, None, 2**62, 2**62, "unbounded", ())

    def model_size(self, h: int, w: int) -> tuple[int, int]:
        """(H, W) of an h x w file after the eval spec's steps. In a spec that keeps each file's size, `resize: N`
        (an int: the shorter side to N, torchvision's rule, max_size capping the longer) is the step that changes
        it; crops and resize: [H, W] set it."""
        for name, arg in self.steps:
            if name not in ("resize", "center_crop", "random_crop", "random_resized_crop"):
                continue
            size = arg.get("size") if isinstance(arg, dict) else arg
            if isinstance(size, list | tuple) and len(size) == 2:
                h, w = size
            elif name != "resize" and size is not None:
                h = w = size[0] if isinstance(size, list | tuple) else size
            elif size is not None:
                short, long = min(h, w), max(h, w)
                new_short = size[0] if isinstance(size, list | tuple) else size
                new_long = int(new_short * long / short)
                cap = arg.get("max_size") if isinstance(arg, dict) else None
                if cap is not None and new_long > cap:
                    new_short, new_long = int(cap * new_short / new_long), cap
                h, w = (new_short, new_long) if h <= w else (new_long, new_short)
        return h, w

    def too_many(self, h: int, w: int, after: tuple[int, int] | None = None) -> str | None:
        """The refusal of an h x w file whose model input (`after`, else computed from the spec) passes
        model_pixels, or None. Never for a fixed-size spec: the spec bounds it (max_pixels bounds the decode)."""
        if self.fixed is not None:
            return None
        mh, mw = after or self.model_size(h, w)
        if mh * mw <= self.model_pixels:
            return None
        side = math.isqrt(self.model_pixels)
        shown = f" ({mw}x{mh} after the eval preprocessing)" if (mh, mw) != (h, w) else ""
        return (
            f"{w}x{h} = {w * h:,} pixels{shown} > serve.max_model_pixels={self.model_pixels:,} ({self.why}): a "
            f"forward pass costs memory and time by its input's pixels; send a smaller image (e.g. {side}x{side}), "
            "or raise serve.max_model_pixels"
        )

    def describe(self, max_batch: int) -> str:
        """The start-up line of the limits in effect."""
        head = f"limits: files up to serve.max_pixels={self.max_pixels:,} pixels (by their header) are decoded; "
        if self.fixed is not None:
            h, w = self.fixed
            return (
                head + f"every model input is {w}x{h} (data.eval.transforms fixes it); a forward pass takes at "
                f"most {max_batch} images ({self.batch_pixels:,} pixels)"
            )
        return (
            head + f"the model input takes serve.max_model_pixels={self.model_pixels:,} pixels at most after the "
            f"eval preprocessing ({self.why}; larger images get 422 too_many_pixels); a forward pass takes at most "
            f"{self.batch_pixels:,} pixels (max_batch={max_batch} images of one shape, fewer of larger ones)"
        )


def resolve_limits(cfg, predictor, target: Path) -> Limits:
    """The Limits of serving `predictor` (from `target`, a run folder or model file) under `cfg` (ServeConfig); a
    serve.max_model_pixels below the size a fixed-size eval spec gives every image is refused (UsageError)."""
    pipe, steps, setting = predictor.pipeline, tuple(predictor.pipeline.steps), cfg.max_model_pixels
    warm = graph_size(predictor)
    if pipe.out_size is not None:
        h, w = pipe.out_size
        if setting != "auto" and setting < h * w:
            raise UsageError(
                f"serve.max_model_pixels={setting:,} is below the {w}x{h} = {h * w:,} pixels that "
                "data.eval.transforms makes every image: every request would be refused. Leave it auto "
                f"(the eval spec bounds the model input) or set at least {h * w}."
            )
        return Limits(
            cfg.max_pixels,
            (h, w),
            h * w,
            cfg.max_batch * h * w,
            "the eval spec's size",
            steps,
            warm or (WARM_SIDE, WARM_SIDE),
        )
    limit, why = (setting, "set") if setting != "auto" else auto_model_pixels(predictor, target)
    side = max(1, min(WARM_SIDE, math.isqrt(limit)))
    return Limits(cfg.max_pixels, None, limit, limit, why, steps, warm or (side, side))


def auto_model_pixels(predictor, target: Path) -> tuple[int, str]:
    """serve.max_model_pixels=auto for a spec that keeps each file's size: AUTO_FACTOR x the pixels of the largest
    image the run trained on, at least AUTO_FLOOR. The largest training image: the sides decisions.json records
    (`image_size.max`: every stored image, or the largest of the sampled files), or data.train.transforms' crop if
    larger. Validation images are not recorded; they come from the same source. A model file records no sizes."""
    candidates = []
    try:
        h, w = json.loads((Path(target) / "decisions.json").read_text())["image_size"]["max"]
        candidates.append((int(h) * int(w), f"{w}x{h}, the largest training image decisions.json records"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        from torchsprint.data.preprocess.transforms import compile_spec

        crop = compile_spec(
            predictor.data_cfg.train.transforms, "data.train.transforms", predictor.in_channels
        ).out_size
    except (UsageError, TypeError, ValueError):
        crop = None
    if crop is not None:
        candidates.append((crop[0] * crop[1], f"{crop[1]}x{crop[0]}, the training crop"))
    floor = f"at least {math.isqrt(AUTO_FLOOR)}x{math.isqrt(AUTO_FLOOR)}"
    if not candidates:
        return AUTO_FLOOR, f"auto: {floor}; {Path(target).name} records no training image size"
    pixels, what = max(candidates)
    return max(AUTO_FACTOR * pixels, AUTO_FLOOR), f"auto: {AUTO_FACTOR} x {what}, and {floor}"


def graph_size(predictor) -> tuple[int, int] | None:
    """(H, W) an ONNX graph fixes (Predictor.graph_input), or None."""
    dims = getattr(predictor, "graph_input", None)
    if not dims or len(dims) != 4 or dims[2] is None or dims[3] is None:
        return None
    return dims[2], dims[3]


def graph_note(predictor) -> str | None:
    """The start-up line of an ONNX graph whose fixed input size the eval spec does not give every image: which
    images onnxruntime refuses (422 model_refused, Predictor.input_refusal) where the torch runtime answers."""
    size = graph_size(predictor)
    out = predictor.pipeline.out_size
    if size is None or out == size:
        return None
    h, w = size
    channels = predictor.graph_input[1]
    if out is None:
        which = (
            f"data.eval.transforms keeps each file's size, so an image that is not {w}x{h} after it gets 422 "
            "model_refused, where the torch runtime answers it"
        )
    else:
        which = f"data.eval.transforms makes every image {out[1]}x{out[0]}, so every image gets 422 model_refused"
    return (
        f"note: the ONNX graph takes only {channels or 'C'}x{h}x{w} images (fixed at export): {which}; to take "
        f"others, add resize: [{h}, {w}] to data.eval.transforms and export again, or serve with "
        "serve.runtime=torch"
    )

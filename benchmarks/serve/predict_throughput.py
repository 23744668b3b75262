"""Predict throughput (images/s) of the torch and onnxruntime backends, end to end and model-only.

Cases: the default digits model (8x8 grayscale PNG files) and a ResNet-18 at 224 (500x375 JPEG files,
eval spec resize 256 + center_crop 224 + imagenet normalisation). Weights are random: throughput does
not depend on them. Backends alternate within each repeat so that machine load hits both alike.

    python -m benchmarks.serve.predict_throughput [--repeats 3] [--images 64] [--device cpu] [--json out.json]

On CUDA the torch backend decodes JPEGs with nvJPEG in batches (predict's GPU path); onnxruntime uses its
CUDA provider when the installed onnxruntime has one (the row says which provider ran).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common.inference import make_images, make_run
from torchsprint.commands.export import export
from torchsprint.commands.predict import Predictor


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="predict-bench-"))
    jpgs = make_images(tmp / "jpg" / "c0", args.images, (500, 375), False, ".jpg")
    r18_spec = [{"resize": 256}, {"center_crop": 224}, {"normalize": "imagenet"}]
    cases = {
        "small_cnn digits 8x8 (PNG)": (
            make_run(tmp / "digits", "small_cnn", [], 1, 10),
            make_images(tmp / "png", args.images * 4, (8, 8), True, ".png"),
            256,
        ),
        "resnet18 224 (500x375 JPEG)": (
            make_run(
                tmp / "r18",
                "resnet18",
                r18_spec,
                3,
                1000,
                ["data.dataset=image_folder", f"data.root={tmp / 'jpg'}", f"data.train.transforms={r18_spec}"],
            ),
            jpgs,
            32,
        ),
    }
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} repeats={args.repeats}")
    rows = []
    print("| case | backend | end-to-end images/s (median, min-max) | model-only images/s |")
    print("|---|---|---|---|")
    for name, (run, paths, bs) in cases.items():
        export(run, "onnx")
        preds = {b: Predictor.from_run(run, backend=b, device=args.device, batch_size=bs) for b in ("torch", "onnx")}
        batch = torch.stack([img for _, img in preds["torch"]._stream(paths[:bs])])
        for p in preds.values():  # warm-up: first-call allocations, onnxruntime graph optimisation
            p.predict(paths[:bs])
        e2e = {b: [] for b in preds}
        model_only = {b: [] for b in preds}
        for _ in range(args.repeats):
            for b, p in preds.items():
                e2e[b].append(len(paths) / timed(lambda p=p, paths=paths: p.predict(paths)))
                model_only[b].append(
                    len(batch) * 3 / timed(lambda p=p, batch=batch: [p.logits(batch) for _ in range(3)])
                )
        for b in preds:
            label = b if b == "torch" else f"onnx ({providers(preds[b])})"
            print(
                f"| {name} | {label} | {statistics.median(e2e[b]):.0f} ({min(e2e[b]):.0f}-{max(e2e[b]):.0f}) | "
                f"{statistics.median(model_only[b]):.0f} |"
            )
            rows.append(
                {
                    "case": name,
                    "backend": label,
                    "end_to_end_images_per_s": statistics.median(e2e[b]),
                    "model_only_images_per_s": statistics.median(model_only[b]),
                    "cpu_fallbacks": getattr(preds[b], "cpu_fallbacks", 0),
                }
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": args.device, "torch": torch.__version__, "rows": rows}, indent=1)
        )


def providers(predictor) -> str:
    """The execution provider onnxruntime actually used (the first of the session's providers)."""
    sess = getattr(predictor.forward, "session", None)
    return sess.get_providers()[0] if sess is not None else "?"


if __name__ == "__main__":
    main()

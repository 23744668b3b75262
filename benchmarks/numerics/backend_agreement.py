"""Do the loader backends train to the same accuracy? The same config on the cpu, memory and gpu backends, several
seeds.

The backends' agreement: ResNet-18 from scratch on generated JPEGs (synthetic_jpeg, 10 classes, validation
sorted by class, eval batch 32) reached 67.2% top-1 on the cpu backend and 36.8% on the memory backend
after 3 epochs. This script measures the seed-to-seed spread of the final validation top-1 per backend
and says whether the backends' means differ by more than it.

Two jobs:
  jpeg    ResNet-18 (torchvision) at --crop px on --train-images generated --size x --size JPEGs,
          random_resized_crop + hflip for training, resize + center_crop for evaluation, --epochs epochs.
  digits  the default run (`torchsprint train` with no config: digits, small_cnn, 10 epochs), run.seed varied.

Backends: cpu, memory, and `gpu_on_cpu`, the gpu backend's own code (data/backends/gpu.build_gpu_loaders:
batched decode, resample_batch, per-sample parameters) on the CPU device, registered here because
`data.backend=gpu` itself needs CUDA. The gpu backend reads files, so it has no digits row.

    python -m benchmarks.numerics.backend_agreement --job jpeg --seeds 0,1,2,3,4 --json jpeg.json
    python -m benchmarks.numerics.backend_agreement --job digits --seeds 0,1,2,3,4 --json digits.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common.runs import train_once
from benchmarks.common.stats import compare, mean_std, strict

JPEG_BACKENDS = ("cpu", "memory", "gpu_on_cpu")
DIGITS_BACKENDS = ("cpu", "memory")
QUIET = ["log.tensorboard=false", "log.progress=false", "checkpoint.every_epochs=null"]


def register_gpu_on_cpu() -> None:
    """`data.backend=gpu_on_cpu`: the gpu backend's code with CPU decoding (gpu_loader itself refuses a CPU device)."""
    from torchsprint.data.backends.gpu import build_gpu_loaders
    from torchsprint.data.core import LOADERS

    if "gpu_on_cpu" not in LOADERS:
        LOADERS.register("gpu_on_cpu")(build_gpu_loaders)


def jpeg_overrides(args, backend: str, seed: int) -> list[str]:
    resize = round(args.crop * 8 / 7)  # the usual 0.875 centre-crop ratio (224 of 256)
    return [
        "data.dataset=synthetic_jpeg",
        f"data.root={args.root}",
        f"data.options={{num_images: {args.train_images}, val_images: {args.val_images}, size: [{args.size}, "
        f"{args.size}], classes: 10}}",
        f"data.backend={backend}",
        f"data.batch_size={args.batch_size}",
        "data.eval_batch_size=32",
        f"data.num_workers={args.workers}",
        f"data.train.transforms=[{{random_resized_crop: {args.crop}}}, hflip, {{normalize: imagenet}}]",
        f"data.eval.transforms=[{{resize: {resize}}}, {{center_crop: {args.crop}}}, {{normalize: imagenet}}]",
        f"model.name={args.model}",
        f"optim.lr={args.lr}",
        f"run.epochs={args.epochs}",
        f"run.seed={seed}",
        *QUIET,
    ]


def digits_overrides(args, backend: str, seed: int) -> list[str]:
    return [f"data.backend={backend}", f"run.seed={seed}", *QUIET]


def run_one(overrides: list[str]) -> dict:
    """Train one run; its final validation figures and wall time."""
    s, seconds = train_once(overrides)
    final = s["final"]
    return {"top1": final["val/top1"], "loss": final.get("val/loss"), "seconds": seconds}


def print_table(job: str, results: dict[str, list[float]], seeds: list[int], note: str) -> None:
    print(f"\n{job}: {note}")
    print(f"{'backend':<12} " + " ".join(f"{'seed ' + str(s):>8}" for s in seeds) + f" {'mean':>8} {'std':>7}")
    for b, xs in results.items():
        m, s = mean_std(xs)
        print(f"{b:<12} " + " ".join(f"{x:8.4f}" for x in xs) + f" {m:8.4f} {s:7.4f}")
    for r in compare(results):
        print(
            f"{r['a']} - {r['b']}: {r['diff']:+.4f} (standard error {r['se']:.4f}, t {r['t']:+.2f}): "
            + ("BEYOND the seed-to-seed spread" if r["beyond_spread"] else "within the seed-to-seed spread")
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    ap.add_argument("--job", choices=("jpeg", "digits"), default="jpeg")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run.seed values")
    ap.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: cpu,memory,gpu_on_cpu for jpeg; cpu,memory for digits)",
    )
    ap.add_argument("--model", default="resnet18", help="jpeg job: model.name (resnet18 is torchvision's)")
    ap.add_argument("--epochs", type=int, default=3, help="jpeg job")
    ap.add_argument("--train-images", type=int, default=2000, help="jpeg job")
    ap.add_argument("--val-images", type=int, default=500, help="jpeg job")
    ap.add_argument("--size", type=int, default=160, help="jpeg job: side of the generated JPEGs")
    ap.add_argument(
        "--crop", type=int, default=112, help="jpeg job: training/eval crop (eval resizes to crop * 8/7 first)"
    )
    ap.add_argument("--batch-size", type=int, default=64, help="jpeg job: training batch size")
    ap.add_argument("--lr", type=float, default=0.1, help="jpeg job: optim.lr (SGD + Nesterov, cosine: the defaults)")
    ap.add_argument("--workers", type=int, default=0, help="jpeg job: data.num_workers")
    ap.add_argument("--root", default="/tmp/backend_agreement", help="jpeg job: where the JPEGs are generated (reused)")
    ap.add_argument("--json", default=None, help="write the per-run figures and the comparison here")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    default = JPEG_BACKENDS if args.job == "jpeg" else DIGITS_BACKENDS
    backends = args.backends.split(",") if args.backends else list(default)
    register_gpu_on_cpu()
    build = jpeg_overrides if args.job == "jpeg" else digits_overrides
    results: dict[str, list[float]] = {b: [] for b in backends}
    runs = []
    for seed in seeds:  # seeds outermost: a cut-short measurement still has every backend
        for b in backends:
            r = run_one(build(args, b, seed))
            runs.append({"backend": b, "seed": seed, **r})
            results[b].append(r["top1"])
            print(f"{b} seed {seed}: val top-1 {r['top1']:.4f} ({r['seconds']:.0f} s)", flush=True)
    import torch
    import torchvision

    note = (
        f"{args.model}, {args.train_images} train / {args.val_images} val {args.size}x{args.size} JPEGs, crop "
        f"{args.crop}, {args.epochs} epochs"
        if args.job == "jpeg"
        else "the default run (digits, small_cnn, 10 epochs)"
    )
    print_table(args.job, results, seeds, note)
    if args.json:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        out = {
            "job": args.job,
            "note": note,
            "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__,
            "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torchvision": torchvision.__version__,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
            "runs": runs,
            "by_backend": {b: dict(zip(("mean", "std"), mean_std(xs)), top1=xs) for b, xs in results.items()},
            "comparison": compare(results),
        }
        Path(args.json).write_text(json.dumps(strict(out), indent=1))


if __name__ == "__main__":
    main()

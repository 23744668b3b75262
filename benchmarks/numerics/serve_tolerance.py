"""How far `torchsprint serve`'s probabilities can be from `torchsprint predict`'s for the same image: the bound
tests/serve_helpers.py's TOL is set from.

serve runs an image in whatever batch it shares (1..max_batch images, padded to a power of two or not), predict
in batches of 64 in file order; in eval mode a row's logits do not depend on the other rows, up to float rounding
of kernels that block differently per batch size. This measures max |p_serve - p_predict| over random batch
compositions, sizes and torch thread counts, and the smallest distance between two different images' probability
vectors (what a swapped answer would show).

    python -m benchmarks.numerics.serve_tolerance [--run RUN_DIR] [--trials 20] [--precision fp32|bf16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def measure(
    run: Path, trials: int, sizes=(1, 2, 3, 4, 5, 7, 8, 16, 31, 32), threads=(1, 2), precision: str = "fp32"
) -> dict:
    import torch
    from sklearn.datasets import load_digits

    from torchsprint.commands.predict import Predictor

    p = Predictor.from_run(run, precision=precision)
    images = torch.tensor(load_digits().images[:64] * 255 / 16).round().to(torch.uint8)[:, None]
    ref_logits = p.logits(images)  # predict's batch of 64
    ref = torch.softmax(ref_logits, 1)
    g = torch.Generator().manual_seed(0)
    worst_p = worst_logit = 0.0
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for n in sizes:
            for _ in range(trials):
                idx = torch.randperm(len(images), generator=g)[:n]
                for size in {n, 1 << (n - 1).bit_length()}:  # as is, and padded to its bucket
                    x = torch.cat([images[idx], torch.zeros((size - n, *images.shape[1:]), dtype=torch.uint8)])
                    logits = p.logits(x)[:n]
                    worst_logit = max(worst_logit, (logits - ref_logits[idx]).abs().max().item())
                    worst_p = max(worst_p, (torch.softmax(logits, 1) - ref[idx]).abs().max().item())
    apart = (torch.cdist(ref, ref, p=float("inf")) + torch.eye(len(ref)) * 9).min().item()
    return {
        "max_abs_prob_diff": worst_p,
        "max_abs_logit_diff": worst_logit,
        "min_prob_distance_between_images": apart,
        "batch_sizes": list(sizes),
        "threads": list(threads),
        "trials": trials,
        "precision": precision,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="a digits run folder (default: train a tiny one in a temp folder)")
    ap.add_argument("--trials", type=int, default=20, help="random batch compositions per batch size")
    ap.add_argument(
        "--precision",
        default="fp32",
        help="fp32 or bf16 (predict's --precision; bf16 trains the tiny run "
        "in amp_bf16 with channels_last, as precision auto serves it on a CPU with native bf16)",
    )
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    run = Path(args.run) if args.run else None
    if run is None:
        from torchsprint import cli

        run = Path(tempfile.mkdtemp(prefix="serve-tol-")) / "run"
        assert (
            cli.main(
                [
                    "train",
                    "run.epochs=1",
                    "model.args={width: 8}",
                    f"run.dir={run}",
                    "log.tensorboard=false",
                    "log.progress=false",
                    *(["precision=amp_bf16", "speed.channels_last=true"] if args.precision == "bf16" else []),
                ]
            )
            == 0
        )
    out = measure(run, args.trials, precision=args.precision)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

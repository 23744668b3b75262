"""The CPU's ceiling for one training job's steps: ResNet-18 (torchvision, zero-initialised residuals) training steps
on tensors already in memory, no data loading, no evaluation: what no loader and no loop can beat.

Modes, each `--steps` timed steps after `--warmup` untimed ones, interleaved over `--rounds` (median reported):
fp32 NCHW, fp32 channels_last, autocast bf16 channels_last (where the CPU computes bf16 natively), and the bf16
one under torch.compile (inductor; its compile time reported apart, from the first call to the end of warm-up).
SGD with Nesterov momentum, weight decay 5e-4, cross-entropy, batch and size as the job (32, 112 px: the timm
comparison's, BENCHMARKS.md "torchsprint beside timm's train.py").

    python -m benchmarks.compare.cpu_step_ceiling --json benchmarks/results/cpu_step_ceiling_<device>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.child import REPO


def build(mode: str, batch: int, size: int, classes: int):
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=classes, zero_init_residual=True)
    cl = mode != "fp32_nchw"
    if cl:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    x = torch.randn(batch, 3, size, size)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,))
    bf16 = mode.startswith("bf16")
    loss_fn = torch.nn.CrossEntropyLoss()

    def fwd_bwd(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    body = torch.compile(fwd_bwd) if mode.endswith("compiled") else fwd_bwd

    def step():
        opt.zero_grad(set_to_none=True)
        body(x, y)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="fp32_nchw,fp32_cl,bf16_cl,bf16_cl_compiled")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from torchsprint.runtime.machine import cpu_info, native_bf16

    modes = [m for m in args.modes.split(",") if native_bf16() or not m.startswith("bf16")]
    steps, compile_s = {m: build(m, args.batch, args.size, 10) for m in modes}, {}
    for m, step in steps.items():  # warm-up (and compilation) before any timing
        t = time.perf_counter()
        for _ in range(args.warmup):
            step()
        if m.endswith("compiled"):
            compile_s[m] = round(time.perf_counter() - t, 1)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m, step in steps.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            rates[m].append(args.batch * args.steps / (time.perf_counter() - t))
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "revision": rev,
        "batch": args.batch,
        "size": args.size,
        "compile_s": compile_s,
        "images_per_s": {m: round(statistics.median(r), 1) for m, r in rates.items()},
        "rounds": {m: [round(v, 1) for v in r] for m, r in rates.items()},
    }
    print(json.dumps(result["images_per_s"]), "compile:", compile_s)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

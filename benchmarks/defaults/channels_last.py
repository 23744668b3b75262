"""channels_last (NHWC) against NCHW for a model's training step on this machine, side by side.

Three variants per model, interleaved in rotating order over --repeats: "nchw" (everything contiguous),
"model" (the weights in channels_last, the batch NCHW: what `speed.channels_last: auto` does) and "full"
(weights and batch in channels_last: `speed.channels_last: true`). Each times --steps SGD steps
(Nesterov momentum, weight decay) on a fixed random batch after 5 warm-up steps; prints the median
images/s and the median per-repeat ratio to nchw. This is the measurement behind the `auto` default.

    python -m benchmarks.defaults.channels_last [--repeats 5] [--cases small_cnn:1:8:200,small_cnn:3:32:40,...]

A case is MODEL:CHANNELS:SIZE:STEPS (batch 64 below 64 pixels, else 32).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from torchsprint import config
from torchsprint.models import build_model

CASES = "small_cnn:1:8:200,small_cnn:3:32:40,resnet18:3:32:15,cifar_resnet18:3:32:4,mobilenet_v3_small:3:64:15"


def images_per_s(model_name: str, x: torch.Tensor, y: torch.Tensor, mode: str, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model(config.load(None, [f"model.name={model_name}"]).model, 10, x.shape[1])
    if mode != "nchw":
        model = model.to(memory_format=torch.channels_last)
    if mode == "full":
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    for i in range(5 + steps):
        if i == 5:
            t = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return steps * x.shape[0] / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=CASES)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| model | input | nchw img/s | model NHWC (auto) img/s | ratio | model + batch NHWC (true) img/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        name, c, s, steps = case.split(":")
        c, s, steps = int(c), int(s), int(steps)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64 if s < 64 else 32, c, s, s, generator=g)
        y = torch.randint(0, 10, (x.shape[0],), generator=g)
        runs: dict[str, list[float]] = {"nchw": [], "model": [], "full": []}
        for r in range(args.repeats):
            for mode in list(runs)[r % 3 :] + list(runs)[: r % 3]:
                runs[mode].append(images_per_s(name, x, y, mode, steps))
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratio = {k: statistics.median(a / b for a, b in zip(runs[k], runs["nchw"])) for k in runs}
        print(
            f"| {name} | {x.shape[0]}x{c}x{s}x{s} | {med['nchw']:.0f} | {med['model']:.0f} | {ratio['model']:.2f}x | "
            f"{med['full']:.0f} | {ratio['full']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()

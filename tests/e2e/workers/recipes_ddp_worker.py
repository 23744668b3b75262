"""DDP worker for tests/e2e/train/test_recipes_repeated_aug.py:
`torchrun --nproc-per-node 2 tests/e2e/workers/recipes_ddp_worker.py OUT ema|aug`.

Two invocations, one process group each: a second init_process_group in the same processes after train()'s
teardown raced on a loaded 2-core machine (rank 1 stuck in gloo's group creation while rank 0 went on).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

B = 16  # per-rank batch; the one-process reference uses 2 * B
EMA_RUN = [
    "model.name=linear",
    "log.tensorboard=false",
    "log.progress=false",
    "eval.per_class=false",
    "run.max_steps=6",
    "checkpoint.every_epochs=null",
    "ema.enabled=true",
    "ema.decay=0.5",
]
AUG = [
    "model.args={width: 8}",
    "data.repeated_aug=2",
    "data.batch_size=16",
    "data.train.transforms=[random_crop: {size: 8, padding: 2}, hflip]",
]


def main(out: Path, part: str) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where, within the test's timeout

    from torchsprint import config, runtime
    from torchsprint.train.build import build_training
    from torchsprint.train.engine import train_step
    from torchsprint.train.run import train

    out.mkdir(parents=True, exist_ok=True)
    if part == "ema":  # 1. EMA of a DDP run (linear model: the same weights as one process with batch 2B).
        summary = train(
            config.load(None, [*EMA_RUN, "strategy=ddp", f"data.batch_size={B}", f"run.dir={out / 'ema_run'}"]),
            quiet=True,
        )
        if os.environ.get("RANK") == "0":  # train() has torn its process group down: the launcher's rank
            (out / "ema_val_count.json").write_text(json.dumps(summary["final"]["ema/val/count"]))
        return
    # 2. Repeated augmentation: every rank's first epoch (indices from its sampler, images from its loader).
    cfg = config.load(None, [*AUG, "strategy=ddp"])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    b = build_training(cfg, rt, lambda m: None)
    loader = b.loaders.train.loader  # under the AgreedLoader: the cpu backend's DeviceLoader
    loader.set_epoch(0)
    indices = loader.sampler.indices()
    images = torch.cat([x for x, _ in loader])
    mine = {"indices": indices[: len(images)], "images": images}
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    # 3. The EMA of a BatchNorm model: per-rank statistics differ after local forwards; sync makes them rank 0's.
    from torchsprint.runtime.parallel import unwrap
    from torchsprint.state.ema import ModelEma

    ema = ModelEma(unwrap(b.model), config.load(None, ["ema.enabled=true", "ema.decay=0.5"]).ema, rt.device)
    ema.attach(unwrap(b.model))
    x, y = next(iter(b.loaders.train))
    train_step(b, [(x, y)])
    ema.update(1)
    train_step(b, [(x + rt.rank, y)])  # different inputs per rank: different BN stats
    ema.update(2)

    def digest():
        h = hashlib.sha256()
        for v in ema.module.state_dict().values():
            h.update(v.cpu().numpy().tobytes())
        return h.hexdigest()

    before = [None, None]
    dist.all_gather_object(before, digest())
    ema.sync(rt)
    after = [None, None]
    dist.all_gather_object(after, digest())
    if rt.is_main:
        where: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for r, got in enumerate(everyone):
            for i, img in zip(got["indices"], got["images"]):
                where.setdefault(i, []).append((r, img))
        repeated = {i: v for i, v in where.items() if len(v) > 1}
        res = {
            "repeated": len(repeated),
            "copies_on_one_rank": sum(len({r for r, _ in v}) < len(v) for v in repeated.values()),
            "identical_copies": sum(torch.equal(v[0][1], v[1][1]) for v in repeated.values()),
            "ema_buffers_differ_before_sync": before[0] != before[1],
            "ema_equal_after_sync": after[0] == after[1],
        }
        (out / "results.json").write_text(json.dumps(res))
    runtime.teardown(rt)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    from torchsprint.runtime.core import exit_process

    exit_process(0)  # as torchsprint's own workers do: no interpreter shutdown after the process group

"""2-process worker for tests/e2e/data/test_data_webdataset.py:
`torchrun --nproc-per-node 2 webdataset_worker.py SHARDS OUT`.

Each rank builds the webdataset loaders (cpu backend, 2 loader workers, real gloo group), reads two
epochs, and the ranks all-gather their targets (each sample's class is its own id) through gloo;
rank 0 writes them with the per-rank step counts into OUT.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from torchsprint import config
from torchsprint.data import build_loaders
from torchsprint.runtime.core import Runtime


def main(shards: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config.load(
        None,
        [
            "data.dataset=webdataset",
            f"data.root={shards}",
            "data.num_workers=2",
            "data.batch_size=4",
            "data.drop_last=false",
            "data.options.shuffle_buffer=6",
            "data.train.transforms=[normalize]",
            "data.eval.transforms=[normalize]",
        ],
    )
    loaders = build_loaders(cfg.data, Runtime(torch.device("cpu"), rank, world, int(os.environ["LOCAL_RANK"])), seed=7)
    res = {"epochs": [], "steps": []}
    for epoch in range(2):
        loaders.train.set_epoch(epoch)
        batches = [y.tolist() for _, y in loaders.train]
        gathered = [None] * world
        dist.all_gather_object(gathered, {"batches": batches, "len": len(loaders.train)})
        res["epochs"].append([g["batches"] for g in gathered])
        res["steps"].append([(len(g["batches"]), g["len"]) for g in gathered])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    from torchsprint.runtime.core import exit_process

    exit_process(0)  # as torchsprint's own workers do: no interpreter shutdown after the process group

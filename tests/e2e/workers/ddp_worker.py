"""DDP worker for tests/e2e/ddp/test_ddp.py: run under
`torchrun --nproc-per-node 2 tests/e2e/workers/ddp_worker.py OUT WEIGHTS`.

Each rank runs every scenario below in sequence (one process start-up for all of them) and
rank 0 writes the results into OUT; the test compares them with single-process references.
Importing this module (as test_ddp.py does) only registers the `digits_odd` dataset.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from torchsprint.data import DATASETS
from torchsprint.data.core import Splits

VAL_SIZE = 359  # odd, and not a multiple of 2 ranks x EVAL_BATCH: the ranks' shards are uneven
EVAL_BATCH = 16
B = 16  # per-rank training batch; the single-process reference uses 2 * B
STEPS = 6

# Shared by the DDP runs (here) and the single-process references (test_ddp.py).
COMMON = [
    "log.tensorboard=false",
    f"run.max_steps={STEPS}",
    "data.dataset=digits_odd",
    f"data.eval_batch_size={EVAL_BATCH}",
    "eval.per_class=true",
    "checkpoint.every_epochs=null",
    "log.every_steps=2",
]
SCENARIOS = {
    "linear": ["model.name=linear"],  # no BatchNorm: DDP must match one process exactly
    "bn_local": ["model.args.width=8"],  # BatchNorm without SyncBN: per-rank statistics, must NOT match
    "accum": ["model.name=linear", "optim.accum_steps=2"],
    "compiled": ["model.name=linear", "speed.compile=true", "speed.compile_backend=aot_eager"],
    # bf16 weights + fp32 masters + clipping: gradients all-reduced in bf16 (DDP's hooks must survive the step).
    "bf16": ["model.name=linear", "precision=bf16", "optim.clip_grad_norm=1.0"],
}
MICRO = {"accum": 2}  # micro-batches per step: each rank's micro-batch is B / MICRO


@DATASETS.register("digits_odd", override=True)
def digits_odd(data_cfg) -> Splits:
    """digits with the validation set cut to VAL_SIZE samples (odd; uneven shards over 2 ranks)."""
    splits = DATASETS.get("digits")(data_cfg)
    splits.val = torch.utils.data.Subset(splits.val, range(VAL_SIZE))
    return splits


def overrides(name: str, world_size: int) -> list[str]:
    """The scenario's config for `world_size` processes over the same global batches of 2B samples."""
    batch = 2 * B // world_size // MICRO.get(name, 1)
    return [*COMMON, f"data.batch_size={batch}", *SCENARIOS[name]]


def evaluate_weights(weights: str) -> dict:
    """DDP evaluation of fixed weights on digits_odd's validation set (the train/run.py flow, without training)."""
    from safetensors.torch import load_file

    from torchsprint import config, runtime
    from torchsprint.data import build_loaders
    from torchsprint.models import build_model
    from torchsprint.optim import build_loss
    from torchsprint.runtime.parallel import wrap_model
    from torchsprint.state.precision import Precision
    from torchsprint.tasks.metrics import ClassificationMetrics
    from torchsprint.train.validation import evaluate

    cfg = config.load(None, [*COMMON, "strategy=ddp", "model.name=linear"])
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        loaders = build_loaders(cfg.data, rt, seed=0)
        info = loaders.info
        model = build_model(cfg.model, info.num_classes, info.in_channels)
        model(next(iter(loaders.val))[0][:1])  # materialise LazyLinear
        model.load_state_dict(load_file(weights))
        model = wrap_model(model, cfg.strategy, rt)
        metrics = ClassificationMetrics(info.num_classes, cfg.eval.topk, True, rt.device)
        out = evaluate(model, loaders.val, build_loss(cfg.loss), Precision("fp32", rt.device), metrics)
        out["rank_samples"] = len(loaders.val.sampler)
        return out
    finally:
        runtime.teardown(rt)


class ListLoader:
    """A loader that claims `claimed` batches but yields only `actual` (an uneven or broken shard)."""

    def __init__(self, batches, claimed: int):
        self.batches, self.claimed = batches, claimed

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        pass

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self):
        return iter(self.batches)


def uneven_and_no_sync() -> dict:
    """Rank 1's loader ends 2 batches early; gradient accumulation must all-reduce once per step."""
    from types import SimpleNamespace

    from torch import nn

    from torchsprint import config, runtime
    from torchsprint.observe.logging import RunLogger
    from torchsprint.runtime.collectives import agree_on_data
    from torchsprint.runtime.parallel import wrap_model
    from torchsprint.state.checkpoint import TrainState
    from torchsprint.state.precision import Precision
    from torchsprint.train.context import RunContext, Trainable
    from torchsprint.train.engine import NO_EMA, train_one_epoch, train_step
    from torchsprint.train.plan import NO_SPEED, build_plan

    cfg = config.load(
        None, ["strategy=ddp", "log.every_steps=1000", "log.tensorboard=false", "checkpoint.every_steps=null"]
    )
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        model = wrap_model(nn.Linear(4, 3), cfg.strategy, rt)
        calls = []

        def counting_allreduce(state, bucket):  # a real DDP comm hook: count, then the default all-reduce
            calls.append(1)
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            return allreduce_hook(None, bucket)

        model.register_comm_hook(None, counting_allreduce)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prec = Precision("fp32", rt.device)
        g = torch.Generator().manual_seed(rt.rank)
        batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]
        for step in range(3):  # 2 micro-batches per step -> one all-reduce per step with no_sync
            train_step(Trainable(model, nn.CrossEntropyLoss(), opt, prec), batches[2 * step : 2 * step + 2])
        allreduces_accum = len(calls)

        mine = batches if rt.rank == 0 else batches[:4]
        loader = agree_on_data(ListLoader(mine, claimed=6), rt)
        state = TrainState()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        saver = SimpleNamespace(save=lambda *a, **k: None)
        plan = build_plan(cfg, rt, info=None, train_batches=len(loader), speed=NO_SPEED, opt=opt)
        b = SimpleNamespace(
            model=model,
            loaders=SimpleNamespace(train=loader),
            loss_fn=nn.CrossEntropyLoss(),
            opt=opt,
            sched=sched,
            prec=prec,
            ema=NO_EMA,
        )
        ep = train_one_epoch(b, state, plan, RunContext(rt, None, RunLogger(None, cfg.log, enabled=False), saver))
        return {
            "allreduces_accum": allreduces_accum,
            "uneven_steps": state.global_step,
            "finished": ep["finished_epoch"],
        }
    finally:
        runtime.teardown(rt)


def main(out: Path, weights: str) -> None:
    from torchsprint import config
    from torchsprint.train.run import train

    # One process group for every scenario: runtime.setup uses a group that already exists and
    # teardown leaves it alive (re-creating groups in a loop races on stale rendezvous keys).
    torch.distributed.init_process_group("gloo")
    results = {}
    for name in SCENARIOS:
        cfg = config.load(None, [*overrides(name, 2), f"run.dir={out / name}", "strategy=ddp"])
        results[name] = train(cfg, quiet=True)["final"]
    results["eval"] = evaluate_weights(weights)
    results["uneven"] = uneven_and_no_sync()
    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    from torchsprint.runtime.core import exit_process

    exit_process(0)  # as torchsprint's own workers do: no interpreter shutdown after the process group

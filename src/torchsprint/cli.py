"""The `torchsprint` command: train | eval | export | predict | serve | tune | data (check, compare, shard) | bench |
lr-find | report | average | weights (get, path) | config (show, schema) | list. One table, COMMANDS: each entry
names its arguments and the function it runs.

torch is imported lazily so that `torchsprint --help` answers in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torchsprint.commands.args import (
    REGISTRIES,
    OneLineParser,
    args_average,
    args_bench,
    args_config,
    args_data,
    args_eval,
    args_export,
    args_list,
    args_lr_find,
    args_predict,
    args_report,
    args_serve,
    args_train,
    args_weights,
)
from torchsprint.commands.tune.args import args_tune


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command in COMMANDS (one sub-parser each, with --debug, and --import where it applies)."""
    parser = OneLineParser(
        prog="torchsprint", description="Train PyTorch vision models fast, with results you can trust."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help, description=c.description)
        c.add_args(p)
        if c.imports:
            p.add_argument(
                "--import",
                dest="imports",
                action="append",
                default=[],
                metavar="MODULE",
                help="import a module that registers your own models/datasets/losses (repeatable)",
            )
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors"
        )
    return parser


def cmd_train(args) -> int:
    from pathlib import Path

    from torchsprint import config
    from torchsprint.train.run import train

    overrides = list(args.overrides)
    path = args.config
    if args.remeasure:  # every process of the run (DDP workers inherit it): the stored start-up figures are not read
        from torchsprint.runtime.measurements import REMEASURE_ENV

        os.environ[REMEASURE_ENV] = "1"
    if args.resume:
        if not Path(args.resume).is_dir():
            from torchsprint.errors import UsageError

            raise UsageError(f"--resume {args.resume}: no such run folder.")
        if path is None and not (Path(args.resume) / "config.yaml").is_file():
            from torchsprint.errors import UsageError

            raise UsageError(
                f"--resume {args.resume}: not a torchsprint run folder (no config.yaml). Pass the folder "
                "`torchsprint train` printed, or give its config with -c."
            )
        path = path or str(Path(args.resume) / "config.yaml")
        overrides += [f"run.dir={args.resume}", "checkpoint.resume=auto"]
    if (args.max_restarts or args.rdzv_backend) and not (args.nproc_per_node or args.nnodes):
        from torchsprint.errors import UsageError

        raise UsageError(
            "--max-restarts/--rdzv-backend configure torchrun's launcher: add --nproc-per-node N "
            "(and --nnodes for several machines)."
        )
    if args.nproc_per_node or args.nnodes:  # a dry run too: each worker checks its part (rank, shard, group)
        from torchsprint.commands.launch import launch

        return launch(args)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # torchrun restarted this worker group after a worker died (--max-restarts): continue from the newest
        # valid checkpoint of the run folder, which every attempt shares (commands/launch.py).
        overrides += ["checkpoint.resume=auto"]
    if args.resume and args.config is None:  # the run folder's own config: its `imports:` are not trusted
        from torchsprint.config.saved import resumed_run_config

        cfg = resumed_run_config(args.resume, overrides, args.imports)
    else:
        cfg = config.load(path, overrides, imports=args.imports)
    summary = train(cfg, overwrite=args.overwrite, dry_run=args.dry_run, hold_signals=True)  # this process exits next
    if summary.get("stopped") == "signal":  # preempted, checkpoint saved: "retry later" (preempt.EXIT_PREEMPTED)
        from torchsprint.runtime.preempt import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    return 0


def cmd_eval(args) -> int:
    from torchsprint.commands.eval_export import describe_file, evaluate_file, is_exported
    from torchsprint.train.evaluation import evaluate_run

    if is_exported(args.run):  # an exported model file (commands/eval_export.py)
        if args.weights is not None:
            from torchsprint.errors import UsageError

            raise UsageError(
                f"--weights {args.weights}: {args.run} is one model file, it has no best/last weights to "
                "choose from; leave --weights out (or evaluate the run folder)."
            )
        out = evaluate_file(args.run, args.split, args.overrides)
        header = describe_file(out)
    else:
        weights = args.weights or "best"
        out = evaluate_run(args.run, weights, args.overrides, split=args.split)
        saved = ", ".join(f"{k} {out[k]}" for k in ("epoch", "step") if out.get(k) is not None)
        tta = "" if out.get("tta", "none") == "none" else f", test-time augmentation {out['tta']}"
        header = (
            f"{args.split} split, {weights} weights "
            f"({os.path.basename(out['weights'])}{', ' + saved if saved else ''}){tta}:"
        )
    if args.json:
        print(json.dumps(out))
    else:
        print(header)
        for k in ("top1", "top5", "balanced_acc", "loss", "count"):
            if k in out:
                print(f"{k:>12}: {out[k]:.4f}" if isinstance(out[k], float) else f"{k:>12}: {out[k]}")
    return 0


def cmd_data(args) -> int:
    if args.data_command == "check":
        from torchsprint.commands.data.check import check_cli

        return check_cli(args)
    if args.data_command == "cache":
        from torchsprint.commands.data.cache import cache_cli

        return cache_cli(args)
    if args.data_command == "shard":
        from torchsprint.commands.data.shard import shard_cli

        return shard_cli(args)
    from torchsprint.commands.data.compare import compare_cli

    return compare_cli(args)


def cmd_lr_find(args) -> int:
    from torchsprint import config
    from torchsprint.commands.lr_find import check_range, lr_find

    check_range(args.steps, args.start, args.end)  # before anything is built: a bad range costs nothing
    cfg = config.load(args.config, list(args.overrides), imports=args.imports)
    out = lr_find(
        cfg,
        steps=args.steps,
        start=args.start,
        end=args.end,
        out=args.out,
        log=(lambda *_: None) if args.json else print,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(out))
    return 0


def cmd_config(args) -> int:
    from torchsprint import config

    if args.config_command == "schema":
        print(json.dumps(config.json_schema(), indent=1))
    else:
        cfg = config.load(args.config, args.overrides)
        if args.resolved:  # the first phase of building a run, as train runs it (data.root scanned)
            from torchsprint.train.resolve import resolve

            cfg = resolve(cfg)
        print(config.dump_yaml(cfg), end="")
    return 0


def registry_for(family: str):
    """The registry `torchsprint list FAMILY` prints (commands/args.py REGISTRIES), imported now."""
    import importlib

    module, name = REGISTRIES[family]
    return getattr(importlib.import_module(module), name)


def cmd_list(args) -> int:
    for name in registry_for(args.family).names():
        print(name)
    return 0


def lazy(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A command function imported when the command runs (so `torchsprint --help` never imports torch)."""

    def run(args) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(args)

    return run


@dataclass(frozen=True)
class Command:
    """One `torchsprint` command: its sub-parser's text, its arguments, the function it runs, and whether it takes
    --import (main imports those modules before running it: they register models, datasets, losses...)."""

    name: str
    help: str
    description: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    imports: bool = False
    # main imports the --import modules first; train and lr-find hand them to config.load instead (train's
    # launcher never imports user code: only its workers do)
    import_first: bool = True


COMMANDS = [
    Command(
        "train",
        "train a model from a config",
        "Train a model from a config file and overrides.",
        args_train,
        cmd_train,
        imports=True,
        import_first=False,
    ),
    Command(
        "eval",
        "re-evaluate a run's saved weights or an exported model file",
        "Re-evaluate saved weights, or an exported .onnx (fp32 or int8) / .pt / .safetensors file, on the "
        "validation (or test) split of the run's data.",
        args_eval,
        cmd_eval,
        imports=True,
    ),
    Command(
        "export",
        "export a run's model (ONNX, safetensors, TorchScript)",
        "Export weights with their preprocessing metadata and check parity.",
        args_export,
        lazy("torchsprint.commands.export_command", "export_cli"),
        imports=True,
    ),
    Command(
        "predict",
        "predict with a run or an exported model (classes, labels or images)",
        "Predict with the eval preprocessing stored with the model.",
        args_predict,
        lazy("torchsprint.commands.predict", "predict_cli"),
        imports=True,
    ),
    Command(
        "serve",
        "serve a run or an exported model over HTTP: dynamic batching, metrics, a page to try it",
        "Answer POST /predict with the top-k classes of each image (the run's own eval preprocessing, batched "
        "across requests), with /health, /ready, /metrics (Prometheus), the OpenAPI page at /docs and a page to "
        "drop images on at /. Listens on 127.0.0.1 unless told otherwise. docs/serve.md.",
        args_serve,
        lazy("torchsprint.commands.serve", "serve_cli"),
        imports=True,
    ),
    Command(
        "tune",
        "search a config's settings on your data, every trial at equal cost (Optuna)",
        "Search the settings of a config (or of data.root alone) with Optuna: the space chosen from the data or "
        "the config's tune section, every trial a run folder under --out, --trial-time for equal cost per trial, "
        "pruning, --resume, --workers and a shared --storage. Writes trials.md, search.png and best.yaml. "
        "docs/tune.md.",
        args_tune,
        lazy("torchsprint.commands.tune.command", "tune_cli"),
        imports=True,
        import_first=False,
    ),
    Command(
        "data",
        "check a dataset and loader, compare CPU/GPU preprocessing, cache decoded images, write shards",
        "Inspect the data pipeline of a config.",
        args_data,
        cmd_data,
        imports=False,
    ),
    Command(
        "bench",
        "measure which accelerations pay off on this model, data and machine",
        "Measure a matrix of speed variants of a config side by side.",
        args_bench,
        lazy("torchsprint.commands.bench.main", "bench_cli"),
        imports=False,
    ),
    Command(
        "lr-find",
        "learning-rate range test: a plot and a suggested optim.lr (no run folder)",
        "Raise the learning rate exponentially from --start to --end over --steps training steps of the run's "
        "model, data and settings; plot the smoothed loss and suggest a learning rate (fastai's 'valley' rule). "
        "Writes lr_find.png and lr_find.json to --out (default: a temp folder); the run folder is never created or "
        "changed.",
        args_lr_find,
        cmd_lr_find,
        imports=True,
        import_first=False,
    ),
    Command(
        "report",
        "one HTML page of a run: curves, confusion matrix, per-class scores, worst mistakes",
        "Write <run>/report/report.html (self-contained) and its plots as PNG files.",
        args_report,
        lazy("torchsprint.commands.report", "report_cli"),
        imports=True,
    ),
    Command(
        "average",
        "average the weights of several runs or checkpoints of one model, BatchNorm recomputed",
        "Average (equal weights) the --weights files of several runs, or one run's N newest checkpoints (timm's "
        "avg_checkpoints.py); refuse inputs of different models; recompute the BatchNorm statistics on the first "
        "run's training data; evaluate every input and the average on its validation split; write -o FILE with "
        "the metadata `eval/export/report --weights FILE` and `predict -r FILE` read.",
        args_average,
        lazy("torchsprint.commands.average", "average_cli"),
        imports=True,
    ),
    Command(
        "weights",
        "fetch pretrained weights into the library's cache, or say where they are",
        "Pretrained weights (the values of model.pretrained) in the caches runs read: `get` downloads, `path` looks.",
        args_weights,
        lazy("torchsprint.commands.weights", "weights_cli"),
        imports=False,
    ),
    Command(
        "config",
        "show the resolved config or its JSON Schema",
        "Inspect configs.",
        args_config,
        cmd_config,
        imports=False,
    ),
    Command("list", "list registered names", "List the names a config can use.", args_list, cmd_list, imports=True),
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse exits on --help and on a refused flag (commands/args.py): its exit code is returned, as every
    # refusal's
    try:
        args = parser.parse_args(argv)
        command = args.command or "train"
        if args.command is None and not args.version:  # `torchsprint` alone runs the default training
            args = parser.parse_args(["train", *([] if argv is None else argv)] if argv else ["train"])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    if args.version:
        from torchsprint.version import __version__

        print(__version__)
        return 0
    entry = next(c for c in COMMANDS if c.name == command)
    try:
        if entry.imports and entry.import_first:
            from torchsprint.config.schema import import_modules

            import_modules(args.imports)
        return entry.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from torchsprint.errors import UsageError

        if isinstance(e, UsageError) and not args.debug:
            from torchsprint.errors import one_line

            print(f"error: {one_line(e)}", file=sys.stderr)
            return 2
        from torchsprint.errors import disk_full

        if disk_full(e) and not args.debug:  # any command's write that found no room (train says more: run.train)
            print(f"error: {disk_full(e)}. Free space there and run the command again.", file=sys.stderr)
            return 2
        if not args.debug and "LOCAL_RANK" in os.environ:  # a DDP worker whose peer died or hung: say so in one line
            from torchsprint.runtime.core import lost_peer

            line = lost_peer(e)
            if line:
                print(f"error: {line}", file=sys.stderr, flush=True)
                return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())

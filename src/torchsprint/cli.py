"""The `torchsprint` command: train | eval | export | predict | serve | data (check, compare, shard) | bench | lr-find | report |
average |
config (show, schema) | list. One table, COMMANDS: each entry names its arguments and the function it runs.

torch is imported lazily so that `torchsprint --help` answers in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

FAMILIES = ("models", "optimizers", "schedulers", "losses", "datasets", "loaders", "transforms", "tasks")


WEIGHTS = ["best", "last", "ema", "swa"]
WEIGHTS_HELP = ("which saved weights of the run: best (by checkpoint.monitor; the EMA's when it monitors an ema/ metric), "
                "last (the model at the end), ema (the EMA at the end; runs with ema.enabled=true), swa (the SWA "
                "average; runs with swa.enabled=true), or a .safetensors file of the same model (e.g. from "
                "`torchsprint average`)")


def weights_arg(value: str) -> str:
    """--weights: one of WEIGHTS or the path of a .safetensors file."""
    if value in WEIGHTS or value.endswith(".safetensors"):
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(WEIGHTS)}, or a .safetensors file)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="run config file (.yaml, .json or .toml); defaults: digits + small CNN")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=0.05 run.epochs=3")


def args_train(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest valid checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything (config, data, model, optimizer) and report, without writing anything")
    p.add_argument("--overwrite", action="store_true",
                   help="run.dir holds another run: move its files into run.dir/replaced-<time>/ and start over there")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="launch N DDP worker processes on this machine through torchrun (sets strategy=ddp)")
    p.add_argument("--nnodes", default=None, metavar="N", help="number of machines (torchrun --nnodes, e.g. 2 or 1:4)")
    p.add_argument("--node-rank", type=int, default=None, metavar="R", help="this machine's rank (torchrun --node-rank)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous address for several machines")
    p.add_argument("--rdzv-backend", choices=["static", "c10d"], default=None,
                   help="rendezvous: static (fixed --node-rank; default with --nnodes > 1) or c10d (elastic: ranks "
                        "assigned on arrival, restarted nodes rejoin)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when a worker dies, restart the worker group up to K times; each restart resumes from the "
                        "newest valid checkpoint (save them often: checkpoint.every_steps)")


def args_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--run", required=True, metavar="RUN_DIR", help="run folder printed by `torchsprint train`")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--split", choices=["val", "test"], default="val",
                   help="which split: val, or test (image_folder: the test/ folder beside train/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. data.eval_batch_size=256 or eval.tta=hflip (test-time augmentation)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--run", required=True, metavar="RUN_DIR", help="run folder printed by `torchsprint train`")
    p.add_argument("--format", choices=["onnx", "safetensors", "torchscript", "tensorrt"], default="onnx", help="output format")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--out", metavar="PATH", help="output file (default: <run>/export/model.<ext>)")
    p.add_argument("--uint8-input", action="store_true", help="fold normalisation into the graph: input is uint8 NCHW")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset version")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max |logits difference| PyTorch vs runtime before failing")
    p.add_argument("--tta", default=None, metavar="none|hflip|five_crop|ten_crop",
                   help="test-time augmentation held in the exported graph (default: the run's eval.tta)")


def args_predict(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--run", required=True, metavar="RUN_DIR|MODEL_FILE", help="run folder or exported model file")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files or folders of images")
    p.add_argument("--topk", type=int, default=5, help="classes to report per image")
    p.add_argument("--threshold", type=float, default=None,
                   help="task=multilabel: report labels with probability >= this (default: the run's eval.threshold)")
    p.add_argument("--out-dir", default=None, metavar="FOLDER",
                   help="task=image_to_image: folder for the output images (default: ./predictions)")
    p.add_argument("--backend", choices=["torch", "onnx"], default="torch", help="inference engine")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda also decodes JPEGs on the GPU)")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--out", metavar="FILE", help="write results to FILE (.jsonl or .csv)")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any input fails")
    p.add_argument("--tta", default=None, metavar="none|hflip|five_crop|ten_crop",
                   help="test-time augmentation (default: the run's eval.tta; an exported graph's own)")


def args_serve(p: argparse.ArgumentParser) -> None:
    from torchsprint.commands.serve import add_serve_args  # stdlib only at import: --help stays fast

    add_serve_args(p, weights_arg, WEIGHTS_HELP)


def args_data(p: argparse.ArgumentParser) -> None:
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    s = dsub.add_parser("check", help="read every file: unreadable ones, duplicates, train/val leaks, class counts, a sample grid",
                        description="Read and decode every sample of every split (whatever data.on_bad_sample says) and "
                        "report unreadable files, identical files, images shared between splits, class counts and "
                        "sizes; load a few batches through the configured backend; write check.json and samples.png.")
    _add_config_args(s)
    s.add_argument("--batches", type=int, default=10, help="batches to load per split")
    s.add_argument("--out", metavar="DIR", default=None, help="folder for the sample grid PNG (default: a temp folder)")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    s = dsub.add_parser("compare", help="run the eval preprocessing through every backend and compare pixels",
                        description="Compare the CPU, GPU and DALI eval preprocessing on the same images.")
    _add_config_args(s)
    s.add_argument("--images", type=int, default=64, help="number of validation images to compare")
    s.add_argument("--run", metavar="RUN_DIR", default=None, help="also report top-1 agreement of this run's model")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    s = dsub.add_parser("shard", help="write an image folder or file list as shuffled WebDataset tar shards",
                        description="Write SRC (an image folder, optionally with train/ and val/, or a `path,label` list) "
                        "as shuffled tar shards plus index.json into OUT; resumable (finished shards are re-hashed and "
                        "kept) and verified at the end (counts, keys, labels, checksums). Train on them with "
                        "data.dataset=webdataset data.root=OUT.")
    s.add_argument("src", metavar="SRC", help="image folder or file list")
    s.add_argument("out", metavar="OUT", help="folder for the shards and index.json")
    s.add_argument("--shard-size", default="1GB", metavar="SIZE", help="largest shard, e.g. 1GB, 500MB, 64MiB (default 1GB)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sample shuffle (default 0)")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")


def args_bench(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per variant")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per variant (median, min-max reported)")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all that apply)")
    p.add_argument("--to-accuracy", type=float, default=None, metavar="X",
                   help="also measure time until the monitored val metric (checkpoint.monitor: top-1, mAP, PSNR) reaches X")
    p.add_argument("--out", metavar="DIR", default=None, help="bench folder (default: bench/<timestamp>)")


def args_lr_find(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep (default 100; it stops early "
                   "when the smoothed loss exceeds 4x its best)")
    p.add_argument("--start", type=float, default=1e-7, help="first learning rate (default 1e-7, as fastai)")
    p.add_argument("--end", type=float, default=10.0, help="last learning rate (default 10, as fastai)")
    p.add_argument("--out", metavar="DIR", default=None, help="folder for lr_find.png and lr_find.json (default: a temp folder)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def args_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR", help="run folder printed by `torchsprint train`")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--out", metavar="DIR", default=None, help="output folder (default: <run>/report)")
    p.add_argument("--wrong", type=int, default=24, help="how many confidently wrong validation images to show")


def args_average(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders of the same model (or one, with --checkpoints)")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="the averaged weights (.safetensors)")
    p.add_argument("--weights", choices=WEIGHTS, default="last",
                   help="which weights file of each run is averaged (default last; best, ema, swa)")
    p.add_argument("--checkpoints", type=int, default=None, metavar="N",
                   help="average the model weights of the one run's N newest checkpoints (checkpoints/ckpt-*.pt)")
    p.add_argument("--json", action="store_true", help="print each input's and the average's figures as JSON")


def args_config(p: argparse.ArgumentParser) -> None:
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    s = csub.add_parser("show", help="print the fully resolved config (YAML)", description="Print the resolved config.")
    _add_config_args(s)
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    csub.add_parser("schema", help="print the config's JSON Schema (for editor completion)", description="Print the JSON Schema.")


def args_list(p: argparse.ArgumentParser) -> None:
    p.add_argument("family", choices=FAMILIES, help="which registry to list")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command in COMMANDS (one sub-parser each, with --debug, and --import where it applies)."""
    parser = argparse.ArgumentParser(prog="torchsprint", description="Train PyTorch vision models fast, with results you can trust.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help, description=c.description)
        c.add_args(p)
        if c.imports:
            p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                           help="import a module that registers your own models/datasets/losses (repeatable)")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    return parser


def cmd_train(args) -> int:
    from pathlib import Path

    from torchsprint import config
    from torchsprint.train.run import train

    overrides = list(args.overrides)
    path = args.config
    if args.resume:
        if not Path(args.resume).is_dir():
            from torchsprint.errors import UsageError

            raise UsageError(f"--resume {args.resume}: no such run folder.")
        if path is None and not (Path(args.resume) / "config.yaml").is_file():
            from torchsprint.errors import UsageError

            raise UsageError(f"--resume {args.resume}: not a torchsprint run folder (no config.yaml). Pass the folder "
                             "`torchsprint train` printed, or give its config with -c.")
        path = path or str(Path(args.resume) / "config.yaml")
        overrides += [f"run.dir={args.resume}", "checkpoint.resume=auto"]
    if (args.max_restarts or args.rdzv_backend) and not (args.nproc_per_node or args.nnodes):
        from torchsprint.errors import UsageError

        raise UsageError("--max-restarts/--rdzv-backend configure torchrun's launcher: add --nproc-per-node N "
                         "(and --nnodes for several machines).")
    if (args.nproc_per_node or args.nnodes) and not args.dry_run:
        from torchsprint.runtime.launch import launch

        return launch(args)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # torchrun restarted this worker group after a worker died (--max-restarts): continue from the newest
        # valid checkpoint of the run folder, which every attempt shares (runtime/launch.py).
        overrides += ["checkpoint.resume=auto"]
    if args.resume and args.config is None:  # the run folder's own config: its `imports:` are not trusted
        from torchsprint.config.saved import resumed_run_config

        cfg = resumed_run_config(args.resume, overrides, args.imports)
    else:
        cfg = config.load(path, overrides, imports=args.imports)
    summary = train(cfg, overwrite=args.overwrite, dry_run=args.dry_run)
    if summary.get("stopped") == "signal":  # preempted, checkpoint saved: "retry later" (preempt.EXIT_PREEMPTED)
        from torchsprint.runtime.preempt import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    return 0


def cmd_eval(args) -> int:
    from torchsprint.train.run import evaluate_run

    out = evaluate_run(args.run, args.weights, args.overrides, split=args.split)
    if args.json:
        print(json.dumps(out))
    else:
        saved = ", ".join(f"{k} {out[k]}" for k in ("epoch", "step") if out.get(k) is not None)
        tta = "" if out.get("tta", "none") == "none" else f", test-time augmentation {out['tta']}"
        print(f"{args.split} split, {args.weights} weights ({os.path.basename(out['weights'])}{', ' + saved if saved else ''}){tta}:")
        for k in ("top1", "top5", "loss", "count"):
            if k in out:
                print(f"{k:>6}: {out[k]:.4f}" if isinstance(out[k], float) else f"{k:>6}: {out[k]}")
    return 0


def cmd_data(args) -> int:
    if args.data_command == "check":
        from torchsprint.data.commands.check import check_cli

        return check_cli(args)
    if args.data_command == "shard":
        from torchsprint.data.commands.shard import shard_cli

        return shard_cli(args)
    from torchsprint.data.commands.compare import compare_cli

    return compare_cli(args)


def cmd_lr_find(args) -> int:
    from torchsprint import config
    from torchsprint.commands.lr_find import check_range, lr_find

    check_range(args.steps, args.start, args.end)  # before anything is built: a bad range costs nothing
    cfg = config.load(args.config, list(args.overrides), imports=args.imports)
    out = lr_find(cfg, steps=args.steps, start=args.start, end=args.end, out=args.out,
                  log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(out))
    return 0


def cmd_config(args) -> int:
    from torchsprint import config

    if args.config_command == "schema":
        print(json.dumps(config.json_schema(), indent=1))
    else:
        print(config.dump_yaml(config.load(args.config, args.overrides)), end="")
    return 0


def registry_for(family: str):
    if family == "models":
        from torchsprint.models import MODELS as reg
    elif family in ("datasets", "loaders"):
        from torchsprint.data import DATASETS, LOADERS

        reg = DATASETS if family == "datasets" else LOADERS
    elif family == "transforms":
        from torchsprint.data.preprocess.transforms import TRANSFORMS as reg
    elif family == "tasks":
        from torchsprint.tasks.core import TASKS as reg
    else:
        from torchsprint import optim

        reg = {"optimizers": optim.OPTIMIZERS, "schedulers": optim.SCHEDULERS, "losses": optim.LOSSES}[family]
    return reg


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
    Command("train", "train a model from a config",
            "Train a model from a config file and overrides.",
            args_train, cmd_train, imports=True, import_first=False),
    Command("eval", "re-evaluate a run's saved weights",
            "Re-evaluate saved weights on the validation (or test) split.",
            args_eval, cmd_eval, imports=True),
    Command("export", "export a run's model (ONNX, safetensors, TorchScript)",
            "Export weights with their preprocessing metadata and check parity.",
            args_export, lazy("torchsprint.commands.export", "export_cli"), imports=True),
    Command("predict", "predict with a run or an exported model (classes, labels or images)",
            "Predict with the eval preprocessing stored with the model.",
            args_predict, lazy("torchsprint.commands.predict", "predict_cli"), imports=True),
    Command("serve", "serve a run or an exported model over HTTP: dynamic batching, metrics, a page to try it",
            "Answer POST /predict with the top-k classes of each image (the run's own eval preprocessing, batched "
            "across requests), with /health, /ready, /metrics (Prometheus), the OpenAPI page at /docs and a page to "
            "drop images on at /. Listens on 127.0.0.1 unless told otherwise. docs/serve.md.",
            args_serve, lazy("torchsprint.commands.serve", "serve_cli"), imports=True),
    Command("data", "check a dataset and loader, or compare CPU/GPU preprocessing",
            "Inspect the data pipeline of a config.",
            args_data, cmd_data, imports=False),
    Command("bench", "measure which accelerations pay off on this model, data and machine",
            "Measure a matrix of speed variants of a config side by side.",
            args_bench, lazy("torchsprint.commands.bench.main", "bench_cli"), imports=False),
    Command("lr-find", "learning-rate range test: a plot and a suggested optim.lr (no run folder)",
            "Raise the learning rate exponentially from --start to --end over --steps training steps of the run's "
            "model, data and settings; plot the smoothed loss and suggest a learning rate (fastai's 'valley' rule). "
            "Writes lr_find.png and lr_find.json to --out (default: a temp folder); the run folder is never created or "
            "changed.",
            args_lr_find, cmd_lr_find, imports=True, import_first=False),
    Command("report", "one HTML page of a run: curves, confusion matrix, per-class scores, worst mistakes",
            "Write <run>/report/report.html (self-contained) and its plots as PNG files.",
            args_report, lazy("torchsprint.commands.report", "report_cli"), imports=True),
    Command("average", "average the weights of several runs or checkpoints of one model, BatchNorm recomputed",
            "Average (equal weights) the --weights files of several runs, or one run's N newest checkpoints (timm's "
            "avg_checkpoints.py); refuse inputs of different models; recompute the BatchNorm statistics on the first "
            "run's training data; evaluate every input and the average on its validation split; write -o FILE with "
            "the metadata `eval/export/report --weights FILE` and `predict -r FILE` read.",
            args_average, lazy("torchsprint.commands.average", "average_cli"), imports=True),
    Command("config", "show the resolved config or its JSON Schema",
            "Inspect configs.",
            args_config, cmd_config, imports=False),
    Command("list", "list registered names",
            "List the names a config can use.",
            args_list, cmd_list, imports=True),
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from torchsprint.version import __version__

        print(__version__)
        return 0
    command = args.command or "train"
    if args.command is None:  # `torchsprint` alone runs the default training
        args = parser.parse_args(["train", *([] if argv is None else argv)] if argv else ["train"])
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
        if not args.debug and "LOCAL_RANK" in os.environ:  # a DDP worker whose peer died or hung: say so in one line
            from torchsprint.runtime.core import lost_peer

            line = lost_peer(e)
            if line:
                print(f"error: {line}", file=sys.stderr, flush=True)
                return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())

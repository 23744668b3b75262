"""The commands' flags: the arguments each command takes (`args_<command>`, named in cli.COMMANDS) and their
types, checked while the command line is parsed, as the config schema checks its fields: whole numbers where counts are
meant, finite numbers in range, devices this machine has, output paths that can be written. A bad value is one line
(`error: torchsprint predict: argument --batch-size: ...`, exit code 2) before any work starts:
`predict --batch-size 0`, `--topk -1` and `--device cuda` without a GPU were tracebacks, `lr-find --out` on a file was
found only after the whole sweep, `--nproc-per-node 0` ran one process.

Each type keeps what it accepts as attributes (tests/e2e/cli/test_cli_flags.py draws bad values from them).
"""

from __future__ import annotations

import argparse
import math
import re


class Count:
    """A whole number >= `minimum` (images, steps, processes, ranks)."""

    def __init__(self, minimum: int = 1, why: str = ""):
        self.minimum, self.why = minimum, why

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a whole number >= {self.minimum}, got {text!r}") from None
        if value < self.minimum:
            raise argparse.ArgumentTypeError(f"must be >= {self.minimum}{self.why}, got {value}")
        return value


class CountOrAuto(Count):
    """`auto`, or a whole number >= `minimum` (a setting whose default is worked out at start-up)."""

    def __call__(self, text: str) -> int | str:
        return "auto" if text == "auto" else super().__call__(text)


class Number:
    """A finite number in [low, high] (`above`: low itself excluded)."""

    def __init__(self, low: float | None = None, high: float | None = None, above: bool = False):
        self.low, self.high, self.above = low, high, above

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = self.low is None or value > self.low or (value == self.low and not self.above)
        if not (math.isfinite(value) and low_ok and (self.high is None or value <= self.high)):
            where = [f"{'>' if self.above else '>='} {self.low:g}"] if self.low is not None else []
            where += [f"<= {self.high:g}"] if self.high is not None else []
            raise argparse.ArgumentTypeError(
                f"must be a finite number{' ' + ' and '.join(where) if where else ''}, got {text!r}"
            )
        return value


def device(text: str) -> str:
    """cpu, cuda or cuda:N of a GPU this machine has (runtime.resolve_device's rules); 'auto' becomes what it
    resolves to."""
    if text == "cpu":  # the default: no torch import to parse it
        return text
    from torchsprint.errors import UsageError
    from torchsprint.runtime.core import resolve_device

    try:
        resolved = resolve_device(text, what="--device")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return str(resolved) if text == "auto" else text


def nnodes(text: str) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job (whole numbers >= 1, MIN <= MAX)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise argparse.ArgumentTypeError(
            f"expected N or MIN:MAX machines (whole numbers >= 1, MIN <= MAX), got {text!r}"
        )
    return text


def shard_size(text: str) -> str:
    """`data shard --shard-size`: a size such as 1GB, 500MB, 64MiB (shard.parse_size's rules)."""
    from torchsprint.commands.data.shard import parse_size
    from torchsprint.errors import UsageError

    try:
        parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None  # parse_size's line without its flag
    return text


class Output:
    """An output file (or `folder`) a command writes: rundir.writable_file's checks (not a run's own file, not a
    folder for a file nor a file for a folder, writable), creating nothing; the command checks again, with its
    --overwrite, when it writes."""

    def __init__(self, folder: bool = False):
        self.folder = folder

    def __call__(self, text: str) -> str:
        from torchsprint.errors import UsageError
        from torchsprint.state.rundir import writable_file

        try:
            writable_file(text, "", folder=self.folder, create=False)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text


class OneLineParser(argparse.ArgumentParser):
    """argparse with every refusal on one line, as the commands' own (`error: ...`, exit code 2), naming the command."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


# ---------------------------------------------------------------- each command's arguments (cli.COMMANDS names them)

# `torchsprint list FAMILY`: each family's registry as (module, name), imported only when listed (so `--help` imports no
# torch); the module is the package face where importing it registers the members (data/: sources and backends).
REGISTRIES = {
    "models": ("torchsprint.models", "MODELS"),
    "optimizers": ("torchsprint.optim", "OPTIMIZERS"),
    "schedulers": ("torchsprint.optim", "SCHEDULERS"),
    "losses": ("torchsprint.optim", "LOSSES"),
    "datasets": ("torchsprint.data", "DATASETS"),
    "loaders": ("torchsprint.data", "LOADERS"),
    "transforms": ("torchsprint.data.preprocess.transforms", "TRANSFORMS"),
    "tasks": ("torchsprint.tasks.core", "TASKS"),
}
FAMILIES = tuple(REGISTRIES)
# commands/export.py's EXPORTERS, named here for the --format choices without importing torch (a test holds them equal)
EXPORT_FORMATS = ("onnx", "safetensors", "torchscript", "tensorrt")


WEIGHTS = ["best", "last", "ema", "swa"]
WEIGHTS_HELP = (
    "which saved weights of the run: best (by checkpoint.monitor; the EMA's when it monitors an ema/ metric), "
    "last (the model at the end), ema (the EMA at the end; runs with ema.enabled=true), swa (the SWA "
    "average; runs with swa.enabled=true), or a .safetensors file of the same model (e.g. from "
    "`torchsprint average`)"
)


def weights_arg(value: str) -> str:
    """--weights: one of WEIGHTS or the path of a .safetensors file."""
    if value in WEIGHTS or value.endswith(".safetensors"):
        return value
    raise argparse.ArgumentTypeError(
        f"invalid choice: {value!r} (choose from {', '.join(WEIGHTS)}, or a .safetensors file)"
    )


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="run config file (.yaml, .json or .toml); defaults: digits + small CNN")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=0.05 run.epochs=3"
    )


def args_train(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest valid checkpoint")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything (config, data, model, optimizer) and report, without writing anything; "
        "with --nproc-per-node each worker checks its part (rank, data shard, process group); with --nnodes, "
        "run it on every machine, as the run itself",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="run.dir holds another run: move its files into run.dir/replaced-<time>/ and start over there",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure the start-up choices (precision=auto, speed.channels_last=auto) again instead of reading "
        "what this machine measured before for the same model, input and batch",
    )
    p.add_argument(
        "--nproc-per-node",
        type=Count(1),
        default=None,
        metavar="N",
        help="launch N DDP worker processes on this machine through torchrun (sets strategy=ddp)",
    )
    p.add_argument(
        "--nnodes", type=nnodes, default=None, metavar="N", help="number of machines (torchrun --nnodes, e.g. 2 or 1:4)"
    )
    p.add_argument(
        "--node-rank", type=Count(0), default=None, metavar="R", help="this machine's rank (torchrun --node-rank)"
    )
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous address for several machines")
    p.add_argument(
        "--rdzv-backend",
        choices=["static", "c10d"],
        default=None,
        help="rendezvous: static (fixed --node-rank; default with --nnodes > 1) or c10d (elastic: ranks "
        "assigned on arrival, restarted nodes rejoin)",
    )
    p.add_argument(
        "--max-restarts",
        type=Count(0),
        default=0,
        metavar="K",
        help="when a worker dies, restart the worker group up to K times; each restart resumes from the "
        "newest valid checkpoint (save them often: checkpoint.every_steps)",
    )


def args_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-r",
        "--run",
        required=True,
        metavar="RUN_DIR|MODEL_FILE",
        help="run folder printed by `torchsprint train`, or a .onnx (fp32 or int8), .pt or .safetensors "
        "file from `torchsprint export` (evaluated on its run's data)",
    )
    p.add_argument(
        "--weights", type=weights_arg, default=None, help=WEIGHTS_HELP + " (default best; a run folder only)"
    )
    p.add_argument(
        "--split",
        choices=["val", "test"],
        default="val",
        help="which split: val, or test (image_folder: the test/ folder beside train/)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. data.eval_batch_size=256 or eval.tta=hflip (test-time augmentation)",
    )
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--run", required=True, metavar="RUN_DIR", help="run folder printed by `torchsprint train`")
    p.add_argument("--format", choices=EXPORT_FORMATS, default=None, help="output format (default onnx)")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--out", type=Output(), metavar="PATH", help="output file (default: <run>/export/model.<ext>)")
    p.add_argument("--overwrite", action="store_true", help="--out may replace an existing file (never a run's own)")
    p.add_argument("--uint8-input", action="store_true", help="fold normalisation into the graph: input is uint8 NCHW")
    p.add_argument("--opset", type=Count(1), default=None, help="ONNX opset version")
    p.add_argument(
        "--tolerance", type=Number(0), default=1e-3, help="max |logits difference| PyTorch vs runtime before failing"
    )
    p.add_argument(
        "--tta",
        default=None,
        metavar="none|hflip|five_crop|ten_crop",
        help="test-time augmentation held in the exported graph (default: the run's eval.tta)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="--format onnx: also quantize the graph to int8 (onnxruntime static QDQ, per-channel int8 weights), "
        "calibrated on the run's training images; written as <run>/export/model[...]-int8.onnx",
    )
    p.add_argument(
        "--calibration",
        type=Count(1, " (static quantization measures the activations' ranges on them)"),
        default=None,
        metavar="N",
        help="--int8: training images to calibrate on (default 256; a fixed "
        "sample seeded with the run's seed, so the same N gives the same file)",
    )
    p.add_argument(
        "--int8-activations",
        choices=["u8", "s8"],
        default=None,
        help="--int8: uint8 (u8, the default: U8S8, the fast one on x86-64) or int8 (s8) activations",
    )
    p.add_argument(
        "--benchmark",
        nargs="?",
        const=True,
        default=None,
        type=Output(folder=True),
        metavar="DIR",
        help="export every format and precision that runs here (torch fp32/bf16, ONNX fp32/int8, TorchScript), "
        "evaluate and time them side by side, write export_bench.{json,csv,md,png} into DIR (default "
        "<run>/export/bench/) and recommend one; --overwrite replaces earlier results",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="--int8: write the int8 file even when its check fails (top-1 more than 1 point below the fp32 "
        "graph's on the validation split, or not faster at the serving batch); the figures are printed",
    )


def args_predict(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--run", required=True, metavar="RUN_DIR|MODEL_FILE", help="run folder or exported model file")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files or folders of images")
    p.add_argument("--topk", type=Count(1), default=5, help="classes to report per image")
    p.add_argument(
        "--threshold",
        type=Number(0, 1),
        default=None,
        help="task=multilabel: report labels with probability >= this (default: the run's eval.threshold)",
    )
    p.add_argument(
        "--out-dir",
        type=Output(folder=True),
        default=None,
        metavar="FOLDER",
        help="task=image_to_image: folder for the output images (default: ./predictions)",
    )
    p.add_argument("--backend", choices=["torch", "onnx"], default="torch", help="inference engine")
    p.add_argument(
        "--device", type=device, default="cpu", help="cpu, cuda or cuda:N (cuda also decodes JPEGs on the GPU)"
    )
    p.add_argument("--batch-size", type=Count(1), default=64, help="images per forward pass")
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="fp32 or bf16 autocast; auto: bf16 where the run trained in bf16 and the CPU computes it natively",
    )
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument("--out", type=Output(), metavar="FILE", help="write results to FILE (.jsonl or .csv)")
    p.add_argument("--overwrite", action="store_true", help="--out may replace an existing file (never a run's own)")
    p.add_argument("--strict", action="store_true", help="exit non-zero if any input fails")
    p.add_argument(
        "--tta",
        default=None,
        metavar="none|hflip|five_crop|ten_crop",
        help="test-time augmentation (default: the run's eval.tta; an exported graph's own)",
    )


def args_serve(p: argparse.ArgumentParser) -> None:
    add_serve_args(p, weights_arg, WEIGHTS_HELP)


def args_data(p: argparse.ArgumentParser) -> None:
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    s = dsub.add_parser(
        "check",
        help="read every file: unreadable ones, duplicates, train/val leaks, class counts, a sample grid",
        description="Read and decode every sample of every split (whatever data.on_bad_sample says) and "
        "report unreadable files, identical files, images shared between splits, class counts and "
        "sizes; load a few batches through the configured backend; write check.json and samples.png.",
    )
    _add_config_args(s)
    s.add_argument("--batches", type=Count(1), default=10, help="batches to load per split")
    s.add_argument(
        "--out",
        type=Output(folder=True),
        metavar="DIR",
        default=None,
        help="folder for the sample grid PNG (default: a temp folder)",
    )
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    s = dsub.add_parser(
        "compare",
        help="run the eval preprocessing through every backend and compare pixels",
        description="Compare the CPU, GPU and DALI eval preprocessing on the same images.",
    )
    _add_config_args(s)
    s.add_argument("--images", type=Count(1), default=64, help="number of validation images to compare")
    s.add_argument("--run", metavar="RUN_DIR", default=None, help="also report top-1 agreement of this run's model")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    s = dsub.add_parser(
        "cache",
        help="build the decoded-image cache of a data set now, list the cache folder, or clear it",
        description="Decode every image of DIR (data.root, or the config's data) once into the "
        "decoded-image cache that training reads (data.cache; pre-sized to what each split's transforms "
        "use); --list shows every cache in the cache folder (data.cache_dir), --clear removes this data "
        "set's caches, --clear-all every cache.",
    )
    s.add_argument("dir", nargs="?", default=None, metavar="DIR", help="the image folder (sets data.root)")
    s.add_argument("-c", "--config", help="run config file (.yaml, .json or .toml)")
    s.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted override, e.g. --set data.cache_dir=/scratch/cache (repeatable)",
    )
    what = s.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list the caches in the cache folder")
    what.add_argument("--clear", action="store_true", help="remove this data set's caches")
    what.add_argument("--clear-all", action="store_true", help="remove every cache in the cache folder")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    s = dsub.add_parser(
        "shard",
        help="write an image folder or file list as shuffled WebDataset tar shards",
        description="Write SRC (an image folder, optionally with train/ and val/, or a `path,label` list) "
        "as shuffled tar shards plus index.json into OUT; resumable (finished shards are re-hashed and "
        "kept) and verified at the end (counts, keys, labels, checksums). Train on them with "
        "data.dataset=webdataset data.root=OUT.",
    )
    s.add_argument("src", metavar="SRC", help="image folder or file list")
    s.add_argument("out", type=Output(folder=True), metavar="OUT", help="folder for the shards and index.json")
    s.add_argument(
        "--shard-size",
        type=shard_size,
        default="1GB",
        metavar="SIZE",
        help="largest shard, e.g. 1GB, 500MB, 64MiB (default 1GB)",
    )
    s.add_argument("--seed", type=Count(0), default=0, help="seed of the sample shuffle (default 0)")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")


def args_bench(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--steps", type=Count(1), default=30, help="timed steps per variant (after warm-up)")
    p.add_argument("--warmup", type=Count(0), default=5, help="untimed warm-up steps per variant")
    p.add_argument("--repeats", type=Count(1), default=3, help="repetitions per variant (median, min-max reported)")
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all that apply)")
    p.add_argument(
        "--to-accuracy",
        type=Number(),
        default=None,
        metavar="X",
        help="also measure time until the monitored val metric (checkpoint.monitor: top-1, mAP, PSNR) reaches X",
    )
    p.add_argument(
        "--out", type=Output(folder=True), metavar="DIR", default=None, help="bench folder (default: bench/<timestamp>)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="--out may hold an earlier bench's files, which are replaced"
    )


def args_lr_find(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--steps",
        type=Count(10, " (the suggestion drops the first tenth and the last 5 points)"),
        default=100,
        help="optimizer steps of the sweep (default 100; it stops early when the smoothed loss exceeds 4x its best)",
    )
    p.add_argument(
        "--start", type=Number(0, above=True), default=1e-7, help="first learning rate (default 1e-7, as fastai)"
    )
    p.add_argument("--end", type=Number(0, above=True), default=10.0, help="last learning rate (default 10, as fastai)")
    p.add_argument(
        "--out",
        type=Output(folder=True),
        metavar="DIR",
        default=None,
        help="folder for lr_find.png and lr_find.json (default: a temp folder)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="--out may hold an earlier sweep's files, which are replaced"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def args_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR", help="run folder printed by `torchsprint train`")
    p.add_argument("--weights", type=weights_arg, default="best", help=WEIGHTS_HELP)
    p.add_argument(
        "--out", type=Output(folder=True), metavar="DIR", default=None, help="output folder (default: <run>/report)"
    )
    p.add_argument("--wrong", type=Count(0), default=24, help="how many confidently wrong validation images to show")
    p.add_argument(
        "--overwrite", action="store_true", help="--out may hold an earlier report's files, which are replaced"
    )


def args_average(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run folders of the same model (or one, with --checkpoints)"
    )
    p.add_argument(
        "-o", "--out", type=Output(), required=True, metavar="FILE", help="the averaged weights (.safetensors)"
    )
    p.add_argument("--overwrite", action="store_true", help="-o may replace an existing file (never a run's own)")
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="last",
        help="which weights file of each run is averaged (default last; best, ema, swa)",
    )
    p.add_argument(
        "--checkpoints",
        type=Count(2, " (an average of one is the checkpoint itself)"),
        default=None,
        metavar="N",
        help="average the model weights of the one run's N newest checkpoints (checkpoints/ckpt-*.pt)",
    )
    p.add_argument("--json", action="store_true", help="print each input's and the average's figures as JSON")


def args_weights(p: argparse.ArgumentParser) -> None:
    wsub = p.add_subparsers(dest="weights_command", metavar="ACTION", required=True)
    for name, text in (
        (
            "get",
            "download SPEC into the cache a run reads (torch.hub's for torchvision and URLs, the Hugging "
            "Face hub's for timm and hf-hub) unless it is there, and print the file's path",
        ),
        ("path", "print where SPEC's file is or would be in the cache; exit 0 when it is there, 1 when not"),
    ):
        s = wsub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ". See docs/pretrained.md.")
        s.add_argument(
            "spec",
            metavar="SPEC",
            help="a model.pretrained value: torchvision:<Enum>.<NAME>, torchvision:DEFAULT "
            "(with --model), timm:<arch>.<tag>, hf-hub:<org>/<name>[@rev], https://host/file.pth[#sha256=<hex>]",
        )
        s.add_argument(
            "--model", metavar="NAME", help="the model.name the weights are for (torchvision:DEFAULT needs it)"
        )
        s.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors"
        )


def args_config(p: argparse.ArgumentParser) -> None:
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    s = csub.add_parser(
        "show",
        help="print the config as loaded (YAML); --resolved: as a run would train it",
        description="Print the config: the file and overrides, validated, every default written out. "
        "With --resolved, also what the task and the data decide (data.root scanned, "
        "the model's start looked up), as `train` records it in config.yaml.",
    )
    _add_config_args(s)
    s.add_argument(
        "--resolved",
        action="store_true",
        help="add the defaults the task and the data decide (reads data.root and the weights cache)",
    )
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors")
    csub.add_parser(
        "schema", help="print the config's JSON Schema (for editor completion)", description="Print the JSON Schema."
    )


def args_list(p: argparse.ArgumentParser) -> None:
    p.add_argument("family", choices=FAMILIES, help="which registry to list")


# The flags that set a serve.* field, as (field, type, help); None when not given. Each is checked against
# config/serve.py's ServeConfig by tests/e2e/serve/test_serve.py. Here, not in
# commands/serve.py, so that `torchsprint --help` imports no server code (socket, signal).
# Numbers checked while the command line is parsed (commands/args.py), with the serve section's bounds.
SERVE_FLAGS = (
    ("host", str, "address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)"),
    ("port", Count(0), "TCP port (default 8000; 0: a free one, printed at start)"),
    ("max_batch", Count(1), "most images per forward pass (default 32)"),
    ("max_wait_ms", Number(0, 10_000), "how long an image waits for others to batch with (default 5)"),
    ("queue_limit", Count(1), "most images waiting; more get 503 + Retry-After (default 256)"),
    ("timeout_s", Number(0, above=True), "a request not answered in this many seconds gets 503 (default 30)"),
    ("workers", Count(1), "server processes, each with its own copy of the model (default 1)"),
    ("runtime", str, "auto, torch or onnxruntime (default auto: by the file)"),
    ("device", str, "auto, cpu, cuda or cuda:N (default auto)"),
    ("token", str, "bearer token /predict and /metrics require (or env TORCHSPRINT_SERVE_TOKEN)"),
    ("max_body_mb", Number(0, above=True), "largest request body in MiB (default 20)"),
    ("max_pixels", Count(1), "largest image in pixels, from its header (default 40000000)"),
    (
        "max_model_pixels",
        CountOrAuto(1),
        "largest model input in pixels where the eval spec keeps each file's size "
        "(default auto: from what the run trained on; docs/serve.md)",
    ),
    ("topk", Count(1), "classes per image unless the request says ?topk=N (default 5)"),
    ("buckets", str, "auto, on or off: pad batches to powers of two (default auto: on CUDA)"),
    (
        "precision",
        str,
        "auto, fp32 or bf16 (default auto: bf16 where the run trained in it and the CPU has it natively)",
    ),
)
FLAGS = tuple(name for name, _, _ in SERVE_FLAGS)


def add_serve_args(p, weights_arg, weights_help: str) -> None:
    """`torchsprint serve`'s arguments (cli.py's args_serve)."""
    p.add_argument("target", metavar="RUN_DIR|MODEL_FILE", help="run folder, or a .onnx/.safetensors file from export")
    p.add_argument("-c", "--config", help="a config file whose `serve:` section applies (over the run's own)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="serve.KEY=VALUE",
        help="dotted overrides, e.g. serve.max_batch=64 (before the --flags)",
    )
    p.add_argument("--weights", type=weights_arg, default="best", help=weights_help)
    p.add_argument(
        "--tta",
        default=None,
        metavar="none|hflip|five_crop|ten_crop",
        help="test-time augmentation (default: the run's eval.tta; an exported graph's own)",
    )
    g = p.add_argument_group("settings (each sets the serve.* key of its name; docs/serve.md describes them)")
    for name, kind, text in SERVE_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=text)

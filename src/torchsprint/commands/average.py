"""`torchsprint average RUN... -o FILE`: the mean of several weights of one model, BatchNorm recomputed, evaluated.

What is averaged (timm's avg_checkpoints.py, which averages a run's checkpoint files):
- several runs: each run's --weights file (last by default; best, ema or swa), e.g. runs of one config with
  different seeds ("model soups", uniform);
- one run with --checkpoints N: the model weights of its N newest resumable checkpoints (checkpoints/ckpt-*.pt,
  by step), the weights of its last N checkpointed epochs.
Every input must be the same model: the same model name, classes and tensor names and shapes; anything else is
refused in one line. Floating tensors are averaged with equal weights (in float64, stored in their own dtype);
integer buffers (BatchNorm's num_batches_tracked) are the first input's. Then the BatchNorm statistics are
recomputed over one pass of the training data of the first run (swa.recompute_bn: torch.optim.swa_utils.update_bn
through the run's own loader, as SWA does at the end of training), and the result is evaluated on the first run's
validation split beside each input. The file carries the metadata `train` writes, so `torchsprint eval/export/
report --weights FILE` and `torchsprint predict -r FILE` take it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchsprint.errors import UsageError


def input_files(runs: list[str], weights: str, checkpoints: int | None) -> list[tuple[str, Path]]:
    """(label, file) of each input: the runs' weights files, or one run's newest checkpoint files."""
    if checkpoints is not None:
        if len(runs) != 1:
            raise UsageError(
                f"--checkpoints {checkpoints} averages the checkpoints of one run; {len(runs)} runs were "
                "given. Pass one run folder, or leave out --checkpoints to average the runs' --weights."
            )
        if checkpoints < 2:
            raise UsageError(f"--checkpoints {checkpoints}: an average needs at least 2 checkpoints.")
        from torchsprint.state.resume import find_checkpoints

        run = Path(runs[0])
        found = find_checkpoints(run) if run.is_dir() else []  # newest first
        if len(found) < checkpoints:
            raise UsageError(
                f"--checkpoints {checkpoints}: {run / 'checkpoints'} holds {len(found)} checkpoint(s). Average "
                f"fewer, or keep more while training (checkpoint.keep_last={checkpoints})."
            )
        return [(p.name, p) for p in reversed(found[:checkpoints])]
    if len(runs) < 2:
        raise UsageError(
            "an average needs at least 2 inputs: pass several run folders, or one run with --checkpoints N."
        )
    out = []
    for r in runs:
        path = Path(r) / f"{weights}.safetensors"
        if not Path(r).is_dir():
            raise UsageError(f"{r}: no such run folder. Pass the folders `torchsprint train` printed.")
        if not path.is_file():
            raise UsageError(
                f"{path} not found: that run has no {weights} weights; choose another --weights "
                "(best, last, ema, swa) or leave the run out."
            )
        out.append((str(r), path))
    return out


def read_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, {model, classes}) of a safetensors weights file or a checkpoint file's model."""
    from torchsprint.state.checkpoint import load_checkpoint, read_safetensors_metadata

    if path.suffix == ".pt":
        ckpt = load_checkpoint(path)
        return ckpt["model"], {"model": ckpt["config"]["model"]["name"], "classes": list(ckpt["classes"])}
    from safetensors.torch import load_file

    try:
        meta = read_safetensors_metadata(path)
        state = load_file(str(path))
    except Exception as e:  # a truncated or corrupt file
        raise UsageError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {str(e)[:200]}). Leave it out, "
            "or re-train the run."
        ) from None
    from torchsprint.config.saved import metadata_entry

    return state, {"model": meta.get("model"), "classes": metadata_entry(meta, "classes", path, default=None)}


def check_same_model(states: list[tuple[str, dict, dict]]) -> None:
    """Refuse inputs that are not the same model (name, classes, tensor names and shapes), naming the first
    difference."""
    label0, state0, meta0 = states[0]
    for label, state, meta in states[1:]:
        if meta["model"] != meta0["model"]:
            raise UsageError(
                f"{label} is model {meta['model']}, {label0} is {meta0['model']}: only weights of the same "
                "model can be averaged."
            )
        if meta["classes"] != meta0["classes"]:
            n, n0 = len(meta["classes"] or []), len(meta0["classes"] or [])
            what = f"{n} classes, {label0} {n0}" if n != n0 else "other class names (or order) than " + label0
            raise UsageError(f"{label} has {what}: only weights of the same classes can be averaged.")
        if state.keys() != state0.keys():
            diff = sorted(state.keys() ^ state0.keys())
            raise UsageError(
                f"{label} and {label0} hold different tensors (e.g. {diff[0]}): other model arguments "
                "(model.args); only the same architecture can be averaged."
            )
        for k, v in state.items():
            if v.shape != state0[k].shape:
                raise UsageError(
                    f"{label}: {k} has shape {list(v.shape)}, {label0} {list(state0[k].shape)}: other model "
                    "arguments (model.args); only the same architecture can be averaged."
                )


def average_states(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Equal-weight mean of floating tensors (float64 sum, cast back); integer tensors from the first state."""
    out = {}
    for k, v0 in states[0].items():
        if v0.is_floating_point():
            total = sum(s[k].double() for s in states)
            out[k] = (total / len(states)).to(v0.dtype)
        else:
            out[k] = v0.clone()
    return out


def run_objects(cfg, first_run: Path, rt, task):
    """(loaders, model, loss_fn) of the first run's config: its training loader (with Mixup/CutMix when it had
    them: the batches training saw, as swa's BatchNorm pass), its validation split, its model and loss."""
    from torchsprint.config.saved import naming_imports
    from torchsprint.data import build_loaders
    from torchsprint.data.preprocess.mix import check_mix, wrap_mix
    from torchsprint.models import build_model
    from torchsprint.tasks.core import check_data_task
    from torchsprint.train.evaluation import build_run_loss, materialize_lazy

    with naming_imports(cfg.imports, first_run):
        loaders = build_loaders(
            cfg.data, rt, seed=cfg.run.seed, channels_last=cfg.speed.channels_last is True, allowed=task.backends
        )
        info = loaders.info
        check_data_task(cfg, info)
        if check_mix(cfg.mix, cfg.task, task.targets, cfg.loss):
            loaders.train = wrap_mix(loaders.train, cfg.mix, info.num_classes, cfg.run.seed, rt.rank, rt.world_size)
        model = build_model(cfg.model, info.num_classes, info.in_channels).to(rt.device)
        materialize_lazy(model, loaders.val)
        loss_fn = build_run_loss(cfg, task.targets, info).to(rt.device)
    return loaders, model, loss_fn


def average(
    runs: list[str],
    out: str | Path,
    weights: str = "last",
    checkpoints: int | None = None,
    overrides: list[str] = (),
    log=print,
    overwrite: bool = False,
) -> dict:
    """Average the inputs into `out` (a .safetensors file) and evaluate it; returns {inputs: [...], average: metrics}.

    Args:
        runs: run folders (several), or one with `checkpoints`.
        out: the file to write.
        weights: which weights file of each run (best, last, ema, swa).
        checkpoints: average the N newest checkpoints of the one run instead.
        overrides: dotted overrides of the first run's config for the BatchNorm pass and the evaluation
            (e.g. data.num_workers=0).
        overwrite: whether an existing `out` may be replaced (never a run's own file: rundir.writable_file).
    """
    from torchsprint import config as config_mod
    from torchsprint import runtime
    from torchsprint.config.saved import load_run_config, naming_imports
    from torchsprint.state.checkpoint import save_weights
    from torchsprint.state.precision import Precision, concrete_mode
    from torchsprint.state.rundir import writable_file
    from torchsprint.state.swa import recompute_bn
    from torchsprint.tasks.core import get_task
    from torchsprint.train.validation import evaluate

    out = Path(out)
    if out.suffix != ".safetensors":
        raise UsageError(f"-o {out}: the average is written as safetensors; name the file *.safetensors.")
    writable_file(out, "-o", overwrite=overwrite)  # never a run's own weights (-o B/last.safetensors replaced them)
    files = input_files(list(runs), weights, checkpoints)
    states = [(label, *read_state(path)) for label, path in files]
    check_same_model(states)
    first_run, first_meta = Path(runs[0]), states[0][2]
    cfg = load_run_config(first_run, list(overrides) + ["strategy.name=single"])
    if cfg.model.name != first_meta["model"]:
        raise UsageError(
            f"{first_run}/config.yaml names model {cfg.model.name}, its weights are {first_meta['model']}: "
            "the folder was changed by hand; average the runs' own files."
        )
    avg = average_states([s for _, s, _ in states])
    with naming_imports(cfg.imports, first_run):
        task = get_task(cfg.task)
        task.check(cfg)
    rt = runtime.setup(cfg.run, cfg.strategy, cfg.speed)
    try:
        loaders, model, loss_fn = run_objects(cfg, first_run, rt, task)
        info, prec = loaders.info, Precision(concrete_mode(cfg.precision.mode), rt.device)
        if info.classes != first_meta["classes"]:
            raise UsageError(
                f"the data of {first_run} now has {len(info.classes)} classes, the weights "
                f"{len(first_meta['classes'])}: the dataset changed since training; average with the "
                "data the runs were trained on."
            )

        def score(state) -> dict:
            model.load_state_dict(state)
            got = evaluate(model, loaders.val, loss_fn, prec, task.make_metrics(info, cfg.eval, rt.device))
            return {k: v for k, v in got.items() if not isinstance(v, list)}

        inputs = []
        for label, state, _ in states:
            inputs.append({"input": label, **score(state)})
            log(f"{label}: {task.summary({f'val/{k}': v for k, v in inputs[-1].items() if k != 'input'})}")
        model.load_state_dict(avg)
        recompute_bn(model, loaders.train, cfg.run.epochs, rt, prec, cfg.run.seed)
        result = score(dict(model.state_dict()))
        log(
            f"average of {len(states)} ({'BatchNorm statistics recomputed' if has_bn(model) else 'no BatchNorm'}): "
            f"{task.summary({f'val/{k}': v for k, v in result.items()})}"
        )
        meta = {
            "classes": json.dumps(info.classes),
            "model": cfg.model.name,
            "in_channels": str(info.in_channels),
            "format": "torchsprint",
            "task": cfg.task,
            "config": json.dumps(config_mod.to_dict(cfg)),
            "weights": "average",
            "average_of": json.dumps([label for label, _ in files]),
        }
        save_weights(out, model, meta)
        log(f"wrote {out}")
    finally:
        runtime.teardown(rt)
    return {"inputs": inputs, "average": result, "file": str(out)}


def has_bn(model) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def average_cli(args) -> int:
    """`torchsprint average`: see the module docstring."""
    out = average(
        args.runs,
        args.out,
        args.weights,
        args.checkpoints,
        log=(lambda *_: None) if args.json else print,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(out))
    return 0

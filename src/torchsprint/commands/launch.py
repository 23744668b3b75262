"""`torchsprint train --nproc-per-node N [--nnodes ...]`: start DDP workers through torchrun's own launcher.

The workers are `python -m torchsprint train <same arguments> strategy.name=ddp`, started by
torch.distributed.run (the code behind `torchrun`), so a run launched here behaves exactly like
`torchrun --nproc-per-node N -m torchsprint train ...`: same environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), same failure handling (one failed worker stops its siblings).
Machines: `--nnodes/--node-rank/--rdzv-endpoint`, or SLURM's variables when run under `srun`
with one task per node.

Surviving a lost worker (`--max-restarts K`): torchrun's elastic agent restarts the whole worker group
(up to K times) when a worker dies, and a restarted worker (TORCHELASTIC_RESTART_COUNT > 0) resumes
from the newest valid checkpoint of the run folder (`checkpoint.resume: auto`, set by cli.cmd_train).
For that every attempt must use the same folder: without run.dir the launcher creates the run's
timestamped folder once and passes it to the workers as run.dir. Rendezvous: `--rdzv-backend static`
(a fixed --node-rank per machine; the default with --nnodes > 1) or `c10d` (torchrun's elastic
rendezvous: ranks assigned on arrival, a restarted or replaced node rejoins). Either waits at most
strategy.timeout_s for the machines; one that never comes (a dead host) fails the run with that said.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torchsprint.errors import UsageError
from torchsprint.train.resolve import resolve

DEFAULT_PORT = 29500


def node_settings(args, env: dict[str, str]) -> tuple[str, int, str | None]:
    """(nnodes, node_rank, rendezvous endpoint) from the flags, else from SLURM, else one machine.

    Args:
        args: the parsed `train` arguments (nnodes, node_rank, rdzv_endpoint).
        env: the environment (os.environ).
    """
    if args.nnodes is not None or args.rdzv_endpoint is not None:
        nnodes = str(args.nnodes or "1")
        multi = nnodes != "1"
        if multi and args.rdzv_endpoint is None:
            raise UsageError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a host every machine can reach, "
                "e.g. the first node's name and a free port), run on every machine."
            )
        return nnodes, args.node_rank or 0, args.rdzv_endpoint
    nnodes_slurm = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
    if nnodes_slurm > 1 and "SLURM_NODEID" in env:
        from torchsprint.runtime.core import first_slurm_host, slurm_port

        ntasks = int(env.get("SLURM_NTASKS", str(nnodes_slurm)))
        if ntasks != nnodes_slurm:
            raise UsageError(
                f"under srun with {ntasks} tasks on {nnodes_slurm} nodes: --nproc-per-node needs one task per node "
                "(srun --ntasks-per-node=1). Or drop --nproc-per-node and let srun start one task per GPU: "
                "torchsprint reads SLURM_PROCID/SLURM_NTASKS itself."
            )
        host = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        )
        return str(nnodes_slurm), int(env["SLURM_NODEID"]), f"{host}:{slurm_port(env)}"
    return "1", 0, None


def check_nproc(nproc: int, device_type: str, gpus: int) -> None:
    """Refuse more DDP processes per machine than it has GPUs (on a CUDA run), or fewer than one."""
    if nproc < 1:
        raise UsageError(f"--nproc-per-node {nproc}: needs at least 1 process.")
    if device_type == "cuda" and nproc > gpus:
        raise UsageError(
            f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s): DDP runs one process per GPU. "
            f"Use --nproc-per-node {gpus} (or fewer), or run.device=cpu to train on CPU processes (gloo)."
        )


def check_memory(nproc: int) -> dict:
    """Refuse, before starting any worker, more workers than the memory here holds; returns the figures (for
    `oom_hint`): each worker's least size, what is available and where that figure comes from.

    Each worker imports torch and reads the config as this launcher just did, so this process's resident size is
    the least a worker takes (its model, data and loader workers come on top): 64 workers on a small machine
    otherwise ran it out of memory, and all the user saw was "rank 57 failed (signal 9)".
    """
    from torchsprint.runtime.core import memory_available, proc_bytes

    per = proc_bytes("/proc/self/status", "VmRSS") or 0
    free, where = memory_available()
    figures = {"nproc": nproc, "per": per, "free": free, "where": where}
    if per and free and nproc * per > free:
        fit = max(1, free // per - 1)  # -1: the launcher itself stays
        raise UsageError(
            f"--nproc-per-node {nproc}: each DDP worker takes at least ~{per / 2**20:.0f} MiB (this "
            f"launcher's own size after importing torch; model and data come on top), {nproc} x that = "
            f"{nproc * per / 2**30:.1f} GiB, over the {free / 2**30:.1f} GiB {where}: the kernel's "
            f"out-of-memory killer would end workers. Use --nproc-per-node {fit} or fewer."
        )
    return figures


def oom_hint(figures: dict) -> str:
    """What a worker killed by signal 9 most likely met, with the launch's memory figures."""
    per, free = figures["per"], figures["free"]
    need = f"{figures['nproc']} workers x at least ~{per / 2**20:.0f} MiB = {figures['nproc'] * per / 2**30:.1f} GiB"
    have = f", with {free / 2**30:.1f} GiB {figures['where']} at launch" if free else ""
    return (
        f"; signal 9 (SIGKILL) is most likely the kernel's out-of-memory killer ({need}{have}; the model, data and "
        "data.num_workers loader processes come on top): use fewer --nproc-per-node or data.num_workers, or a "
        "smaller data.batch_size"
    )


def config_source(args) -> tuple[str | None, list[str]]:
    """The config path and overrides the workers will load, as `cmd_train` computes them."""
    path, overrides = args.config, list(args.overrides)
    if args.resume:
        if not Path(args.resume).is_dir():
            raise UsageError(f"--resume {args.resume}: no such run folder.")
        path = path or str(Path(args.resume) / "config.yaml")
        overrides += [f"run.dir={args.resume}", "checkpoint.resume=auto"]
    return path, overrides + ["strategy.name=ddp"]


def preflight(args):
    """Load the config and refuse what the workers would refuse, once, before starting any of them."""
    import torch

    from torchsprint import config
    from torchsprint.runtime.core import resolve_backend, resolve_device
    from torchsprint.runtime.parallel import check_speed
    from torchsprint.state.precision import check_mode

    path, overrides = config_source(args)
    if args.resume and args.config is None:  # the run folder's own config: its `imports:` are not trusted
        from torchsprint.config.saved import resumed_run_config

        cfg = resumed_run_config(args.resume, overrides, args.imports)
    else:
        cfg = config.load(path, overrides, imports=args.imports)
    cfg = resolve(cfg)
    device = resolve_device(cfg.run.device)
    if device.type == "cuda" and cfg.run.device not in ("auto", "cuda"):
        raise UsageError(
            f"run.device={cfg.run.device} pins every DDP process to one GPU. Use run.device=auto (or cuda): "
            "each process takes cuda:<local rank>."
        )
    resolve_backend(cfg.strategy, device)
    check_mode(cfg.precision.mode, device)
    check_speed(cfg.speed, cfg.strategy, device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return cfg, device.type, gpus


def worker_args(args) -> list[str]:
    """`train` arguments of each worker: the user's, plus strategy.name=ddp."""
    out = ["train"]
    if args.config:
        out += ["-c", args.config]
    for name in args.imports:
        out += ["--import", name]
    if args.resume:
        out += ["--resume", args.resume]
    if getattr(args, "overwrite", False):
        out.append("--overwrite")
    if getattr(args, "dry_run", False):
        out.append("--dry-run")
    if getattr(args, "debug", False):
        out.append("--debug")
    return out + list(args.overrides) + ["strategy.name=ddp"]


def join_timeout(timeout_s: float) -> int:
    """Seconds the rendezvous waits for every machine: strategy.timeout_s less a reserve of up to 10 s.

    After a machine dies, a survivor's collective fails within seconds (its peer's sockets close), its
    agent restarts the group and waits join_timeout for the machines, then stops. Measured on localhost
    (tests/e2e/ddp/test_elastic.py): ~3 s until the failure is seen plus ~1 s to stop, so the reserve keeps that
    whole sequence inside strategy.timeout_s, as docs/cluster.md promises.
    """
    return max(1, int(timeout_s - min(10.0, timeout_s / 2)))


def torchrun_argv(
    nproc: int,
    nnodes: str,
    node_rank: int,
    endpoint: str | None,
    timeout_s: float,
    script_args: list[str],
    max_restarts: int = 0,
    rdzv_backend: str | None = None,
    run_id: str = "torchsprint",
) -> list[str]:
    """torchrun's command line for these settings (without the leading `torchrun`).

    rdzv_backend: None (static with --nnodes > 1, c10d on one machine), "static" or "c10d". With c10d
    the node rank comes from the rendezvous, `run_id` names the job (every machine passes the same), and
    the rendezvous waits at most `join_timeout(timeout_s)` for all machines.
    """
    wait = join_timeout(timeout_s)
    argv = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if endpoint is None:
        argv.append("--standalone")  # one machine: c10d rendezvous on a free localhost port
    elif rdzv_backend == "c10d":
        # join_timeout: the wait for every machine; read_timeout: for the rendezvous store (on the endpoint's
        # machine); last_call_timeout: for more machines once --nnodes MIN is reached (MIN:MAX only).
        argv += [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf=join_timeout={wait},read_timeout={wait},last_call_timeout=5,close_timeout=10",
        ]
    elif nnodes != "1":
        host, _, port = endpoint.rpartition(":")
        if not host:
            host, port = endpoint, str(DEFAULT_PORT)
        # With a fixed --node-rank, static rendezvous (rank = node rank); the join timeout is the
        # strategy timeout less the reserve, so a machine that never arrives fails the run instead of hanging it.
        argv += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-conf=timeout={wait}",
        ]
    else:
        argv += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    return argv + ["-m", "torchsprint", *script_args]


def root_failure(err) -> tuple[int, object]:
    """(rank, failure) that most likely caused torchrun's ChildFailedError.

    A worker killed by a signal comes first: its peers then fail with "lost contact with the group" (exit
    code 1) and may be seen first, since the agent records a killed worker's time when it notices the death
    but a failed worker's when it wrote its error file. Otherwise the earliest failure (torchrun's own pick).
    """
    signalled = [(f.timestamp, rank, f) for rank, f in err.failures.items() if f.exitcode < 0]
    if signalled:
        _, rank, failure = min(signalled, key=lambda t: (t[0], t[1]))
        return rank, failure
    return err.get_first_failure()


def exit_code(err) -> int:
    """A shell exit status for torchrun's ChildFailedError: the root failure's code (128+N for signal N)."""
    _, failure = root_failure(err)
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


def check_restarts(args, nnodes: str, endpoint: str | None) -> tuple[int, str | None]:
    """(--max-restarts, --rdzv-backend), refused where they cannot work with these machines."""
    restarts = getattr(args, "max_restarts", 0) or 0
    backend = getattr(args, "rdzv_backend", None)
    if restarts < 0:
        raise UsageError(f"--max-restarts {restarts}: use 0 (a failed worker ends the run) or more restarts.")
    if backend == "c10d" and endpoint is None:
        raise UsageError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the same on every machine).")
    if backend == "static" and nnodes != "1" and args.node_rank is None and "SLURM_NODEID" not in os.environ:
        raise UsageError(
            "--rdzv-backend static needs --node-rank R on every machine (0 on the one at --rdzv-endpoint); "
            "or use --rdzv-backend c10d, which assigns ranks itself."
        )
    return restarts, backend


def launch(args) -> int:
    """Run `torchsprint train` as DDP workers through torch.distributed.run; returns the exit status.

    Args:
        args: the parsed `train` arguments (config, overrides, imports, resume, nproc_per_node,
            nnodes, node_rank, rdzv_endpoint, debug).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise UsageError(
            "already running under torchrun (LOCAL_RANK is set): drop --nproc-per-node/--nnodes, "
            "torchrun has started the workers."
        )
    cfg, device_type, gpus = preflight(args)
    nnodes, node_rank, endpoint = node_settings(args, dict(os.environ))
    nproc = args.nproc_per_node or (gpus if device_type == "cuda" else 1)
    check_nproc(nproc, device_type, gpus)
    memory = check_memory(nproc)
    restarts, backend = check_restarts(args, nnodes, endpoint)
    dry = getattr(args, "dry_run", False)
    extra = []
    if restarts and not cfg.run.dir:
        if nnodes != "1":
            raise UsageError(
                "--max-restarts with several machines needs run.dir=<a folder every machine shares>: "
                "the restarted workers resume from its newest checkpoint, whichever machine rank 0 is on."
            )
        from torchsprint.state.rundir import create_unique, planned_path

        if not dry:  # a dry run writes nothing
            extra = [f"run.dir={create_unique(planned_path(cfg.run)[0])}"]  # one folder for every attempt
    if dry:
        restarts = 0  # checked above as for the run; a dry run trains nothing to restart, nor retries a failed check

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchsprint.runtime.preempt import EXIT_PREEMPTED, LAUNCHER_ENV

    if restarts:  # a paused worker group tells this process to stop rather than be restarted (preempt.stop_launcher)
        os.environ[LAUNCHER_ENV] = str(os.getpid())

    # torchrun's agent turns these signals into "stop the workers with this signal, SIGKILL after 30 s"; the
    # run's stop signals join them, so that a SIGUSR1 sent to the launcher (SLURM --signal) reaches the workers
    # (which save a checkpoint and exit 75) instead of killing the launcher.
    handled = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(dict.fromkeys(handled + list(cfg.run.stop_signals)))
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    argv = torchrun_argv(
        nproc,
        nnodes,
        node_rank,
        endpoint,
        cfg.strategy.timeout_s,
        worker_args(args) + extra,
        restarts,
        backend,
        run_id=f"torchsprint-{cfg.run.name}",
    )
    where = (
        "this machine"
        if nnodes == "1"
        else f"node {node_rank if backend != 'c10d' else '(rank by rendezvous)'} of {nnodes} (rendezvous {endpoint})"
    )
    print(
        f"launching {nproc} DDP process(es) on {where} ({'NCCL' if device_type == 'cuda' else 'gloo'}): "
        f"torchrun {' '.join(argv)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        run(get_args_parser().parse_args(argv))
    except RendezvousError as e:
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        print(
            f"error: the rendezvous at {endpoint} did not complete "
            f"({type(e).__name__}{': ' + detail if detail else ''}): a machine of the {nnodes} did not join "
            f"within strategy.timeout_s={cfg.strategy.timeout_s:g} s (dead or unreachable host?). The workers "
            "here were stopped.",
            file=sys.stderr,
        )
        return 1
    except SignalException as e:  # the workers got the signal and were waited for (see above)
        if e.sigval.name not in cfg.run.stop_signals:
            print(
                f"launcher: stopped by {e.sigval.name} (not in run.stop_signals): the workers were ended",
                file=sys.stderr,
            )
            return 128 + int(e.sigval)
        print(
            f"launcher: {e.sigval.name}: the workers stop after their current step with a checkpoint "
            f"(run.stop_signals); exit {EXIT_PREEMPTED}",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        if any(f.exitcode == EXIT_PREEMPTED for f in e.failures.values()):
            print(
                f"DDP workers stopped by a stop signal after saving a checkpoint; exit {EXIT_PREEMPTED} (continue with "
                "checkpoint.resume=auto or --resume)",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        code = exit_code(e)
        rank, failure = root_failure(e)
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        tried = f" after {restarts} restart(s)" if restarts else ""
        hint = oom_hint(memory) if failure.exitcode == -9 else ""
        print(
            f"error: DDP worker rank {rank} failed ({how}){tried}; the other workers were stopped{hint}.",
            file=sys.stderr,
        )
        return code
    return 0

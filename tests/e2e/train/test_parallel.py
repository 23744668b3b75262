"""Strategies, launch settings and speed switches in one process: bad input, SLURM/torchrun env, compile,
channels_last."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from torchsprint import config
from torchsprint.cli import main as cli_main
from torchsprint.commands.launch import check_nproc, node_settings, torchrun_argv, worker_args
from torchsprint.errors import UsageError
from torchsprint.runtime.core import Runtime, check_strategy, first_slurm_host, launch_env, resolve_backend
from torchsprint.runtime.parallel import check_speed, no_sync, unwrap, wrap_model
from torchsprint.runtime.sync_bn import GlooSyncBatchNorm, convert_sync_batchnorm
from torchsprint.state.precision import Precision
from torchsprint.train.plan import decide_speed
from torchsprint.train.run import train

CPU_RT = Runtime(device=torch.device("cpu"))
TINY = [
    "log.tensorboard=false",
    "run.max_steps=4",
    "checkpoint.every_epochs=null",
    "eval.per_class=false",
    "log.every_steps=2",
]


# ---------------------------------------------------------------- bad input: what to use instead


def test_dp_on_cpu_is_refused(capsys, tmp_path):
    cfg = config.load(None, ["strategy=dp"])
    with pytest.raises(UsageError, match="strategy=ddp"):
        wrap_model(nn.Linear(2, 2), cfg.strategy, CPU_RT)
    assert cli_main(["train", "strategy=dp", "run.device=cpu", "run.max_steps=1", f"run.dir={tmp_path}"]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err


def test_nccl_on_cpu_is_refused_before_any_worker_starts(capsys):
    cfg = config.load(None, ["strategy.backend=nccl"])
    with pytest.raises(UsageError, match="gloo"):
        resolve_backend(cfg.strategy, torch.device("cpu"))
    # launch.preflight refuses in the launching process: exit 2, no torchrun agent, no workers.
    assert cli_main(["train", "--nproc-per-node", "2", "run.device=cpu", "strategy.backend=nccl"]) == 2
    assert "strategy.backend=gloo" in capsys.readouterr().err


def test_fp16_and_cuda_graphs_on_cpu_are_refused_by_the_launcher(capsys):
    assert cli_main(["train", "--nproc-per-node", "2", "run.device=cpu", "precision=fp16"]) == 2
    assert "amp_bf16" in capsys.readouterr().err
    assert cli_main(["train", "--nproc-per-node", "2", "run.device=cpu", "speed.cuda_graphs=true"]) == 2
    assert "speed.cuda_graphs=false" in capsys.readouterr().err


def test_more_processes_than_gpus_is_refused():
    check_nproc(2, "cpu", 0)  # CPU processes (gloo): no GPU limit
    check_nproc(4, "cuda", 4)
    with pytest.raises(UsageError, match="--nproc-per-node 2 .or fewer"):
        check_nproc(3, "cuda", 2)


@pytest.mark.gpu
def test_cli_nproc_per_node_above_gpu_count_exits_2(capsys):
    n = torch.cuda.device_count() + 1
    assert cli_main(["train", "--nproc-per-node", str(n), "run.max_steps=1"]) == 2
    assert f"Use --nproc-per-node {n - 1}" in capsys.readouterr().err


def test_compile_on_an_unsupported_platform_is_refused(monkeypatch):
    """No C++ compiler for inductor on CPU (CXX names a program that does not exist)."""
    cfg = config.load(None, ["speed.compile=true"])
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(UsageError, match="speed.compile=false"):
        check_speed(cfg.speed, cfg.strategy, torch.device("cpu"))
    cfg = config.load(None, ["speed.compile=true", "speed.compile_backend=aot_eager"])
    check_speed(cfg.speed, cfg.strategy, torch.device("cpu"))  # no C++ needed for aot_eager


def test_dp_under_a_multi_process_launch_is_refused():
    with pytest.raises(UsageError, match="strategy=ddp"):
        check_strategy(config.load(None, ["strategy=dp"]).strategy, world_size=2)
    check_strategy(config.load(None, []).strategy, world_size=2)  # single becomes DDP under torchrun


# ---------------------------------------------------------------- launch settings


def test_first_slurm_host():
    assert first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_slurm_host("node3,node4") == "node3"
    assert first_slurm_host("single") == "single"


def test_launch_env_reads_torchrun_then_srun():
    assert launch_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == launch_env(
        {
            "WORLD_SIZE": "4",
            "RANK": "3",
            "LOCAL_RANK": "1",
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_STEP_ID": "0",
        }
    )
    srun = launch_env(
        {
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "gpu[3-4]",
            "SLURM_JOB_ID": "1234",
        }
    )
    assert (srun.rank, srun.world_size, srun.local_rank, srun.source) == (5, 8, 1, "slurm")
    assert srun.init_method == f"tcp://gpu3:{15000 + 1234}"
    # The batch script of `sbatch --ntasks=8` (no job step) and a login shell are one process.
    assert launch_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}).world_size == 1
    assert launch_env({}).world_size == 1


def train_args(*argv):
    from torchsprint.cli import build_parser

    return build_parser().parse_args(["train", *argv])


def test_node_settings_from_flags_and_slurm():
    assert node_settings(train_args("--nproc-per-node", "2"), {}) == ("1", 0, None)
    assert node_settings(train_args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29400"), {}) == (
        "2",
        1,
        "h0:29400",
    )
    with pytest.raises(UsageError, match="--rdzv-endpoint"):
        node_settings(train_args("--nnodes", "2"), {})
    slurm = {
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "n[01-02]",
        "MASTER_PORT": "29777",
    }
    assert node_settings(train_args("--nproc-per-node", "4"), slurm) == ("2", 1, "n01:29777")
    with pytest.raises(UsageError, match="ntasks-per-node=1"):
        node_settings(train_args("--nproc-per-node", "4"), slurm | {"SLURM_NTASKS": "8"})


def test_torchrun_command_line():
    args = train_args("-c", "run.yaml", "--nproc-per-node", "2", "optim.lr=0.05")
    script = worker_args(args)
    assert script == ["train", "-c", "run.yaml", "optim.lr=0.05", "strategy.name=ddp"]
    assert torchrun_argv(2, "1", 0, None, 300, script)[:3] == ["--nproc-per-node=2", "--max-restarts=0", "--standalone"]
    multi = torchrun_argv(8, "2", 1, "h0:29400", 300, script)
    assert {
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=static",
        "--rdzv-endpoint=h0:29400",
        "--rdzv-conf=timeout=290",
    } <= set(multi)
    assert multi[-len(script) - 2 :] == ["-m", "torchsprint", *script]
    # The parser accepts what we build (torchrun's own argument parser).
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(multi)
    assert parsed.module and parsed.training_script == "torchsprint" and parsed.node_rank == 1
    # Elastic: restarts, and c10d rendezvous (ranks by arrival, one job id, joins bounded by strategy.timeout_s).
    elastic = torchrun_argv(
        8, "2", 0, "h0:29400", 60, script, max_restarts=3, rdzv_backend="c10d", run_id="torchsprint-x"
    )
    assert {
        "--max-restarts=3",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h0:29400",
        "--rdzv-id=torchsprint-x",
        "--rdzv-conf=join_timeout=50,read_timeout=50,last_call_timeout=5,close_timeout=10",
    } <= set(elastic)
    assert not any(a.startswith("--node-rank") for a in elastic)
    parsed = get_args_parser().parse_args(elastic)
    assert parsed.max_restarts == 3 and parsed.rdzv_backend == "c10d"


def test_elastic_flags_need_the_launcher(capsys, monkeypatch, tmp_path):
    """--max-restarts/--rdzv-backend without --nproc-per-node would be ignored: refused, one line, exit 2."""
    monkeypatch.chdir(tmp_path)  # a refusal that failed to happen would train into ./runs
    code, err = cli_main(["train", "--max-restarts", "2", "run.max_steps=1"]), capsys.readouterr().err
    assert code == 2 and "add --nproc-per-node N" in err and "Traceback" not in err and len(err.splitlines()) == 1
    code, err = (
        cli_main(["train", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "run.max_steps=1"]),
        capsys.readouterr().err,
    )
    assert code == 2 and "--rdzv-backend c10d needs --rdzv-endpoint" in err


def test_launch_refuses_to_nest_inside_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli_main(["train", "--nproc-per-node", "2", "run.device=cpu"]) == 2
    assert "already running under torchrun" in capsys.readouterr().err


# ---------------------------------------------------------------- SyncBN, wrappers, no-op objects


def test_cpu_sync_batchnorm_conversion_shares_parameters_and_state_keys():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(3)))
    weight, keys = net[1].weight, set(net.state_dict())
    out = convert_sync_batchnorm(net, torch.device("cpu"))
    assert isinstance(out[1], GlooSyncBatchNorm) and isinstance(out[2][0], GlooSyncBatchNorm)
    assert out[1].weight is weight and set(out.state_dict()) == keys
    x = torch.randn(5, 4, 6, 6)
    ref = nn.BatchNorm2d(4)
    ref.load_state_dict(out[1].state_dict())
    torch.testing.assert_close(out[1](x), ref(x))  # one process: plain BatchNorm behaviour
    torch.testing.assert_close(out[1].running_mean, ref.running_mean)

    class BNAct(nn.BatchNorm2d):  # a subclass with its own forward, like timm's BatchNormAct2d
        pass

    with pytest.raises(UsageError, match="sync_bn=false"):
        convert_sync_batchnorm(nn.Sequential(BNAct(3)), torch.device("cpu"))


def test_single_process_wrappers_are_no_op_objects():
    cfg = config.load(None, ["strategy.sync_bn=true"])
    said = []
    model = wrap_model(nn.Sequential(nn.BatchNorm1d(3)), cfg.strategy, CPU_RT, log=said.append)
    assert isinstance(model[0], nn.BatchNorm1d) and "nothing to synchronise" in said[0]
    assert type(no_sync(model)).__name__ == "nullcontext"
    assert Precision("fp32", torch.device("cpu")).prepare(model) is model


def compiled_frames() -> dict:
    """What dynamo did since the last counters.clear(): frames seen/compiled, graphs, graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "frames": dict(counters["frames"]),
        "graphs": counters["stats"]["unique_graphs"],
        "backward": counters["aot_autograd"]["ok"],
        "breaks": sum(counters["graph_break"].values()),
    }


def assert_ran_compiled(seen: dict) -> None:
    """The model went through torch.compile (not a silent eager fallback): every frame dynamo saw
    compiled, forward and backward graphs exist, no graph breaks."""
    assert seen["frames"].get("ok", 0) >= 1 and seen["frames"].get("ok") == seen["frames"].get("total"), seen
    assert seen["graphs"] >= 1 and seen["backward"] >= 1 and seen["breaks"] == 0, seen


def test_compile_trains_like_eager(tmp_path):
    """speed.compile (aot_eager backend: dynamo + AOT autograd, no C++ build, seconds not minutes)."""
    from torch._dynamo.utils import counters

    over = [*TINY, "model.name=linear"]
    train(config.load(None, [*over, f"run.dir={tmp_path / 'eager'}"]), quiet=True)
    torch._dynamo.reset()  # frames compiled by earlier tests in this process would not be counted again
    counters.clear()
    train(
        config.load(
            None, [*over, "speed.compile=true", "speed.compile_backend=aot_eager", f"run.dir={tmp_path / 'compiled'}"]
        ),
        quiet=True,
    )
    assert_ran_compiled(compiled_frames())
    eager, compiled = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("eager", "compiled"))
    assert eager.keys() == compiled.keys()  # `_orig_mod.` stripped
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-6)


def test_channels_last_reaches_model_and_inputs_and_trains_like_contiguous(tmp_path):
    cfg = config.load(None, ["speed.channels_last=true"])
    net = nn.Sequential(nn.Conv2d(1, 4, 3))
    model = wrap_model(net, cfg.strategy, CPU_RT, speed=decide_speed(cfg.speed, cfg.strategy, net, CPU_RT.device))
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    over = [*TINY, "model.args.width=8"]
    train(config.load(None, [*over, "speed.channels_last=false", f"run.dir={tmp_path / 'nchw'}"]), quiet=True)
    train(config.load(None, [*over, "speed.channels_last=true", f"run.dir={tmp_path / 'nhwc'}"]), quiet=True)
    train(config.load(None, [*over, f"run.dir={tmp_path / 'auto'}"]), quiet=True)  # the default: the model in NHWC
    a, b, c = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("nchw", "nhwc", "auto"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c[k], a[k], rtol=1e-4, atol=1e-5)


def test_unwrap_sees_through_every_wrapper():
    net = nn.Linear(2, 2)
    prec = Precision("bf16", torch.device("cpu"))
    wrapped = torch.compile(nn.DataParallel(prec.prepare(net)), backend="eager")
    assert unwrap(wrapped) is net


def test_cuda_graph_compile_modes_with_accumulation_are_refused():
    """CUDA-graph trees reuse static outputs between replays; accumulated gradients are such outputs."""
    for mode in ("reduce-overhead", "max-autotune"):
        cfg = config.load(None, ["speed.compile=true", f"speed.compile_mode={mode}"])
        with pytest.raises(UsageError, match="optim.accum_steps=4"):
            check_speed(cfg.speed, cfg.strategy, torch.device("cuda"), accum_steps=4)
        check_speed(cfg.speed, cfg.strategy, torch.device("cpu"), accum_steps=4)  # no CUDA graphs on CPU
    cfg = config.load(None, ["speed.compile=true", "speed.compile_mode=max-autotune-no-cudagraphs"])
    check_speed(cfg.speed, cfg.strategy, torch.device("cpu"), accum_steps=4)


@pytest.mark.gpu
def test_cuda_graphs_train_like_eager(tmp_path):
    over = [*TINY, "model.args.width=8", "data.drop_last=true"]
    train(config.load(None, [*over, f"run.dir={tmp_path / 'eager'}"]), quiet=True)
    train(config.load(None, [*over, "speed.cuda_graphs=true", f"run.dir={tmp_path / 'graphed'}"]), quiet=True)
    a, b = (load_file(str(tmp_path / n / "last.safetensors")) for n in ("eager", "graphed"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_dp_says_ddp_is_faster(tmp_path, capsys):
    train(config.load(None, [*TINY, "model.args.width=8", "strategy=dp", f"run.dir={tmp_path}"]))
    assert "DDP runs one process per GPU" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "switch", [["precision=amp_fp16"], ["precision=amp_bf16"], ["speed.channels_last=true"], ["speed.compile=true"]]
)
def test_speed_switches_train_on_gpu(tmp_path, switch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    summary = train(config.load(None, [*switch, f"run.dir={tmp_path}", "log.tensorboard=false"]), quiet=True)
    assert summary["final"]["val/top1"] >= 0.98
    if switch == ["speed.compile=true"]:
        assert_ran_compiled(compiled_frames())  # not a silent eager fallback


def test_lost_peer_line_only_for_communication_failures(monkeypatch):
    """A DDP worker whose peer died prints one line naming it; other errors keep their traceback."""
    import torch.distributed as dist

    from torchsprint.runtime.core import lost_peer

    gloo_reset = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:27843: "
        "Connection reset by peer. This is typically caused by a remote worker hanging"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line = lost_peer(gloo_reset)
    assert (
        line.startswith("DDP rank 1 of 2 lost contact with the group (another rank's connection closed")
        and "\n" not in line
    )
    hung = lost_peer(dist.DistBackendError("[Rank 1] Watchdog caught collective operation timeout"))
    assert "did not answer within strategy.timeout_s" in hung
    assert lost_peer(RuntimeError("DataLoader worker (pid 12) timed out after 5 seconds")) is None  # not a peer
    assert lost_peer(ValueError("bad value")) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_peer(gloo_reset) is None  # one process: there is no group to lose

"""env.json and bench.json record the CPU a figure came from: its model, cores, the instruction sets that change
PyTorch's speed and numbers, the kernels PyTorch picked, its threads. Checked against `lscpu` and against PyTorch in
another process with other kernels forced (ATEN_CPU_CAPABILITY=default): a record filled from a constant, from the
wrong processor line or from this process instead of the run's fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from torchsprint.runtime.machine import cpu_text, native_bf16


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
@pytest.mark.skipif(shutil.which("lscpu") is None, reason="needs lscpu (util-linux)")
def test_env_json_records_the_cpu_as_lscpu_and_the_run_s_pytorch_see_it(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(__import__("os").environ, ATEN_CPU_CAPABILITY="default")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchsprint",
            "train",
            "run.epochs=1",
            "model.args={width: 4}",
            "log.tensorboard=false",
            "log.progress=false",
            f"run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cpu = json.loads((run_dir / "env.json").read_text())["cpu"]
    ref = lscpu()
    flags = set(ref.get("Flags", "").split())
    assert cpu["model"] == ref["Model name"]
    assert cpu["logical_cores"] == int(ref["CPU(s)"])
    assert cpu["flags"] == {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}
    assert cpu["native_bf16"] == ("avx512_bf16" in flags or "amx_bf16" in flags)
    # The run's own kernels (forced to the portable ones in its process), not this test process's.
    assert cpu["torch_cpu_capability"] == "DEFAULT" and cpu["aten_cpu_capability_env"] == "default"
    assert cpu["torch_threads"] >= 1 and cpu["usable_cores"] >= 1
    assert cpu["model"] in cpu_text(cpu) and "PyTorch kernels DEFAULT" in cpu_text(cpu)


def test_native_bf16_needs_the_instructions_not_just_avx512():
    assert not native_bf16(frozenset({"avx2", "avx512f", "avx512bw"}))  # AVX-512 without BF16: bf16 is emulated
    assert native_bf16(frozenset({"avx512f", "avx512_bf16"})) and native_bf16(frozenset({"amx_bf16", "amx_tile"}))

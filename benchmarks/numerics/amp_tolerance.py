"""How far amp_bf16 lands from fp32 on the tiny task runs of tests/e2e/tasks/test_task_everything.py, across seeds and
CPU kernels (the runs: common/task_runs.py, a copy a test holds equal to the test's).

The test's tolerance (AMP_TOL) must hold on any machine: this script measures |bf16 - fp32| of the monitored metric per
seed, and the seed-to-seed spread of each precision, in one process per (kernel, seed) so ATEN_CPU_CAPABILITY applies.

    python -m benchmarks.numerics.amp_tolerance --seeds 0,1,2,3,4 --kernels default,avx2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common.child import child_env
from benchmarks.common.task_runs import MONITOR, amp_overrides


def one(task: str, seed: int, data: Path, out: Path) -> dict:
    """Both precisions of one task and seed in this process: {precision: metric}."""
    from torchsprint import config
    from torchsprint.train.run import train

    got = {}
    for prec in ("fp32", "amp_bf16"):
        over = amp_overrides(task, data, out / f"{task}-{seed}-{prec}") + [f"precision={prec}", f"run.seed={seed}"]
        got[prec] = train(config.load(None, over), quiet=True)["final"][MONITOR[task]]
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--kernels", default="default,avx2")
    ap.add_argument("--tasks", default="multilabel,image_to_image,video")
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=4, metavar=("TASK", "SEED", "DATA", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), Path(a.one[2]), Path(a.one[3]))))
        return
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in a.kernels.split(","):
            for task in a.tasks.split(","):
                for seed in map(int, a.seeds.split(",")):
                    env = child_env({"ATEN_CPU_CAPABILITY": kernel})
                    p = subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            __spec__.name,
                            "--one",
                            task,
                            str(seed),
                            f"{tmp}/data",
                            f"{tmp}/{kernel}",
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    got = json.loads(p.stdout.strip().splitlines()[-1])
                    row = {
                        "kernel": kernel,
                        "task": task,
                        "seed": seed,
                        **got,
                        "diff": abs(got["amp_bf16"] - got["fp32"]),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = {}
    for task in a.tasks.split(","):
        r = [x for x in rows if x["task"] == task]
        summary[task] = {
            "max_diff": max(x["diff"] for x in r),
            "fp32_range": [min(x["fp32"] for x in r), max(x["fp32"] for x in r)],
            "bf16_range": [min(x["amp_bf16"] for x in r), max(x["amp_bf16"] for x in r)],
        }
    print(json.dumps(summary, indent=1))
    if a.json:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        Path(a.json).write_text(
            json.dumps({"cpu": cpu, "torch": torch.__version__, "rows": rows, "summary": summary}, indent=1)
        )


if __name__ == "__main__":
    main()

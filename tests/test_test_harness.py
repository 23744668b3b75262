"""The harness itself: unmarked tests run on the CPU on a GPU machine too; gpu-marked tests see the GPU.

On a CPU-only machine the first two are trivially true; on the GPU machine they prove that
run.device=auto resolves to the CPU in process and in child processes (issue 12, item 6).
"""

import os
import subprocess
import sys

import pytest
import torch

from torchsprint.runtime import resolve_device

PROBE = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"


def probe(env):
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120).stdout.split()


def test_unmarked_tests_see_no_gpu_in_process_or_in_children():
    assert not torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cpu")
    assert probe(dict(os.environ)) == ["False", "0"]  # inherits the environment
    assert probe({"PATH": os.environ.get("PATH", "")}) == ["False", "0"]  # a fresh environment


@pytest.mark.gpu
def test_gpu_marked_tests_see_the_gpu():
    assert torch.cuda.is_available() and resolve_device("auto").type == "cuda"
    assert probe(dict(os.environ))[0] == "True"
    torch.ones(1, device="cuda").add_(1)  # the CUDA context works after unmarked tests ran in this process

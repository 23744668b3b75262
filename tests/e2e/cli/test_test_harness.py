"""The harness itself: unmarked tests run on the CPU on a GPU machine too; gpu-marked tests see the GPU.

On a CPU-only machine the first two are trivially true; on the GPU machine they prove that
run.device=auto resolves to the CPU in process and in child processes.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from paths import TESTS
from torchsprint.runtime.core import resolve_device

PROBE = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"


def probe(env):
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    ).stdout.split()


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


INNER = """
import os

import pytest
import torch

SEEN = {}
# As this inner pytest started: unset on a CPU machine; "" on a GPU machine, where the outer test is unmarked
# and so starts this process with the GPU hidden (the first GPU run failed on asserting None there).
AT_START = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def reference_run():  # like test_resume.py's module-scoped uninterrupted run
    SEEN["fixture"] = (torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_unmarked_first(reference_run):
    assert SEEN["fixture"] == (False, "")


@pytest.mark.gpu
def test_marked_between():
    assert torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") == AT_START


def test_unmarked_after(reference_run):
    assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""
"""


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_the_gpu_is_hidden_before_module_scoped_fixtures_of_unmarked_tests(tmp_path):
    """A pytest run inside this one, with the harness's conftest.py and a torch that claims a GPU: a
    module-scoped fixture of an unmarked test is built with the GPU already hidden (an autouse fixture was
    too late: module-scoped fixtures come first, and test_resume.py's reference ran on CUDA), and a
    gpu-marked test between two unmarked ones sees the GPU (and the environment as the process started)."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"TORCHSPRINT_TEST_PRETEND_CUDA": "1"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
            "test_inner.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]

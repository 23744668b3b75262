#!/usr/bin/env bash
# Download, on a machine with PyPI access, exactly the wheels the GPU device machine lacks, into the
# repository's .whl/ (ignored by git; the device tool carries it with `carry: [".whl"]`).
#
#   benchmarks/gpu/fetch_wheels.sh [DEST]        # DEST defaults to <repository root>/.whl
#
# The device (see /work/.library/device/KINDS.md) has Python 3.12, torch 2.11+cu130, torchvision 0.26 and
# most of torchsprint's dependencies; it lacks pydantic (and its parts), simplejpeg, PyAV and webdataset
# (fetched with its small dependency braceexpand); pydantic
# needs typing-extensions >= 4.16, newer than the device may have (the copy in .whl shadows it). DALI is not
# fetched: its CUDA 13 wheel (nvidia-dali-cuda130 2.4.0) is 190 MiB, over the 64 MiB a call can carry.
# Versions are those of the Python that runs the tests here (VENV_PY), so the device runs what CI runs.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
DEST=${1:-$ROOT/.whl}
VENV_PY=${VENV_PY:-/work/main/.venv/bin/python}
PKGS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions simplejpeg av webdataset braceexpand)

version() { "$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

mkdir -p "$DEST"
# .gitignore has /.whl/: the wheels stay out of git, and the device tool carries ignored paths named in `carry`.
rm -f "$DEST"/*.whl
for pkg in "${PKGS[@]}"; do
  v=$(version "$pkg")
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$pkg==$v"
done
ls -la "$DEST"
du -ch "$DEST"/*.whl | tail -1

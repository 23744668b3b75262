#!/usr/bin/env bash
# Download, on a machine with PyPI access, exactly the wheels the GPU device machine lacks, into the
# repository's .whl/ (ignored by git; the device tool carries it with `carry: [".whl"]`).
#
#   benchmarks/gpu/fetch_wheels.sh [DEST]        # DEST defaults to <repository root>/.whl
#   benchmarks/gpu/fetch_wheels.sh --dali        # also DALI, in parts .dali-1/ ... .dali-N/ (below)
#   WITH_AV=1 benchmarks/gpu/fetch_wheels.sh     # also PyAV (35 MiB: only the video tests need it; left out of
#                                                # the 15-minute window, benchmarks/gpu/window.sh)
#
# The device (see /work/.library/device/KINDS.md) has Python 3.12, torch 2.11+cu130, torchvision 0.26 and
# most of torchsprint's dependencies; it lacks pydantic (and its parts), simplejpeg, PyAV and webdataset
# (fetched with its small dependency braceexpand); pydantic
# needs typing-extensions >= 4.16, newer than the device may have (the copy in .whl shadows it).
# DALI's CUDA 13 wheel (nvidia-dali-cuda130 2.4.0) is 190 MiB and needs nvImageCodec, nvCOMP and nvJPEG (256 MiB
# of wheels), over the 64 MiB one call can carry. With --dali they are installed here for the device's Python
# and platform (pip --target), packed into one tar.xz (170 MiB) and split into parts of PART_MIB (default 60; the first smaller by .whl's size):
# carry one part per call after the first (which carries .whl); the device keeps ignored paths between calls while
# it stays warm, and run_all.sh installs DALI once every part is there (the manifest's sha256 checks them).
# Versions are those of the Python that runs the tests here (VENV_PY), so the device runs what CI runs.
set -euo pipefail
WITH_DALI=0
if [ "${1:-}" = --dali ]; then WITH_DALI=1; shift; fi
ROOT=$(git rev-parse --show-toplevel)
DEST=${1:-$ROOT/.whl}
VENV_PY=${VENV_PY:-/work/main/.venv/bin/python}
PKGS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions simplejpeg webdataset braceexpand)
[ "${WITH_AV:-0}" = 1 ] && PKGS+=(av)

PYVER=${PYVER:-3.12}  # the device's Python (KINDS.md); another only to rehearse the DALI install here
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

version() { "$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

mkdir -p "$DEST"
# .gitignore has /.whl/: the wheels stay out of git, and the device tool carries ignored paths named in `carry`.
rm -f "$DEST"/*.whl
for pkg in "${PKGS[@]}"; do
  v=$(version "$pkg")
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$pkg==$v"
done
ls -la "$DEST"
du -ch "$DEST"/*.whl | tail -1
[ "$WITH_DALI" = 1 ] || exit 0

# DALI 2.4.0 for CUDA 13 and what it requires that the device image lacks (its METADATA's Requires-Dist,
# checked against KINDS.md's package list; nvJPEG 13.0 matches the device's CUDA 13.0 driver), pinned.
DALI_PKGS=(nvidia-dali-cuda130==2.4.0 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-libnvcomp-cu13==5.3.0.16
           nvidia-nvjpeg==13.0.4.44 nvidia-nvjpeg2k-cu13==0.11.0.51 nvidia-nvtiff-cu13==0.8.0.82
           astunparse==1.6.3 gast==0.7.0 optree==0.20.0 nvtx==0.2.17 makefun==1.16.0 libcst==1.9.0 six==1.17.0)
# Part sizes for the window's three calls (benchmarks/gpu/window.sh): each call carries at most 64 MiB, the working
# tree (~1.7 MiB) included; the first call also carries .whl, so its part is that much smaller.
PART_MIB=${PART_MIB:-60}
WHL_MIB=$(( ($(du -cb "$DEST"/*.whl | tail -1 | cut -f1) + 1048575) / 1048576 ))
FIRST_PART_MIB=${FIRST_PART_MIB:-$(( PART_MIB - WHL_MIB ))}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
"$VENV_PY" -m pip install -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" --target "$STAGE/site" "${DALI_PKGS[@]}"
# An empty nvidia/__init__.py (from the nvJPEG2000 wheel) would make `nvidia` a regular package that hides the
# device's own nvidia/* namespace (torch's CUDA libraries); without it the two directories merge.
rm -f "$STAGE/site/nvidia/__init__.py"
rm -rf "$STAGE/site/bin"  # console scripts with this machine's interpreter path
XZ_LEVEL=${XZ_LEVEL:--9e}  # -9e: 170 MiB in 3.5 min on 2 cores; -1 (rehearsals): larger, seconds
echo "packing DALI ($(du -sh "$STAGE/site" | cut -f1) installed) with xz $XZ_LEVEL"
tar -C "$STAGE/site" -cf - . | xz -T0 "$XZ_LEVEL" >"$STAGE/dali.tar.xz"
SHA=$(sha256sum "$STAGE/dali.tar.xz" | cut -d' ' -f1)
rm -rf "$ROOT"/.dali-*
head -c "${FIRST_PART_MIB}M" "$STAGE/dali.tar.xz" >"$STAGE/part.00"
tail -c +"$(( FIRST_PART_MIB * 1048576 + 1 ))" "$STAGE/dali.tar.xz" | split -b "${PART_MIB}M" -d -a 2 - "$STAGE/part.r"
n=0
for f in "$STAGE"/part.*; do
  n=$((n + 1))
  mkdir -p "$ROOT/.dali-$n"
  mv "$f" "$ROOT/.dali-$n/part"
done
for k in $(seq 1 "$n"); do
  printf 'PARTS=%s\nSHA256=%s\nPYVER=%s\nPACKAGES="%s"\n' "$n" "$SHA" "$PYVER" "${DALI_PKGS[*]}" >"$ROOT/.dali-$k/manifest"
done
du -sh "$ROOT"/.dali-*
echo "DALI in $n parts (the first $FIRST_PART_MIB MiB at most, the others $PART_MIB): call K of the window carries .dali-K,"
echo "the first one with .whl (64 MiB a call); bash benchmarks/gpu/window.sh check says whether each call fits"

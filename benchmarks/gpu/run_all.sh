#!/usr/bin/env bash
# The whole GPU job on a fresh device machine (Python 3.12, torch 2.11+cu130, torchvision 0.26,
# no internet), in parts that each fit one 10-minute call of the device tool:
#
#   benchmarks/gpu/run_all.sh tests suite          # gpu/dali-marked tests (4 processes), then the rest (~6 min)
#   benchmarks/gpu/run_all.sh bench M1,M4,M6       # model-only, memory backend, predict (~7 min)
#   benchmarks/gpu/run_all.sh bench M2,M3,M5       # loaders, end to end, torchsprint bench (~8 min)
#   benchmarks/gpu/run_all.sh recipes              # the recipe switches' costs on the memory and gpu backends (~5 min)
#   benchmarks/gpu/run_all.sh dali                 # DALI's tests, loader rate and end to end (~4 min), once the
#                                                  # .dali-* parts (fetch_wheels.sh --dali) have all been carried
#   benchmarks/gpu/run_all.sh all                  # everything in one go (a machine without the call limit)
#
# DALI does not fit one call (170 MiB packed): fetch_wheels.sh --dali splits it into .dali-1 ... .dali-N; carry one
# part per call after the first, back to back (the machine keeps ignored paths between calls while warm, and
# goes back after 30 s idle); each call's setup installs DALI once all parts are there and says which are missing.
#
# Each call first installs what the machine lacks from .whl/ (benchmarks/gpu/fetch_wheels.sh made it; carry
# it with the call: carry [".whl"]) and the project itself (pip --no-deps on top of the machine's torch),
# and prints versions and the GPU. Everything lands in $OUT (the device tool's output folder; ./gpu-out
# elsewhere), at most 8 files: env.txt, run.log, results.json (this call's part of the results; merge the
# parts with benchmarks/gpu/merge_results.py), tests_gpu.log, suite.log, figures.jsonl (numbers the tests
# measured, for their tolerances), m2_profile.txt, m6_predict.json / m5_*.log, tests_dali.log.
#
# Environment: DEADLINE (seconds a bench call may start measurements, default 480), SUITE_MARKS (pytest -m
# for the suite, default "not gpu and not dali": the gpu tests ran just before), QUICK=1 (small sizes),
# SMOKE=1 (measure.py --smoke-cpu: the bench parts' code on the CPU, tiny sizes; a rehearsal without a GPU),
# PREVIOUS (an earlier call's results.json, read by M3; the results of earlier calls on the same warm machine
# are kept in gpu-out/previous/ and read without it), GPU_WORKERS (pytest-xdist processes for the gpu tests,
# default 4), WHEELS (the wheels to install, default .whl/), DALI_PARTS / DALI_SITE (where the .dali-* parts
# are, default the repository root, and where DALI is unpacked, default /tmp/site-dali), NO_INSTALL=1 (use
# PYTHONPATH=src only: a dry run on a machine whose Python must not be changed).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "${RUN_LOG:-$OUT/run.log}") 2>&1  # window.sh keeps its own log instead (RUN_LOG)
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
T0=$(date +%s)

setup() {
  echo "== setup $(date -u +%FT%TZ)"
  local wheels=${WHEELS:-$REPO/.whl}
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    # Once per machine: a later call of the same window (window.sh) finds them installed (10-15 s saved a call).
    local stamp; stamp=$(ls -l "$wheels"/*.whl | md5sum | cut -d' ' -f1)
    if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
        || { echo "installing .whl/ failed"; exit 3; }
      echo "$stamp" >/tmp/site/.wheels
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "no .whl/ here: pydantic, simplejpeg and av must already be installed (benchmarks/gpu/fetch_wheels.sh)"
  fi
  if [ "${NO_INSTALL:-0}" != 1 ] && [ ! -f /tmp/.torchsprint-editable ]; then  # once per machine
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
      && touch /tmp/.torchsprint-editable || echo "pip install -e . failed; using PYTHONPATH=src"
  fi
  install_dali
  export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PY" - <<'PYEOF'
import importlib.metadata as m, platform, torch, torchvision
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version(), "| torchvision", torchvision.__version__)
print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE",
      "| capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else "-")
for p in ("torchsprint", "pydantic", "simplejpeg", "av", "onnxruntime", "onnxruntime-gpu", "timm", "triton",
          "nvidia-dali-cuda130", "tensorrt", "pytest", "pytest-xdist"):
    try:
        print(f"  {p} {m.version(p)}")
    except m.PackageNotFoundError:
        print(f"  {p} not installed")
import re, tomllib
meta = tomllib.loads(open("pyproject.toml", "rb").read().decode())["project"]
missing = []
for req in meta["dependencies"] + meta["optional-dependencies"]["dev"]:
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
    if ";" in req and "python_version < '3.11'" in req:
        continue
    try:
        m.version(name)
    except m.PackageNotFoundError:
        missing.append(name)
print("declared dependencies missing here:", missing or "none")
import torchsprint.data.backends.dali as d
print("DALI importable:", d.dali_available())
PYEOF
  } | tee "$OUT/env.txt"
}

DALI_READY=""
install_dali() {  # the .dali-K/part files (fetch_wheels.sh --dali), once all are here, into $DALI_SITE
  local parts=${DALI_PARTS:-$REPO} site=${DALI_SITE:-/tmp/site-dali} manifest here
  manifest=$(ls "$parts"/.dali-*/manifest 2>/dev/null | head -1)
  [ -n "$manifest" ] || { echo "DALI: no .dali-* parts here (benchmarks/gpu/fetch_wheels.sh --dali)"; return 0; }
  local PARTS SHA256 PYVER PACKAGES k missing="" files=()
  . "$manifest"
  here=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$PYVER" != "$here" ]; then
    echo "DALI: the parts were packed for Python $PYVER, this is $here (PYVER=$here fetch_wheels.sh --dali); not installed"
    return 0
  fi
  for k in $(seq 1 "$PARTS"); do
    if [ -f "$parts/.dali-$k/part" ]; then files+=("$parts/.dali-$k/part"); else missing="$missing .dali-$k"; fi
  done
  if [ -n "$missing" ]; then
    echo "DALI: ${#files[@]} of $PARTS parts here; carry$missing in the next calls (not installed yet)"
    return 0
  fi
  if [ "$(cat "$site/.sha256" 2>/dev/null)" != "$SHA256" ]; then
    if [ "$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)" != "$SHA256" ]; then
      echo "DALI: the parts do not match their manifest's sha256 (from two runs of fetch_wheels.sh?); not installed"
      return 0
    fi
    rm -rf "$site" && mkdir -p "$site"
    cat "${files[@]}" | xz -d -T0 | tar -x -C "$site" || { echo "DALI: unpacking failed"; return 0; }
    echo "$SHA256" >"$site/.sha256"
    echo "DALI: unpacked $PARTS parts ($PACKAGES) into $site"
  fi
  DALI_READY=$site
  echo "DALI: ready in $site (on the path of the dali part only: its packages, optree for one, stay out of the rest)"
}

summarise() {  # summarise <name> <junit xml>: counts and failures into results.json's "tests"
  "$PY" - "$1" "$2" "$OUT/results.json" "$OUT/figures.jsonl" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
name, xml, out, figs = sys.argv[1:]
res = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
t = {"passed": 0, "failed": [], "skipped": [], "errors": []}
if Path(xml).is_file():
    for case in ET.parse(xml).getroot().iter("testcase"):
        nid = f"{case.get('classname')}::{case.get('name')}"
        kinds = {c.tag for c in case}
        if "failure" in kinds:
            t["failed"].append({"test": nid, "message": (case.find("failure").get("message") or "")[:400]})
        elif "error" in kinds:
            t["errors"].append({"test": nid, "message": (case.find("error").get("message") or "")[:400]})
        elif "skipped" in kinds:
            t["skipped"].append({"test": nid, "reason": (case.find("skipped").get("message") or "")[:200]})
        else:
            t["passed"] += 1
res.setdefault("tests", {})[name] = t
if Path(figs).is_file():
    res["figures"] = [json.loads(l) for l in Path(figs).read_text().splitlines() if l.strip()]
Path(out).write_text(json.dumps(res, indent=1))
print(f"{name}: {t['passed']} passed, {len(t['failed'])} failed, {len(t['errors'])} errors, {len(t['skipped'])} skipped")
PYEOF
}

# A test that hangs must not eat the call: pytest-timeout (on the device image) stops it after 300 s.
TIMEOUT_OPT=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout=300")

run_tests() {  # the gpu tests are small: GPU_WORKERS processes share the GPU (default 4)
  echo "== gpu-marked tests $(date -u +%T)"
  TORCHSPRINT_FIGURES=$OUT/figures.jsonl "$PY" -m pytest -m "gpu or dali" -n "${GPU_WORKERS:-4}" -v -rA -p no:cacheprovider \
    --durations=25 $TIMEOUT_OPT --junitxml=/tmp/tests_gpu.xml tests 2>&1 | tee "$OUT/tests_gpu.log" | tail -60
  summarise gpu /tmp/tests_gpu.xml
}

run_suite() {
  echo "== suite ($SUITE_MARKS) $(date -u +%T)"
  local n=$(( $(nproc) / 2 )); [ "$n" -gt 8 ] && n=8
  "$PY" -m pytest -m "$SUITE_MARKS" -n "$n" -q -rfE -p no:cacheprovider --durations=15 $TIMEOUT_OPT \
    --junitxml=/tmp/suite.xml tests 2>&1 | tee "$OUT/suite.log" | tail -40
  summarise suite /tmp/suite.xml
}

# Results of earlier calls on this machine: the repository's ignored paths stay between calls while it is warm,
# so M3 finds M1's figures from the call before without a PREVIOUS (or measures its own reference, 4 minutes).
HISTORY=$REPO/gpu-out/previous

measure() {  # measure <measure.py arguments>: this call's results plus every earlier call's as --previous
  local prev=() f
  for f in "$HISTORY"/*.json ${PREVIOUS:-}; do [ -f "$f" ] && prev+=(--previous "$f"); done
  "$PY" -m benchmarks.gpu.measure --out "$OUT/results.json" "${prev[@]}" "$@"
  mkdir -p "$HISTORY" && [ -f "$OUT/results.json" ] && cp "$OUT/results.json" "$HISTORY/$(date +%s%N).json"
}

run_bench() {
  echo "== measurements $1 $(date -u +%T)"
  local quick=""; [ "${QUICK:-0}" = 1 ] && quick="--quick"; [ "${SMOKE:-0}" = 1 ] && quick="--smoke-cpu"
  measure --only "$1" --deadline-s "${DEADLINE:-480}" $quick
}

run_recipes() {  # what each recipe switch costs per backend on the GPU (the CPU figures are in BENCHMARKS.md)
  echo "== recipe switch costs $(date -u +%T)"
  timeout 280 "$PY" -m benchmarks.recipes.recipe_costs --backends memory,gpu --repeats 3 --steps 100 --root /tmp/recipe-costs \
    2>&1 | tee "$OUT/recipes_gpu.log" | tail -12
  timeout 280 "$PY" -m benchmarks.recipes.aug_cost --backends memory,gpu --repeats 3 --steps 50 --warmup 5 --root /tmp/aug-bench \
    2>&1 | tee -a "$OUT/recipes_gpu.log" | tail -12
}

run_dali() (  # DALI's own tests (the CPU-graph ones skip where DALI is missing, so they run here too) and figures
  echo "== DALI $(date -u +%T)"
  if [ -n "$DALI_READY" ]; then  # a subshell: the path changes end with this part
    export PYTHONPATH=$PYTHONPATH:$DALI_READY
    # nvImageCodec's nvJPEG (nvidia-nvjpeg 13.0) and nvCOMP, wherever DALI's loader looks for them
    export LD_LIBRARY_PATH=$DALI_READY/nvidia/cu13/lib:$DALI_READY/nvidia/libnvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  if ! "$PY" -c "import nvidia.dali as d; print('DALI', d.__version__)"; then
    echo "DALI does not import: carry every .dali-K part (see setup above), or see the error"
    return 0
  fi
  TORCHSPRINT_FIGURES=$OUT/figures.jsonl "$PY" -m pytest -n 2 -v -rA -p no:cacheprovider $TIMEOUT_OPT \
    --junitxml=/tmp/tests_dali.xml tests -k dali 2>&1 | tee "$OUT/tests_dali.log" | tail -40
  summarise dali /tmp/tests_dali.xml
  measure --only M2,M3 --backends dali --deadline-s "${DEADLINE:-420}"
)

SUITE_MARKS=${SUITE_MARKS:-not gpu and not dali}
[ $# -eq 0 ] && set -- all
setup
while [ $# -gt 0 ]; do
  case "$1" in
    tests) run_tests ;;
    suite) run_suite ;;
    bench)
      list=M1,M2,M3,M4,M5,M6
      if [ $# -gt 1 ] && [[ "$2" == M* ]]; then list=$2; shift; fi
      run_bench "$list" ;;
    recipes) run_recipes ;;
    dali) run_dali ;;
    setup) ;;  # only the install and the versions (setup ran above)
    all) run_tests; SUITE_MARKS="not gpu and not dali" run_suite; DEADLINE=${DEADLINE:-3600} run_bench M1,M2,M3,M4,M5,M6
         run_recipes; run_dali ;;
    *) echo "unknown part '$1': use setup, tests, suite, bench [M1,...], recipes, dali, all"; exit 2 ;;
  esac
  shift
done
echo "== done in $(( $(date +%s) - T0 )) s; outputs: $(ls "$OUT" | tr '\n' ' ')"

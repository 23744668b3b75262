#!/usr/bin/env bash
# The GPU job in one 15-minute device window: three calls of the device tool, back to back, each
# `bash benchmarks/gpu/window.sh K` from the repository root, carrying what the table says. BENCHMARKS.md ("GPU job:
# the plan") has the commands, the time budget per part and what to drop first.
#
#   call 1  carry [".whl", ".dali-1"]  setup; gpu tests (+ test_test_harness) with the JPEGs generated beside them; M1
#   call 2  carry [".dali-2"]          M3 + M2 (gpu, cpu, split auto); M6; M5 on the 224-px JPEG config
#   call 3  carry [".dali-3"]          DALI (installed from the 3 parts): its tests, M2/M3 with DALI; M4; merge
#   here, before the window:  bash benchmarks/gpu/window.sh check    (each call's carry against the 64 MiB limit)
#   DALI in a window of its own (window B):  calls `window.sh carry` with .whl + .dali-1, then .dali-2, then
#                                            `window.sh dali-alone` with .dali-3 (DALI beside the gpu backend; merge)
#
# Every part runs in its own process group with a hard time limit (`bounded`, from the script of the first GPU run),
# and every limit is also cut to what is left of the window: call 1 writes the window's start to gpu-out/window_t0
# (the machine keeps the repository's ignored paths between calls while it stays warm), and a part starts only if
# the window still holds its minimum plus what the later, more important parts reserve. Each part writes its
# figures as it goes ($OUT/results.json, rewritten after each measurement, copied to gpu-out/previous/ after each
# part), so a killed part keeps what it measured; `merge` (end of call 3) merges every call's results into
# $OUT/merged.json: the file to commit as benchmarks/results/measure_<device>_<date>.json.
#
# Environment: OUT (the device tool's output folder; gpu-out/out elsewhere), PY, WINDOW_S (seconds from call 1's
# start to the end of the last call, default 780: 15 minutes less the machine's start, the transfers and the gaps),
# SMOKE=1 (a rehearsal on a CPU machine: measure.py --smoke-cpu, tiny sizes, short limits), GPU_WORKERS (default 4).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
STATE=$REPO/gpu-out                      # ignored by git; kept on the device between the window's calls
OUT=${OUT:-$STATE/out}
PY=${PY:-python3}
mkdir -p "$OUT" "$STATE/previous"
export PYTHONUNBUFFERED=1
SMOKE=${SMOKE:-0}
DATA=${DATA:-/tmp/torchsprint-m2}
WINDOW_S=${WINDOW_S:-780}

if [ "${1:-}" = check ]; then  # here, before the window: what each call carries, against the device tool's 64 MiB
  "$PY" - <<'PYEOF'
import subprocess
from pathlib import Path
MIB = 2**20
def size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else (p.stat().st_size if p.exists() else 0)
files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, text=True).stdout
tree = sum(Path(f).stat().st_size for f in files.split("\0") if f and Path(f).is_file())
bad = False
print(f"working tree (tracked and untracked-not-ignored files): {tree / MIB:.1f} MiB")
for k, carry in ((1, [".whl", ".dali-1"]), (2, [".dali-2"]), (3, [".dali-3"])):
    there = [c for c in carry if Path(c).exists()]
    total = tree + sum(size(Path(c)) for c in there)
    bad |= total > 64 * MIB
    print(f"call {k}: carry {there} -> {total / MIB:.1f} MiB of 64 {'OVER' if total > 64 * MIB else 'ok'}"
          + ("" if there == carry else f" (missing here: {sorted(set(carry) - set(there))})"))
extra = sorted(str(p) for p in Path(".").glob(".dali-*") if p.name not in (".dali-1", ".dali-2", ".dali-3"))
if extra:
    print(f"DALI packed into more than 3 parts ({extra}): it does not fit this window; see BENCHMARKS.md (window B)")
    bad = True
if not Path(".whl").is_dir():
    print("no .whl here: run benchmarks/gpu/fetch_wheels.sh first (pydantic, simplejpeg, webdataset: ~3.2 MiB)")
    bad = True
raise SystemExit(1 if bad else 0)
PYEOF
  exit $?
fi

exec > >(tee -a "$OUT/call.log") 2>&1
[ "${1:-}" = 1 ] || [ ! -f "$STATE/window_t0" ] && date +%s >"$STATE/window_t0"
T0=$(cat "$STATE/window_t0")
left() { echo $(( T0 + WINDOW_S - $(date +%s) )); }
el() { echo "[window $(( $(date +%s) - T0 )) s]"; }
echo "== window.sh $* $(el); revision $(git rev-parse HEAD 2>/dev/null || cat REVISION 2>/dev/null)"

bounded() {  # bounded SECONDS cmd...: cmd in its own process group, the whole group killed at the limit
  local lim=$1; shift
  setsid "$@" &
  local pid=$!
  (  # the watcher holds no copy of the call's output (a lingering sleep would keep the call open)
    exec >/dev/null 2>&1
    trap 'kill "$sp"; exit 0' TERM
    sleep "$lim" & sp=$!; wait "$sp"
    kill -TERM -- "-$pid"; sleep 5; kill -KILL -- "-$pid"
  ) &
  local w=$!
  wait "$pid"; local rc=$?
  kill "$w" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null  # stragglers (xdist workers, loader workers)
  echo "$(el) exit $rc (limit $lim s)"
  return 0
}

LIM=0
budget() {  # budget NAME LIMIT MIN RESERVE: sets LIM = min(LIMIT, window left - RESERVE); false (part skipped) under MIN
  local name=$1 limit=$2 min=$3 reserve=$4 l
  if [ "$SMOKE" = 1 ]; then limit=$(( limit < 240 ? limit : 240 )); fi
  l=$(( $(left) - reserve ))
  LIM=$(( limit < l ? limit : l ))
  if [ "$LIM" -lt "$min" ]; then
    echo "== $name $(el): SKIPPED, the window has $(left) s left ($reserve s reserved for later parts, $min s needed)"
    return 1
  fi
  echo "== $name $(el): limit $LIM s"
}

keep() { [ -f "$OUT/results.json" ] && cp "$OUT/results.json" "$STATE/previous/call$CALL.json"; }

SMOKEARG=(); [ "$SMOKE" = 1 ] && SMOKEARG=(--smoke-cpu)
measure() {  # measure LIMIT ARGS...: measure.py bounded, its own deadline 10 s inside the limit
  local lim=$1 prev=() f; shift
  for f in "$STATE"/previous/*.json; do [ -f "$f" ] && [ "$f" != "$STATE/previous/call$CALL.json" ] && prev+=(--previous "$f"); done
  bounded "$lim" "$PY" -m benchmarks.gpu.measure --out "$OUT/results.json" --data "$DATA" --deadline-s $(( lim - 10 )) \
    "${prev[@]}" "${SMOKEARG[@]}" "$@"
  keep
}

setup() {  # run_all.sh's setup: wheels (once per machine), the project, versions -> $OUT/env.txt; DALI once all parts are here
  budget setup 90 20 0 || return 0
  OUT=$STATE/setup RUN_LOG=$STATE/run_all.log NO_INSTALL=${NO_INSTALL:-0} bounded "$LIM" bash benchmarks/gpu/run_all.sh setup
  cp "$STATE/setup/env.txt" "$OUT/env.txt" 2>/dev/null
  : >"$STATE/run_all.log"
}
export PYTHONPATH=/tmp/site:$REPO/src${PYTHONPATH:+:$PYTHONPATH}

tests() {  # gpu- and dali-marked tests (run_all.sh tests: 4 processes, junit summary into results.json), with the
           # JPEGs generated beside them on the cores the tests leave; then the unmarked test that failed on the GPU
  local gen=""
  budget "JPEG generation (background)" 150 30 0 && {
    bounded "$LIM" "$PY" -m benchmarks.gpu.measure --make-data $(( $(nproc) > 6 ? $(nproc) - ${GPU_WORKERS:-4} : 1 )) \
      --data "$DATA" "${SMOKEARG[@]}" & gen=$!; }
  if budget "gpu tests" 150 40 340; then  # reserve: M1 60 and what M1 reserves
    if [ "$SMOKE" = 1 ]; then  # no GPU: the gpu tests only collected (they would skip), as call_example.sh rehearsed
      bounded "$LIM" "$PY" -m pytest -m "gpu or dali" --collect-only -q -p no:cacheprovider tests >"$OUT/tests_gpu.log" 2>&1
      tail -1 "$OUT/tests_gpu.log"
    else
      OUT=$OUT RUN_LOG=$STATE/run_all.log bounded "$LIM" bash benchmarks/gpu/run_all.sh tests
      grep -E "passed|failed" "$STATE/run_all.log" | tail -3
      bounded 40 "$PY" -m pytest -q -p no:cacheprovider -n 0 tests/e2e/cli/test_test_harness.py 2>&1 | tail -3
    fi
  fi
  keep
  [ -n "$gen" ] && wait "$gen"
}

dali_part() {  # DALI's tests and M2/M3 with DALI (backends: "dali", or "gpu,dali" in a window of its own)
  local site=${DALI_SITE:-/tmp/site-dali}
  if [ ! -f "$site/.sha256" ]; then
    echo "== DALI $(el): not installed (setup above says which .dali-K parts are missing); M2/M3 with DALI not measured"
    return 0
  fi
  (
    export PYTHONPATH=$PYTHONPATH:$site  # (a subshell: DALI's packages, optree for one, stay out of the other parts)
    export LD_LIBRARY_PATH=$site/nvidia/cu13/lib:$site/nvidia/libnvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    if budget "DALI tests" 60 20 70; then  # reserve: M2/M3 with DALI 60, merge
      TORCHSPRINT_FIGURES=$OUT/figures.jsonl bounded "$LIM" "$PY" -m pytest -n 2 -q -rA -p no:cacheprovider \
        tests/e2e/gpu/test_data_dali.py tests/e2e/data/test_data_backends.py tests/e2e/gpu/test_gpu.py -k dali >"$OUT/tests_dali.log" 2>&1
      tail -3 "$OUT/tests_dali.log"
    fi
    budget "M2/M3 with DALI" 120 60 10 && measure "$LIM" --only M2,M3 --backends "$1"
  )
}

CALL=0
[ $# -eq 0 ] && { echo "usage: window.sh check | 1 | 2 | 3 | carry | dali-alone | PART... (parts: setup tests m1 m23 m6 m5 m4 dali suite merge)"; exit 2; }
for arg in "$@"; do
  case "$arg" in
    1) CALL=1; set -- setup tests m1 ;;
    2) CALL=2; set -- setup m23 m6 m5 ;;
    3) CALL=3; set -- setup dali m4 merge ;;
    carry) CALL=0; set -- setup ;;
    dali-alone) CALL=3; set -- setup dali-alone merge ;;
    *) set -- "$arg" ;;
  esac
  for part in "$@"; do
    case "$part" in
      setup) setup ;;
      tests) tests ;;
      # budget PART LIMIT MIN RESERVE; the figures behind them: BENCHMARKS.md's budget table. Priority: tests, M1,
      # M3/M2, M6, DALI, then M5 and M4 (measured before; they take what is left). RESERVE = the minimum of every
      # later part ranked above, plus the gaps between calls (30 s each) and call 3's setup with DALI's unpacking.
      m1) budget M1 270 60 280 && measure "$LIM" --only M1 ;;
      m23) budget "M3 + M2 (gpu, cpu, split)" 130 60 200 && measure "$LIM" --only M3,M2 --backends cpu,gpu ;;
      m6) budget M6 90 60 170 && measure "$LIM" --only M6 ;;
      m5) budget "M5 (224-px JPEG config)" 200 60 160 && measure "$LIM" --only M5 --m5-configs "jpeg 224" ;;
      dali) dali_part dali ;;
      dali-alone) dali_part gpu,dali ;;
      m4) budget M4 60 45 5 && measure "$LIM" --only M4 ;;
      suite)  # the unmarked suite (run_all.sh suite, -n nproc/2): ~150 s estimated, not in window A's budget
        budget suite 300 120 15 && OUT=$OUT RUN_LOG=$STATE/run_all.log bounded "$LIM" bash benchmarks/gpu/run_all.sh suite
        grep -E "^suite:" "$STATE/run_all.log" | tail -1; keep ;;
      merge)
        "$PY" -m benchmarks.gpu.merge_results "$STATE"/previous/call*.json -o "$OUT/merged.json" \
          && echo "$(el) merged into $OUT/merged.json: commit it as benchmarks/results/measure_<device>_<date>.json" ;;
      *) echo "unknown part '$part'"; exit 2 ;;
    esac
  done
done
echo "== call $CALL done $(el), $(left) s left in the window; $OUT: $(ls "$OUT" | tr '\n' ' ')"

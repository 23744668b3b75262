#!/usr/bin/env bash
# Mutation testing of one module against its own fast tests (mutmut 3; TESTING.md has the scores).
#
#   benchmarks/tools/mutation.sh MODULE        MODULE: precision | optim | metrics | augment | checkpoint | engine
#
# Copies the working tree (tracked + untracked, not ignored) to .mutation/MODULE/ (git-ignored), appends a
# [tool.mutmut] section naming the one source file and its tests, and runs `mutmut run` there at nice 19 with
# one worker (the 2-core VMs are shared). mutmut runs, for each mutant, only the selected tests that call the
# mutated function, with -x: a killed mutant costs one failing test. Each run starts from scratch (mutmut's
# cache does not notice changed tests); MUTATION_KEEP=1 reuses .mutation/MODULE/mutants/. Prints the score
# and the survivors; `cd .mutation/MODULE && mutmut show NAME` shows one survivor's diff.
#
# Needs mutmut 3 (`pip install -e .[mutation]`). Env: PYTHON (default: python next to mutmut, or python3).
set -euo pipefail

module=${1:?usage: benchmarks/tools/mutation.sh precision|optim|metrics|augment|checkpoint|engine}
repo=$(cd "$(dirname "$0")/../.." && pwd)

# Per module: the files to mutate and the tests that exercise it (files, then an optional -k expression).
# Chosen so every mutant's test run takes seconds: no full-length training runs, no subprocess CLIs.
case "$module" in
  precision)
    src=(src/torchsprint/state/precision.py)
    tests=(tests/e2e/train/test_precision.py -k "not 98_percent and not cpu_is_refused")
    ;;
  optim)
    src=("src/torchsprint/optim/*")  # the package: mutmut only_mutate takes glob patterns
    tests=(tests/unit/optim/test_optim.py)
    ;;
  metrics)
    src=(src/torchsprint/tasks/metrics.py)
    tests=(tests/unit/tasks/test_metrics.py)
    ;;
  augment)
    src=(src/torchsprint/data/preprocess/augment.py)
    tests=(tests/unit/data/test_batch_ops.py tests/e2e/data/test_data_backends.py)
    ;;
  checkpoint)
    src=(src/torchsprint/state/checkpoint.py)
    tests=(tests/unit/state/test_checkpoint.py tests/e2e/train/test_checkpoint_runs.py -k "not two_ranks")
    ;;
  engine)
    src=(src/torchsprint/train/engine.py src/torchsprint/train/validation.py)  # the loop, and the evaluations it runs
    # test_engine_units.py: every engine function on a tiny model and 40 in-memory images (~6 s in all);
    # test_engine.py: three short real runs against a plain loop.
    tests=(tests/e2e/train/test_engine_units.py tests/e2e/train/test_engine.py)
    ;;
  *)
    echo "mutation.sh: unknown module '$module'; use precision, optim, metrics, augment, checkpoint or engine." >&2
    exit 2
    ;;
esac

mutmut=$(command -v mutmut || true)
[ -n "$mutmut" ] || mutmut="$repo/.venv/bin/mutmut"
[ -x "$mutmut" ] || mutmut=/work/main/.venv/bin/mutmut
[ -x "$mutmut" ] || { echo "mutation.sh: mutmut not found; pip install -e '.[mutation]'" >&2; exit 2; }

work="$repo/.mutation/$module"
[ "${MUTATION_KEEP:-0}" = 1 ] || rm -rf "$work/mutants"
mkdir -p "$work"
# A fresh copy of the sources and tests each time (mutmut's cache keys on function hashes, so unchanged
# functions keep their results).
(cd "$repo" && git ls-files -co --exclude-standard -z | grep -zv '^\.mutation/' | tar --null -T - -cf -) \
  | (cd "$work" && tar -xf -)

toml_list() { local out="" a; for a in "$@"; do out+="\"${a//\"/\\\"}\", "; done; echo "[${out%, }]"; }
cat >> "$work/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["src"]
only_mutate = $(toml_list "${src[@]}")
pytest_add_cli_args = ["-x", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-W", "ignore"]
pytest_add_cli_args_test_selection = $(toml_list "${tests[@]}")
process_isolation = "fork"
EOF

cd "$work"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# No PYTHONPATH: mutmut puts mutants/src first on sys.path itself (setting it breaks its test-to-function
# stats). Tests that start subprocesses would import the unmutated install: the selections avoid them.
unset PYTHONPATH
start=$(date +%s)
nice -n 19 "$mutmut" run --max-children 1 \
  > "$work/run.log" 2>&1 || { tail -30 "$work/run.log"; exit 1; }
elapsed=$(( $(date +%s) - start ))
"$mutmut" results --all true > "$work/results.txt" 2>&1 || true
killed=$(grep -c ': killed$' "$work/results.txt" || true)
total=$(grep -cE ': (killed|survived|timeout|no tests|suspicious|segfault|skipped|check was interrupted by user|caught by type check)$' "$work/results.txt" || true)
timeout=$(grep -c ': timeout$' "$work/results.txt" || true)
echo "module $module (${src[*]}): $killed killed + $timeout timeout of $total mutants in ${elapsed}s"
grep -vE ': (killed|timeout)$' "$work/results.txt" | sed 's/^/  /' || true

#!/usr/bin/env bash
# CPU test of tools/sanitizer_matrix.sh: its queue, --split case ranges, table and exit status, run against a
# fake build directory (test binaries that only answer doctest's --count) and a fake `meson` on PATH that logs
# each cell's arguments and writes the JSON log meson would. No GPU, no compute-sanitizer.
#
#   tests/tools/test_sanitizer_matrix.sh <source root>
set -euo pipefail
root="${1:-$(dirname "$0")/../..}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# The tool runs from its own tree's root (it cds there): a copy, so no .venv/bin/meson shadows the fake one.
mkdir -p "$work/tree/tools" "$work/bin" "$work/build/tests" "$work/build/meson-logs"
cp "$root/tools/sanitizer_matrix.sh" "$work/tree/tools/"
touch "$work/build/build.ninja"
count_binary() { # $1 name, $2 case count ("" for a binary that skips: no GPU)
  if [ -n "$2" ]; then
    printf '#!/bin/bash\necho "[doctest] unskipped test cases passing the current filters: %s"\n' "$2"
  else
    printf '#!/bin/bash\necho "no CUDA device: skipping (exit 77)" >&2\nexit 77\n'
  fi >"$work/build/tests/test_$1"
  chmod +x "$work/build/tests/test_$1"
}
count_binary alpha_gpu 7
count_binary beta_gpu 3
count_binary gamma_gpu 4
count_binary delta_gpu ""
cat >"$work/bin/meson" <<'FAKE'
#!/bin/bash
# fake meson: `test --list` names the suites; a cell run logs its arguments and writes meson's JSON log
if [[ " $* " == *" --list "* ]]; then
  printf 'smcgraph:alpha_gpu\nsmcgraph:beta_gpu\nsmcgraph:gamma_gpu\nsmcgraph:delta_gpu\n'
  exit 0
fi
build="" logbase="" setup="" test_args=""
suite="${@: -1}"
while [ $# -gt 0 ]; do
  case "$1" in
    -C) build="$2"; shift 2 ;;
    --logbase) logbase="$2"; shift 2 ;;
    --setup) setup="$2"; shift 2 ;;
    --test-args) test_args="$2"; shift 2 ;;
    *) shift ;;
  esac
done
echo "$setup $logbase [$test_args] $suite" >>"$build/cells.log"
result=OK
[ -n "${FAKE_FAIL:-}" ] && [ "$logbase" = "matrix-$setup-$FAKE_FAIL" ] && result=FAIL
summary="========= ERROR SUMMARY: 0 errors"
[ "$setup" = racecheck ] && summary="========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
printf '{"name": "smcgraph:%s", "result": "%s", "stdout": "%s\\n[doctest] test cases: 2 | 2 passed | 0 failed |", "stderr": ""}\n' \
  "$suite" "$result" "$summary" >"$build/meson-logs/$logbase-$setup.json"
[ "$result" = OK ]
FAKE
chmod +x "$work/bin/meson"

run_matrix() { # the tool's output in $work/out, its exit status in $status
  set +e
  PATH="$work/bin:$PATH" bash "$work/tree/tools/sanitizer_matrix.sh" --build-dir "$work/build" --no-build \
    --jobs 4 "$@" >"$work/out" 2>&1
  status=$?
  set -e
  true
}

# 1. Splits: alpha 7 cases in 3 parts, beta 3 cases asked in 5 (clamped to 3), gamma whole, delta cannot
#    count (no GPU) and runs whole.
: >"$work/build/cells.log"
run_matrix --tools memcheck,racecheck --split alpha_gpu=3,beta_gpu=5,delta_gpu=2
[ "$status" = 0 ] || fail "all cells OK should exit 0, got $status: $(cat "$work/out")"
expected_cells="$(for tool in memcheck racecheck; do
  for part in "alpha_gpu.1of3 [--first=1 --last=3]" "alpha_gpu.2of3 [--first=4 --last=6]" \
              "alpha_gpu.3of3 [--first=7 --last=7]" "beta_gpu.1of3 [--first=1 --last=1]" \
              "beta_gpu.2of3 [--first=2 --last=2]" "beta_gpu.3of3 [--first=3 --last=3]" "delta_gpu []" "gamma_gpu []"; do
    echo "$tool matrix-$tool-${part%% *} ${part#* } ${part%%[. ]*}"
  done
done | sort)"
actual_cells="$(sort "$work/build/cells.log")"
[ "$actual_cells" = "$expected_cells" ] || fail "cells differ: expected
$expected_cells
got
$actual_cells"
grep -q "could not count delta_gpu's test cases: running it whole" "$work/out" || fail "no note for delta_gpu"
grep -q "^| alpha_gpu.2of3 | OK, [0-9]* s, 0 errors, cases 4-6 | OK, [0-9]* s, 0 hazards (0 err, 0 warn), cases 4-6 |$" \
  "$work/out" || fail "alpha_gpu.2of3's row: $(grep alpha_gpu.2of3 "$work/out" | tail -1)"
grep -q "^| gamma_gpu | OK, [0-9]* s, 0 errors, 2 cases |" "$work/out" || fail "gamma_gpu's row"
grep -q "^16/16 cells OK" "$work/out" || fail "summary: $(grep 'cells OK' "$work/out")"

# 2. A failed part fails the matrix and is named.
: >"$work/build/cells.log"
FAKE_FAIL=alpha_gpu.3of3 run_matrix --tools memcheck --split alpha_gpu=3
[ "$status" != 0 ] || fail "a failed part should fail the matrix"
grep -q "alpha_gpu.3of3 x memcheck (FAIL)" "$work/out" || fail "the failed part is not named: $(tail -5 "$work/out")"

# 3. --split SUITE=cases: a cell a case (beta's 3); a suite that cannot count (delta) runs whole.
: >"$work/build/cells.log"
run_matrix --tools memcheck --split beta_gpu=cases,delta_gpu=cases
[ "$status" = 0 ] || fail "--split beta_gpu=cases should exit 0, got $status: $(cat "$work/out")"
expected_cells="$(for part in "alpha_gpu []" "beta_gpu.1of3 [--first=1 --last=1]" "beta_gpu.2of3 [--first=2 --last=2]" \
                              "beta_gpu.3of3 [--first=3 --last=3]" "delta_gpu []" "gamma_gpu []"; do
  echo "memcheck matrix-memcheck-${part%% *} ${part#* } ${part%%[. ]*}"
done | sort)"
actual_cells="$(sort "$work/build/cells.log")"
[ "$actual_cells" = "$expected_cells" ] || fail "--split =cases cells differ: expected
$expected_cells
got
$actual_cells"

# 4. A split that is not a positive count or 'cases' is refused.
run_matrix --tools memcheck --split alpha_gpu=x
[ "$status" = 2 ] || fail "--split alpha_gpu=x should exit 2, got $status"
grep -q "need a positive count or .cases." "$work/out" || fail "no reason for the refused --split"

if [ "$failures" -gt 0 ]; then
  echo "test_sanitizer_matrix: $failures failure(s)" >&2
  exit 1
fi
echo "test_sanitizer_matrix: ok"

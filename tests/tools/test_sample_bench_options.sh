#!/usr/bin/env bash
# CPU test of sample_bench's command line: --shapes items it refuses (each named in the message, exit status
# 2, before any CUDA call, so no GPU is needed), --shapes with --quick or --peers, and the usage text.
#
#   tests/tools/test_sample_bench_options.sh <path to sample_bench>
set -uo pipefail
bench="$1"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

refused() { # $1 expected text in stderr, then the arguments
  local expected="$1"
  shift
  local err rc
  err="$("$bench" "$@" 2>&1 >/dev/null)"
  rc=$?
  [ "$rc" -eq 2 ] || fail "sample_bench $*: exit status $rc, expected 2"
  case "$err" in *"$expected"*) ;; *) fail "sample_bench $*: stderr '$err' lacks '$expected'" ;; esac
}

for item in 0x49152 257x49152 1x0 1x151937 1x49152:fp16 1x49152:bf16:0 1x49152:bf16:-1 1x49152:bf16:2x \
  3 1x 1xx2 x5 1x49152:fp32:inf; do
  refused "--shapes item '$item' must be ROWSxVOCAB" --shapes "$item"
done
refused "--shapes item '' must be ROWSxVOCAB" --shapes 1x49152,,8x49152
refused "item '2y3'" --shapes 1x49152:bf16,2y3
refused "not with --quick" --shapes 1x49152 --quick
refused "not with --peers" --peers --shapes 1x49152
refused "--shapes needs a value" --shapes

usage="$("$bench" --help)" || fail "sample_bench --help: exit status $?"
case "$usage" in *"--shapes LIST"*) ;; *) fail "sample_bench --help does not describe --shapes" ;; esac

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "sample_bench options: ok"

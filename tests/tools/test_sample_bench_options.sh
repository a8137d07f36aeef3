#!/usr/bin/env bash
# CPU test of sample_bench's command line: --shapes items it refuses (each named in the message, exit status
# 2, before any CUDA call, so no GPU is needed), --shapes with --quick or --peers, and the usage text.
#
#   tests/tools/test_sample_bench_options.sh <path to sample_bench>
set -uo pipefail
bench="$1"
name=sample_bench
source "$(dirname "$0")/options_test_lib.sh"

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

finish

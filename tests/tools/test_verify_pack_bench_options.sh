#!/usr/bin/env bash
# CPU test of verify_pack_bench's command line: --only values it refuses (malformed, or naming none of the
# bench's configurations; each named in the message, exit status 2, before any CUDA call, so no GPU is
# needed), flags without their values, unknown flags, and the usage text.
#
#   tests/tools/test_verify_pack_bench_options.sh <path to verify_pack_bench>
set -uo pipefail
bench="$1"
name=verify_pack_bench
source "$(dirname "$0")/options_test_lib.sh"

for value in 1:2:3 a:b:c:d 32:128:0.9:2048x 32:128:0.9 "" 32:128:0.9:2048:1; do
  refused "--only $value: expected rows:draft_steps:alpha:kv_dim" --only "$value"
done
refused "--only 32:128:0.5:2048 is not one of the configurations: 4:8:0.30:128" --only 32:128:0.5:2048
refused "--only 7:8:0.3:128 is not one of the configurations" --only 32:128:0.9:2048 --only 7:8:0.3:128
refused "--only needs a value" --only
refused "--peer-csv needs a value" /tmp/x.csv --peer-csv
refused "unknown option --shapes" --shapes 1x2

usage="$("$bench" --help)" || fail "verify_pack_bench --help: exit status $?"
case "$usage" in *"--only rows:draft_steps:alpha:kv_dim"*) ;; *) fail "verify_pack_bench --help does not describe --only" ;; esac

finish

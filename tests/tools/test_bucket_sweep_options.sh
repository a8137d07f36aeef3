#!/usr/bin/env bash
# CPU test of bucket_sweep's command line: the values it refuses (each named in the message, exit status 2,
# before any CUDA call, so no GPU is needed), --context with --peers, and the usage text.
#
#   tests/tools/test_bucket_sweep_options.sh <path to bucket_sweep>
set -uo pipefail
bench="$1"
name=bucket_sweep
source "$(dirname "$0")/options_test_lib.sh"

for value in 0 31 32769 x 64x -5 ''; do
  refused "bad value for --context: '$value'" --context "$value"
done
refused "--context 2048 runs without --peers" --context 2048 --peers
refused "--context 2048 runs without --peers" --peers --context 2048
refused "bad value for --cycles: '0'" --cycles 0
refused "bad value for --model: 'llama'" --model llama
refused "unknown argument '--contexts'" --contexts 64

usage="$("$bench" --help)" || fail "bucket_sweep --help: exit status $?"
case "$usage" in *"--context N"*) ;; *) fail "bucket_sweep --help does not describe --context" ;; esac

finish

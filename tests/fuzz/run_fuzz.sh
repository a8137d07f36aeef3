#!/usr/bin/env bash
# Builds and runs the CPU fuzz targets under ASan + UBSan (the `fuzz` suite of tests/meson.build runs this
# for a few seconds per target with a fixed seed; `./run fuzz --seconds 300` runs longer).
#
#   tests/fuzz/run_fuzz.sh [--target engine|gguf|tokenizer|all] [--build-dir DIR] [--seconds N] [--seed N]
#                          [--seed-test PATH] [--engine libfuzzer|mutation] [--keep-corpus]
#
# Per target, under DIR/fuzz/<target>/:
#   1. builds the target (cached: rebuilt when a source under include/, src/ or tests/fuzz/ is newer) with
#      clang++ -fsanitize=fuzzer,address,undefined when clang's libFuzzer links here, else with
#      g++ -fsanitize=address,undefined and tests/fuzz/mutation_driver.cpp (a seeded, coverage-guided
#      mutation loop taking the same flags);
#   2. writes the seed corpus: runs the target's CPU suite (DIR/tests/test_<target>_cpu, or --seed-test) with
#      SMCGRAPH_FUZZ_CORPUS_DIR set (the suites write their interesting inputs there as <target>_seed_* files,
#      tests/support/fuzz_corpus.hpp), plus any checked-in seeds in tests/fuzz/seeds/<target>/;
#   3. fuzzes for --seconds (default $SMCGRAPH_FUZZ_SECONDS, else 5) from --seed (default $SMCGRAPH_FUZZ_SEED,
#      else 1). A crash, sanitizer report, leak or hang fails the run and leaves the reproducer in
#      DIR/fuzz/<target>/artifacts/ (replay it: DIR/fuzz/<target>/fuzz_<target> <file>).
# Environment: SMCGRAPH_FUZZ_ENGINE=libfuzzer|mutation forces the engine; SMCGRAPH_FUZZ_MAX_LEN caps the input.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
targets="all"
build_dir="$root/build"
seconds="${SMCGRAPH_FUZZ_SECONDS:-5}"
seed="${SMCGRAPH_FUZZ_SEED:-1}"
seed_test=""
engine="${SMCGRAPH_FUZZ_ENGINE:-auto}"
keep_corpus=0
while [ $# -gt 0 ]; do
  case "$1" in
    --target) targets="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --seed-test) seed_test="$2"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    --keep-corpus) keep_corpus=1; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "run_fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$targets" = all ] && targets="engine gguf tokenizer"
if [ -n "$seed_test" ] && [ "$(echo "$targets" | wc -w)" -ne 1 ]; then
  echo "run_fuzz.sh: --seed-test goes with a single --target" >&2
  exit 2
fi
build_dir="$(mkdir -p "$build_dir" && cd "$build_dir" && pwd)"
fuzz_root="$build_dir/fuzz"
mkdir -p "$fuzz_root"

# The CUDA toolkit's headers (error.hpp includes cuda_runtime_api.h) and static runtime (error.cpp names
# CUDA errors; no CUDA call runs in these targets).
nvcc_path="$(command -v nvcc || true)"
[ -z "$nvcc_path" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_path=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc_path" ]; then
  echo "run_fuzz.sh: no nvcc on PATH or in /usr/local/cuda/bin (the targets need the CUDA headers)" >&2
  exit 1
fi
cuda_root="$(cd "$(dirname "$(readlink -f "$nvcc_path")")/.." && pwd)"
cuda_lib="$cuda_root/lib64"
[ -d "$cuda_lib" ] || cuda_lib="$cuda_root/lib"
include_flags=(-I"$root/include" -I"$root/src" -I"$root/tests" -isystem "$cuda_root/include")
[ -d "$cuda_root/include/cccl" ] && include_flags+=(-isystem "$cuda_root/include/cccl")
link_flags=("$cuda_lib/libcudart_static.a" -ldl -lrt -lpthread)
common_flags=(-std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all)

# Which engine: clang's libFuzzer when a fuzzer links here, else the mutation driver.
pick_engine() {
  if [ "$engine" != auto ]; then
    echo "$engine"
    return
  fi
  local probe="$fuzz_root/probe"
  mkdir -p "$probe"
  printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' \
    >"$probe/probe.cpp"
  if command -v clang++ >/dev/null 2>&1 &&
    clang++ -std=c++20 -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" >/dev/null 2>&1; then
    echo libfuzzer
  else
    echo mutation
  fi
}
engine="$(pick_engine)"
case "$engine" in
  libfuzzer) cxx="${SMCGRAPH_FUZZ_CXX:-clang++}" ;;
  mutation) cxx="${SMCGRAPH_FUZZ_CXX:-g++}" ;;
  *) echo "run_fuzz.sh: --engine must be libfuzzer or mutation, not $engine" >&2; exit 2 ;;
esac

# Per target: sources (besides the target file), default maximum input length.
target_sources() {
  case "$1" in
    engine) echo "src/runtime/engine_validation.cpp src/runtime/error.cpp" ;;
    gguf) echo "src/models/llama/gguf.cpp src/runtime/error.cpp" ;;
    tokenizer) echo "src/models/llama/tokenizer.cpp src/models/llama/gguf.cpp src/runtime/error.cpp" ;;
    *) return 1 ;;
  esac
}
target_file() {
  case "$1" in
    engine) echo "tests/fuzz/fuzz_engine_validation.cpp" ;;
    *) echo "tests/fuzz/fuzz_$1.cpp" ;;
  esac
}
target_max_len() {
  case "$1" in
    gguf) echo 65536 ;;
    *) echo 4096 ;;
  esac
}

build_target() { # $1 target, $2 output binary; compiles only when something it may include changed
  local target="$1" binary="$2" object_dir="$fuzz_root/$1/obj-$engine"
  local sources
  sources="$(target_file "$target") $(target_sources "$target")"
  for source in $sources; do
    if [ ! -f "$root/$source" ]; then
      echo "run_fuzz.sh: $target: $source is missing" >&2
      return 1
    fi
  done
  if [ -x "$binary" ] && [ -z "$(find "$root/include" "$root/src" "$root/tests/fuzz" "$root/tests/support" \
    -newer "$binary" \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) -print -quit)" ]; then
    return 0
  fi
  mkdir -p "$object_dir"
  local objects=() coverage_flags=()
  [ "$engine" = mutation ] && coverage_flags=(-fsanitize-coverage=trace-pc,trace-cmp)
  [ "$engine" = libfuzzer ] && coverage_flags=(-fsanitize=fuzzer-no-link)
  for source in $sources; do
    local object="$object_dir/$(echo "$source" | tr '/' '_').o"
    "$cxx" "${common_flags[@]}" "${coverage_flags[@]}" "${include_flags[@]}" -c "$root/$source" -o "$object"
    objects+=("$object")
  done
  if [ "$engine" = mutation ]; then # the driver itself is not instrumented for coverage
    "$cxx" "${common_flags[@]}" -c "$root/tests/fuzz/mutation_driver.cpp" -o "$object_dir/mutation_driver.o"
    "$cxx" "${common_flags[@]}" "${objects[@]}" "$object_dir/mutation_driver.o" "${link_flags[@]}" -o "$binary"
  else
    "$cxx" "${common_flags[@]}" -fsanitize=fuzzer "${objects[@]}" "${link_flags[@]}" -o "$binary"
  fi
}

status=0
for target in $targets; do
  if ! target_sources "$target" >/dev/null; then
    echo "run_fuzz.sh: unknown target $target (engine, gguf, tokenizer)" >&2
    exit 2
  fi
  dir="$fuzz_root/$target"
  binary="$dir/fuzz_${target}_$engine"
  mkdir -p "$dir/artifacts"
  echo "== fuzz $target: $engine ($cxx, ASan + UBSan), $seconds s, seed $seed"
  if ! build_target "$target" "$binary" >"$dir/build.log" 2>&1; then
    cat "$dir/build.log" >&2
    echo "fuzz $target: FAILED to build (log: $dir/build.log)" >&2
    status=1
    continue
  fi

  # Seeds: the CPU suite's interesting inputs (written fresh each run) and the checked-in ones.
  seeds="$dir/seeds"
  rm -rf "$seeds" "$dir/seed-root"
  mkdir -p "$seeds" "$dir/seed-root"
  test_binary="${seed_test:-$build_dir/tests/test_${target}_cpu}"
  if [ -x "$test_binary" ]; then
    if ! SMCGRAPH_FUZZ_CORPUS_DIR="$dir/seed-root" SMCGRAPH_SOURCE_ROOT="${SMCGRAPH_SOURCE_ROOT:-$root}" \
      "$test_binary" >"$dir/seed-test.log" 2>&1; then
      echo "   note: $test_binary failed (log: $dir/seed-test.log); fuzzing with the seeds it wrote"
    fi
    # The suites write "<target>_seed_*" files into SMCGRAPH_FUZZ_CORPUS_DIR (a subdirectory named after the
    # target is read too).
    find "$dir/seed-root" -maxdepth 1 -type f -exec cp {} "$seeds/" \;
    [ -d "$dir/seed-root/$target" ] && cp -r "$dir/seed-root/$target/." "$seeds/"
  else
    echo "   note: no seed suite at $test_binary: fuzzing from the checked-in seeds only"
  fi
  [ -d "$root/tests/fuzz/seeds/$target" ] && cp -r "$root/tests/fuzz/seeds/$target/." "$seeds/"
  echo "   seeds: $(find "$seeds" -type f | wc -l) files"

  # The working corpus starts empty each run (reproducible from the seed) unless --keep-corpus.
  corpus="$dir/corpus"
  [ "$keep_corpus" = 1 ] || rm -rf "$corpus"
  mkdir -p "$corpus"
  rm -f "$dir/artifacts/"*
  flags=(-seed="$seed" -max_total_time="$seconds" -max_len="${SMCGRAPH_FUZZ_MAX_LEN:-$(target_max_len "$target")}"
    -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$dir/artifacts/")
  [ -f "$root/tests/fuzz/$target.dict" ] && flags+=(-dict="$root/tests/fuzz/$target.dict")
  start=$(date +%s.%N)
  set +e
  # Our sanitizer options, not the caller's (meson sets its own ASAN_OPTIONS / UBSAN_OPTIONS for every test): a
  # leak, a huge allocation (a size read from the input and trusted) or any UB report is a finding.
  ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:allocator_may_return_null=0:max_allocation_size_mb=4096" \
    UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1" \
    "$binary" "${flags[@]}" "$corpus" "$seeds" >"$dir/fuzz.log" 2>&1
  rc=$?
  set -e
  wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/fuzz.log" | tail -1)
  artifacts=$(find "$dir/artifacts" -type f | wc -l)
  if [ "$rc" -ne 0 ] || [ "$artifacts" -ne 0 ]; then
    tail -n 60 "$dir/fuzz.log" >&2
    echo "fuzz $target: FAILED (exit $rc) after ${wall} s; reproducer(s):" >&2
    find "$dir/artifacts" -type f -exec echo "   {}  (replay: $binary {})" \; >&2
    status=1
  else
    echo "fuzz $target: ok, ${execs:-?} inputs in ${wall} s, corpus $(find "$corpus" -type f | wc -l) new files, 0 crashes (log: $dir/fuzz.log)"
  fi
done
exit $status

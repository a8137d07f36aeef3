#!/usr/bin/env bash
# Every GPU suite under every compute-sanitizer tool, in parallel, as one table.
#
#   tools/sanitizer_matrix.sh [--build-dir build] [--tools memcheck,racecheck,synccheck,initcheck]
#                             [--suites cycle_gpu,engine_gpu,...] [--jobs N] [--cell-timeout S] [--no-build]
#                             [--split llama_gpu=cases,spec_gpu=cases,llama_real_gpu=2]
#
# Each cell (suite x tool) is `meson test -C <build> --setup <tool> <suite>` (the setups of tests/meson.build:
# compute-sanitizer with --error-exitcode, SMCGRAPH_UNDER_SANITIZER=1 and SMCGRAPH_SANITIZER_TOOL=<tool> for
# the sanitizer-sized loops, SMCGRAPH_REQUIRE_GPU=1), with its own log base so the cells run side by side on
# one GPU: --jobs at a time (default: the number of CPU cores), racecheck cells first (the slowest). The suites
# are the `gpu` suite without `fault-injection` (that one traps on purpose), as `meson test --list` names them.
# A cell running past --cell-timeout seconds (default 1200: meson's timeout of a GPU suite under a sanitizer) is
# stopped and reported as TIMEOUT. --split SUITE=N runs a suite as N cells a tool, each a contiguous range of
# its doctest cases (--first / --last over the `--count` of the binary, which needs the GPU): the Llama suites
# take minutes a cell under racecheck, and their parts then run side by side (rows "llama_gpu.2of4").
# --split SUITE=cases gives every case a cell of its own: how racecheck of llama_gpu and spec_gpu finishes in
# minutes (2026-11-27, NVIDIA H100: the longest llama_gpu case 392 s, with 21 other cells beside it).
#
# Prints a markdown table suite x tool (status, wall seconds, the tool's error / hazard counts parsed from its
# summary lines, doctest's test-case count), writes it to <build>/sanitizer-matrix.md, and exits nonzero if
# any cell failed, timed out, was skipped or reported anything. The logs:
# <build>/meson-logs/matrix-<tool>-<suite>-<tool>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build
tools="racecheck,memcheck,initcheck,synccheck"
suites=""
jobs="$(nproc)"
cell_timeout=1200
do_build=1
split=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --tools) tools="$2"; shift 2 ;;
    --suites) suites="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --cell-timeout) cell_timeout="$2"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    --split) split="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "sanitizer_matrix.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

command -v nvcc >/dev/null 2>&1 || export PATH="$PATH:/usr/local/cuda/bin"
[ -x .venv/bin/meson ] && export PATH="$PWD/.venv/bin:$PATH"
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" --buildtype=release
fi
[ "$do_build" = 1 ] && ninja -C "$build"
for tool in ${tools//,/ }; do
  if ! meson test -C "$build" --no-rebuild --setup "$tool" --list >/dev/null 2>&1; then
    echo "sanitizer_matrix.sh: no '$tool' test setup in $build (compute-sanitizer not found at configure time?)" >&2
    exit 1
  fi
done
if [ -z "$suites" ]; then
  suites="$(meson test -C "$build" --no-rebuild --list --suite gpu --no-suite fault-injection 2>/dev/null |
    sed -n 's/.*smcgraph:\([A-Za-z0-9_]*\).*/\1/p' | tr '\n' ',' | sed 's/,$//')"
fi
[ -n "$suites" ] || { echo "sanitizer_matrix.sh: no GPU suites found" >&2; exit 1; }

state="$build/sanitizer-matrix"
rm -rf "$state"
mkdir -p "$state"
# The rows: a suite, or its parts "<suite>.<i>of<n>" (--split), each part's case range in $state/<row>.range.
rows=""
for suite in ${suites//,/ }; do
  parts=1
  for entry in ${split//,/ }; do
    [ "${entry%%=*}" = "$suite" ] && parts="${entry#*=}"
  done
  case "$parts" in cases) ;; ''|*[!0-9]*|0) echo "sanitizer_matrix.sh: --split $suite=$parts: need a positive count or 'cases'" >&2; exit 2 ;; esac
  count=""
  if [ "$parts" = cases ] || [ "$parts" -gt 1 ]; then
    count="$("$build/tests/test_$suite" --count 2>/dev/null |
      sed -n 's/.*unskipped test cases passing the current filters: \([0-9]*\).*/\1/p' | head -1 || true)"
    [ -n "$count" ] || echo "sanitizer_matrix.sh: could not count $suite's test cases: running it whole" >&2
  fi
  [ "$parts" = cases ] && parts="${count:-1}" # one case a cell
  if [ -z "$count" ] || [ "$parts" -le 1 ]; then
    rows="$rows,$suite"
    continue
  fi
  [ "$parts" -gt "$count" ] && parts="$count"
  per=$(( (count + parts - 1) / parts ))
  for (( i = 1; i <= parts; i++ )); do
    first=$(( (i - 1) * per + 1 ))
    last=$(( i * per < count ? i * per : count ))
    [ "$first" -le "$count" ] || continue
    echo "--first=$first --last=$last" >"$state/$suite.${i}of$parts.range"
    rows="$rows,$suite.${i}of$parts"
  done
done
rows="${rows#,}"
# The queue: racecheck first, then the others; within a tool, the engine-level suites first (longest).
queue="$state/queue"
: >"$queue"
for tool in racecheck memcheck initcheck synccheck; do
  case ",$tools," in *",$tool,"*) ;; *) continue ;; esac
  for suite in cycle_gpu engine_gpu spec_gpu toy_model_gpu sample_gpu verify_gpu host_engine_gpu ${suites//,/ }; do
    case ",$suites," in *",$suite,"*) ;; *) continue ;; esac
    for row in ${rows//,/ }; do
      [ "${row%%.*}" = "$suite" ] || continue
      grep -qx "$tool $row" "$queue" || echo "$tool $row" >>"$queue"
    done
  done
done
cells=$(wc -l <"$queue")
echo "sanitizer matrix: $cells cells ($(echo "${suites//,/ }" | wc -w) suites, $(echo "${rows//,/ }" | wc -w) rows x tools $tools), $jobs at a time, build $build"

run_cell() { # $1 tool, $2 row (a suite or a part of one): one meson test run, its status and wall time
  local tool="$1" suite="$2" start end rc
  local args=()
  [ -f "$state/$suite.range" ] && args=(--test-args "$(cat "$state/$suite.range")")
  start=$(date +%s.%N)
  set +e
  meson test -C "$build" --no-rebuild --setup "$tool" --logbase "matrix-$tool-$suite" --num-processes 1 \
    --timeout-multiplier "$timeout_multiplier" "${args[@]}" "${suite%%.*}" >"$state/$tool-$suite.out" 2>&1
  rc=$?
  set -e
  end=$(date +%s.%N)
  awk -v a="$start" -v b="$end" -v rc="$rc" 'BEGIN { printf "%d %.1f\n", rc, b - a }' >"$state/$tool-$suite.status"
  echo "  done: $tool $suite (exit $rc, $(cut -d' ' -f2 "$state/$tool-$suite.status") s)"
}
timeout_multiplier=$(awk -v s="$cell_timeout" 'BEGIN { printf "%.4f", s / 1200 }')
export -f run_cell
export build state timeout_multiplier
matrix_start=$(date +%s)
xargs -P "$jobs" -L 1 bash -c 'run_cell "$0" "$1"' <"$queue"
matrix_wall=$(( $(date +%s) - matrix_start ))

python3 - "$build" "$state" "$tools" "$rows" "$matrix_wall" <<'PY'
import json, os, re, sys

build, state, tools, suites, wall = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(","), sys.argv[5]
order = [t for t in ["memcheck", "racecheck", "synccheck", "initcheck"] if t in tools]

def log_path(tool, suite, extension):
    # meson appends the setup's name to --logbase
    for name in (f"matrix-{tool}-{suite}-{tool}.{extension}", f"matrix-{tool}-{suite}.{extension}"):
        path = os.path.join(build, "meson-logs", name)
        if os.path.exists(path):
            return path
    return os.path.join(build, "meson-logs", f"matrix-{tool}-{suite}-{tool}.{extension}")

def parse(tool, suite):
    cell = {"status": "NOT RUN", "wall": None, "errors": None, "hazards": None, "warnings": None,
            "leaked": None, "cases": None, "failed_cases": None, "failures": []}
    status_file = os.path.join(state, f"{tool}-{suite}.status")
    if os.path.exists(status_file):
        rc, seconds = open(status_file).read().split()
        cell["wall"] = float(seconds)
        cell["status"] = "OK" if rc == "0" else "FAIL"
    log_json = log_path(tool, suite, "json")
    output = ""
    if os.path.exists(log_json):
        for line in open(log_json):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("name", "").endswith(suite.split(".")[0]):
                result = entry.get("result", "")
                if result and result != "OK":
                    cell["status"] = result  # FAIL, TIMEOUT, SKIP, ERROR, ...
                output += (entry.get("stdout") or "") + (entry.get("stderr") or "")
    if not output:
        log_txt = log_path(tool, suite, "txt")
        if os.path.exists(log_txt):
            output = open(log_txt, errors="replace").read()
    m = re.findall(r"ERROR SUMMARY: (\d+) error", output)
    if m:
        cell["errors"] = int(m[-1])
    m = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", output)
    if m:
        cell["hazards"], cell["errors"], cell["warnings"] = (int(x) for x in m[-1])
    m = re.findall(r"LEAK SUMMARY: (\d+) bytes leaked", output)
    if m:
        cell["leaked"] = int(m[-1])
    m = re.findall(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", output)
    if m:
        cell["cases"], _, cell["failed_cases"] = (int(x) for x in m[-1])
    # A failed doctest case, with the seed its suite printed: the lines that reproduce and explain it (the
    # test case, the failed check, its logged context), so a failure seen once is not lost with the log.
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"\bseed \d+", line) or line.startswith("TEST CASE:"):
            cell["failures"].append(line.strip())
        elif "ERROR:" in line or "FATAL ERROR" in line:
            cell["failures"].extend(x.rstrip() for x in lines[i:i + 8] if x.strip())
    reported = (cell["errors"] or 0) + (cell["hazards"] or 0) + (cell["warnings"] or 0) + (cell["leaked"] or 0)
    if cell["status"] == "OK" and reported:
        cell["status"] = "REPORTS"
    if cell["status"] == "OK" and cell["errors"] is None:
        cell["status"] = "NO SUMMARY"  # the tool's summary line is missing: cannot judge
    return cell

def text(cell, tool):
    parts = [cell["status"]]
    if cell["wall"] is not None:
        parts.append(f"{cell['wall']:.0f} s")
    if tool == "racecheck":
        if cell["hazards"] is not None:
            parts.append(f"{cell['hazards']} hazards ({cell['errors']} err, {cell['warnings']} warn)")
    elif cell["errors"] is not None:
        parts.append(f"{cell['errors']} errors")
    if cell["leaked"]:
        parts.append(f"{cell['leaked']} B leaked")
    if cell["cases"] is not None:
        # A part's doctest summary counts every case that passes the filters, in its range or not: name the
        # range instead.
        cases = f"cases {cell['range']}" if cell.get("range") else f"{cell['cases']} cases"
        parts.append(cases + (f", {cell['failed_cases']} failed" if cell["failed_cases"] else ""))
    return ", ".join(parts)

cells = {(t, s): parse(t, s) for t in order for s in suites}
for (t, s), cell in cells.items():
    range_file = os.path.join(state, f"{s}.range")
    if os.path.exists(range_file):
        first, last = (int(x.split("=")[1]) for x in open(range_file).read().split())
        cell["range"] = f"{first}-{last}"
lines = ["| suite | " + " | ".join(order) + " |", "|---|" + "---|" * len(order)]
for s in suites:
    lines.append(f"| {s} | " + " | ".join(text(cells[(t, s)], t) for t in order) + " |")
bad = [(t, s) for (t, s), c in cells.items() if c["status"] != "OK"]
longest = max((c["wall"] or 0.0 for c in cells.values()), default=0.0)
summary = (f"{len(cells) - len(bad)}/{len(cells)} cells OK; matrix wall {wall} s, longest cell {longest:.0f} s")
table = "\n".join(lines) + "\n\n" + summary + "\n"
if bad:
    table += "not OK (logs: " + build + "/meson-logs/matrix-<tool>-<suite>-<tool>.txt): " + \
        ", ".join(f"{s} x {t} ({cells[(t, s)]['status']})" for t, s in bad) + "\n"
    for t, s in bad:
        failures = cells[(t, s)]["failures"]
        if failures and cells[(t, s)]["failed_cases"]:
            table += f"\n{s} x {t}, failed cases (the suite's seeds and the failed checks):\n" + \
                "\n".join("    " + x for x in failures[:40]) + "\n"
print()
print(table, end="")
open(os.path.join(build, "sanitizer-matrix.md"), "w").write(table)
sys.exit(1 if bad else 0)
PY

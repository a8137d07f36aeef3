#!/usr/bin/env bash
# CPU test of tools/trace_critical_path.py on a synthetic kernel trace (tools/kernel_trace.cpp's CSV): replays
# found as the period of a graph's kernel names, output-parity graphs of the same sequence pooled, critical
# shares that add up to the span (a kernel that starts under its predecessor counts only what it adds, a gap
# counts to the kernel after it), --graph, --per-node, and the refusals of malformed input.
#
#   tests/tools/test_trace_critical_path.sh <repository root>
set -uo pipefail
tool="$1/tools/trace_critical_path.py"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
expect() { # $1 output, $2 expected line (exact, after squeezing spaces)
  # grep without -q: it reads all its input, so under pipefail no writer ends on SIGPIPE.
  printf '%s\n' "$1" | tr -s ' ' | grep -xF -- "$2" >/dev/null || fail "no line '$2' in:
$1"
}

# Graph 7 and its parity graph 9: A 0-10 us, B 8-20 (started under A: adds 10), C 25-30 (after a 5 us gap:
# adds 10); two replays of 7, one of 9. Graph 4: X 1 us then Y 2 us, three replays. One launch outside a graph.
{
  echo "name,start_ns,end_ns,graph_id"
  for base in 0 100000; do
    echo "\"A\",$((base)),$((base + 10000)),7"
    echo "\"B\",$((base + 8000)),$((base + 20000)),7"
    echo "\"C\",$((base + 25000)),$((base + 30000)),7"
  done
  echo "\"A\",200000,210000,9"
  echo "\"B\",208000,220000,9"
  echo "\"C\",225000,230000,9"
  for base in 300000 310000 320000; do
    echo "\"X\",$base,$((base + 1000)),4"
    echo "\"Y\",$((base + 1000)),$((base + 3000)),4"
  done
  echo "\"eager\",400000,401000,0"
} > "$dir/trace.csv"

out="$(python3 "$tool" "$dir/trace.csv")" || fail "default run: exit status $?"
expect "$out" "graphs 7,9: 3 replays of 3 kernels, median span 30.0 us"
expect "$out" " 10.0 1.0 10.00 A"
expect "$out" " 10.0 1.0 12.00 B"
expect "$out" " 10.0 1.0 5.00 C"
expect "$out" " 30.0 3.0 total"
expect "$out" "(graph 4: 2 kernels a replay, 3 replays; --graph 4)"

out="$(python3 "$tool" "$dir/trace.csv" --graph 4)" || fail "--graph 4: exit status $?"
expect "$out" "graphs 4: 3 replays of 2 kernels, median span 3.0 us"
expect "$out" " 2.0 1.0 2.00 Y"
expect "$out" " 1.0 1.0 1.00 X"

# Per node: A starts the replay (gap 0), B starts 2 us under A's end and adds 10, C waits 5 us and adds 10.
out="$(python3 "$tool" "$dir/trace.csv" --per-node 0:3)" || fail "--per-node 0:3: exit status $?"
expect "$out" " 0 0.00 10.00 10.00 A"
expect "$out" " 1 -2.00 12.00 10.00 B"
expect "$out" " 2 5.00 5.00 10.00 C"
for bad in 2:2 3:1 x:2 -1:2; do
  python3 "$tool" "$dir/trace.csv" --per-node "$bad" > /dev/null 2> "$dir/err" && fail "--per-node $bad accepted"
  grep -q -- "--per-node" "$dir/err" || fail "--per-node $bad: message '$(cat "$dir/err")'"
done
python3 "$tool" "$dir/trace.csv" --per-node 0:4 > /dev/null 2> "$dir/err" && fail "--per-node 0:4 accepted"
grep -q "a replay has 3 kernels" "$dir/err" || fail "--per-node 0:4: message '$(cat "$dir/err")'"

python3 "$tool" "$dir/trace.csv" --graph 5 > /dev/null 2> "$dir/err" && fail "--graph 5 (absent) accepted"
grep -q "not in the trace" "$dir/err" || fail "--graph 5: message '$(cat "$dir/err")'"
printf 'name,start_ns\n"A",1\n' > "$dir/bad.csv"
python3 "$tool" "$dir/bad.csv" > /dev/null 2> "$dir/err" && fail "a CSV without end_ns accepted"
grep -q "missing columns" "$dir/err" || fail "missing columns: message '$(cat "$dir/err")'"
printf 'name,start_ns,end_ns,graph_id\n"A",x,2,1\n' > "$dir/bad.csv"
python3 "$tool" "$dir/bad.csv" > /dev/null 2> "$dir/err" && fail "a non-numeric start accepted"
grep -q "bad.csv:2: not a trace record" "$dir/err" || fail "bad record: message '$(cat "$dir/err")'"

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "trace_critical_path: ok"

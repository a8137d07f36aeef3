#!/usr/bin/env python3
"""Per-kernel GPU times of any command, from Nsight Compute: each kernel's duration at the clocks the GPU runs
(--clock-control none), grouped by kernel name, in launch order of first appearance.

  python3 tools/kernel_times.py [--skip N] [--count N] [--filter REGEX] -- COMMAND [ARGS...]

  --skip N      kernel launches (matching --filter) to skip first: warm-up, prefill (default 0)
  --count N     launches to profile after them (default 200)
  --filter RE   ncu's kernel-name regex (default: every kernel)
  --csv PATH    also write the per-launch rows (name, microseconds) to PATH

Example, one decode forward of the real model (152 launches: embed, 30 layers x 5, LM head):
  python3 tools/kernel_times.py --skip 152 --count 152 --filter Llama -- \\
      build/examples/llama_logits --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 1,9690,42 \\
      --greedy 2

ncu serialises kernels, so PDL overlap and launch gaps are not in these numbers: they are each kernel's own
time. Needs ncu on PATH (or /usr/local/cuda/bin) and a GPU.
"""

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from collections import OrderedDict


def short_name(name):
    """The kernel's name without its argument list; template arguments kept (they name the variant)."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--filter", default=None)
    parser.add_argument("--csv", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to profile is required after --")
    if args.skip < 0 or args.count < 1:
        parser.error("--skip must be >= 0 and --count >= 1")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        print("kernel_times: ncu not found", file=sys.stderr)
        return 2
    cmd = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "--page", "raw",
           "--launch-skip", str(args.skip), "--launch-count", str(args.count)]
    if args.filter:
        cmd += ["-k", "regex:" + args.filter]
    run = subprocess.run(cmd + command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        sys.stderr.write(run.stdout[-4000:])
        print("kernel_times: ncu exited with %d" % run.returncode, file=sys.stderr)
        return 1
    lines = run.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        sys.stderr.write(run.stdout[-4000:])
        print("kernel_times: no kernel was profiled", file=sys.stderr)
        return 1
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    per_launch = []
    for row in rows:
        value = row.get("gpu__time_duration.sum", "")
        try:
            duration = float(value.replace(",", ""))
        except ValueError:
            continue  # the units row
        per_launch.append((short_name(row["Kernel Name"]), duration))
    # ncu reports nanoseconds for gpu__time_duration unless it says otherwise in the units row.
    unit = rows[0].get("gpu__time_duration.sum", "ns") if rows else "ns"
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "nsecond": 1e-3}.get(unit, 1e-3)
    groups = OrderedDict()
    for name, duration in per_launch:
        groups.setdefault(name, []).append(duration * scale)
    total = sum(sum(v) for v in groups.values())
    print("%-90s %7s %11s %9s %9s %6s" % ("kernel", "launches", "total_us", "mean_us", "max_us", "share"))
    for name, values in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print("%-90s %7d %11.1f %9.2f %9.2f %5.1f%%" % (name[:90], len(values), sum(values),
                                                        sum(values) / len(values), max(values),
                                                        100.0 * sum(values) / total if total else 0.0))
    print("%-90s %7d %11.1f" % ("all", len(per_launch), total))
    if args.csv:
        with open(args.csv, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["kernel", "us"])
            for name, duration in per_launch:
                writer.writerow([name, "%.3f" % (duration * scale)])
    return 0


if __name__ == "__main__":
    sys.exit(main())

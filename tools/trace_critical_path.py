#!/usr/bin/env python3
"""Where a captured cycle's time goes: each kernel's share of the critical path per graph replay, from the CSV
that tools/kernel_trace.cpp writes (SMCGRAPH_TRACE_CSV: name,start_ns,end_ns,graph_id).

  python3 tools/trace_critical_path.py TRACE.csv [--nodes N] [--graph ID] [--top K] [--per-node FIRST:LAST]

A graph's replay is one period of its kernel-name sequence in start order (the shortest p with
the next two p-long runs equal to the first; --nodes N sets it). The graphs measured are those of the longest
replay (the cycle graph: its output parities are graphs of their own, pooled when their sequences are the
same), or --graph ID[,ID...]; the others are listed with their replay length. Within a replay, in start
order, a kernel's critical share is its end minus the latest end before it (0 if it ended earlier; the first
kernel's whole duration): the shares add up to the replay's span, and a kernel that started early under its
predecessor (programmatic dependent launch) counts only the time it added. Prints, per kernel name (template
arguments kept), the mean share a replay, launches a replay and mean duration, then the total and the median
span. --per-node FIRST:LAST prints, for the replay's kernels FIRST .. LAST - 1 (positions in start order, 0
first), the median over the replays of each one's gap (its start minus the latest end before it: negative
where it started under its predecessor), duration and share: where inside a forward's layer the time goes.
Example, the real SMC cycle at 1 request:

  CUDA_INJECTION64_PATH=$PWD/build/libsmcgraph_kernel_trace.so SMCGRAPH_TRACE_SKIP=0 \\
      SMCGRAPH_TRACE_CSV=/tmp/smc.csv build/bench/bucket_sweep --model smollm2 --kinds smc --particles 8 \\
      --steps 4 --requests 1 --cycles 20 --no-progress
  python3 tools/trace_critical_path.py /tmp/smc.csv
"""

import argparse
import collections
import csv
import statistics
import sys

def load(path):
    records = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"name", "start_ns", "end_ns", "graph_id"} - set(reader.fieldnames or [])
        if missing:
            sys.exit(f"trace_critical_path: {path}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                records.append((int(row["start_ns"]), int(row["end_ns"]), row["name"], int(row["graph_id"])))
            except ValueError:
                sys.exit(f"trace_critical_path: {path}:{line}: not a trace record: {row}")
    records.sort()
    return records


def period(names):
    """The shortest p with names[p:2p] and names[2p:3p] (what there is of them) equal to names[:p]."""
    first = names[0]
    for p in range(1, len(names)):
        if names[p] != first:
            continue
        if names[p:2 * p] == names[:len(names[p:2 * p])] and names[2 * p:3 * p] == names[:len(names[2 * p:3 * p])]:
            return p
    return len(names)


def critical_steps(replay):
    """(gap, duration, share) of each kernel of a replay, in start order: the gap is its start minus the latest
    end before it (negative where it started under its predecessor; 0 for the first), the share its end minus
    that latest end, at least 0 (the whole duration for the first). The latest end is a running maximum, so
    the shares add up to the replay's span."""
    steps, last_end = [], None
    for start, end, _, _ in replay:
        if last_end is None:
            steps.append((0, end - start, end - start))
            last_end = end
        else:
            steps.append((start - last_end, end - start, max(0, end - last_end)))
            last_end = max(last_end, end)
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--graph", help="graph ids to measure, comma-separated (default: the longest replay's)")
    parser.add_argument("--nodes", type=int, help="kernels a replay (default: the most common run length)")
    parser.add_argument("--top", type=int, default=0, help="print only the K largest shares (default: all)")
    parser.add_argument("--per-node", metavar="FIRST:LAST",
                        help="also print each replay position's median gap, duration and share")
    args = parser.parse_args()
    per_node = None
    if args.per_node is not None:
        try:
            first, last = (int(x) for x in args.per_node.split(":"))
        except ValueError:
            sys.exit(f"trace_critical_path: --per-node {args.per_node!r}: expected FIRST:LAST (integers)")
        if first < 0 or last <= first:
            sys.exit(f"trace_critical_path: --per-node {args.per_node!r}: needs 0 <= FIRST < LAST")
        per_node = (first, last)

    by_graph = collections.defaultdict(list)
    for record in load(args.csv):
        if record[3] != 0:  # graph_id 0: launched outside a graph
            by_graph[record[3]].append(record)
    if not by_graph:
        sys.exit("trace_critical_path: no graph launches in the trace")
    names_of = {g: [r[2] for r in records] for g, records in by_graph.items()}
    period_of = {g: args.nodes or period(names) for g, names in names_of.items()}
    if args.graph:
        graphs = [int(g) for g in args.graph.split(",")]
        unknown = [g for g in graphs if g not in by_graph]
        if unknown:
            sys.exit(f"trace_critical_path: --graph {unknown}: not in the trace (graphs {sorted(by_graph)})")
    else:
        longest = max(period_of.values())
        chosen = min((g for g in by_graph if period_of[g] == longest), key=lambda g: (-len(by_graph[g]), g))
        pattern = names_of[chosen][:longest]
        graphs = sorted(g for g in by_graph if period_of[g] == longest and names_of[g][:longest] == pattern)
    replays = []
    for g in graphs:
        records, nodes = by_graph[g], period_of[g]
        replays += [records[i:i + nodes] for i in range(0, len(records) - nodes + 1, nodes)]
    if not replays:
        sys.exit(f"trace_critical_path: graphs {graphs} hold no whole replay")
    for g in sorted(set(by_graph) - set(graphs)):
        print(f"(graph {g}: {period_of[g]} kernels a replay, {len(by_graph[g]) // period_of[g]} replays; --graph {g})")

    share, launches, duration = collections.Counter(), collections.Counter(), collections.Counter()
    spans = []
    for replay in replays:
        steps = critical_steps(replay)
        for (_, _, name, _), (_, took, added) in zip(replay, steps):
            share[name] += added
            launches[name] += 1
            duration[name] += took
        spans.append(sum(added for _, _, added in steps))  # the shares add up to the span
    n = len(replays)
    print(f"graphs {','.join(map(str, graphs))}: {n} replays of {len(replays[0])} kernels, "
          f"median span {statistics.median(spans) / 1000:.1f} us")
    print(f"{'share us':>9} {'launches':>9} {'dur us':>8}  kernel (mean a replay; dur: mean a launch)")
    rows = share.most_common(args.top or None)
    for name, total in rows:
        print(f"{total / n / 1000:9.1f} {launches[name] / n:9.1f} {duration[name] / launches[name] / 1000:8.2f}  {name}")
    print(f"{sum(share.values()) / n / 1000:9.1f} {sum(launches.values()) / n:9.1f} {'':8}  total")
    if per_node is None:
        return
    first, last = per_node
    nodes = len(replays[0])
    if last > nodes:
        sys.exit(f"trace_critical_path: --per-node {first}:{last}: a replay has {nodes} kernels")
    # (gap, duration, share) of positions first .. last - 1, a list per position over the replays.
    rows = [([], [], []) for _ in range(first, last)]
    for replay in replays:
        for (gaps, durations, shares), step in zip(rows, critical_steps(replay)[first:last]):
            gaps.append(step[0])
            durations.append(step[1])
            shares.append(step[2])
    print(f"{'node':>5} {'gap us':>8} {'dur us':>8} {'share us':>9}  kernel (medians over the replays)")
    med = lambda values: statistics.median(values) / 1000
    for i, (gaps, durations, shares) in enumerate(rows, start=first):
        print(f"{i:5d} {med(gaps):8.2f} {med(durations):8.2f} {med(shares):9.2f}  {replays[0][i][2]}")


if __name__ == "__main__":
    main()

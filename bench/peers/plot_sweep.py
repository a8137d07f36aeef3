#!/usr/bin/env python3
"""PNG plots of bucket_sweep's CSV (and the PyTorch peers' CSVs, when given), matplotlib's Agg backend.

One figure per cycle kind and quantity; each figure holds one panel per engine config (rows: vocabulary and
logits dtype, columns: N and K), requests per bucket on a log2 x axis:
  cycle_time_<kind>.png   median GPU time per cycle: smcgraph graph replay, smcgraph eager, the model forwards
                          alone, and each peer method
  nonmodel_<kind>.png     non-model time per cycle (cycle - model forwards) against its floor (bytes / copy
                          bandwidth + non-model nodes x node floor), with the floor's two parts, and each peer
                          method's non-model time
  tokens_per_s_<kind>.png request tokens/s of smcgraph (graph and eager) and of each peer method

Peer rows go to the figures of their cycle kind: spec_peer.py's methods (spec_*) to the spec figures, the
others (smc_peer.py's) to the smc figures; a `kind` column, where a peer CSV has one, decides instead.

Usage: python3 bench/peers/plot_sweep.py [--sweep results/bucket_sweep.csv] [--peer results/smc_peer.csv]
                                         [--peer results/spec_peer.csv] [--out results/plots]
"""

import argparse
import csv
import math
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="results/bucket_sweep.csv", help="bucket_sweep's CSV")
    parser.add_argument("--peer", action="append", default=[],
                        help="a peer's CSV (smc_peer.py's, spec_peer.py's); repeat for several (optional)")
    parser.add_argument("--out", default="results/plots", help="output directory (created)")
    return parser.parse_args()


def number(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return math.nan
    return value


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def config_key(row):
    return (int(row["vocab"]), row["dtype"], int(row["particles"]), int(row["steps"]))


def peer_kind(row):
    """The cycle kind a peer row belongs to: its `kind` column, else spec for spec_peer.py's spec_* methods."""
    if row.get("kind"):
        return row["kind"]
    return "spec" if row["method"].startswith("spec_") else "smc"


DTYPE_ORDER = {"fp32": 0, "bf16": 1, "fp16": 2}
# One colour per series across every figure.
COLORS = {"smcgraph graph": "C0", "smcgraph eager": "C1", "smcgraph non-model": "C0",
          "torch_eager": "C2", "torch_graph_draft": "C4", "torch_graph_cycle": "C3",
          "spec_torch_eager": "C2", "spec_torch_graph_draft": "C4"}
PEER_COLORS = ["C5", "C6", "C8", "C9"]


def color_for(label):
    for key, color in COLORS.items():
        if label == key or label.startswith("peer " + key):
            return color
    return PEER_COLORS[sum(map(ord, label)) % len(PEER_COLORS)]


def main():
    args = parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print("plot_sweep: matplotlib is not importable (%s)" % error, file=sys.stderr)
        return 2
    try:
        sweep = read_csv(args.sweep)
    except OSError as error:
        print("plot_sweep: cannot read %s (%s)" % (args.sweep, error), file=sys.stderr)
        return 2
    peer = []
    for path in args.peer:
        try:
            peer += read_csv(path)
        except OSError as error:
            print("plot_sweep: no peer data (%s)" % error, file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)

    # kind -> (vocab, dtype, N, K) -> method -> sorted [(requests, row)]
    peer_series = {}
    for row in peer:
        peer_series.setdefault(peer_kind(row), {}).setdefault(config_key(row), {}).setdefault(
            row["method"], []).append((int(row["requests"]), row))
    for configs in peer_series.values():
        for methods in configs.values():
            for points in methods.values():
                points.sort(key=lambda point: point[0])

    device = sweep[0].get("device", "") if sweep else ""
    written = []
    for kind in sorted({row.get("kind", "smc") for row in sweep}):
        rows = [row for row in sweep if row.get("kind", "smc") == kind]
        series = {}
        for row in rows:
            series.setdefault(config_key(row), []).append(row)
        for points in series.values():
            points.sort(key=lambda row: int(row["requests"]))
        panel_rows = sorted({(key[0], key[1]) for key in series}, key=lambda vd: (vd[0], DTYPE_ORDER.get(vd[1], 9)))
        panel_cols = sorted({(key[2], key[3]) for key in series})
        kind_peers = peer_series.get(kind, {})

        def figure(title, ylabel, draw, name):
            width = max(9.0, 4.2 * len(panel_cols))
            height = 3.3 * len(panel_rows) + 1.6
            fig, axes = plt.subplots(len(panel_rows), len(panel_cols), squeeze=False, figsize=(width, height))
            handles = {}
            for i, (vocab, dtype) in enumerate(panel_rows):
                for j, (particles, steps) in enumerate(panel_cols):
                    ax = axes[i][j]
                    key = (vocab, dtype, particles, steps)
                    if key not in series:
                        ax.set_visible(False)
                        continue
                    for label, line in draw(ax, series[key], kind_peers.get(key, {})):
                        handles.setdefault(label, line)
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.set_title("V=%d %s N=%d K=%d" % (vocab, dtype, particles, steps), fontsize=9)
                    ax.grid(True, which="both", alpha=0.3)
                    ax.tick_params(labelsize=8)
                    if i == len(panel_rows) - 1:
                        ax.set_xlabel("requests per bucket", fontsize=8)
                    if j == 0:
                        ax.set_ylabel(ylabel, fontsize=8)
            fig.suptitle("%s (%s cycle%s)" % (title, kind, ", " + device if device else ""), fontsize=11)
            columns = max(1, min(len(handles), int(width // 3.0)))
            legend_rows = math.ceil(len(handles) / columns) if handles else 0
            fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=columns, fontsize=8)
            fig.tight_layout(rect=(0, min(0.4, (0.22 * legend_rows + 0.15) / height), 1, 1 - 0.45 / height))
            path = os.path.join(args.out, "%s_%s.png" % (name, kind))
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)

        def plot(ax, xs, ys, label, **style):
            points = [(x, y) for x, y in zip(xs, ys) if y > 0 and math.isfinite(y)]
            if not points:
                return None
            style.setdefault("color", color_for(label))
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)
            return label, line

        def cycle_time(ax, points, peers):
            xs = [int(r["requests"]) for r in points]
            drawn = [plot(ax, xs, [number(r["graph_us"]) for r in points], "smcgraph graph", marker="o", lw=2),
                     plot(ax, xs, [number(r["eager_us"]) for r in points], "smcgraph eager", marker="s"),
                     plot(ax, xs, [number(r["model_us"]) for r in points], "model forwards alone", ls="--",
                          color="gray")]
            for method, peer_points in sorted(peers.items()):
                drawn.append(plot(ax, [p[0] for p in peer_points], [number(p[1]["cycle_us"]) for p in peer_points],
                                  "peer " + method, marker="^", ls=":"))
            return [d for d in drawn if d]

        def nonmodel(ax, points, peers):
            xs = [int(r["requests"]) for r in points]
            drawn = [plot(ax, xs, [number(r["nonmodel_us"]) for r in points], "smcgraph non-model", marker="o", lw=2),
                     plot(ax, xs, [number(r["floor_us"]) for r in points], "floor (bytes + nodes)", color="black"),
                     plot(ax, xs, [number(r["bytes_floor_us"]) for r in points], "bytes / copy bandwidth",
                          color="black", ls="--", lw=0.8),
                     plot(ax, xs, [number(r["node_floor_total_us"]) for r in points], "nodes x node floor",
                          color="black", ls=":", lw=0.8)]
            for method, peer_points in sorted(peers.items()):
                drawn.append(plot(ax, [p[0] for p in peer_points], [number(p[1]["nonmodel_us"]) for p in peer_points],
                                  "peer %s non-model" % method, marker="^", ls=":"))
            return [d for d in drawn if d]

        def tokens(ax, points, peers):
            xs = [int(r["requests"]) for r in points]
            graph = [number(r["request_tokens_per_s"]) for r in points]
            # Eager tokens/s from the same committed tokens per cycle as the graph run.
            eager = [number(r["request_tokens_per_s"]) * number(r["graph_us"]) / number(r["eager_us"]) for r in points]
            drawn = [plot(ax, xs, graph, "smcgraph graph", marker="o", lw=2),
                     plot(ax, xs, eager, "smcgraph eager", marker="s")]
            for method, peer_points in sorted(peers.items()):
                drawn.append(plot(ax, [p[0] for p in peer_points], [number(p[1]["tokens_per_s"]) for p in peer_points],
                                  "peer " + method, marker="^", ls=":"))
            return [d for d in drawn if d]

        figure("Median GPU time per cycle", "us per cycle", cycle_time, "cycle_time")
        figure("Non-model time per cycle vs its floor", "us per cycle", nonmodel, "nonmodel")
        figure("Request tokens per second", "tokens / s", tokens, "tokens_per_s")

    for path in written:
        print("plot_sweep: wrote %s" % path)
    if not written:
        print("plot_sweep: no rows in %s" % args.sweep, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

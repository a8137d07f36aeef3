#!/usr/bin/env python3
"""PyTorch peer of smcgraph's verify_pack_bench (bench/verify_pack_bench.cpp): seed 000's two-step pipeline.

Step 1, ATen greedy verification: mismatch = draft != target[:, :draft_steps]; the first mismatch (argmax of the
mismatch mask, or the cumulative product of the matches); accepted = draft_steps where nothing mismatched; next
tokens by gather; exclusive offsets by cumsum. Step 2, the pack: packed = draft_kv[mask] with
mask = arange(draft_steps) < accepted (boolean-mask indexing sizes its output on the host, so it synchronizes).

Same configurations, oracle construction (draft uniform in [0, 4096); k_i ~ Binomial(draft_steps, alpha); the target
agrees before k_i and differs at k_i), fp16 payload and byte count as the C++ bench; inputs rotate over enough
payload buffers that two reads of one buffer are more than 3x L2 apart. CUDA events recorded back to back
around each call, median over 200 calls after 20 warm-up calls.

Methods:
  torch_two_step_argmax    first mismatch = argmax(mismatch) (seed 000's baseline: eq, not, any, argmax, where)
  torch_two_step_cumprod   accepted = cumprod(matches).sum()

Usage: python3 bench/peers/verify_pack_peer.py [--csv results/verify_pack_peer.csv]
CSV columns (as verify_pack_bench): method, rows, draft_steps, alpha, kv_dim, dtype, packed_rows, median_us, min_us,
p90_us, gbs, fraction_of_copy, device. Then: verify_pack_bench --peer-csv results/verify_pack_peer.csv prints
peer time / smcgraph time per configuration.
"""

import argparse
import csv
import os
import statistics
import sys

VOCAB = 4096
ORACLE_SEED = 7
WARMUP = 20
REPETITIONS = 200
MAX_ROTATION = 512
CONFIGS = (
    [(4, 8, 0.3, 128), (4, 8, 0.9, 2048), (32, 8, 0.3, 128), (32, 8, 0.9, 2048)]
    + [(32, 128, alpha, kv_dim) for alpha in (0.3, 0.9) for kv_dim in (128, 512, 1024, 2048)]
    + [(256, 8, 0.6, 1024)]
)
HEADER = ["method", "rows", "draft_steps", "alpha", "kv_dim", "dtype", "packed_rows", "median_us", "min_us", "p90_us",
          "gbs", "fraction_of_copy", "device"]
METHODS = ["torch_two_step_argmax", "torch_two_step_cumprod"]


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="results/verify_pack_peer.csv", help="CSV output path (parents created)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError as error:
        print("verify_pack_peer: torch is not importable (%s)" % error, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("verify_pack_peer: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    properties = torch.cuda.get_device_properties(device)
    device_name = properties.name
    l2_bytes = int(getattr(properties, "L2_cache_size", 0) or (50 << 20))
    rotation_bytes = 3 * l2_bytes

    def two_step(draft, target, kv, draft_steps, cumprod):
        mismatch = draft != target[:, :draft_steps]
        if cumprod:
            accepted = torch.cumprod((~mismatch).to(torch.int64), dim=1).sum(dim=1)
        else:
            has_mismatch = mismatch.any(dim=1)
            first = mismatch.to(torch.int64).argmax(dim=1)
            accepted = torch.where(has_mismatch, first, torch.full_like(first, draft_steps))
        has_mismatch = accepted < draft_steps
        next_tokens = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
        offsets = torch.cumsum(accepted, 0) - accepted
        mask = torch.arange(draft_steps, device=draft.device).unsqueeze(0) < accepted.unsqueeze(1)
        packed = kv[mask]
        return accepted, has_mismatch, next_tokens, offsets, packed

    def oracle(rows, draft_steps, alpha):
        generator = torch.Generator().manual_seed(ORACLE_SEED)
        k = torch.binomial(torch.full((rows,), float(draft_steps)), torch.full((rows,), float(alpha)),
                           generator=generator).to(torch.int64)
        draft = torch.randint(0, VOCAB, (rows, draft_steps), generator=generator)
        target = torch.randint(0, VOCAB, (rows, draft_steps + 1), generator=generator)
        positions = torch.arange(draft_steps + 1).unsqueeze(0)
        padded = torch.cat([draft, torch.zeros(rows, 1, dtype=draft.dtype)], dim=1)
        target = torch.where(positions < k.unsqueeze(1), padded, target)
        shift = torch.randint(1, VOCAB, (rows,), generator=generator)
        rejected = (k < draft_steps).nonzero().squeeze(1)
        at_k = k[rejected]
        target[rejected, at_k] = (draft[rejected, at_k] + shift[rejected]) % VOCAB  # differs at k
        return draft.to(device), target.to(device), k.to(device)

    def copy_bandwidth_gbs():
        size = 1 << 30
        source = torch.ones(size, dtype=torch.uint8, device=device)
        destination = torch.empty_like(source)
        for _ in range(3):
            destination.copy_(source)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            destination.copy_(source)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del source, destination
        torch.cuda.empty_cache()
        return 2 * size / statistics.median(times) / 1e9

    copy_gbs = copy_bandwidth_gbs()
    print("verify_pack_peer on %s (torch %s): copy %.0f GB/s (read + write), fp16 payload, vocab %d, median of %d"
          % (device_name, torch.__version__, copy_gbs, VOCAB, REPETITIONS))
    print("%-24s %5s %11s %5s %6s %7s %10s %10s %9s %8s" % ("method", "rows", "draft_steps", "alpha", "kv_dim",
                                                          "packed", "median_us", "p90_us", "GB/s", "of_copy"))
    csv_dir = os.path.dirname(args.csv)
    if csv_dir:
        os.makedirs(csv_dir, exist_ok=True)
    status = 0
    with open(args.csv, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        for rows, draft_steps, alpha, kv_dim in CONFIGS:
            draft, target, k = oracle(rows, draft_steps, alpha)
            base = torch.randn(rows, draft_steps, kv_dim, device=device).to(torch.float16)
            payload_bytes = base.numel() * 2
            copies = max(1, min(MAX_ROTATION, -(-rotation_bytes // (2 * payload_bytes))))
            pool = [base.clone() for _ in range(copies)]
            total = int(k.sum().item())
            for method in METHODS:
                cumprod = method.endswith("cumprod")
                accepted, has_mismatch, next_tokens, offsets, packed = two_step(draft, target, pool[0], draft_steps,
                                                                                cumprod)
                expected_next = target.gather(1, k.unsqueeze(1)).squeeze(1)
                valid = (bool(torch.equal(accepted, k)) and bool(torch.equal(next_tokens, expected_next))
                         and packed.shape[0] == total and bool(torch.equal(has_mismatch, k < draft_steps)))
                if not valid:
                    print("INVALID %s rows %d draft_steps %d alpha %.2f kv_dim %d"
                          % (method, rows, draft_steps, alpha, kv_dim))
                    status = 1
                    continue
                for i in range(WARMUP):
                    two_step(draft, target, pool[i % copies], draft_steps, cumprod)
                events = [torch.cuda.Event(enable_timing=True) for _ in range(REPETITIONS + 1)]
                torch.cuda.synchronize()
                events[0].record()
                for i in range(REPETITIONS):
                    two_step(draft, target, pool[i % copies], draft_steps, cumprod)
                    events[i + 1].record()
                torch.cuda.synchronize()
                times_us = [1000.0 * events[i].elapsed_time(events[i + 1]) for i in range(REPETITIONS)]
                median_us = statistics.median(times_us)
                # Same byte count as the C++ bench (tokens counted as int32 there).
                moved = (2.0 * total * kv_dim * 2 + 4.0 * rows * (2 * draft_steps + 1) + 4.0 * total
                         + rows * (4.0 + 4.0 + 1.0 + 4.0) + 4.0)
                gbs = moved / (median_us * 1e3)
                writer.writerow([method, rows, draft_steps, "%.2f" % alpha, kv_dim, "fp16", total,
                                 "%.3f" % median_us, "%.3f" % min(times_us), "%.3f" % percentile(times_us, 0.9),
                                 "%.1f" % gbs, "%.3f" % (gbs / copy_gbs), device_name])
                handle.flush()
                print("%-24s %5d %11d %5.2f %6d %7d %10.2f %10.2f %9.1f %8.3f" % (
                    method, rows, draft_steps, alpha, kv_dim, total, median_us, percentile(times_us, 0.9), gbs,
                    gbs / copy_gbs))
                sys.stdout.flush()
            del pool, base
            torch.cuda.empty_cache()
    print("CSV: %s (verify_pack_bench --peer-csv %s prints the ratios)" % (args.csv, args.csv))
    return status


if __name__ == "__main__":
    sys.exit(main())

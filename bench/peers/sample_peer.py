#!/usr/bin/env python3
"""PyTorch / torch.compile / FlashInfer peers of smcgraph's sample_bench (bench/sample_bench.cpp).

Times one categorical sample per row from softmax(logits / T) on the same shapes and dtypes as the C++
bench, with the same measurement rules: CUDA events, median over 100 calls after warm-up, inputs rotated
over enough buffers that two reads of one buffer are more than 3x L2 apart (so HBM, not L2, is measured).

Methods (a method that cannot run here is skipped with a reason, the others go on):
  torch_gumbel_eager         Gumbel-max with log-prob: rand_like, g = -log(-log u), argmax(l/T + g),
                             logsumexp, gather (what smcgraph::sample computes, as separate kernels)
  torch_multinomial          torch.multinomial(softmax(l/T), 1) (no log-prob)
  torch_compile_gumbel       torch.compile(torch_gumbel_eager, dynamic=False), one compile per shape
  torch_gumbel_cudagraph     torch_gumbel_eager captured in a CUDA graph over the rotating buffers (per
                             call = replay time / calls per graph, as the C++ bench's graph timing)
  flashinfer_sampling_from_logits  flashinfer.sampling.sampling_from_logits on the raw logits (it takes no
                             temperature; a caller would fold 1/T into the LM head), when flashinfer imports

Usage: python3 bench/peers/sample_peer.py [--csv results/sample_peer.csv] [--quick] [--methods a,b,...]
CSV columns: method, rows, vocab, dtype, median_us, gbs (GB/s = logits bytes read / median time, 1e9 B/s).
"""

import argparse
import csv
import os
import statistics
import sys
import time

TEMPERATURE = 0.7
ROWS = [1, 8, 64, 256]
VOCABS = [32000, 128256, 151936]
QUICK_ROWS = [1, 64]
QUICK_VOCABS = [128256]
DTYPE_NAMES = ["fp32", "bf16"]
BUFFER_ALIGNMENT_BYTES = 256
MAX_BUFFERS = 4096
MIN_CALLS_PER_GRAPH = 20
WARMUP = 10
REPETITIONS = 100
GRAPH_WARMUP = 3
GRAPH_REPETITIONS = 20
ALL_METHODS = [
    "torch_gumbel_eager",
    "torch_multinomial",
    "torch_compile_gumbel",
    "torch_gumbel_cudagraph",
    "flashinfer_sampling_from_logits",
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="results/sample_peer.csv", help="CSV output path (parents are created)")
    parser.add_argument("--quick", action="store_true", help="rows {1, 64} x vocab {128256} x {fp32, bf16}")
    parser.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated subset of the methods")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        parser.error("unknown method(s) %s; known: %s" % (", ".join(unknown), ", ".join(ALL_METHODS)))
    return args


def main():
    args = parse_args()
    try:
        import torch
    except ImportError as error:
        print("sample_peer: torch is not importable (%s)" % error, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sample_peer: torch.cuda.is_available() is False", file=sys.stderr)
        return 2

    device = torch.device("cuda", torch.cuda.current_device())
    properties = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(properties, "L2_cache_size", 0) or (50 << 20))
    rotation_bytes = 3 * l2_bytes
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

    # --- the methods --------------------------------------------------------------------------------------
    def torch_gumbel_eager(logits):
        x = logits.float() / TEMPERATURE
        u = torch.rand_like(x)
        g = -torch.log(-torch.log(u))
        tokens = torch.argmax(x + g, dim=-1)
        lse = torch.logsumexp(x, dim=-1)
        logprobs = torch.gather(x, -1, tokens.unsqueeze(-1)).squeeze(-1) - lse
        return tokens, logprobs

    def torch_multinomial(logits):
        probs = torch.softmax(logits.float() / TEMPERATURE, dim=-1)
        return torch.multinomial(probs, 1).squeeze(-1), None

    skipped = {}  # method -> reason it cannot run at all here
    methods = {}
    if "torch_gumbel_eager" in args.methods:
        methods["torch_gumbel_eager"] = torch_gumbel_eager
    if "torch_multinomial" in args.methods:
        methods["torch_multinomial"] = torch_multinomial
    if "torch_compile_gumbel" in args.methods:
        try:
            import torch._dynamo

            # One compile per (shape, dtype): lift the recompile limits so no shape falls back to eager.
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 1024)
            for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 4096)
            methods["torch_compile_gumbel"] = torch.compile(torch_gumbel_eager, dynamic=False)
        except Exception as error:  # noqa: BLE001 - report any reason and go on
            skipped["torch_compile_gumbel"] = "torch.compile unavailable: %s" % error
    if "torch_gumbel_cudagraph" in args.methods:
        methods["torch_gumbel_cudagraph"] = torch_gumbel_eager  # captured per shape below
    if "flashinfer_sampling_from_logits" in args.methods:
        try:
            from flashinfer.sampling import sampling_from_logits

            methods["flashinfer_sampling_from_logits"] = lambda logits: (sampling_from_logits(logits), None)
        except Exception as error:  # noqa: BLE001 - ImportError, or a broken install (missing JIT toolchain)
            skipped["flashinfer_sampling_from_logits"] = "flashinfer not importable: %s" % error

    print(
        "sample_peer on %s (torch %s): T = %.2f, rotating > %.0f MB of logits per shape, median of %d calls"
        % (properties.name, torch.__version__, TEMPERATURE, rotation_bytes / 1e6, REPETITIONS)
    )
    for method, reason in skipped.items():
        print("  skipped %s: %s" % (method, reason))
    sys.stdout.flush()

    # --- helpers -------------------------------------------------------------------------------------------
    def make_pool(rows, vocab, dtype):
        """Rotation buffers, every one holding the same realistic logits (normal, sigma 2-3, plus outliers)."""
        element_bytes = torch.finfo(dtype).bits // 8
        buffer_bytes = rows * vocab * element_bytes
        buffers = min(MAX_BUFFERS, max(2, -(-rotation_bytes // buffer_bytes)))
        pitch = -(-buffer_bytes // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES // element_bytes
        generator = torch.Generator(device=device)
        generator.manual_seed(rows * 1000003 + vocab)
        sigma = 2.0 + torch.rand(rows, 1, device=device, generator=generator)
        mean = -1.0 + 2.0 * torch.rand(rows, 1, device=device, generator=generator)
        base = torch.randn(rows, vocab, device=device, generator=generator) * sigma + mean
        outliers = torch.randint(0, vocab, (rows, 6), device=device, generator=generator)
        base.scatter_(1, outliers, mean + 8.0 + 8.0 * torch.rand(rows, 6, device=device, generator=generator))
        pool = torch.empty(buffers, pitch, device=device, dtype=dtype)
        views = []
        for b in range(buffers):
            view = pool[b, : rows * vocab].view(rows, vocab)
            view.copy_(base)
            views.append(view)
        torch.cuda.synchronize()
        return views, buffer_bytes

    def validate(method, rows, vocab, views):
        tokens, logprobs = methods[method](views[0])
        torch.cuda.synchronize()
        tokens = tokens.reshape(-1).long()
        if tokens.numel() != rows:
            return "got %d tokens for %d rows" % (tokens.numel(), rows)
        if bool((tokens < 0).any()) or bool((tokens >= vocab).any()):
            return "token out of range"
        if logprobs is not None:
            if not bool(torch.isfinite(logprobs).all()) or bool((logprobs > 1e-5).any()):
                return "log-prob not finite and <= 0"
        return None

    def time_calls(fn, views, next_index):
        """Events recorded back to back between calls (no sync in between), median per call in us."""
        count = len(views)
        for _ in range(WARMUP):
            fn(views[next_index % count])
            next_index += 1
        events = [torch.cuda.Event(enable_timing=True) for _ in range(REPETITIONS + 1)]
        events[0].record()
        for i in range(REPETITIONS):
            fn(views[next_index % count])
            next_index += 1
            events[i + 1].record()
        torch.cuda.synchronize()
        times_us = [1000.0 * events[i].elapsed_time(events[i + 1]) for i in range(REPETITIONS)]
        return statistics.median(times_us), next_index

    def time_cudagraph(fn, views):
        """Captures one call per rotation buffer (at least MIN_CALLS_PER_GRAPH) into one graph."""
        calls = max(len(views), MIN_CALLS_PER_GRAPH)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch's docs ask
            for i in range(3):
                fn(views[i % len(views)])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        outputs = []
        with torch.cuda.graph(graph):
            for i in range(calls):
                outputs.append(fn(views[i % len(views)]))
        for _ in range(GRAPH_WARMUP):
            graph.replay()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(GRAPH_REPETITIONS + 1)]
        events[0].record()
        for i in range(GRAPH_REPETITIONS):
            graph.replay()
            events[i + 1].record()
        torch.cuda.synchronize()
        times_us = [1000.0 * events[i].elapsed_time(events[i + 1]) / calls for i in range(GRAPH_REPETITIONS)]
        del outputs, graph
        return statistics.median(times_us)

    # --- the sweep ------------------------------------------------------------------------------------------
    rows_list = QUICK_ROWS if args.quick else ROWS
    vocab_list = QUICK_VOCABS if args.quick else VOCABS
    csv_dir = os.path.dirname(args.csv)
    if csv_dir:
        os.makedirs(csv_dir, exist_ok=True)
    results = []
    started = time.time()
    with open(args.csv, "w", newline="") as csv_file:
        writer = csv.writer(csv_file)
        writer.writerow(["method", "rows", "vocab", "dtype", "median_us", "gbs"])
        csv_file.flush()
        print("%-32s %5s %7s %5s %11s %8s" % ("method", "rows", "vocab", "dtype", "median_us", "GB/s"))
        for vocab in vocab_list:
            for rows in rows_list:
                for dtype_name in DTYPE_NAMES:
                    views, buffer_bytes = make_pool(rows, vocab, dtypes[dtype_name])
                    next_index = 0
                    for method in methods:
                        try:
                            problem = validate(method, rows, vocab, views)  # also compiles torch.compile
                            if problem is not None:
                                print("%-32s %5d %7d %5s  INVALID: %s" % (method, rows, vocab, dtype_name, problem))
                                continue
                            if method == "torch_gumbel_cudagraph":
                                median_us = time_cudagraph(methods[method], views)
                            else:
                                median_us, next_index = time_calls(methods[method], views, next_index)
                        except Exception as error:  # noqa: BLE001 - one failing peer must not stop the others
                            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                            print("%-32s %5d %7d %5s  SKIPPED: %s" % (method, rows, vocab, dtype_name, message[:160]))
                            try:
                                torch.cuda.synchronize()
                            except Exception:  # noqa: BLE001 - a sticky CUDA error: stop here, keep what was written
                                print("sample_peer: CUDA context unusable after %s; stopping" % method)
                                return 1 if not results else 0
                            continue
                        gbs = buffer_bytes / (median_us * 1e3)
                        writer.writerow([method, rows, vocab, dtype_name, "%.3f" % median_us, "%.1f" % gbs])
                        csv_file.flush()
                        results.append((method, rows, vocab, dtype_name, median_us, gbs))
                        print("%-32s %5d %7d %5s %11.2f %8.0f" % (method, rows, vocab, dtype_name, median_us, gbs))
                        sys.stdout.flush()
                    del views
                    torch.cuda.empty_cache()
    print("sample_peer: %d rows in %s (%.0f s)" % (len(results), args.csv, time.time() - started))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())

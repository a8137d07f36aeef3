"""Shared pieces of the PyTorch cycle peers (smc_peer.py, spec_peer.py): the toy weights reader, the toy draft /
target model with its slot-indexed KV cache, and the timing helpers, so both peers run the same models the same
way. Imported by the peers (they put their own directory on sys.path by being run as scripts); not a script.

  peer_argument_parser(...)         the command line both peers share (manifest, csv, methods, device, ...);
  parse_peer_arguments(parser, methods)
                                    parses it, checks the method names, splits --requests
  import_torch_and_manifest(prog, args)
                                    (torch, manifest) or the exit status 2 after a message naming what is missing
  GraphedCycle(torch, eager, graphed, captures, before, after)
                                    a method's cycle driver: eager, or captured parts replayed between host parts
  load_safetensors(path)            (metadata, {name: (shape, raw float32 bytes)}) of toy_weights_v<V>.safetensors
  ToyKit(torch, device, manifest, manifest_dir)
    .Weights(tensors, prefix)       one model's weights on the device (E [V, H], P [period, H], W [V, H], b [V])
    .Model(weights, dtype, exact)   weights + KV cache [pool_size, H]; forward(tokens, positions, slot_table,
                                    seq_lens, out_slots) -> logits [R, T, V] in the logits dtype. exact=True
                                    reproduces the toy kernels' float operations bit for bit (validation);
                                    exact=False is the fast matmul forward (timing)
    .weights_for(vocab)             (draft, target) Weights of the manifest's weights file, cached (one vocabulary)
    .time_cycles(driver, cycles)    median and p90 us per driver.cycle(): CUDA events between cycles (GPU) or
                                    wall clock (CPU)
    .time_model_forwards(draft_w, target_w, dtype, rows, steps)
                                    us of draft head (rows x 2) + (K - 1) draft steps (rows x 1) + target verify
                                    (rows x K + 1), captured in one CUDA graph (as the C++ side times its models)
    .timing_prompts(requests, vocab, length)
                                    the sweep's timing prompts: token i of request slot q is
                                    ((q + 1) * 7919 + i * 104729) % vocab

The model (toy_weights_io.md): kv[slot] = E[t] + P[p % period]; hidden = mean of the window's KV read through
the slot table; logits = b + W g(hidden), g(x) = x / (1 + |x|).
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

BASE_POSITION = 100  # positions of the stand-alone model forwards (full window)
MODEL_REPETITIONS = 20
MODEL_WARMUP = 3
CSV_COLUMNS = ["method", "requests", "particles", "steps", "vocab", "dtype", "cycle_us", "tokens_per_s",
               "cycle_p90_us", "model_us", "nonmodel_us", "valid", "device", "torch"]


def peer_argument_parser(description, default_csv, methods, manifest_help):
    """The options both cycle peers take; the caller may add its own before parse_peer_arguments."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default="results/bucket_sweep_peer.json", help=manifest_help)
    parser.add_argument("--csv", default=default_csv, help="CSV output path (parents are created)")
    parser.add_argument("--methods", default=",".join(methods), help="comma-separated subset of the methods")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: eager method only, wall-clock timing (for checking the logic without a GPU)")
    parser.add_argument("--only-validate", action="store_true", help="validate, do not time")
    parser.add_argument("--skip-validation", action="store_true", help="time without validating first")
    parser.add_argument("--cycles", type=int, default=0, help="timed cycles per run (default: the manifest's)")
    parser.add_argument("--requests", default="", help="subset of the manifest's request counts, e.g. 1,8")
    return parser


def parse_peer_arguments(parser, methods):
    """Parses the command line; --methods must name known methods (a usage error otherwise)."""
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in methods]
    if unknown:
        parser.error("unknown method(s) %s; known: %s" % (", ".join(unknown), ", ".join(methods)))
    args.requests = [int(x) for x in args.requests.split(",") if x.strip()]
    return args


def import_torch_and_manifest(prog, args):
    """(torch, manifest) for a peer run, or 2 (the exit status) after a message: torch missing, no CUDA device
    for --device cuda, or a manifest that cannot be read."""
    try:
        import torch
    except ImportError as error:
        print("%s: torch is not importable (%s)" % (prog, error), file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("%s: torch.cuda.is_available() is False (use --device cpu to check the logic)" % prog, file=sys.stderr)
        return 2
    try:
        with open(args.manifest) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        print("%s: cannot read the manifest %s (%s); run bucket_sweep first" % (prog, args.manifest, error),
              file=sys.stderr)
        return 2
    return torch, manifest


def median_cycle_us(torch, driver, cycles, on_gpu):
    """(median, p90) microseconds of `cycles` calls of driver.cycle(), each bracketed by CUDA events on the GPU,
    by perf_counter on the CPU. Shared by the toy and llama peers."""
    if on_gpu:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(cycles + 1)]
        events[0].record()
        for i in range(cycles):
            driver.cycle()
            events[i + 1].record()
        torch.cuda.synchronize()
        us = [1000.0 * events[i].elapsed_time(events[i + 1]) for i in range(cycles)]
    else:
        us = []
        for _ in range(cycles):
            start = time.perf_counter()
            driver.cycle()
            us.append(1e6 * (time.perf_counter() - start))
    us.sort()
    return statistics.median(us), us[min(len(us) - 1, math.ceil(0.9 * len(us)) - 1)]


class GraphedCycle:
    """Drives one peer method's cycles (the toy and llama peers): eagerly, or with parts of the cycle captured
    once as CUDA graphs and replayed.

    eager():     one whole cycle, eagerly.
    captures:    when graphed, callables each captured into its own graph, in order, after the warm-up cycles
                 (run on a side stream, so lazy initialisation such as cuBLAS workspaces happens outside any
                 capture); capturing only records work, so the state does not change.
    before() / after(): the host-side parts of a graphed cycle around the replays (slot allocation, commit,
                 resampling); None for nothing.
    warm_up(cycles) and cycle() are what the timing helpers call."""

    def __init__(self, torch, eager, graphed, captures=(), before=None, after=None):
        self.torch, self.eager, self.graphed = torch, eager, graphed
        self.captures, self.before, self.after = list(captures), before, after
        self.graphs = []

    def warm_up(self, cycles):
        torch = self.torch
        if not self.graphed:
            for _ in range(cycles):
                self.eager()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, cycles)):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graphs = []
        for capture in self.captures:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                capture()
            self.graphs.append(graph)
        torch.cuda.synchronize()

    def cycle(self):
        if not self.graphs:
            self.eager()
            return
        if self.before is not None:
            self.before()
        for graph in self.graphs:
            graph.replay()
        if self.after is not None:
            self.after()


def median_forwards_us(torch, forwards, on_gpu, warmup=MODEL_WARMUP, repetitions=MODEL_REPETITIONS):
    """Median microseconds of `forwards()` replayed as one CUDA graph (captured on a side stream, warmed up, timed
    with CUDA events); on the CPU one timed call after one warm-up call. Shared by the toy and llama peers."""
    if not on_gpu:
        forwards()
        start = time.perf_counter()
        forwards()
        return 1e6 * (time.perf_counter() - start)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forwards()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        forwards()
    for _ in range(warmup):
        graph.replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repetitions + 1)]
    events[0].record()
    for i in range(repetitions):
        graph.replay()
        events[i + 1].record()
    torch.cuda.synchronize()
    result = statistics.median(1000.0 * events[i].elapsed_time(events[i + 1]) for i in range(repetitions))
    del graph
    return result


def load_safetensors(path):
    """(metadata, {name: (shape, raw little-endian float32 bytes)}) of a safetensors file; F32 only."""
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes).decode("utf-8"))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        if info["dtype"] != "F32":
            raise ValueError("%s: tensor %s has dtype %s, expected F32" % (path, name, info["dtype"]))
        begin, end = info["data_offsets"]
        count = 1
        for extent in info["shape"]:
            count *= extent
        if end - begin != 4 * count or end > len(data):
            raise ValueError("%s: tensor %s: %d bytes for shape %s" % (path, name, end - begin, info["shape"]))
        tensors[name] = (info["shape"], bytearray(data[begin:end]))
    return metadata, tensors


def _toy_classes(torch, device, pool_size, window, period):
    int64 = torch.int64

    class ToyWeights:
        """One model's weights on the device (E [V, H], P [period, H], W [V, H], b [V])."""

        def __init__(self, tensors, prefix):
            def get(name):
                shape, raw = tensors[prefix + "." + name]
                return torch.frombuffer(raw, dtype=torch.float32).reshape(shape).to(device)

            self.embedding = get("embedding")
            self.position = get("position")
            self.head = get("head")
            self.bias = get("bias")
            self.vocab, self.hidden = self.head.shape
            if self.position.shape[0] != period:
                raise ValueError("position table has %d rows, manifest says %d" % (self.position.shape[0], period))

    class ToyModel:
        """Weights + a KV cache [pool_size, H] indexed by slot id (slot 0: the never-written dummy)."""

        def __init__(self, weights, logits_dtype, exact=False):
            self.w = weights
            self.logits_dtype = logits_dtype
            self.exact = exact
            self.kv = torch.zeros(pool_size, weights.hidden, device=device)
            self.offsets = torch.arange(window, device=device, dtype=int64) - (window - 1)

        def forward(self, tokens, positions, slot_table, seq_lens, out_slots):
            """tokens / positions / out_slots [R, T], slot_table [R, S], seq_lens [R] -> logits [R, T, V]."""
            w = self.w
            rows, per_row = tokens.shape
            hidden = w.hidden
            # 1. KV of every token of the forward first (token j sees tokens < j of the same forward).
            values = w.embedding[tokens] + w.position[positions % period]
            self.kv.index_copy_(0, out_slots.reshape(-1), values.reshape(-1, hidden))
            # 2. Mean of the window's KV, read through the slot table.
            q = positions.unsqueeze(-1) + self.offsets  # [R, T, window], increasing positions
            last = torch.minimum(positions, (seq_lens - 1).unsqueeze(-1))
            valid = (q >= 0) & (q <= last.unsqueeze(-1))
            slots = torch.gather(slot_table, 1, q.clamp(0, slot_table.shape[1] - 1).reshape(rows, -1))
            slots = torch.where(valid, slots.reshape(rows, per_row, window), 0)
            count = valid.sum(-1, keepdim=True)
            if self.exact:  # the kernel's order: add the window's entries one by one, increasing position
                total = torch.zeros(rows, per_row, hidden, device=device)
                for k in range(window):
                    total = total + torch.where(valid[..., k : k + 1], self.kv[slots[..., k]], 0.0)
            else:
                total = self.kv[slots].sum(2)
            mean = total / count.clamp(min=1).to(torch.float32)
            g = torch.where(count > 0, mean / (1.0 + mean.abs()), 0.0).reshape(-1, hidden)
            # 3. LM head.
            if self.exact:  # bias, then one fused multiply-add per h in increasing h (float64 product is exact)
                head64 = w.head.double()
                g64 = g.double()
                logits = w.bias.unsqueeze(0).expand(g.shape[0], -1).clone()
                for h in range(hidden):
                    logits = (head64[:, h].unsqueeze(0) * g64[:, h : h + 1] + logits.double()).float()
            else:
                logits = torch.addmm(w.bias, g, w.head.t())
            return logits.to(self.logits_dtype).reshape(rows, per_row, w.vocab)

    return ToyWeights, ToyModel


class ToyKit:
    """The toy models and timing helpers for one manifest on one device (see the module comment)."""

    def __init__(self, torch, device, manifest, manifest_dir):
        self.torch = torch
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.manifest = manifest
        self.manifest_dir = manifest_dir
        self.max_seq_len = int(manifest["max_seq_len"])
        self.pool_size = int(manifest["slot_pool_size"])
        toy = manifest["toy"]
        self.window = int(toy["window"])
        self.period = int(toy["position_period"])
        self.Weights, self.Model = _toy_classes(torch, device, self.pool_size, self.window, self.period)
        self._weights_cache = {}

    def weights_for(self, vocab):
        torch = self.torch
        if vocab not in self._weights_cache:
            self._weights_cache.clear()
            if self.on_gpu:
                torch.cuda.empty_cache()
            path = os.path.join(self.manifest_dir, self.manifest["weights"][str(vocab)])
            metadata, tensors = load_safetensors(path)
            if int(metadata.get("vocab", vocab)) != vocab:
                raise ValueError("%s holds vocab %s, expected %d" % (path, metadata.get("vocab"), vocab))
            for key, expected in (("max_seq_len", self.max_seq_len), ("pool_size", self.pool_size),
                                  ("window", self.window)):
                if key in metadata and int(metadata[key]) != expected:
                    raise ValueError("%s: %s = %s, the manifest says %d" % (path, key, metadata[key], expected))
            self._weights_cache[vocab] = (self.Weights(tensors, "draft"), self.Weights(tensors, "target"))
        return self._weights_cache[vocab]

    def time_cycles(self, driver, cycles):
        return median_cycle_us(self.torch, driver, cycles, self.on_gpu)

    def time_model_forwards(self, draft_weights, target_weights, logits_dtype, rows, steps):
        """Draft head (rows x 2) + (K - 1) draft steps (rows x 1) + verify (rows x K + 1) in one graph."""
        torch, device = self.torch, self.device
        int64 = torch.int64
        max_seq_len, pool_size = self.max_seq_len, self.pool_size
        draft = self.Model(draft_weights, logits_dtype)
        target = self.Model(target_weights, logits_dtype)
        vocab = draft_weights.vocab
        r = torch.arange(rows, device=device, dtype=int64).unsqueeze(1)
        q = torch.arange(max_seq_len, device=device, dtype=int64)
        slot_table = 1 + (r * max_seq_len + q) % (pool_size - 1)

        def inputs(per_row):
            j = torch.arange(per_row, device=device, dtype=int64)
            tokens = (r * 131 + j * 7919 + 5) % vocab
            positions = (BASE_POSITION + j).expand(rows, per_row).contiguous()
            seq = torch.full((rows,), BASE_POSITION + per_row, device=device, dtype=int64)
            return tokens, positions, slot_table, seq, slot_table.gather(1, positions)

        head, one, verify = inputs(2), inputs(1), inputs(steps + 1)

        def forwards():
            draft.forward(*head)
            for _ in range(steps - 1):
                draft.forward(*one)
            target.forward(*verify)

        return median_forwards_us(torch, forwards, self.on_gpu)

    def timing_prompts(self, requests, vocab, length):
        torch = self.torch
        int64 = torch.int64
        q = torch.arange(requests, device=self.device, dtype=int64).unsqueeze(1)
        i = torch.arange(length, device=self.device, dtype=int64)
        return ((q + 1) * 7919 + i * 104729) % vocab

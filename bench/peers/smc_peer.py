#!/usr/bin/env python3
"""PyTorch peer of smcgraph's bucket_sweep (bench/bucket_sweep.cpp): the same SMC cycle, the same toy models.

The C++ sweep writes the toy weights and the engine config (toy_weights_v<V>.safetensors, format in
bench/peers/toy_weights_io.md) and a manifest (bucket_sweep_peer.json: the grid, the run's constants and the
engine's tokens for a few validation prompts). This script loads them and runs the SMC cycle of DESIGN.md §2
(deferred bonus) in PyTorch, the way a first implementation would be written:

  alloc K + 1 slots per row from a free list -> draft head (2-token forward on [x_{L-2}, x_{L-1}]) and
  K - 1 one-token draft steps, each followed by a Gumbel-max sample (torch.rand) and its log q ->
  target verify forward over [x_{L-1}, d_1 .. d_K] -> log-softmax scores of the drafts, bonus token and logZ
  -> log-weights -> commit -> per request: ESS, systematic resampling with a torch uniform -> block-table
  reshuffle with index_select and refcount updates (index_add_), freed slots back to the free list.

The toy forward (toy_torch.py, shared with spec_peer.py) keeps a KV cache per model indexed by slot ids read
through a slot-table tensor: kv[slot] = E[t] + P[p % 64]; hidden = mean of the window's KV; logits = b + W g(hidden),
g(x) = x / (1 + |x|).

Methods (CSV column `method`):
  torch_eager        every stage eager, host loop; the resampling step syncs (`if need.any()`, the freed-slot
                     list), as in a first implementation
  torch_graph_draft  the draft phase (head + K - 1 steps with their sampling) captured once per bucket with
                     torch.cuda.graphs and replayed; verify, scoring, weights, commit, resampling and the
                     reshuffle eager (the SMC-SD engine's first graphed version)
  torch_graph_cycle  draft phase + verify + scoring + weights + commit captured; alloc, resampling and the
                     reshuffle eager (the SMC-SD engine v0.2.0 capture boundary)

Validation before timing: with a greedy target (T_t = 0) and a near-zero draft temperature, the peer's
particle-0 tokens must equal the engine's (from the manifest). First with an exact forward that reproduces the
toy kernels' float operations bit for bit (sequential window sum, one fused multiply-add per hidden unit in
float64 then rounded), then with each method's own (matmul) forward. A mismatch counts as explained only where
the logits leave the choice open: tokens within Gumbel reach of the maximum (50 x T) for the exact forward, plus
the matmul rounding slack (and one bf16 ulp) for the fast forward; comparison of that prompt stops there.

Timing: per bucket and method, fresh state, prompts of 32 tokens, 3 warm-up cycles, then `cycles` cycles with a
CUDA event between cycles (median). model_us = draft head + (K - 1) draft steps + verify forwards alone, captured
in one CUDA graph (as the C++ side times its models), so nonmodel_us = cycle_us - model_us compares with
smcgraph's non-model time. Slot invariants (refcounts = references, free list disjoint and complete) are checked
after every timed run.

Usage:
  python3 bench/peers/smc_peer.py --manifest results/bucket_sweep_peer.json [--csv results/smc_peer.csv]
         [--methods torch_eager,torch_graph_draft,torch_graph_cycle] [--only-validate] [--skip-validation]
         [--device cuda|cpu] [--cycles C] [--requests 1,8]
CSV columns: method, requests, particles, steps, vocab, dtype, cycle_us, tokens_per_s, cycle_p90_us, model_us,
nonmodel_us, valid, device, torch. tokens_per_s = requests x (K + 1) / cycle time. Exit status 0, or 1 when a
validation or a slot check failed, 2 when it could not run.
"""

import csv
import math
import os
import sys

import toy_torch  # beside this script: the toy models and timing helpers shared with spec_peer.py
from toy_torch import CSV_COLUMNS

ALL_METHODS = ["torch_eager", "torch_graph_draft", "torch_graph_cycle"]
GRAPH_METHODS = {"torch_graph_draft", "torch_graph_cycle"}
GUMBEL_REACH = 50.0  # Gumbel noise reorders logits only within this many temperatures of each other (P ~ e^-50)


def parse_args():
    parser = toy_torch.peer_argument_parser(__doc__, "results/smc_peer.csv", ALL_METHODS,
                                            "written by bucket_sweep (default results/bucket_sweep_peer.json)")
    return toy_torch.parse_peer_arguments(parser, ALL_METHODS)


def main():
    args = parse_args()
    loaded = toy_torch.import_torch_and_manifest("smc_peer", args)
    if loaded == 2:
        return 2
    torch, manifest = loaded
    manifest_dir = os.path.dirname(os.path.abspath(args.manifest))

    torch.set_float32_matmul_precision("highest")  # no TF32: the toy head is fp32
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    methods = [m for m in args.methods if on_gpu or m not in GRAPH_METHODS]
    if not methods:
        print("smc_peer: no method can run on %s" % device, file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    max_seq_len = int(manifest["max_seq_len"])
    pool_size = int(manifest["slot_pool_size"])
    int64 = torch.int64
    kit = toy_torch.ToyKit(torch, device, manifest, manifest_dir)  # the toy models (toy_torch.py)
    ToyModel = kit.Model

    # ------------------------------------------------------------------------------------------------------
    # Sampling and scoring

    tiny = torch.finfo(torch.float32).tiny

    def gumbel_argmax(x):
        u = torch.rand_like(x).clamp_min_(tiny)
        return torch.argmax(x - torch.log(-torch.log(u)), dim=-1)

    def sample(logits, temperature, alpha=1.0):
        """Token, log-prob under softmax(alpha l / T) and logZ = lse(alpha l / T) - alpha lse(l / T) per row."""
        l = logits.float()
        if temperature == 0.0:
            token = torch.argmax(l, dim=-1)
            zeros = torch.zeros(l.shape[0], device=device)
            return token, zeros, zeros
        x = l / temperature
        power = x if alpha == 1.0 else alpha * x
        token = gumbel_argmax(power)
        lse_power = torch.logsumexp(power, dim=-1)
        logprob = power.gather(1, token.unsqueeze(1)).squeeze(1) - lse_power
        logz = torch.zeros_like(lse_power) if alpha == 1.0 else lse_power - alpha * torch.logsumexp(x, dim=-1)
        return token, logprob, logz

    def score(logits, drafts, temperature, alpha):
        """logits [R, K + 1, V]: log p(d_k) at k < K under softmax(l / T), bonus and logZ at K."""
        steps = drafts.shape[1]
        l = logits.float()
        if temperature == 0.0:  # greedy target: log p is 0 for the argmax, -inf otherwise
            head = l[:, :steps]
            chosen = head.gather(2, drafts.unsqueeze(-1)).squeeze(-1)
            logp = torch.where(chosen == head.amax(-1), 0.0, -math.inf)
        else:
            x = l[:, :steps] / temperature
            logp = x.gather(2, drafts.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)
        bonus, _, logz = sample(l[:, steps], temperature, alpha)
        return logp, bonus, logz

    # ------------------------------------------------------------------------------------------------------
    # The SMC engine in PyTorch

    class Recorder:
        """Per request, per generated token of particle 0: the 16 largest logits it was drawn from."""

        def __init__(self, requests, particles):
            self.rows = torch.arange(requests, device=device, dtype=int64) * particles
            self.records = [[] for _ in range(requests)]

        def add(self, kind, logits_rows):
            values, indices = torch.topk(logits_rows[self.rows].float(), 16, dim=-1)
            values, indices = values.cpu().tolist(), indices.cpu().tolist()
            for q in range(len(self.records)):
                self.records[q].append((kind, values[q], indices[q]))

    class SmcState:
        """Device state of `requests` requests x `particles` particles, every row live, uniform lengths."""

        def __init__(self, draft_weights, target_weights, logits_dtype, requests, particles, steps, params,
                     exact=False, recorder=None):
            self.Q, self.N, self.K = requests, particles, steps
            self.R = requests * particles
            self.p = params
            self.draft = ToyModel(draft_weights, logits_dtype, exact)
            self.target = ToyModel(target_weights, logits_dtype, exact)
            self.recorder = recorder
            R, K = self.R, steps
            self.slot_table = torch.zeros(R, max_seq_len, device=device, dtype=int64)
            self.token_table = torch.zeros(R, max_seq_len, device=device, dtype=int64)
            self.seq_len = torch.zeros(R, device=device, dtype=int64)
            self.logw = torch.zeros(R, device=device, dtype=torch.float64)
            self.log_evidence = torch.zeros(requests, device=device, dtype=torch.float64)
            self.refcount = torch.zeros(pool_size, device=device, dtype=int64)
            self.free_slots = torch.arange(1, pool_size, device=device, dtype=int64)  # slot 0 is the dummy
            self.drafts = torch.zeros(R, K, device=device, dtype=int64)
            self.logq = torch.zeros(R, K, device=device)
            self.arange2 = torch.arange(2, device=device, dtype=int64)
            self.arange_k1 = torch.arange(K + 1, device=device, dtype=int64)
            self.particle_ids = torch.arange(particles, device=device, dtype=int64)
            self.request_base = torch.arange(requests, device=device, dtype=int64).unsqueeze(1) * particles
            self.length = 0  # host copy of the (uniform) row length L
            self.prompt_length = 0

        def take_slots(self, count):
            if self.free_slots.numel() < count:
                raise RuntimeError("slot pool exhausted (%d free, %d needed)" % (self.free_slots.numel(), count))
            slots, self.free_slots = self.free_slots[:count], self.free_slots[count:]
            return slots

        def admit(self, prompts):
            """Prefill both models over the prompts [Q, P], x_P from the target, fan out to N particles."""
            Q, N, P = self.Q, self.N, prompts.shape[1]
            rows0 = self.request_base.squeeze(1)
            slots = self.take_slots(Q * (P + 1)).reshape(Q, P + 1)
            self.slot_table[rows0, : P + 1] = slots
            self.token_table[rows0, :P] = prompts
            positions = torch.arange(P, device=device, dtype=int64).expand(Q, P)
            seq = torch.full((Q,), P, device=device, dtype=int64)
            table0 = self.slot_table[rows0]
            self.draft.forward(prompts, positions, table0, seq, slots[:, :P])
            logits = self.target.forward(prompts, positions, table0, seq, slots[:, :P])
            first, _, _ = sample(logits[:, P - 1], self.p["target_temperature"], self.p["alpha"])
            if self.recorder is not None:
                self.recorder.add("target", logits[:, P - 1].repeat_interleave(N, 0))
            self.token_table[rows0, P] = first
            # Fan-out: every particle shares the prompt's slots (refcount N).
            self.slot_table.copy_(self.slot_table[rows0].repeat_interleave(N, 0))
            self.token_table.copy_(self.token_table[rows0].repeat_interleave(N, 0))
            self.seq_len.fill_(P + 1)
            self.refcount[slots.reshape(-1)] = N
            self.length = P + 1
            self.prompt_length = P

        # --- stages ------------------------------------------------------------------------------------------
        def alloc(self):
            K = self.K
            if self.length + K + 1 > max_seq_len:
                raise RuntimeError("rows would pass max_seq_len %d (fewer cycles)" % max_seq_len)
            slots = self.take_slots(self.R * (K + 1)).reshape(self.R, K + 1)
            self.slot_table.scatter_(1, self.seq_len.unsqueeze(1) + self.arange_k1, slots)
            self.refcount[slots.reshape(-1)] = 1

        def draft_phase(self):
            """Draft head on [x_{L-2}, x_{L-1}], then K - 1 one-token steps, each sampled (capturable)."""
            L = self.seq_len
            T_d = self.p["draft_temperature"]
            head_positions = L.unsqueeze(1) - 2 + self.arange2
            logits = self.draft.forward(self.token_table.gather(1, head_positions), head_positions, self.slot_table,
                                        L, self.slot_table.gather(1, head_positions))
            token, logq, _ = sample(logits[:, 1], T_d)
            if self.recorder is not None:
                self.recorder.add("draft", logits[:, 1])
            self.drafts[:, 0].copy_(token)
            self.logq[:, 0].copy_(logq)
            for s in range(1, self.K):
                positions = (L + (s - 1)).unsqueeze(1)
                logits = self.draft.forward(self.drafts[:, s - 1 : s], positions, self.slot_table, L + s,
                                            self.slot_table.gather(1, positions))
                token, logq, _ = sample(logits[:, 0], T_d)
                if self.recorder is not None:
                    self.recorder.add("draft", logits[:, 0])
                self.drafts[:, s].copy_(token)
                self.logq[:, s].copy_(logq)

        def verify_phase(self):
            """Target verify, scores, weights and the commit (capturable)."""
            K, L = self.K, self.seq_len
            alpha = self.p["alpha"]
            positions = L.unsqueeze(1) - 1 + self.arange_k1
            tokens = torch.cat([self.token_table.gather(1, positions[:, :1]), self.drafts], dim=1)
            logits = self.target.forward(tokens, positions, self.slot_table, L + K,
                                         self.slot_table.gather(1, positions))
            logp, bonus, logz = score(logits, self.drafts, self.p["target_temperature"], alpha)
            if self.recorder is not None:
                self.recorder.add("target", logits[:, K])
            self.logw += (alpha * logp - self.logq).sum(1).double() + logz.double()
            self.token_table.scatter_(1, positions + 1, torch.cat([self.drafts, bonus.unsqueeze(1)], dim=1))
            self.seq_len += K + 1

        def resample(self):
            """Per request: ESS, systematic resampling (one torch uniform), then the block-table reshuffle."""
            Q, N = self.Q, self.N
            logw = self.logw.view(Q, N)
            weights = torch.softmax(logw, dim=1)
            ess = 1.0 / (weights * weights).sum(1)
            need = ess < self.p["tau"] * N  # NaN (all weights -inf) compares False: identity
            if not bool(need.any()):  # host sync, as a first implementation has it
                return
            u = torch.rand(Q, 1, device=device, dtype=torch.float64)
            cumulative = torch.cumsum(weights, dim=1)
            cumulative[:, -1] = 1.0
            points = (u + self.particle_ids.double()) / N
            ancestors = torch.searchsorted(cumulative, points, right=True).clamp_(max=N - 1)
            ancestors = torch.where(need.unsqueeze(1), ancestors, self.particle_ids)
            self.log_evidence += torch.where(need, torch.logsumexp(logw, dim=1) - math.log(N), 0.0)
            self.logw.copy_(torch.where(need.unsqueeze(1), 0.0, logw).reshape(-1))
            self.reshuffle((ancestors + self.request_base).reshape(-1))

        def reshuffle(self, sources):
            """Row r becomes a copy of row sources[r]: slot and token rows by index_select, refcounts moved."""
            width = self.length
            positions = torch.arange(width, device=device, dtype=int64)
            old_slots = self.slot_table[:, :width]
            new_slots = old_slots.index_select(0, sources)
            new_tokens = self.token_table[:, :width].index_select(0, sources)
            new_len = self.seq_len.index_select(0, sources)
            old_mask = positions < self.seq_len.unsqueeze(1)
            new_mask = positions < new_len.unsqueeze(1)
            self.refcount.index_add_(0, new_slots.reshape(-1), new_mask.reshape(-1).to(int64))
            self.refcount.index_add_(0, old_slots.reshape(-1), -old_mask.reshape(-1).to(int64))
            freed = old_slots[old_mask & (self.refcount[old_slots] == 0)]  # host sync (boolean mask)
            if freed.numel() > 0:
                self.free_slots = torch.cat([self.free_slots, torch.unique(freed)])
            self.slot_table[:, :width] = new_slots
            self.token_table[:, :width] = new_tokens
            self.seq_len.copy_(new_len)

        def after_commit(self):
            self.length += self.K + 1

        def cycle_eager(self):
            self.alloc()
            self.draft_phase()
            self.verify_phase()
            self.after_commit()
            self.resample()

        # --- checks ------------------------------------------------------------------------------------------
        def particle0_tokens(self):
            rows0 = self.request_base.squeeze(1)
            return self.token_table[rows0, self.prompt_length : self.length].cpu().tolist()

        def check_slots(self):
            """Refcount = references through the tables; free list disjoint from them, no duplicates, complete."""
            width = self.length
            mask = torch.arange(width, device=device) < self.seq_len.unsqueeze(1)
            referenced = self.slot_table[:, :width][mask]
            counts = torch.bincount(referenced, minlength=pool_size)
            problems = []
            if bool((referenced <= 0).any()) or bool((referenced >= pool_size).any()):
                problems.append("slot id out of range or the dummy in a table")
            if not torch.equal(counts, self.refcount):
                bad = (counts != self.refcount).nonzero().reshape(-1)[:4].tolist()
                problems.append("refcount != references at slots %s" % bad)
            free = self.free_slots
            if torch.unique(free).numel() != free.numel():
                problems.append("a slot is twice on the free list")
            if free.numel() and bool((self.refcount[free] != 0).any()):
                problems.append("a free slot is referenced")
            if free.numel() + int((counts > 0).sum()) != pool_size - 1:
                problems.append("leak: %d free + %d referenced != %d" % (free.numel(), int((counts > 0).sum()),
                                                                         pool_size - 1))
            return problems

    # ------------------------------------------------------------------------------------------------------
    # Driving a method: warm-up cycles eagerly, capture (graph methods), then cycles

    def Driver(state, method):
        """torch_graph_cycle: the draft phase and the verify forward in one graph; torch_graph_draft: the draft
        phase only, the verify phase eager; both allocate before and commit and resample after the replay."""
        whole = method == "torch_graph_cycle"

        def captured():
            state.draft_phase()
            if whole:
                state.verify_phase()

        def after():
            if not whole:
                state.verify_phase()
            state.after_commit()
            state.resample()

        return toy_torch.GraphedCycle(torch, state.cycle_eager, method in GRAPH_METHODS, [captured], state.alloc,
                                      after)

    time_cycles = kit.time_cycles
    time_model_forwards = kit.time_model_forwards
    timing_prompts = kit.timing_prompts

    # ------------------------------------------------------------------------------------------------------
    # Validation against the engine's tokens

    def tie_set(record, tolerance):
        kind, values, indices = record
        top = values[0]
        return {index for value, index in zip(values, indices) if value >= top - tolerance(kind, top)}

    def compare(expected, got, records, limits, tolerance):
        """Matched tokens, explained (near-tie) divergences, problems; each prompt is compared up to its limit
        and stops at its first divergence."""
        matched, explained, problems = 0, 0, []
        for q, (want, have) in enumerate(zip(expected, got)):
            if len(want) != len(have):
                problems.append("prompt %d: %d tokens, engine %d" % (q, len(have), len(want)))
                continue
            for i in range(min(len(want), limits[q])):
                if want[i] == have[i]:
                    matched += 1
                    continue
                record = records[q][i] if i < len(records[q]) else None
                if record is not None:
                    allowed = tie_set(record, tolerance)
                    if want[i] in allowed and have[i] in allowed:
                        explained += 1
                        break
                problems.append("prompt %d token %d: engine %d, peer %d%s" % (
                    q, i, want[i], have[i],
                    "" if record is None else " (%s logits, top %s)" % (
                        record[0], ", ".join("%d:%.7g" % (ix, v) for v, ix in zip(record[1][:4], record[2][:4])))))
                break
        return matched, explained, problems

    def validate(entry, weights, methods):
        """Returns (ok, text lines) for one (vocab, dtype) validation entry of the manifest."""
        vocab, dtype_name = int(entry["vocab"]), entry["dtype"]
        particles, steps, cycles = int(entry["particles"]), int(entry["steps"]), int(entry["cycles"])
        params = {"draft_temperature": float(entry["draft_temperature"]),
                  "target_temperature": float(entry["target_temperature"]),
                  "alpha": float(entry["alpha"]), "tau": float(entry["tau"])}
        prompts = torch.tensor(entry["prompts"], device=device, dtype=int64)
        expected = entry["tokens"]
        lines = []
        if not entry.get("engine_ok", True) or not expected:
            return False, ["V=%d %s: the engine's validation run failed; nothing to compare" % (vocab, dtype_name)]
        draft_w, target_w = weights
        logits_dtype = dtypes[dtype_name]

        def temperature_of(kind):
            return params["draft_temperature"] if kind == "draft" else params["target_temperature"]

        def exact_tolerance(kind, top):
            return GUMBEL_REACH * temperature_of(kind)

        def fast_tolerance(kind, top):
            slack = 1e-4 + 1e-5 * abs(top)  # matmul order vs the kernel's fma chain
            if logits_dtype == torch.bfloat16:
                slack += 2.0 ** -7 * max(1.0, abs(top))  # one bf16 ulp either way of a rounding boundary
            return exact_tolerance(kind, top) + slack

        requests = prompts.shape[0]
        recorder = Recorder(requests, particles)
        state = SmcState(draft_w, target_w, logits_dtype, requests, particles, steps, params, exact=True,
                         recorder=recorder)
        state.admit(prompts)
        for _ in range(cycles):
            state.cycle_eager()
        got = state.particle0_tokens()
        full = [len(t) for t in expected]
        matched, explained, problems = compare(expected, got, recorder.records, full, exact_tolerance)
        # Where the exact run left the engine's path (an explained tie), later records describe another path.
        limits = []
        for want, have in zip(expected, got):
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), len(want))
            limits.append(first)
        total = sum(full)
        lines.append("V=%d %s N=%d K=%d: exact forward, eager: %d/%d tokens equal%s%s" % (
            vocab, dtype_name, particles, steps, matched, total,
            ", %d stopped at a near-tie" % explained if explained else "",
            "" if not problems else "; MISMATCH: " + "; ".join(problems[:3])))
        ok = not problems
        slot_problems = state.check_slots()
        if slot_problems:
            ok = False
            lines.append("  slot check after the exact run: " + "; ".join(slot_problems))
        del state
        for method in methods:
            state = SmcState(draft_w, target_w, logits_dtype, requests, particles, steps, params)
            state.admit(prompts)
            driver = Driver(state, method)
            warm = 1 if method in GRAPH_METHODS else 0
            driver.warm_up(warm)
            for _ in range(cycles - warm):
                driver.cycle()
            got = state.particle0_tokens()
            m, e, p = compare(expected, got, recorder.records, limits, fast_tolerance)
            lines.append("  %s (own forward): %d/%d tokens equal up to the exact run's path%s%s" % (
                method, m, sum(limits), ", %d stopped at a near-tie" % e if e else "",
                "" if not p else "; MISMATCH: " + "; ".join(p[:3])))
            ok = ok and not p
            del driver, state
        return ok, lines

    # ------------------------------------------------------------------------------------------------------
    # Main loop

    print("smc_peer on %s (torch %s): methods %s" % (device_name, torch.__version__, ", ".join(methods)))
    sys.stdout.flush()
    weights_for = kit.weights_for

    all_ok = True
    validated = {}  # (vocab, dtype) -> ok
    if not args.skip_validation:
        print("validation against the engine's tokens (greedy target, near-zero draft temperature):")
        for entry in manifest.get("validation", []):
            try:
                ok, lines = validate(entry, weights_for(int(entry["vocab"])), methods)
            except Exception as error:  # noqa: BLE001 - report and go on with the timing
                ok, lines = False, ["V=%s %s: validation raised %s: %s" % (entry.get("vocab"), entry.get("dtype"),
                                                                         type(error).__name__, error)]
            validated[(int(entry["vocab"]), entry["dtype"])] = ok
            all_ok = all_ok and ok
            for line in lines:
                print("  " + line)
            sys.stdout.flush()
        print("validation: %s" % ("ok" if all_ok else "FAILED"))
    if args.only_validate:
        return 0 if all_ok else 1

    cycles = args.cycles or int(manifest["cycles"])
    warmup = int(manifest["warmup_cycles"])
    prompt_length = int(manifest["prompt_length"])
    requests_list = [q for q in manifest["requests"] if not args.requests or q in args.requests]
    params = {key: float(manifest[key]) for key in ("draft_temperature", "target_temperature", "alpha", "tau")}
    csv_dir = os.path.dirname(args.csv)
    if csv_dir:
        os.makedirs(csv_dir, exist_ok=True)
    with open(args.csv, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        out.flush()
        for vocab in manifest["vocabs"]:
            weights = weights_for(int(vocab))
            for dtype_name in manifest["dtypes"]:
                logits_dtype = dtypes[dtype_name]
                for particles in manifest["particles"]:
                    for steps in manifest["steps"]:  # the SMC cycle's (bucket_sweep lists no K = 0 there)
                        print("\nV=%d %s N=%d K=%d (median us per cycle)" % (vocab, dtype_name, particles, steps))
                        print("%8s %10s %s" % ("requests", "model_us", "  ".join("%-18s" % m for m in methods)))
                        for requests in requests_list:
                            rows = requests * particles
                            cells = []
                            try:
                                model_us = time_model_forwards(weights[0], weights[1], logits_dtype, rows, steps)
                            except Exception as error:  # noqa: BLE001
                                print("  model timing failed: %s" % error)
                                model_us = float("nan")
                            for method in methods:
                                cycle_us, p90_us, problems = float("nan"), float("nan"), []
                                try:
                                    state = SmcState(weights[0], weights[1], logits_dtype, requests, particles, steps,
                                                     params)
                                    state.admit(timing_prompts(requests, int(vocab), prompt_length))
                                    driver = Driver(state, method)
                                    driver.warm_up(warmup)
                                    cycle_us, p90_us = time_cycles(driver, cycles)
                                    problems = state.check_slots()
                                    del driver, state
                                except Exception as error:  # noqa: BLE001 - report, go on
                                    problems = ["%s: %s" % (type(error).__name__, error)]
                                if on_gpu:
                                    torch.cuda.empty_cache()
                                valid = not problems and validated.get((int(vocab), dtype_name), args.skip_validation)
                                all_ok = all_ok and not problems
                                tokens_per_s = requests * (steps + 1) / (cycle_us * 1e-6)
                                writer.writerow([method, requests, particles, steps, vocab, dtype_name,
                                                 "%.2f" % cycle_us, "%.0f" % tokens_per_s, "%.2f" % p90_us,
                                                 "%.2f" % model_us, "%.2f" % (cycle_us - model_us),
                                                 1 if valid else 0, device_name, torch.__version__])
                                out.flush()
                                cells.append("%.1f%s" % (cycle_us, "" if not problems else " !"))
                                if problems:
                                    print("  %s requests=%d: %s" % (method, requests, "; ".join(problems[:3])))
                            print("%8d %10.1f %s" % (requests, model_us,
                                                     "  ".join("%-18s" % c for c in cells)))
                            sys.stdout.flush()
    print("\nsmc_peer: CSV %s; %s" % (args.csv, "ok" if all_ok else "FAILED (see above)"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

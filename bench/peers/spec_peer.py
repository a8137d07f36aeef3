#!/usr/bin/env python3
"""PyTorch peer of smcgraph's speculative cycle in bucket_sweep (bench/bucket_sweep.cpp, cycle kind `spec`):
greedy speculative decoding (N = 1, K draft tokens per cycle) with the same toy draft and target models.

The C++ sweep writes the toy weights (toy_weights_v<V>.safetensors, format in bench/peers/toy_weights_io.md) and a
manifest (bucket_sweep_peer.json) whose `spec` section holds the spec grid, the timed engines' temperatures and
the engine's tokens for a few validation prompts. This script runs the cycle of graphs/spec_cycle.cpp in PyTorch,
the way a first implementation would be written:

  alloc K + 1 slots per row from a free list (positions L .. L + K) -> draft head (2-token forward on
  [x_{L-2}, x_{L-1}], d_1 = argmax) and K - 1 one-token draft steps (d_{s+1} = argmax) -> target verify forward
  over [x_{L-1}, d_1 .. d_K] at positions L - 1 .. L + K - 1 -> greedy verification: d_k is accepted while the
  target gives it its largest logit (k = 1 .. K, first rejection ends it), the next token is the target's argmax
  at the first rejected position, or the bonus argmax at position K after K accepts (lowest id on ties, as the
  engine) -> commit the accepted drafts and the next token (L += accepted + 1) -> the slots of rejected positions
  back to the free list.

With a greedy target this is exactly what smcgraph's stochastic verifier does at T_t = 0 (accept d_k iff
log p(d_k) = 0, i.e. its target logit equals the maximum; next token by argmax), and the tokens are those of
greedy target-only decoding (DESIGN.md §3). Admission: both models prefill the prompt, x_P = the target's argmax.

The toy forward and its KV cache (per model, indexed by slot ids through a slot table) come from toy_torch.py,
shared with smc_peer.py.

Methods (CSV column `method`):
  spec_torch_eager        every stage eager with a host loop; two host syncs per cycle, as a first implementation
                          has them: the accepted count (`.item()`, for the acceptance bookkeeping) and the
                          rejected slots (a boolean-mask gather) going back to the free list
  spec_torch_graph_draft  the draft phase (head + K - 1 steps with their argmax) captured once per bucket with
                          torch.cuda.graphs and replayed; alloc, verify, accept, commit and the slot release eager

Validation before timing (manifest `spec.validation`: the engine with T_t = 0 and T_d = 0): the peer's tokens
(x_P first, then accepted + 1 per cycle, over the same number of cycles) must equal the engine's. First with the
exact forward (toy_torch: the toy kernels' float operations bit for bit), then with each method's own (matmul)
forward. A token mismatch counts as explained only where the target's logits leave the choice open (both tokens
within tolerance of the maximum: exact ties for the exact forward, the matmul rounding slack and one bf16 ulp for
the fast forward), and comparison of that prompt stops there. Equal tokens but a different count after the same
cycles (the cycles accepted differently) counts as explained only where a draft argmax was within that tolerance
of the runner-up (a draft near-tie moves the cycle boundaries, not the tokens).

Timing: per bucket and method, fresh state, the sweep's timing prompts, `warmup_cycles` untimed cycles, then
`cycles` cycles with a CUDA event between cycles (median). tokens_per_cycle = tokens committed per row and timed
cycle (accepted + 1; the engine reports the same as tok/c); tokens_per_s = requests x tokens_per_cycle / cycle
time. model_us = draft head + (K - 1) draft steps + verify forwards alone in one CUDA graph (as the C++ side times
its models); nonmodel_us = cycle_us - model_us. Slot invariants (each referenced slot in one table entry, nothing
referenced past a row's length, free list disjoint and complete) are checked after every timed run.

Usage:
  python3 bench/peers/spec_peer.py --manifest results/bucket_sweep_peer.json [--csv results/spec_peer.csv]
         [--methods spec_torch_eager,spec_torch_graph_draft] [--only-validate] [--skip-validation]
         [--device cuda|cpu] [--cycles C] [--requests 1,8]
CSV columns: those of smc_peer.py (method, requests, particles (1), steps, vocab, dtype, cycle_us, tokens_per_s,
cycle_p90_us, model_us, nonmodel_us, valid, device, torch), then tokens_per_cycle. Exit status 0, or 1 when a
validation or a slot check failed, 2 when it could not run.
"""

import csv
import math
import os
import sys

import toy_torch  # beside this script: the toy models and timing helpers shared with smc_peer.py
from toy_torch import CSV_COLUMNS

ALL_METHODS = ["spec_torch_eager", "spec_torch_graph_draft"]
GRAPH_METHODS = {"spec_torch_graph_draft"}
SPEC_CSV_COLUMNS = CSV_COLUMNS + ["tokens_per_cycle"]
GUMBEL_REACH = 50.0  # Gumbel noise reorders logits only within this many temperatures of each other (P ~ e^-50)
RECORD_TOP = 16  # logits kept per validated token


def parse_args():
    parser = toy_torch.peer_argument_parser(__doc__, "results/spec_peer.csv", ALL_METHODS,
                                            "written by bucket_sweep with the spec kind in its grid (default results/bucket_sweep_peer.json)")
    return toy_torch.parse_peer_arguments(parser, ALL_METHODS)


def main():
    args = parse_args()
    loaded = toy_torch.import_torch_and_manifest("spec_peer", args)
    if loaded == 2:
        return 2
    torch, manifest = loaded
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        print("spec_peer: the manifest %s has no `spec` section; run bucket_sweep with the spec kind in --kinds"
              % args.manifest, file=sys.stderr)
        return 2
    manifest_dir = os.path.dirname(os.path.abspath(args.manifest))

    torch.set_float32_matmul_precision("highest")  # no TF32: the toy head is fp32
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    methods = [m for m in args.methods if on_gpu or m not in GRAPH_METHODS]
    if not methods:
        print("spec_peer: no method can run on %s" % device, file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    max_seq_len = int(manifest["max_seq_len"])
    pool_size = int(manifest["slot_pool_size"])
    int64 = torch.int64
    kit = toy_torch.ToyKit(torch, device, manifest, manifest_dir)  # the toy models (toy_torch.py)
    ToyModel = kit.Model

    def fast_slack(top, logits_dtype):
        """How far the matmul forward's logit can sit from the toy kernel's (|top| a float or a tensor)."""
        magnitude = top.abs() if torch.is_tensor(top) else abs(top)
        slack = 1e-4 + 1e-5 * magnitude  # matmul order vs the kernel's fma chain
        if logits_dtype == torch.bfloat16:  # one bf16 ulp either way of a rounding boundary
            slack = slack + 2.0 ** -7 * (magnitude.clamp(min=1.0) if torch.is_tensor(top) else max(1.0, magnitude))
        return slack

    # ------------------------------------------------------------------------------------------------------
    # Greedy speculative decoding in PyTorch

    class Recorder:
        """Validation only: per request, per committed token (x_P first), the largest target logits it was chosen
        from (the target decides every token of greedy speculative decoding)."""

        def __init__(self, requests):
            self.records = [[] for _ in range(requests)]

        def add(self, logits, counts):
            """logits [R, C, V]; row q's first counts[q] columns produced committed tokens."""
            values, indices = torch.topk(logits.float(), min(RECORD_TOP, logits.shape[-1]), dim=-1)
            values, indices = values.cpu().tolist(), indices.cpu().tolist()
            for q, count in enumerate(counts):
                for c in range(count):
                    self.records[q].append(("target", values[q][c], indices[q][c]))

    class SpecState:
        """Device state of `requests` rows (N = 1), each with its own length, every row live."""

        def __init__(self, draft_weights, target_weights, logits_dtype, requests, steps, exact=False,
                     recorder=None, draft_slack=None):
            self.R, self.K = requests, steps
            self.draft = ToyModel(draft_weights, logits_dtype, exact)
            self.target = ToyModel(target_weights, logits_dtype, exact)
            self.recorder = recorder
            # draft_slack(top) -> tolerance: keep the smallest (top - runner-up - tolerance) of every draft argmax
            self.draft_slack = draft_slack
            R, K = requests, steps
            self.slot_table = torch.zeros(R, max_seq_len, device=device, dtype=int64)
            self.token_table = torch.zeros(R, max_seq_len, device=device, dtype=int64)
            self.seq_len = torch.zeros(R, device=device, dtype=int64)
            self.in_use = torch.zeros(pool_size, device=device, dtype=int64)  # 1: in a table (nothing is shared)
            self.free_slots = torch.arange(1, pool_size, device=device, dtype=int64)  # slot 0 is the dummy
            self.drafts = torch.zeros(R, K, device=device, dtype=int64)
            self.draft_margin = torch.full((R,), math.inf, device=device)
            self.arange2 = torch.arange(2, device=device, dtype=int64)
            self.arange_k1 = torch.arange(K + 1, device=device, dtype=int64)
            self.length_bound = 0  # host upper bound of the longest row (no sync to check max_seq_len)
            self.prompt_length = 0
            self.committed = 0  # tokens committed by cycles, all rows (host, from the accepted counts)

        def take_slots(self, count):
            if self.free_slots.numel() < count:
                raise RuntimeError("slot pool exhausted (%d free, %d needed)" % (self.free_slots.numel(), count))
            slots, self.free_slots = self.free_slots[:count], self.free_slots[count:]
            return slots

        def admit(self, prompts):
            """Prefill both models over the prompts [R, P]; x_P = the target's argmax."""
            R, P = self.R, prompts.shape[1]
            slots = self.take_slots(R * (P + 1)).reshape(R, P + 1)
            self.slot_table[:, : P + 1] = slots
            self.token_table[:, :P] = prompts
            positions = torch.arange(P, device=device, dtype=int64).expand(R, P)
            seq = torch.full((R,), P, device=device, dtype=int64)
            self.draft.forward(prompts, positions, self.slot_table, seq, slots[:, :P])
            logits = self.target.forward(prompts, positions, self.slot_table, seq, slots[:, :P])
            self.token_table[:, P] = torch.argmax(logits[:, P - 1].float(), dim=-1)
            if self.recorder is not None:
                self.recorder.add(logits[:, P - 1 :], [1] * R)
            self.seq_len.fill_(P + 1)
            self.in_use[slots.reshape(-1)] = 1
            self.length_bound = P + 1
            self.prompt_length = P

        # --- stages ------------------------------------------------------------------------------------------
        def alloc(self):
            """K + 1 slots per row for positions L .. L + K."""
            K = self.K
            if self.length_bound + K + 1 > max_seq_len:
                raise RuntimeError("rows could pass max_seq_len %d (fewer cycles)" % max_seq_len)
            slots = self.take_slots(self.R * (K + 1)).reshape(self.R, K + 1)
            self.slot_table.scatter_(1, self.seq_len.unsqueeze(1) + self.arange_k1, slots)
            self.in_use[slots.reshape(-1)] = 1
            self.length_bound += K + 1

        def draft_argmax(self, logits):
            l = logits.float()
            if self.draft_slack is not None:  # validation: how close the runner-up came
                top2 = torch.topk(l, 2, dim=-1).values
                margin = top2[:, 0] - top2[:, 1] - self.draft_slack(top2[:, 0])
                self.draft_margin.copy_(torch.minimum(self.draft_margin, margin))
            return torch.argmax(l, dim=-1)  # lowest id on ties, as the engine's greedy sampler

        def draft_phase(self):
            """Draft head on [x_{L-2}, x_{L-1}], then K - 1 one-token steps, each by argmax (capturable)."""
            L = self.seq_len
            head_positions = L.unsqueeze(1) - 2 + self.arange2
            logits = self.draft.forward(self.token_table.gather(1, head_positions), head_positions, self.slot_table,
                                        L, self.slot_table.gather(1, head_positions))
            self.drafts[:, 0].copy_(self.draft_argmax(logits[:, 1]))
            for s in range(1, self.K):
                positions = (L + (s - 1)).unsqueeze(1)
                logits = self.draft.forward(self.drafts[:, s - 1 : s], positions, self.slot_table, L + s,
                                            self.slot_table.gather(1, positions))
                self.drafts[:, s].copy_(self.draft_argmax(logits[:, 0]))

        def verify_and_commit(self):
            """Target verify, greedy acceptance, commit, rejected slots back to the free list (eager, 2 syncs)."""
            K = self.K
            L = self.seq_len
            positions = L.unsqueeze(1) - 1 + self.arange_k1  # L - 1 .. L + K - 1
            tokens = torch.cat([self.token_table.gather(1, positions[:, :1]), self.drafts], dim=1)
            logits = self.target.forward(tokens, positions, self.slot_table, L + K,
                                         self.slot_table.gather(1, positions)).float()
            # d_k is accepted while the target gives it its largest logit; the next token is the target's argmax
            # at the first rejected position (the bonus at position K when all K are accepted).
            best = logits.amax(-1)  # [R, K + 1]
            chosen = logits[:, :K].gather(2, self.drafts.unsqueeze(-1)).squeeze(-1)
            accepted = (chosen == best[:, :K]).to(int64).cumprod(1).sum(1)  # [R]
            next_token = logits.argmax(-1).gather(1, accepted.unsqueeze(1))  # [R, 1], lowest id on ties
            # Commit: positions L .. L + accepted hold d_1 .. d_accepted, then the next token.
            columns = self.arange_k1.unsqueeze(0)
            cycle_positions = positions + 1  # L .. L + K
            keep = columns <= accepted.unsqueeze(1)
            self.token_table.scatter_(1, cycle_positions,
                                      torch.where(columns < accepted.unsqueeze(1),
                                                  torch.cat([self.drafts, next_token], dim=1), next_token))
            # Rejected positions L + accepted + 1 .. L + K give their slots back.
            cycle_slots = self.slot_table.gather(1, cycle_positions)
            freed = cycle_slots[~keep]  # host sync (boolean mask), as a first implementation has it
            self.free_slots = torch.cat([self.free_slots, freed])
            self.in_use[freed] = 0
            self.slot_table.scatter_(1, cycle_positions, torch.where(keep, cycle_slots, 0))
            self.seq_len += accepted + 1
            self.committed += int(accepted.sum().item()) + self.R  # host sync: the acceptance bookkeeping
            if self.recorder is not None:
                self.recorder.add(logits, (accepted + 1).cpu().tolist())

        def cycle_eager(self):
            self.alloc()
            self.draft_phase()
            self.verify_and_commit()

        # --- checks ------------------------------------------------------------------------------------------
        def generated_tokens(self):
            """Per row: x_P and every committed token (what Engine::result().particles[0] returns)."""
            table = self.token_table.cpu().tolist()
            lengths = self.seq_len.cpu().tolist()
            return [row[self.prompt_length : length] for row, length in zip(table, lengths)]

        def check_slots(self):
            """Every slot referenced below a row's length once and marked in use, nothing referenced past it,
            the free list disjoint from the referenced slots, without duplicates and complete."""
            width = self.length_bound
            mask = torch.arange(width, device=device) < self.seq_len.unsqueeze(1)
            table = self.slot_table[:, :width]
            referenced = table[mask]
            counts = torch.bincount(referenced, minlength=pool_size)
            problems = []
            if bool((referenced <= 0).any()) or bool((referenced >= pool_size).any()):
                problems.append("slot id out of range or the dummy in a table")
            if bool((table[~mask] != 0).any()):
                problems.append("a slot is referenced past a row's length")
            if bool((counts > 1).any()):
                problems.append("a slot is referenced twice")
            if not torch.equal(counts.clamp(max=1), self.in_use):
                bad = (counts.clamp(max=1) != self.in_use).nonzero().reshape(-1)[:4].tolist()
                problems.append("in-use marks != references at slots %s" % bad)
            free = self.free_slots
            if torch.unique(free).numel() != free.numel():
                problems.append("a slot is twice on the free list")
            if free.numel() and bool((self.in_use[free] != 0).any()):
                problems.append("a free slot is referenced")
            if free.numel() + int((counts > 0).sum()) != pool_size - 1:
                problems.append("leak: %d free + %d referenced != %d" % (free.numel(), int((counts > 0).sum()),
                                                                         pool_size - 1))
            return problems

    # ------------------------------------------------------------------------------------------------------
    # Driving a method: warm-up cycles eagerly, capture (graph method), then cycles

    def Driver(state, method):
        """The graph method replays the captured draft phase between the slot allocation and the verify-and-commit
        phase (eager)."""
        return toy_torch.GraphedCycle(torch, state.cycle_eager, method in GRAPH_METHODS, [state.draft_phase],
                                      state.alloc, state.verify_and_commit)

    # ------------------------------------------------------------------------------------------------------
    # Validation against the engine's tokens

    def tie_set(record, tolerance):
        kind, values, indices = record
        top = values[0]
        return {index for value, index in zip(values, indices) if value >= top - tolerance(top)}

    def compare(expected, got, records, limits, tolerance, margins):
        """Matched tokens, explained divergences, problems and per prompt where the comparison stopped. Each prompt
        is compared up to its limit (None: all of it) and stops at its first divergence; equal tokens with a
        different count need a draft near-tie (margins[q] <= 0; None: never explained)."""
        matched, explained, problems, stops = 0, 0, [], []
        for q, (want, have) in enumerate(zip(expected, got)):
            common = min(len(want), len(have))
            limit = common if limits is None else min(common, limits[q])
            stop = limit
            for i in range(limit):
                if want[i] == have[i]:
                    matched += 1
                    continue
                stop = i
                record = records[q][i] if i < len(records[q]) else None
                if record is not None:
                    allowed = tie_set(record, tolerance)
                    if want[i] in allowed and have[i] in allowed:
                        explained += 1
                        break
                problems.append("prompt %d token %d: engine %d, peer %d%s" % (
                    q, i, want[i], have[i],
                    "" if record is None else " (target logits, top %s)" % (
                        ", ".join("%d:%.7g" % (ix, v) for v, ix in zip(record[1][:4], record[2][:4])))))
                break
            stops.append(stop)
            if stop == common and limit == common and len(want) != len(have):
                if margins is not None and margins[q] <= 0.0:
                    explained += 1
                else:
                    problems.append("prompt %d: %d tokens after the engine's cycles, engine %d (equal up to there)"
                                    % (q, len(have), len(want)))
        if len(got) != len(expected):
            problems.append("%d prompts, engine %d" % (len(got), len(expected)))
        return matched, explained, problems, stops

    def validate(entry, weights, methods):
        """Returns (ok, text lines) for one (vocab, dtype) entry of the manifest's spec.validation."""
        vocab, dtype_name = int(entry["vocab"]), entry["dtype"]
        steps, cycles = int(entry["steps"]), int(entry["cycles"])
        draft_t, target_t = float(entry["draft_temperature"]), float(entry["target_temperature"])
        expected = entry["tokens"]
        if not entry.get("engine_ok", True) or not expected:
            return False, ["V=%d %s: the engine's validation run failed; nothing to compare" % (vocab, dtype_name)]
        if target_t != 0.0:
            return False, ["V=%d %s: the engine's validation run used T_t = %g; this peer is greedy (T_t = 0)"
                           % (vocab, dtype_name, target_t)]
        prompts = torch.tensor(entry["prompts"], device=device, dtype=int64)
        draft_w, target_w = weights
        logits_dtype = dtypes[dtype_name]
        requests = prompts.shape[0]
        lines = []

        def exact_tolerance(top):
            return 0.0  # T_t = 0 and a bit-exact forward: only exact ties leave the choice open

        def fast_tolerance(top):
            return fast_slack(top, logits_dtype)

        # A draft drawn at T_d > 0 (Gumbel-max) is the argmax except within Gumbel reach of it.
        exact_draft = (lambda top: GUMBEL_REACH * draft_t) if draft_t > 0.0 else None

        def fast_draft(top):
            return fast_slack(top, logits_dtype) + GUMBEL_REACH * draft_t

        recorder = Recorder(requests)
        state = SpecState(draft_w, target_w, logits_dtype, requests, steps, exact=True, recorder=recorder,
                          draft_slack=exact_draft)
        state.admit(prompts)
        for _ in range(cycles):
            state.cycle_eager()
        got = state.generated_tokens()
        margins = state.draft_margin.cpu().tolist() if exact_draft is not None else None
        matched, explained, problems, stops = compare(expected, got, recorder.records, None, exact_tolerance,
                                                      margins)
        total = sum(len(t) for t in expected)
        lines.append("V=%d %s K=%d, %d cycles: exact forward, eager: %d/%d tokens equal%s%s" % (
            vocab, dtype_name, steps, cycles, matched, total,
            ", %d stopped at a near-tie" % explained if explained else "",
            "" if not problems else "; MISMATCH: " + "; ".join(problems[:3])))
        ok = not problems
        slot_problems = state.check_slots()
        if slot_problems:
            ok = False
            lines.append("  slot check after the exact run: " + "; ".join(slot_problems))
        del state
        # Where the exact run left the engine's path (an explained tie), later records describe another path.
        limits = stops
        for method in methods:
            state = SpecState(draft_w, target_w, logits_dtype, requests, steps, draft_slack=fast_draft)
            state.admit(prompts)
            driver = Driver(state, method)
            warm = 1 if method in GRAPH_METHODS else 0
            driver.warm_up(warm)
            for _ in range(cycles - warm):
                driver.cycle()
            got = state.generated_tokens()
            m, e, p, _ = compare(expected, got, recorder.records, limits, fast_tolerance,
                                 state.draft_margin.cpu().tolist())
            p += state.check_slots()
            lines.append("  %s (own forward): %d/%d tokens equal up to the exact run's path%s%s" % (
                method, m, sum(limits), ", %d stopped at a near-tie" % e if e else "",
                "" if not p else "; MISMATCH: " + "; ".join(p[:3])))
            ok = ok and not p
            del driver, state
        return ok, lines

    # ------------------------------------------------------------------------------------------------------
    # Main loop

    print("spec_peer on %s (torch %s): methods %s" % (device_name, torch.__version__, ", ".join(methods)))
    spec_draft_t = float(spec.get("draft_temperature", 0.0))
    spec_target_t = float(spec.get("target_temperature", 0.0))
    if spec_draft_t != 0.0 or spec_target_t != 0.0:
        print("spec_peer: note: smcgraph's spec rows ran with T_d = %g, T_t = %g; this peer times greedy "
              "speculative decoding (T_d = T_t = 0), so tokens per cycle may differ" % (spec_draft_t, spec_target_t))
    sys.stdout.flush()
    weights_for = kit.weights_for

    all_ok = True
    validated = {}  # (vocab, dtype) -> ok
    if not args.skip_validation:
        print("validation against the engine's tokens (greedy target, greedy draft):")
        for entry in spec.get("validation", []):
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
        if not spec.get("validation"):
            all_ok = False
            print("  the manifest holds no spec validation entry")
        print("validation: %s" % ("ok" if all_ok else "FAILED"))
    if args.only_validate:
        return 0 if all_ok else 1

    cycles = args.cycles or int(manifest["cycles"])
    warmup = int(manifest["warmup_cycles"])
    prompt_length = int(manifest["prompt_length"])
    requests_list = [q for q in spec.get("requests", manifest["requests"]) if not args.requests or q in args.requests]
    steps_list = spec.get("steps", manifest["steps"])
    csv_dir = os.path.dirname(args.csv)
    if csv_dir:
        os.makedirs(csv_dir, exist_ok=True)
    with open(args.csv, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(SPEC_CSV_COLUMNS)
        out.flush()
        for vocab in spec.get("vocabs", manifest["vocabs"]):
            weights = weights_for(int(vocab))
            for dtype_name in spec.get("dtypes", manifest["dtypes"]):
                logits_dtype = dtypes[dtype_name]
                for steps in steps_list:
                    print("\nV=%d %s N=1 K=%d (median us per cycle; tok/c = tokens per row and cycle)"
                          % (vocab, dtype_name, steps))
                    print("%8s %10s %s" % ("requests", "model_us", "  ".join("%-26s" % m for m in methods)))
                    for requests in requests_list:
                        cells = []
                        try:
                            model_us = kit.time_model_forwards(weights[0], weights[1], logits_dtype, requests, steps)
                        except Exception as error:  # noqa: BLE001
                            print("  model timing failed: %s" % error)
                            model_us = float("nan")
                        for method in methods:
                            cycle_us, p90_us, per_cycle, problems = float("nan"), float("nan"), float("nan"), []
                            try:
                                state = SpecState(weights[0], weights[1], logits_dtype, requests, steps)
                                state.admit(kit.timing_prompts(requests, int(vocab), prompt_length))
                                driver = Driver(state, method)
                                driver.warm_up(warmup)
                                before = state.committed
                                cycle_us, p90_us = kit.time_cycles(driver, cycles)
                                per_cycle = (state.committed - before) / float(cycles * requests)
                                problems = state.check_slots()
                                del driver, state
                            except Exception as error:  # noqa: BLE001 - report, go on
                                problems = ["%s: %s" % (type(error).__name__, error)]
                            if on_gpu:
                                torch.cuda.empty_cache()
                            valid = not problems and validated.get((int(vocab), dtype_name), args.skip_validation)
                            all_ok = all_ok and not problems
                            tokens_per_s = requests * per_cycle / (cycle_us * 1e-6)
                            writer.writerow([method, requests, 1, steps, vocab, dtype_name,
                                             "%.2f" % cycle_us, "%.0f" % tokens_per_s, "%.2f" % p90_us,
                                             "%.2f" % model_us, "%.2f" % (cycle_us - model_us),
                                             1 if valid else 0, device_name, torch.__version__,
                                             "%.3f" % per_cycle])
                            out.flush()
                            cells.append("%.1f (%.2f tok/c)%s" % (cycle_us, per_cycle, "" if not problems else " !"))
                            if problems:
                                print("  %s requests=%d: %s" % (method, requests, "; ".join(problems[:3])))
                        print("%8d %10.1f %s" % (requests, model_us, "  ".join("%-26s" % c for c in cells)))
                        sys.stdout.flush()
    print("\nspec_peer: CSV %s; %s" % (args.csv, "ok" if all_ok else "FAILED (see above)"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

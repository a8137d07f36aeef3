#!/usr/bin/env python3
"""PyTorch and HF transformers peers of smcgraph on the real model (SmolLM2-135M-Instruct Q4_1 GGUF, DESIGN.md §6.1):
the same decoding jobs as smcgraph's Llama bench, on the same GGUF, bf16, on the same GPU, each validated against
smcgraph's tokens before it is timed.

Methods (CSV column `method`):
  hf_generate_greedy  transformers `generate(do_sample=False)` on the bf16 model, batch 1 and the manifest's batch
                      sizes (left padding); per run `new_tokens` tokens per request
  hf_assisted         transformers assisted generation (batch 1, greedy): assistant_model = a layer-subset draft
                      whose modules ARE the target's for the draft layers (llama_torch.layer_subset_hf_model: shared
                      parameters, attention layer_idx renumbered for the draft's own cache), K candidate tokens per
                      round (num_assistant_tokens = K, schedule constant, no confidence threshold)
  hf_prompt_lookup    transformers prompt-lookup decoding (batch 1, greedy): K candidate tokens per round from the
                      n-gram match in the context (prompt_lookup_num_tokens = K), the peer of smcgraph's n-gram
                      draft (bucket_sweep --draft-layers ngram)
  torch_spec_eager    greedy speculative decoding in plain PyTorch (llama_torch.LlamaTorch fast forward over the same
                      bf16 weights, static KV cache indexed by (row, position)), the cycle of graphs/spec_cycle.cpp:
                      draft head over [x_{L-2}, x_{L-1}] + K - 1 one-token draft steps (argmax), target verify over
                      [x_{L-1}, d_1 .. d_K], accept the longest prefix the target's argmax agrees with, then the
                      target's token (correction or bonus); per-row lengths; every stage eager
  torch_spec_graph    the same, the draft phase (head + steps + argmax) and the verify forward each captured once in
                      a torch.cuda.CUDAGraph and replayed; acceptance and commit eager
  torch_smc_eager     the SMC-SD cycle of DESIGN.md §2 (deferred bonus) with N particles per request: Gumbel-max draft
                      samples at T_d and their log q, target verify, log p at T_t, bonus from the target's power
                      distribution (alpha) and logZ, importance weights, ESS and systematic resampling at tau; the
                      resampling copies the chosen rows' tokens and KV (rows that change only) and syncs the host
                      (`if need.any()`, the changed-row list), as a first implementation has it
  torch_smc_graph     the same, the draft phase (with its sampling) and the verify forward captured in CUDA graphs

Validation before timing, against smcgraph's tokens from the manifest (below): each method's tokens must equal
smcgraph's until the end or until a first difference that the logits leave open. "Open" is judged on the exact
forward (llama_torch exact: smcgraph's numerics contract) run teacher-forced over the prompt and smcgraph's own
tokens: at the first difference the two tokens' logits (target's for target-chosen tokens, draft's for draft
samples) must be within --near-tie (default 0.5, the bf16 logit error at the top measured against HF fp32, see
tests/hf_compare.py); comparison of that prompt stops there. smcgraph's tokens themselves must be within --near-tie
of the exact forward's argmax at every step (a check of smcgraph against the contract). The torch methods are
validated with their own (fast) forward and driver; the exact forward first runs the same algorithm as a check
of the peer. Without a manifest (--model only) the references are the exact forward's own runs.

Timing: CUDA events; hf_*: median over --repeats generate calls after one warm-up call, cycle_us = time / target
forwards (generate: one per token; assisted: counted with a forward hook), tokens_per_cycle = new tokens / target
forwards; torch_*: fresh state per (requests, K), warm-up cycles, then `cycles` cycles with an event between cycles
(median, p90). tokens_per_s: hf_* requests x new_tokens / time; spec: requests x tokens_per_cycle / cycle time
(tokens_per_cycle = accepted + 1 averaged over rows and timed cycles, as bucket_sweep's spec rows); smc: requests x
(K + 1) / cycle time (as bucket_sweep's smc rows). model_us (torch_* only): draft head (rows x 2) + K - 1 draft steps
(rows x 1) + verify (rows x (K + 1)) forwards alone in one CUDA graph; nonmodel_us = cycle_us - model_us.

Manifest (JSON; bucket_sweep writes it when it runs the Llama model; every section but "format" and "prompts" is
optional, and a method whose section is missing is skipped with a note):
  {
    "format": "smcgraph-llama-peer-1",
    "device": "NVIDIA H200",                  informational
    "model": "../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                              path, absolute or relative to the manifest's directory (--model wins)
    "model_sha256": "b179...",                optional; checked when present
    "draft_layers": [0, 1, ..., 19],          the layers smcgraph's speculative draft runs (--draft-layers wins)
    "smc_draft_layers": [0, 1, ..., 20],      the layers smcgraph's SMC draft runs (--smc-draft-layers wins;
                                              default: draft_layers)
    "logits_dtype": "bf16",                   smcgraph's logits dtype, "bf16" or "fp32" (the torch peers use it too)
    "eos_id": -1,                             -1: no EOS (generation never stops early; what bucket_sweep times)
    "prompts": [[1, 9690, ...], ...],         token ids (the HF tokenizer's apply_chat_template ids); request q of a
                                              timed run uses prompts[q % len(prompts)]
    "greedy": {"new_tokens": 48,              smcgraph's greedy target-only decoding (llama_logits --greedy, or the
               "tokens": [[...], ...]},       engine's greedy speculative run: the same tokens), per prompt, first
                                              generated token (x_P) first; validates hf_generate_greedy, hf_assisted
                                              and torch_spec_*; may cover only the first prompts
    "generate": {"requests": [1, 8, 64], "new_tokens": 128},             hf_generate_greedy timing grid
    "spec": {"steps": [4, 8], "requests": [1, 8, 64],                    torch_spec_* grid (hf_assisted: requests 1)
             "cycles": 32, "warmup_cycles": 3, "new_tokens": 128},       new_tokens: hf_assisted's run length
    "smc": {"particles": [8], "steps": [4, 8], "requests": [1, 8, 64], "cycles": 32, "warmup_cycles": 3,
            "draft_temperature": 0.7, "target_temperature": 1.0, "alpha": 1.0, "tau": 0.5,
            "validation": {"particles": 8, "steps": 4, "cycles": 6,     the engine with a greedy target and a
                           "draft_temperature": 1e-6,                    near-zero draft temperature on the first
                           "target_temperature": 0.0, "alpha": 1.0,      len(tokens) prompts; tokens[i] = particle 0's
                           "tau": 0.5, "engine_ok": true,               generated tokens: x_P, then K + 1 per cycle
                           "tokens": [[...], ...]}}                      (Engine::result().particles[0])
  }

Usage:
  python3 bench/peers/llama_peer.py --manifest results/llama_peer.json [--csv results/llama_peer.csv]
         [--methods a,b] [--model PATH] [--draft-layers 0-19] [--requests 1,8] [--cycles C] [--new-tokens N]
         [--repeats R] [--near-tie 0.5] [--quick] [--only-validate] [--skip-validation] [--device cuda|cpu]
  python3 bench/peers/llama_peer.py --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --draft-layers 0-19
                                              no manifest: built-in chat prompts, references from the exact forward
CSV columns: method, requests, particles, steps, vocab, dtype, cycle_us, tokens_per_s, cycle_p90_us, model_us,
nonmodel_us, valid, device, torch, tokens_per_cycle. --device cpu runs the eager methods with wall-clock timing, to
check the logic without a GPU (slowly). Exit status 0, 1 when a validation failed, 2 when it could not run.
"""

import argparse
import copy
import csv
import hashlib
import json
import math
import os
import statistics
import sys
import time

import llama_torch  # beside this script: the GGUF loading and the PyTorch forward, shared with tests/hf_compare.py
from toy_torch import CSV_COLUMNS, GraphedCycle, median_cycle_us, median_forwards_us

ALL_METHODS = ["hf_generate_greedy", "hf_assisted", "hf_prompt_lookup", "torch_spec_eager", "torch_spec_graph",
               "torch_smc_eager", "torch_smc_graph"]
GRAPH_METHODS = {"torch_spec_graph", "torch_smc_graph"}
LLAMA_CSV_COLUMNS = CSV_COLUMNS + ["tokens_per_cycle"]
GUMBEL_REACH = 50.0  # Gumbel noise reorders logits only within this many temperatures of each other (P ~ e^-50)
DEFAULTS = {"generate": {"requests": [1, 8, 64], "new_tokens": 128},
            "spec": {"steps": [4], "requests": [1, 8, 64], "cycles": 32, "warmup_cycles": 3, "new_tokens": 128},
            "smc": {"particles": [8], "steps": [4], "requests": [1, 8, 64], "cycles": 32, "warmup_cycles": 3,
                    "draft_temperature": 0.7, "target_temperature": 1.0, "alpha": 1.0, "tau": 0.5},
            "validation_new_tokens": 48, "smc_validation": {"particles": 4, "steps": 4, "cycles": 6,
                                                            "draft_temperature": 1e-6, "target_temperature": 0.0,
                                                            "alpha": 1.0, "tau": 0.5}}
MODEL_REPETITIONS, MODEL_WARMUP = 20, 3


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", help="written by bucket_sweep for the Llama model (format above)")
    parser.add_argument("--model", help="the GGUF (default: the manifest's)")
    parser.add_argument("--csv", default="results/llama_peer.csv", help="CSV output path (parents are created)")
    parser.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated subset of the methods")
    parser.add_argument("--draft-layers", help="draft layer subset, e.g. 0-19 or 0-11,18-29 (default: manifest's)")
    parser.add_argument("--smc-draft-layers",
                        help="the SMC methods' draft layers (default: the manifest's smc_draft_layers, else the "
                             "draft layers)")
    parser.add_argument("--requests", default="", help="subset / override of the request counts, e.g. 1,8")
    parser.add_argument("--cycles", type=int, default=0, help="timed cycles per torch run (default: manifest's)")
    parser.add_argument("--new-tokens", type=int, default=0, help="tokens per hf_* run (default: manifest's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed hf_* generate calls (median; default 3)")
    parser.add_argument("--near-tie", type=float, default=0.5, help="logit gap of a numerics near-tie (default 0.5)")
    parser.add_argument("--validation-tokens", type=int, default=0,
                        help="greedy tokens validated per prompt (default: all of the manifest's, else 48)")
    parser.add_argument("--prompts", type=int, default=4, help="built-in chat prompts without a manifest (default 4)")
    parser.add_argument("--quick", action="store_true", help="requests 1,8, 16 cycles, 64 new tokens, 2 repeats")
    parser.add_argument("--only-validate", action="store_true", help="validate, do not time")
    parser.add_argument("--skip-validation", action="store_true", help="time without validating first")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--loader", default="gguf", choices=["auto", "transformers", "gguf"],
                        help="how the GGUF gets into transformers (llama_torch.load_hf_model; default gguf)")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in ALL_METHODS]
    if unknown:
        parser.error("unknown method(s) %s; known: %s" % (", ".join(unknown), ", ".join(ALL_METHODS)))
    args.requests = [int(x) for x in args.requests.split(",") if x.strip()]
    if args.quick:
        args.requests = args.requests or [1, 8]
        args.cycles = args.cycles or 16
        args.new_tokens = args.new_tokens or 64
        args.repeats = min(args.repeats, 2)
    if not args.manifest and not args.model:
        parser.error("give --manifest or --model")
    return args


def sha256_of(path):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def main():
    args = parse_args()
    try:
        import torch
    except ImportError as error:
        print("llama_peer: torch is not importable (%s)" % error, file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("llama_peer: torch.cuda.is_available() is False (use --device cpu to check the logic)", file=sys.stderr)
        return 2
    manifest, manifest_dir = {}, os.getcwd()
    if args.manifest:
        try:
            with open(args.manifest) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as error:
            print("llama_peer: cannot read the manifest %s (%s)" % (args.manifest, error), file=sys.stderr)
            return 2
        if manifest.get("format") != "smcgraph-llama-peer-1":
            print("llama_peer: %s has format %r, expected smcgraph-llama-peer-1" % (args.manifest,
                                                                                  manifest.get("format")),
                  file=sys.stderr)
            return 2
        manifest_dir = os.path.dirname(os.path.abspath(args.manifest))
    model_path = args.model or os.path.join(manifest_dir, manifest.get("model", ""))
    if not os.path.isfile(model_path):
        print("llama_peer: no model at %s (python3 tools/fetch_model.py fetches it)" % model_path, file=sys.stderr)
        return 2
    if manifest.get("model_sha256") and sha256_of(model_path) != manifest["model_sha256"]:
        print("llama_peer: %s does not have the manifest's sha256" % model_path, file=sys.stderr)
        return 2

    torch.set_float32_matmul_precision("highest")  # no TF32: the exact forward's matmuls are fp32
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    methods = [m for m in args.methods if on_gpu or m not in GRAPH_METHODS]
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    int64 = torch.int64
    logits_dtype = manifest.get("logits_dtype", "bf16")
    eos_id = int(manifest.get("eos_id", -1))
    near_tie = args.near_tie

    def layers_of(given, key, what, fallback):
        """A draft's layers: the flag's, else the manifest's `key`, else `fallback` (a ValueError when None).
        A flag that differs from the manifest (smcgraph's draft) gets a note: that validation will not match."""
        manifest_layers = [int(x) for x in manifest[key]] if key in manifest else None
        layers = llama_torch.parse_layers(given) if given else (
            manifest_layers if manifest_layers is not None else fallback)
        if layers is None:
            raise ValueError("no draft layers: give --%s or the manifest's %s" % (key.replace("_", "-"), key))
        if manifest_layers is not None and layers != manifest_layers:
            print("llama_peer: note: --%s differs from the manifest's %s (smcgraph's %s); the validation of "
                  "those tokens will not match" % (key.replace("_", "-"), key, what))
        return layers

    try:
        draft_layers = layers_of(args.draft_layers, "draft_layers", "draft", None)
        smc_draft_layers = layers_of(args.smc_draft_layers, "smc_draft_layers", "SMC draft", draft_layers)
    except ValueError as error:
        print("llama_peer: %s" % error, file=sys.stderr)
        return 2

    # ------------------------------------------------------------------------------------------------------------
    # Models: HF fp32 (exact dequantised weights) -> smcgraph's weights; HF bf16 for the hf_* methods
    start = time.time()
    hf32, loader = llama_torch.load_hf_model(torch, model_path, torch.float32, device, args.loader)
    weights = llama_torch.LlamaWeights(torch, hf32, device)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)  # = transformers' bf16 load: RNE of the same fp32 values
    del hf32
    hf16.generation_config.eos_token_id = None if eos_id < 0 else eos_id  # no EOS: fixed-length runs
    hf16.generation_config.pad_token_id = int(hf16.config.pad_token_id if hf16.config.pad_token_id is not None else 0)
    if max(draft_layers[-1], smc_draft_layers[-1]) >= weights.layers:
        print("llama_peer: draft layers %s / %s exceed the model's %d layers" % (draft_layers, smc_draft_layers,
                                                                               weights.layers),
              file=sys.stderr)
        return 2
    vocab = weights.vocab
    if "prompts" in manifest:
        prompts = [[int(t) for t in p] for p in manifest["prompts"]]
    else:
        prompts = llama_torch.chat_prompts(llama_torch.load_tokenizer(model_path), args.prompts)
    print("llama_peer on %s (torch %s): model %s (loader %s, %.0f s), %d layers, draft layers %s (%d), SMC draft "
          "layers %s (%d), logits %s; methods %s" % (
              device_name, torch.__version__, os.path.basename(model_path), loader, time.time() - start,
              weights.layers, compact_layers(draft_layers), len(draft_layers), compact_layers(smc_draft_layers),
              len(smc_draft_layers), logits_dtype, ", ".join(methods)))
    sys.stdout.flush()

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    # ------------------------------------------------------------------------------------------------------------
    # Sampling and scoring (as smc_peer.py)
    tiny = torch.finfo(torch.float32).tiny

    def sample(logits, temperature, alpha=1.0):
        """Token, log-prob under softmax(alpha l / T) and logZ = lse(alpha l / T) - alpha lse(l / T) per row."""
        l = logits.float()
        if temperature == 0.0:
            zeros = torch.zeros(l.shape[0], device=device)
            return torch.argmax(l, dim=-1), zeros, zeros
        x = l / temperature
        power = x if alpha == 1.0 else alpha * x
        u = torch.rand_like(power).clamp_min_(tiny)
        token = torch.argmax(power - torch.log(-torch.log(u)), dim=-1)
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

    def padded(rows_prompts, fill=0):
        """Right-padded [R, Pmax] tokens, lengths [R] (device tensors)."""
        width = max(len(p) for p in rows_prompts)
        table = torch.full((len(rows_prompts), width), fill, dtype=int64)
        for r, p in enumerate(rows_prompts):
            table[r, : len(p)] = torch.tensor(p, dtype=int64)
        return table.to(device), torch.tensor([len(p) for p in rows_prompts], dtype=int64, device=device)

    # ------------------------------------------------------------------------------------------------------------
    # Speculative decoding (greedy) and SMC in PyTorch over LlamaTorch

    class Run:
        """Per-row token table and lengths, the target and draft LlamaTorch with their static caches."""

        def __init__(self, rows_prompts, steps, extra_tokens, exact, layers):
            self.R, self.K = len(rows_prompts), steps
            self.max_len = max(len(p) for p in rows_prompts) + 1 + extra_tokens + steps + 2
            self.target = llama_torch.LlamaTorch(weights, None, self.R, self.max_len, exact, logits_dtype)
            self.draft = llama_torch.LlamaTorch(weights, layers, self.R, self.max_len, exact, logits_dtype)
            self.tokens = torch.zeros(self.R, self.max_len, dtype=int64, device=device)
            self.length = torch.zeros(self.R, dtype=int64, device=device)
            self.prompt_length = torch.zeros(self.R, dtype=int64, device=device)
            self.drafts = torch.zeros(self.R, steps, dtype=int64, device=device)
            self.arange2 = torch.arange(2, device=device)
            self.arange_k1 = torch.arange(steps + 1, device=device)
            self.committed = torch.zeros((), dtype=int64, device=device)

        def prefill(self, rows_prompts):
            """Both models over the prompts (right-padded: pad positions' KV is rewritten before any query reads
            it, since every later forward starts at the first position not yet valid); returns the target's logits
            at each row's last prompt token."""
            table, lengths = padded(rows_prompts)
            width = table.shape[1]
            positions = torch.arange(width, device=device).expand(self.R, width)
            self.tokens[:, :width] = table
            self.prompt_length.copy_(lengths)
            self.draft.forward(table, positions, logits=False)
            return self.target.forward(table, positions, columns=lengths - 1)

        def generated(self, count):
            """Per row, `count` tokens from the first generated one (fewer when the row is shorter)."""
            tokens, start, length = self.tokens.cpu().tolist(), self.prompt_length.tolist(), self.length.tolist()
            return [tokens[r][start[r] : min(start[r] + count, length[r])] for r in range(self.R)]

    class SpecRun(Run):
        """Greedy speculative decoding, N = 1 (graphs/spec_cycle.cpp's cycle)."""

        def __init__(self, rows_prompts, steps, extra_tokens, exact=False):
            super().__init__(rows_prompts, steps, extra_tokens, exact, draft_layers)
            last = self.prefill(rows_prompts)
            self.tokens.scatter_(1, self.prompt_length.unsqueeze(1), torch.argmax(last.float(), -1).unsqueeze(1))
            self.length.copy_(self.prompt_length + 1)
            self.verify_logits = None

        def draft_phase(self):
            L = self.length
            positions = L.unsqueeze(1) - 2 + self.arange2
            logits = self.draft.forward(self.tokens.gather(1, positions), positions)
            self.drafts[:, 0].copy_(torch.argmax(logits[:, 1].float(), -1))
            for s in range(1, self.K):
                logits = self.draft.forward(self.drafts[:, s - 1 : s], (L + s - 1).unsqueeze(1))
                self.drafts[:, s].copy_(torch.argmax(logits[:, 0].float(), -1))

        def verify(self):
            positions = self.length.unsqueeze(1) - 1 + self.arange_k1
            tokens = torch.cat([self.tokens.gather(1, positions[:, :1]), self.drafts], dim=1)
            self.verify_logits = self.target.forward(tokens, positions)

        def accept_commit(self):
            best = torch.argmax(self.verify_logits.float(), -1)  # [R, K + 1]
            accepted = torch.cumprod((best[:, : self.K] == self.drafts).to(int64), 1).sum(1)
            # best[j] = d_{j+1} for j < accepted, so best is exactly the committed tokens at L .. L + accepted.
            self.tokens.scatter_(1, self.length.unsqueeze(1) + self.arange_k1, best)
            self.length += accepted + 1
            self.committed += (accepted + 1).sum()

        def cycle_eager(self):
            self.draft_phase()
            self.verify()
            self.accept_commit()

    class SmcRun(Run):
        """The SMC-SD cycle (DESIGN.md §2, deferred bonus), Q requests x N particles, uniform lengths per request."""

        def __init__(self, request_prompts, particles, steps, params, extra_tokens, exact=False):
            rows_prompts = [p for p in request_prompts for _ in range(particles)]
            super().__init__(rows_prompts, steps, extra_tokens, exact, smc_draft_layers)
            self.Q, self.N, self.p = len(request_prompts), particles, params
            self.logw = torch.zeros(self.R, dtype=torch.float64, device=device)
            self.logq = torch.zeros(self.R, steps, device=device)
            self.particle_ids = torch.arange(particles, device=device)
            self.request_base = torch.arange(self.Q, device=device).unsqueeze(1) * particles
            self.all_rows = torch.arange(self.R, device=device)
            last = self.prefill(rows_prompts)
            # x_P from the target's power distribution, one draw per request, shared by its particles.
            first, _, _ = sample(last[:: particles], params["target_temperature"], params["alpha"])
            self.tokens.scatter_(1, self.prompt_length.unsqueeze(1), first.repeat_interleave(particles).unsqueeze(1))
            self.length.copy_(self.prompt_length + 1)
            self.host_max_length = max(len(p) for p in rows_prompts) + 1
            self.verify_logits = None

        def draft_phase(self):
            L, T_d = self.length, self.p["draft_temperature"]
            positions = L.unsqueeze(1) - 2 + self.arange2
            logits = self.draft.forward(self.tokens.gather(1, positions), positions)
            token, logq, _ = sample(logits[:, 1], T_d)
            self.drafts[:, 0].copy_(token)
            self.logq[:, 0].copy_(logq)
            for s in range(1, self.K):
                logits = self.draft.forward(self.drafts[:, s - 1 : s], (L + s - 1).unsqueeze(1))
                token, logq, _ = sample(logits[:, 0], T_d)
                self.drafts[:, s].copy_(token)
                self.logq[:, s].copy_(logq)

        def verify(self):
            positions = self.length.unsqueeze(1) - 1 + self.arange_k1
            tokens = torch.cat([self.tokens.gather(1, positions[:, :1]), self.drafts], dim=1)
            self.verify_logits = self.target.forward(tokens, positions)

        def weigh_commit(self):
            alpha = self.p["alpha"]
            logp, bonus, logz = score(self.verify_logits, self.drafts, self.p["target_temperature"], alpha)
            self.logw += (alpha * logp - self.logq).sum(1).double() + logz.double()
            self.tokens.scatter_(1, self.length.unsqueeze(1) + self.arange_k1,
                                 torch.cat([self.drafts, bonus.unsqueeze(1)], dim=1))
            self.length += self.K + 1
            self.host_max_length += self.K + 1

        def resample(self):
            """Per request: ESS; systematic resampling below tau N; the changed rows copy tokens and KV."""
            Q, N = self.Q, self.N
            logw = self.logw.view(Q, N)
            w = torch.softmax(logw, dim=1)
            ess = 1.0 / (w * w).sum(1)
            need = ess < self.p["tau"] * N  # NaN (all weights -inf) compares False: no resampling
            if not bool(need.any()):  # host sync, as a first implementation has it
                return
            u = torch.rand(Q, 1, device=device, dtype=torch.float64)
            cumulative = torch.cumsum(w, dim=1)
            cumulative[:, -1] = 1.0
            ancestors = torch.searchsorted(cumulative, (u + self.particle_ids.double()) / N, right=True)
            ancestors = torch.where(need.unsqueeze(1), ancestors.clamp_(max=N - 1), self.particle_ids)
            self.logw.copy_(torch.where(need.unsqueeze(1), 0.0, logw).reshape(-1))
            source = (ancestors + self.request_base).reshape(-1)
            changed = torch.nonzero(source != self.all_rows).squeeze(1)  # host sync (the row list)
            if changed.numel() == 0:
                return
            src = source[changed]
            self.tokens[changed] = self.tokens[src]
            self.length[changed] = self.length[src]
            for model in (self.target, self.draft):
                model.copy_rows(changed, src, self.host_max_length)

        def cycle_eager(self):
            self.draft_phase()
            self.verify()
            self.weigh_commit()
            self.resample()

    def Driver(run, graph):
        """Eager cycles, or (graph methods) the draft phase and the verify forward captured once (two graphs) and
        replayed, then the commit eagerly."""

        def after():
            if isinstance(run, SpecRun):
                run.accept_commit()
            else:
                run.weigh_commit()
                run.resample()

        # verify(): verify_logits then names the graph's output buffer
        return GraphedCycle(torch, run.cycle_eager, graph, [run.draft_phase, run.verify], None, after)

    def time_cycles(driver, cycles):
        return median_cycle_us(torch, driver, cycles, on_gpu)

    def time_call(fn, repeats):
        """Median us of fn() over `repeats` calls after one warm-up call; returns (us, last result)."""
        result = fn()
        us = []
        for _ in range(repeats):
            sync()
            if on_gpu:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                result = fn()
                end.record()
                torch.cuda.synchronize()
                us.append(1000.0 * begin.elapsed_time(end))
            else:
                begin = time.perf_counter()
                result = fn()
                us.append(1e6 * (time.perf_counter() - begin))
        return statistics.median(us), result

    def time_model_forwards(rows, steps, layers):
        """Draft head (rows x 2) + K - 1 draft steps (rows x 1) + verify (rows x K + 1) alone, in one CUDA graph."""
        base = 64
        max_len = base + steps + 2
        target = llama_torch.LlamaTorch(weights, None, rows, max_len, False, logits_dtype)
        draft = llama_torch.LlamaTorch(weights, layers, rows, max_len, False, logits_dtype)
        r = torch.arange(rows, device=device).unsqueeze(1)

        def inputs(count):
            j = torch.arange(count, device=device)
            return (r * 131 + j * 7919 + 5) % vocab, (base + j).expand(rows, count).contiguous()

        head, one, verify = inputs(2), inputs(1), inputs(steps + 1)

        def forwards():
            draft.forward(*head)
            for _ in range(steps - 1):
                draft.forward(*one)
            target.forward(*verify)

        return median_forwards_us(torch, forwards, on_gpu, MODEL_WARMUP, MODEL_REPETITIONS)

    # ------------------------------------------------------------------------------------------------------------
    # HF transformers methods
    draft16 = llama_torch.layer_subset_hf_model(torch, hf16, draft_layers)
    draft16.generation_config.num_assistant_tokens_schedule = "constant"
    draft16.generation_config.assistant_confidence_threshold = 0.0  # > 0 would stop drafting early

    def hf_batch(request_prompts):
        """Left-padded input_ids and attention_mask."""
        width = max(len(p) for p in request_prompts)
        pad = hf16.generation_config.pad_token_id
        ids = torch.full((len(request_prompts), width), pad, dtype=int64)
        mask = torch.zeros((len(request_prompts), width), dtype=int64)
        for r, p in enumerate(request_prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=int64)
            mask[r, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    def hf_generate(request_prompts, new_tokens, assistant_steps=0, prompt_lookup=0):
        """New tokens per request (lists) and the target's forward count of one generate call."""
        ids, mask = hf_batch(request_prompts)
        calls = [0]
        hook = hf16.register_forward_pre_hook(lambda module, inputs: calls.__setitem__(0, calls[0] + 1))
        try:
            kwargs = {}
            if assistant_steps:
                draft16.generation_config.num_assistant_tokens = assistant_steps
                kwargs["assistant_model"] = draft16
            if prompt_lookup:
                kwargs["prompt_lookup_num_tokens"] = prompt_lookup
            with torch.no_grad():
                out = hf16.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                    **kwargs)
        finally:
            hook.remove()
        return out[:, ids.shape[1] :].cpu().tolist(), calls[0]

    # ------------------------------------------------------------------------------------------------------------
    # Validation: references and the near-tie rule on the exact forward, teacher-forced along smcgraph's tokens

    def exact_path_logits(prompt, tokens, layers):
        """Exact forward's logits [len(tokens), V] predicting tokens[i] after prompt + tokens[:i] (one prefill)."""
        sequence = list(prompt) + list(tokens[:-1])
        model = llama_torch.LlamaTorch(weights, layers, 1, len(sequence), True, logits_dtype)
        with torch.no_grad():
            logits = model.forward(torch.tensor([sequence], device=device),
                                   torch.arange(len(sequence), device=device).unsqueeze(0))[0]
        return logits[len(prompt) - 1 :].float()

    class Reference:
        """Reference tokens per prompt and, per generated position, the logits that chose it (exact forward)."""

        def __init__(self, name, prompts_used, tokens, chooser, layers=None):
            self.name, self.prompts, self.tokens = name, prompts_used, [list(t) for t in tokens]
            self.logits = []  # per prompt: [len, V] of the model that chose each token (chooser(i) -> "t" / "d")
            self.choosers = [chooser(i) for i in range(max(len(t) for t in tokens))]
            for prompt, toks in zip(prompts_used, self.tokens):
                path = {"t": exact_path_logits(prompt, toks, None)}
                if "d" in self.choosers:
                    path["d"] = exact_path_logits(prompt, toks, layers if layers is not None else draft_layers)
                self.logits.append(torch.stack([path[self.choosers[i]][i] for i in range(len(toks))]))

        def self_check(self):
            """smcgraph's own tokens against the exact forward: each within near_tie of the argmax."""
            worst, where = 0.0, None
            for q, (toks, logits) in enumerate(zip(self.tokens, self.logits)):
                chosen = logits.gather(1, torch.tensor(toks, device=device).unsqueeze(1)).squeeze(1)
                gaps = (logits.max(1).values - chosen).cpu().tolist()
                for i, gap in enumerate(gaps):
                    if gap > worst:
                        worst, where = gap, (q, i)
            return worst, where

        def compare(self, got):
            """(matched, explained, problems) of per-prompt token lists against the reference."""
            matched, explained, problems = 0, [], []
            for q, (want, have) in enumerate(zip(self.tokens, got)):
                n = min(len(want), len(have))
                if len(have) < len(want):
                    problems.append("prompt %d: %d tokens, reference %d" % (q, len(have), len(want)))
                for i in range(n):
                    if want[i] == have[i]:
                        matched += 1
                        continue
                    logits = self.logits[q][i]
                    gap = abs(float(logits[want[i]] - logits[have[i]]))
                    tolerance = near_tie + (GUMBEL_REACH * smc_draft_t if self.choosers[i] == "d" else 0.0)
                    if gap <= tolerance:
                        explained.append(gap)
                    else:
                        problems.append("prompt %d token %d: reference %d, peer %d (%s logit gap %.3f)" % (
                            q, i, want[i], have[i], "draft" if self.choosers[i] == "d" else "target", gap))
                    break
            return matched, explained, problems

    def report(label, reference, got):
        matched, explained, problems = reference.compare(got)
        total = sum(len(t) for t in reference.tokens)
        print("  %-22s %d/%d tokens equal to %s%s%s" % (
            label, matched, total, reference.name,
            ", %d stopped at a near-tie (gap <= %.3f)" % (len(explained), max(explained)) if explained else "",
            "" if not problems else "; MISMATCH: " + "; ".join(problems[:3])))
        sys.stdout.flush()
        return not problems

    smc_manifest = dict(DEFAULTS["smc"], **manifest.get("smc", {}))
    smc_validation = dict(DEFAULTS["smc_validation"], **smc_manifest.get("validation", {}))
    smc_draft_t = float(smc_validation["draft_temperature"])
    spec_manifest = dict(DEFAULTS["spec"], **manifest.get("spec", {}))
    generate_manifest = dict(DEFAULTS["generate"], **manifest.get("generate", {}))
    spec_steps = [int(k) for k in spec_manifest["steps"] if int(k) > 0]  # K = 0 (no draft): hf_generate_greedy

    valid = {}  # method -> bool
    all_ok = True
    if not args.skip_validation:
        print("validation (near-tie: logit gap <= %g on the exact forward along the reference's tokens):" % near_tie)
        greedy = manifest.get("greedy")
        if greedy and greedy.get("tokens"):
            greedy_tokens = [[int(t) for t in toks[: args.validation_tokens or len(toks)]] for toks in greedy["tokens"]]
            greedy_prompts = prompts[: len(greedy_tokens)]
            greedy_ref = Reference("smcgraph's greedy", greedy_prompts, greedy_tokens, lambda i: "t")
        else:
            count = args.validation_tokens or DEFAULTS["validation_new_tokens"]
            greedy_prompts = prompts
            run = SpecRun(greedy_prompts, 1, count, exact=True)  # K = 1 keeps it near target-only decoding
            with torch.no_grad():
                while min(run.length - run.prompt_length).item() < count:
                    run.cycle_eager()
            greedy_ref = Reference("the exact forward's greedy (no manifest)", greedy_prompts,
                                   run.generated(count), lambda i: "t")
            del run
        worst, where = greedy_ref.self_check()
        ok = worst <= near_tie
        print("  %-22s %s vs the exact forward's argmax: largest gap %.3f%s%s" % (
            "reference", greedy_ref.name, worst, "" if where is None else " (prompt %d token %d)" % where,
            "" if ok else " > %g: MISMATCH" % near_tie))
        all_ok = all_ok and ok
        new_tokens_val = max(len(t) for t in greedy_ref.tokens)
        with torch.no_grad():
            if "hf_generate_greedy" in methods:
                got = [hf_generate([p], new_tokens_val)[0][0] for p in greedy_prompts]
                ok = report("hf_generate_greedy b=1", greedy_ref, got)
                got, _ = hf_generate(greedy_prompts, new_tokens_val)
                ok = report("hf_generate_greedy pad", greedy_ref, got) and ok
                valid["hf_generate_greedy"] = ok
            if "hf_assisted" in methods:
                ok = True
                for steps in spec_steps:
                    got = [hf_generate([p], new_tokens_val, steps)[0][0] for p in greedy_prompts]
                    ok = report("hf_assisted K=%d" % steps, greedy_ref, got) and ok
                valid["hf_assisted"] = ok
            if "hf_prompt_lookup" in methods:
                ok = True
                for steps in spec_steps:
                    got = [hf_generate([p], new_tokens_val, prompt_lookup=steps)[0][0] for p in greedy_prompts]
                    ok = report("hf_prompt_lookup K=%d" % steps, greedy_ref, got) and ok
                valid["hf_prompt_lookup"] = ok
            spec_methods = [m for m in methods if m.startswith("torch_spec")]
            if spec_methods and spec_steps:
                steps = spec_steps[0]

                def spec_tokens(exact, method=None):
                    """Cycles until every row has new_tokens_val tokens (at least one per cycle)."""
                    run = SpecRun(greedy_prompts, steps, (new_tokens_val + 2) * (steps + 1), exact)
                    driver = Driver(run, method in GRAPH_METHODS)
                    driver.warm_up(1 if method in GRAPH_METHODS else 0)
                    for _ in range(new_tokens_val + 1):
                        if int((run.length - run.prompt_length).min()) >= new_tokens_val:
                            break
                        driver.cycle()
                    return run.generated(new_tokens_val)

                ok = report("exact spec K=%d" % steps, greedy_ref, spec_tokens(True))
                for method in spec_methods:
                    valid[method] = report("%s K=%d" % (method, steps), greedy_ref, spec_tokens(False, method)) and ok
            smc_methods = [m for m in methods if m.startswith("torch_smc")]
            if smc_methods:
                params = {key: float(smc_validation[key]) for key in ("draft_temperature", "target_temperature",
                                                                       "alpha", "tau")}
                particles, steps = int(smc_validation["particles"]), int(smc_validation["steps"])
                cycles = int(smc_validation["cycles"])

                def chooser(i):  # x_P from the target, then K draft samples and the target's bonus per cycle
                    return "t" if i == 0 or (i - 1) % (steps + 1) == steps else "d"

                def smc_tokens(exact, method=None):
                    run = SmcRun(smc_prompts, particles, steps, params, cycles * (steps + 1), exact)
                    driver = Driver(run, method in GRAPH_METHODS)
                    warm = 1 if method in GRAPH_METHODS else 0
                    driver.warm_up(warm)
                    for _ in range(cycles - warm):
                        driver.cycle()
                    return [row for row in run.generated(1 + cycles * (steps + 1))[:: particles]]

                if smc_validation.get("tokens") and not smc_validation.get("engine_ok", True):
                    print("  smc: the engine's validation run failed; nothing to compare")
                    ok, smc_methods = False, []
                    for method in [m for m in methods if m.startswith("torch_smc")]:
                        valid[method] = False
                elif smc_validation.get("tokens"):
                    smc_tokens_ref = [[int(t) for t in toks] for toks in smc_validation["tokens"]]
                    smc_prompts = prompts[: len(smc_tokens_ref)]
                    smc_ref = Reference("smcgraph's SMC tokens", smc_prompts, smc_tokens_ref, chooser,
                                        smc_draft_layers)
                    worst, where = smc_ref.self_check()
                    ok = worst <= near_tie + GUMBEL_REACH * smc_draft_t
                    print("  %-22s smcgraph's SMC tokens vs the exact forward's argmax: largest gap %.3f%s%s" % (
                        "reference", worst, "" if where is None else " (prompt %d token %d)" % where,
                        "" if ok else ": MISMATCH"))
                    ok = report("exact smc N=%d K=%d" % (particles, steps), smc_ref, smc_tokens(True)) and ok
                else:
                    smc_prompts = prompts
                    smc_ref = Reference("the exact forward's SMC run (no manifest)", smc_prompts,
                                        smc_tokens(True), chooser, smc_draft_layers)
                    ok = True
                for method in smc_methods:
                    valid[method] = report("%s N=%d K=%d" % (method, particles, steps), smc_ref,
                                           smc_tokens(False, method)) and ok
        sync()
        all_ok = all_ok and all(valid.values())
        print("validation: %s" % ("ok" if all_ok else "FAILED"))
        if on_gpu:
            torch.cuda.empty_cache()
    if args.only_validate:
        return 0 if all_ok else 1

    # ------------------------------------------------------------------------------------------------------------
    # Timing
    def requests_of(section):
        return args.requests or [int(q) for q in section["requests"]]

    def request_prompts(count):
        return [prompts[q % len(prompts)] for q in range(count)]

    csv_dir = os.path.dirname(args.csv)
    if csv_dir:
        os.makedirs(csv_dir, exist_ok=True)
    torch_version = torch.__version__
    with open(args.csv, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(LLAMA_CSV_COLUMNS)

        def row(method, requests, particles, steps, cycle_us, tokens_per_s, p90_us, model_us, tokens_per_cycle, ok):
            writer.writerow([method, requests, particles, steps, vocab, logits_dtype, "%.2f" % cycle_us,
                             "%.0f" % tokens_per_s, "%.2f" % p90_us, "%.2f" % model_us, "%.2f" % (cycle_us - model_us),
                             1 if ok and valid.get(method, args.skip_validation) else 0, device_name, torch_version,
                             "%.3f" % tokens_per_cycle])
            out.flush()

        nan = float("nan")
        new_tokens = args.new_tokens or int(generate_manifest["new_tokens"])
        if "hf_generate_greedy" in methods:
            print("\nhf_generate_greedy (bf16, %d new tokens per request; median of %d calls)" % (new_tokens,
                                                                                                 args.repeats))
            for requests in requests_of(generate_manifest):
                try:
                    us, (got, calls) = time_call(lambda: hf_generate(request_prompts(requests), new_tokens),
                                                 args.repeats)
                    ok = all(len(t) == new_tokens for t in got)
                    tps = requests * new_tokens / (us * 1e-6)
                    row("hf_generate_greedy", requests, 1, 0, us / calls, tps, nan, nan, new_tokens / calls, ok)
                    print("  requests %3d: %10.0f us per call, %8.0f tokens/s%s" % (requests, us, tps,
                                                                                    "" if ok else " (short runs!)"))
                except Exception as error:  # noqa: BLE001 - report, go on
                    all_ok = False
                    print("  requests %3d: %s: %s" % (requests, type(error).__name__, error))
                sys.stdout.flush()
        for method, what in (("hf_assisted", "assistant_steps"), ("hf_prompt_lookup", "prompt_lookup")):
            if method not in methods:
                continue
            assisted_tokens = args.new_tokens or int(spec_manifest["new_tokens"])
            print("\n%s (bf16, batch 1, prompt 0, %d new tokens; median of %d calls)" % (method, assisted_tokens,
                                                                                        args.repeats))
            for steps in spec_steps:
                try:
                    us, (got, calls) = time_call(
                        lambda: hf_generate(request_prompts(1), assisted_tokens, **{what: steps}), args.repeats)
                    tps = assisted_tokens / (us * 1e-6)
                    row(method, 1, 1, steps, us / calls, tps, nan, nan, assisted_tokens / calls,
                        len(got[0]) == assisted_tokens)
                    print("  K %d: %10.0f us per call, %d target forwards, %.2f tokens per forward, %8.0f tokens/s"
                          % (steps, us, calls, assisted_tokens / calls, tps))
                except Exception as error:  # noqa: BLE001
                    all_ok = False
                    print("  K %d: %s: %s" % (steps, type(error).__name__, error))
                sys.stdout.flush()

        def time_torch(method, requests, particles, steps, section, model_us):
            cycles = args.cycles or int(section["cycles"])
            warmup = int(section["warmup_cycles"])
            extra = (cycles + warmup + 1) * (steps + 1)
            with torch.no_grad():
                if method.startswith("torch_spec"):
                    run = SpecRun(request_prompts(requests), steps, extra)
                else:
                    params = {key: float(section[key]) for key in ("draft_temperature", "target_temperature",
                                                                   "alpha", "tau")}
                    run = SmcRun(request_prompts(requests), particles, steps, params, extra)
                driver = Driver(run, method in GRAPH_METHODS)
                driver.warm_up(warmup)
                sync()
                before = run.committed.item()
                cycle_us, p90_us = time_cycles(driver, cycles)
                if method.startswith("torch_spec"):
                    tokens_per_cycle = (run.committed.item() - before) / (cycles * run.R)
                else:
                    tokens_per_cycle = steps + 1
            tps = requests * tokens_per_cycle / (cycle_us * 1e-6)
            row(method, requests, particles, steps, cycle_us, tps, p90_us, model_us, tokens_per_cycle, True)
            del driver, run
            if on_gpu:
                torch.cuda.empty_cache()
            return cycle_us, tokens_per_cycle, tps

        for kind, section, grid in (
                ("spec", spec_manifest, [(1, k) for k in spec_steps]),
                # the SMC cycle's draft lengths (bucket_sweep lists no K = 0 there: SMC needs a draft)
                ("smc", smc_manifest, [(int(n), int(k)) for n in smc_manifest["particles"]
                                       for k in smc_manifest["steps"]])):
            kind_methods = [m for m in methods if m.startswith("torch_" + kind)]
            if not kind_methods:
                continue
            for particles, steps in grid:
                print("\n%s N=%d K=%d (median us per cycle; tok/c = tokens per row and cycle)" % (kind, particles,
                                                                                                  steps))
                print("%8s %10s %s" % ("requests", "model_us", "  ".join("%-30s" % m for m in kind_methods)))
                for requests in requests_of(section):
                    try:
                        with torch.no_grad():
                            model_us = time_model_forwards(requests * particles, steps,
                                                           smc_draft_layers if kind == "smc" else draft_layers)
                    except Exception as error:  # noqa: BLE001
                        print("  model timing failed: %s" % error)
                        model_us = nan
                    cells = []
                    for method in kind_methods:
                        try:
                            cycle_us, tpc, tps = time_torch(method, requests, particles, steps, section, model_us)
                            cells.append("%.1f (%.2f tok/c, %.0f tok/s)" % (cycle_us, tpc, tps))
                        except Exception as error:  # noqa: BLE001 - report, go on
                            all_ok = False
                            cells.append("%s: %s" % (type(error).__name__, str(error)[:60]))
                    print("%8d %10.1f %s" % (requests, model_us, "  ".join("%-30s" % c for c in cells)))
                    sys.stdout.flush()
    print("\nllama_peer: CSV %s; %s" % (args.csv, "ok" if all_ok else "FAILED (see above)"))
    return 0 if all_ok else 1


def compact_layers(layers):
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else "%d-%d" % (start, layer))
            start = None
    return ",".join(parts)


if __name__ == "__main__":
    sys.exit(main())

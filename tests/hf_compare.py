#!/usr/bin/env python3
"""smcgraph's Llama forward (examples/llama_logits) against HF transformers on the real model (DESIGN.md §6.1).

HF transformers' LlamaForCausalLM holds the same GGUF twice, in fp32 (the exactly dequantised Q4_1 / Q8_0
weights) and in bf16 (round to nearest even of those), on the GPU; the prompts are built with the HF tokenizer from
the GGUF's own metadata (apply_chat_template, ChatML with a generation prompt). For every prompt smcgraph's tool
is run as

    <tool> --model M.gguf --tokens t0,t1,... --logits-out F --greedy N --greedy-out G

(F: raw little-endian fp32 logits [T, vocab] of one prefill at positions 0 .. T-1; G: N greedy token ids, comma-
separated, from one-token forwards) and compared with HF:
  - logits of the prefill: max |delta| and relative error ||delta||_F / ||L_fp32||_F against HF fp32 and HF bf16
    (HF bf16 against HF fp32 is printed too: the scale of plain bf16 inference's own deviation);
  - top-1 agreement over the prompt's positions against HF fp32;
  - the greedy continuation: how many leading tokens agree with HF fp32's greedy path and with HF bf16's, and at the
    first divergence from fp32 the fp32 margin L[hf token] - L[smcgraph token] on the common prefix.

Pass / fail (per prompt; exit 1 when any fails):
  max |delta| vs HF fp32 <= --max-abs (default 1.5) and relative error <= --max-rel (default 0.03);
  every top-1 mismatch and the first greedy divergence from fp32 sits at a near-tie: fp32 margin <= --near-tie
  (default 0.5); and the tool returned N tokens.
Tolerance rationale: smcgraph holds the weights as bf16 (round to nearest even of the dequantised value, relative
error <= 2^-9) and rounds activations to bf16 at fixed points (normed inputs, q / k / v, attention output, SwiGLU
product) with fp32 accumulation and an fp32 residual. HF fp32 uses the exact weights and no rounding. The bf16
roundings compound over 30 layers: emulating smcgraph's numerics in PyTorch (--emulate, bench/peers/llama_torch.py
exact forward) gives, on the 6 built-in chat prompts, max |delta| 0.53 and relative error 0.011-0.012 against HF
fp32, with logits up to ~38 in magnitude; HF's own bf16 inference gives 1.2 and 0.029. Bugs that still give
plausible text give far more: RoPE base 10^4 instead of 10^5 relative error 0.17, one layer skipped 0.31,
positions off by one 0.44. So the defaults allow about 3x smcgraph's expected error and HF bf16's level, and
still catch a structural mistake by 5x or more. A top-1 or greedy difference is a numerics effect only where the
two tokens' fp32 logits are within about twice the logit error at the top (~0.3 measured), hence --near-tie 0.5
(HF bf16 leaves the fp32 greedy path only at margins < 0.1 on these prompts, DESIGN.md §6.1).

Usage (on a machine with a CUDA GPU, torch, transformers and the `gguf` package):
  python3 tests/hf_compare.py --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --tool build/examples/llama_logits
         [--prompts 6] [--greedy 48] [--max-abs 1.5] [--max-rel 0.03] [--near-tie 0.5] [--json FILE]
  --long N                  long prompts instead: prompt i is a multi-turn chat of at least N tokens, the built-in
                            questions from the i-th on, each answered by HF fp32's own greedy reply (up to 96 tokens,
                            to <|im_end|>), ending with a question and the generation prompt. Past 512 positions the
                            tool's attention folds a row in 512-position splits (split-KV, llama_attention.cu): the
                            prefill's later queries and every greedy step read several splits
  --emulate                 compare smcgraph's numerics contract emulated in PyTorch (llama_torch.py, exact forward)
                            instead of running the tool: the expected numbers, and a check of this script
  --dump-reference DIR      also write HF's reference to DIR as .npy (prompt<i>_tokens, _logits_fp32 [T, V],
                            _logits_bf16, _greedy_fp32, _greedy_bf16 (int32 [N]), _greedy_top_values_fp32 /
                            _greedy_top_ids_fp32 ([N, 8] of the fp32 greedy path) + reference.json)
  --reference DIR           use such a dump instead of running HF (no transformers / gguf needed; torch neither,
                            with the tool)
  --device cuda|cpu         where HF runs (default cuda; cpu works, slowly)
  --loader gguf|transformers|auto
                            how the GGUF gets into a dense transformers LlamaForCausalLM (llama_torch.load_hf_model):
                            gguf (default) dequantises with the `gguf` package (llama.cpp's reader) and un-permutes
                            Q/K as transformers does; transformers uses from_pretrained(gguf_file=) with
                            GgufConfig(dequantize=True) (needs `accelerate`; transformers >= 5.17 otherwise keeps the
                            weights packed, computing in fp32)
Exit status: 0 all prompts pass, 1 a prompt failed, 2 it could not run.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench", "peers"))
TOP = 8  # logits kept per greedy step of the fp32 path (near-tie check at a divergence)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(os.path.dirname(HERE), ".cache", "models",
                                                         "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--tool", default="build/examples/llama_logits", help="smcgraph's llama_logits binary")
    parser.add_argument("--emulate", action="store_true", help="emulate smcgraph in PyTorch instead of the tool")
    parser.add_argument("--prompts", type=int, default=6, help="built-in chat prompts to run (default 6)")
    parser.add_argument("--greedy", type=int, default=48, help="greedy tokens to compare (default 48)")
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="multi-turn chat prompts of at least N tokens (HF fp32's own replies) instead")
    parser.add_argument("--max-abs", type=float, default=1.5, help="max |logit delta| vs HF fp32 (default 1.5)")
    parser.add_argument("--max-rel", type=float, default=0.03, help="relative error vs HF fp32 (default 0.03)")
    parser.add_argument("--near-tie", type=float, default=0.5,
                        help="fp32 margin under which a top-1 / greedy difference is a near-tie (default 0.5)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--loader", default="gguf", choices=["auto", "transformers", "gguf"],
                        help="how the GGUF gets into transformers (llama_torch.load_hf_model; default gguf)")
    parser.add_argument("--dump-reference", metavar="DIR", help="write HF's reference as .npy files to DIR")
    parser.add_argument("--reference", metavar="DIR", help="read HF's reference from DIR instead of running HF")
    parser.add_argument("--json", metavar="FILE", help="write the per-prompt results as JSON")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------------------------
# The HF reference


def hf_greedy(torch, model, prompt, steps, device):
    """Greedy continuation of `steps` tokens (argmax, no EOS stop) with HF's cache; per step the TOP largest fp32
    logits (values, ids) it was chosen from."""
    tokens, top_values, top_ids = [], [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for i in range(steps):
            logits = out.logits[0, -1].float()
            token = int(torch.argmax(logits))
            values, ids = torch.topk(logits, TOP)
            tokens.append(token)
            top_values.append(values.cpu().numpy())
            top_ids.append(ids.cpu().numpy())
            if i + 1 == steps:
                break
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return (np.array(tokens, dtype=np.int32), np.array(top_values, dtype=np.float32),
            np.array(top_ids, dtype=np.int64))


def long_chat_prompts(torch, model, tokenizer, count, min_tokens, device):
    """`count` multi-turn chats of at least `min_tokens` tokens: the built-in questions from the i-th on (cycled),
    each answered by `model`'s greedy reply (up to 96 tokens, to <|im_end|>), then one more question and the
    generation prompt."""
    import llama_torch

    def encode(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    questions, replies, prompts = llama_torch.CHAT_MESSAGES, {}, []
    for i in range(count):
        messages, q = [], i
        while True:
            messages.append({"role": "user", "content": questions[q % len(questions)]})
            ids = encode(messages)
            if len(ids) >= min_tokens:
                break
            key = tuple(ids)
            if key not in replies:  # the reply to this conversation so far (prompts share their beginnings)
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=96, do_sample=False,
                                         eos_token_id=end, pad_token_id=end)
                reply = [int(t) for t in out[0, len(ids):].tolist() if int(t) != end]
                replies[key] = tokenizer.decode(reply, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": replies[key]})
            q += 1
        prompts.append(ids)
    return prompts


def hf_reference(args):
    """Per prompt: tokens, fp32 / bf16 prefill logits, fp32 / bf16 greedy tokens, fp32 greedy top-k."""
    import torch

    import llama_torch

    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)
    tokenizer = llama_torch.load_tokenizer(args.model)
    model32, loader = llama_torch.load_hf_model(torch, args.model, torch.float32, device, args.loader)
    prompts = (long_chat_prompts(torch, model32, tokenizer, args.prompts, args.long, device) if args.long > 0
               else llama_torch.chat_prompts(tokenizer, args.prompts))
    reference = [{"tokens": np.array(p, dtype=np.int32)} for p in prompts]
    emulator = Emulator(torch, model32) if args.emulate else None
    for name in ("fp32", "bf16"):
        # bf16: round to nearest even of the same fp32 values, as transformers' bf16 load of the file
        model = model32 if name == "fp32" else copy.deepcopy(model32).to(torch.bfloat16)
        for entry, prompt in zip(reference, prompts):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt], device=device)).logits[0].float()
            entry["logits_" + name] = logits.cpu().numpy()
            tokens, values, ids = hf_greedy(torch, model, prompt, args.greedy, device)
            entry["greedy_" + name] = tokens
            if name == "fp32":
                entry["greedy_top_values_fp32"], entry["greedy_top_ids_fp32"] = values, ids
        del model
    del model32
    if device.type == "cuda":
        torch.cuda.empty_cache()
    import transformers

    info = {"model": os.path.abspath(args.model), "greedy": args.greedy, "prompts": len(prompts), "long": args.long,
            "loader": loader, "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    return reference, info, emulator


REFERENCE_KEYS = ["tokens", "logits_fp32", "logits_bf16", "greedy_fp32", "greedy_bf16", "greedy_top_values_fp32",
                  "greedy_top_ids_fp32"]


def dump_reference(directory, reference, info):
    os.makedirs(directory, exist_ok=True)
    for i, entry in enumerate(reference):
        for key in REFERENCE_KEYS:
            np.save(os.path.join(directory, "prompt%d_%s.npy" % (i, key)), entry[key])
    with open(os.path.join(directory, "reference.json"), "w") as f:
        json.dump(info, f, indent=2)


def load_reference(directory):
    with open(os.path.join(directory, "reference.json")) as f:
        info = json.load(f)
    reference = [{key: np.load(os.path.join(directory, "prompt%d_%s.npy" % (i, key))) for key in REFERENCE_KEYS}
                 for i in range(int(info["prompts"]))]
    return reference, info


# ------------------------------------------------------------------------------------------------------------------
# smcgraph's side: the tool, or its numerics emulated


def run_tool(tool, model, tokens, steps, vocab):
    with tempfile.TemporaryDirectory(prefix="hf_compare-") as directory:
        logits_path, greedy_path = os.path.join(directory, "logits.f32"), os.path.join(directory, "greedy.txt")
        command = [tool, "--model", model, "--tokens", ",".join(str(int(t)) for t in tokens), "--logits-out",
                   logits_path, "--greedy", str(steps), "--greedy-out", greedy_path,
                   "--max-len", str(max(2048, len(tokens) + steps))]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            raise RuntimeError("%s exited %d:\n%s" % (" ".join(command[:3]) + " ...", result.returncode,
                                                      result.stdout[-2000:]))
        logits = np.fromfile(logits_path, dtype="<f4")
        if logits.size != len(tokens) * vocab:
            raise RuntimeError("%s: %d floats, expected %d x %d" % (logits_path, logits.size, len(tokens), vocab))
        with open(greedy_path) as f:
            text = f.read().strip()
        greedy = [int(x) for x in text.split(",") if x.strip()]
        return logits.reshape(len(tokens), vocab), greedy


class Emulator:
    """smcgraph's numerics contract in PyTorch (llama_torch.LlamaTorch, exact forward) on the HF model's device."""

    def __init__(self, torch, hf_model_fp32):
        import llama_torch

        self.torch = torch
        self.device = hf_model_fp32.model.embed_tokens.weight.device
        self.weights = llama_torch.LlamaWeights(torch, hf_model_fp32, self.device)
        self.llama_torch = llama_torch

    def __call__(self, tokens, steps):
        torch = self.torch
        length = len(tokens) + steps
        model = self.llama_torch.LlamaTorch(self.weights, rows=1, max_len=length, exact=True)
        with torch.no_grad():
            ids = torch.tensor([list(tokens)], device=self.device)
            logits = model.forward(ids, torch.arange(len(tokens), device=self.device).unsqueeze(0))[0]
            greedy, last = [], logits[-1]
            for i in range(steps):
                greedy.append(int(torch.argmax(last)))
                if i + 1 == steps:
                    break
                position = torch.tensor([[len(tokens) + i]], device=self.device)
                last = model.forward(torch.tensor([[greedy[-1]]], device=self.device), position)[0, 0]
        return logits.cpu().numpy(), greedy


# ------------------------------------------------------------------------------------------------------------------
# Comparison


def errors(a, b):
    """(max |a - b|, ||a - b||_F / ||b||_F) in float64."""
    delta = a.astype(np.float64) - b.astype(np.float64)
    return float(np.abs(delta).max()), float(np.linalg.norm(delta) / np.linalg.norm(b.astype(np.float64)))


def agreement(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return n


def compare(entry, logits, greedy, args):
    result = {"T": int(len(entry["tokens"]))}
    problems = []
    ref32, ref16 = entry["logits_fp32"], entry["logits_bf16"]
    result["max_abs_fp32"], result["rel_fp32"] = errors(logits, ref32)
    result["max_abs_bf16"], result["rel_bf16"] = errors(logits, ref16)
    result["hf_bf16_max_abs_fp32"], result["hf_bf16_rel_fp32"] = errors(ref16, ref32)
    if not np.isfinite(logits).all():
        problems.append("non-finite logits")
    if result["max_abs_fp32"] > args.max_abs:
        problems.append("max |delta| %.3f > %.3f" % (result["max_abs_fp32"], args.max_abs))
    if result["rel_fp32"] > args.max_rel:
        problems.append("relative error %.4f > %.4f" % (result["rel_fp32"], args.max_rel))
    # Top-1 over the prompt's positions.
    ours, theirs = logits.argmax(-1), ref32.argmax(-1)
    mismatches = np.nonzero(ours != theirs)[0]
    result["top1_agree"] = int(len(ours) - len(mismatches))
    worst = 0.0
    for t in mismatches:
        margin = float(ref32[t, theirs[t]] - ref32[t, ours[t]])
        worst = max(worst, margin)
        if margin > args.near_tie:
            problems.append("position %d: top-1 %d, HF fp32 %d with margin %.3f" % (t, ours[t], theirs[t], margin))
    result["top1_worst_margin"] = worst
    # Greedy continuation.
    if len(greedy) != args.greedy:
        problems.append("%d greedy tokens, asked for %d" % (len(greedy), args.greedy))
    g32, g16 = entry["greedy_fp32"], entry["greedy_bf16"]
    result["greedy_agree_fp32"] = agreement(greedy, g32)
    result["greedy_agree_bf16"] = agreement(greedy, g16)
    result["hf_bf16_greedy_agree_fp32"] = agreement(g16, g32)
    result["divergence_margin"] = None
    step = result["greedy_agree_fp32"]
    if step < min(len(greedy), len(g32)):
        values, ids = entry["greedy_top_values_fp32"][step], entry["greedy_top_ids_fp32"][step]
        ours_token = int(greedy[step])
        hits = np.nonzero(ids == ours_token)[0]
        # Not among HF's TOP largest: the margin is at least top1 - TOP-th largest.
        margin = float(values[0] - (values[hits[0]] if len(hits) else values[-1]))
        result["divergence_margin"] = margin
        if not len(hits) or margin > args.near_tie:
            problems.append("greedy step %d: token %d, HF fp32 %d with margin %s%.3f" % (
                step, ours_token, int(g32[step]), "" if len(hits) else ">= ", margin))
    result["problems"] = problems
    result["ok"] = not problems
    return result


def main():
    args = parse_args()
    vocab, emulator = None, None
    if args.reference and args.emulate:
        print("hf_compare: --emulate needs the HF model; it does not go with --reference", file=sys.stderr)
        return 2
    try:
        if args.reference:
            reference, info = load_reference(args.reference)
            if int(info["greedy"]) < args.greedy:
                args.greedy = int(info["greedy"])
        else:
            if not os.path.isfile(args.model):
                print("hf_compare: no model at %s (python3 tools/fetch_model.py fetches it)" % args.model,
                      file=sys.stderr)
                return 2
            import torch

            if args.device == "cuda" and not torch.cuda.is_available():
                print("hf_compare: no CUDA device (use --device cpu to run HF on the CPU)", file=sys.stderr)
                return 2
            start = time.time()
            reference, info, emulator = hf_reference(args)
            print("HF reference: %d prompts, greedy %d, loader %s, torch %s, transformers %s, %s (%.0f s)" % (
                len(reference), args.greedy, info["loader"], info["torch"], info["transformers"],
                info["device"], time.time() - start))
            if args.dump_reference:
                dump_reference(args.dump_reference, reference, info)
                print("HF reference written to %s" % args.dump_reference)
        vocab = reference[0]["logits_fp32"].shape[1]
        if args.emulate:
            side = emulator
            label = "smcgraph numerics emulated (llama_torch exact)"
        else:
            if not os.access(args.tool, os.X_OK):
                print("hf_compare: %s is not an executable (build it: ninja -C build examples/llama_logits)"
                      % args.tool, file=sys.stderr)
                return 2

            def side(tokens, steps):
                return run_tool(args.tool, args.model, tokens, steps, vocab)

            label = args.tool
    except (ImportError, OSError, ValueError, RuntimeError) as error:
        print("hf_compare: cannot run: %s: %s" % (type(error).__name__, error), file=sys.stderr)
        return 2

    print("comparing %s against HF fp32 / bf16 (pass: max|d| <= %g, rel <= %g, near-tie margin <= %g)" % (
        label, args.max_abs, args.max_rel, args.near_tie))
    header = ("prompt", "T", "max|d|32", "rel32", "max|d|16", "rel16", "hf16:max", "hf16:rel", "top1", "greedy=32",
              "margin", "greedy=16", "hf16=32", "result")
    print("%6s %4s %9s %8s %9s %8s %9s %8s %7s %9s %7s %9s %7s  %s" % header)
    results, all_ok = [], True
    for i, entry in enumerate(reference):
        try:
            logits, greedy = side(entry["tokens"].tolist(), args.greedy)
            result = compare(entry, logits, greedy, args)
        except (OSError, RuntimeError, ValueError) as error:
            result = {"T": int(len(entry["tokens"])), "ok": False, "problems": ["%s" % error]}
            print("%6d %4d  could not run: %s" % (i, result["T"], error))
            results.append(result)
            all_ok = False
            continue
        results.append(result)
        all_ok = all_ok and result["ok"]
        margin = result["divergence_margin"]
        print("%6d %4d %9.4f %8.5f %9.4f %8.5f %9.4f %8.5f %7s %9s %7s %9s %7s  %s" % (
            i, result["T"], result["max_abs_fp32"], result["rel_fp32"], result["max_abs_bf16"], result["rel_bf16"],
            result["hf_bf16_max_abs_fp32"], result["hf_bf16_rel_fp32"], "%d/%d" % (result["top1_agree"], result["T"]),
            "%d/%d" % (result["greedy_agree_fp32"], args.greedy), "-" if margin is None else "%.3f" % margin,
            "%d/%d" % (result["greedy_agree_bf16"], args.greedy),
            "%d/%d" % (result["hf_bf16_greedy_agree_fp32"], args.greedy),
            "ok" if result["ok"] else "FAIL: " + "; ".join(result["problems"][:3])))
    print("columns: max|d| / rel vs HF fp32 (32) and bf16 (16); hf16: HF bf16 vs HF fp32; top1: positions whose "
          "argmax equals HF fp32's; greedy=32 / =16: leading greedy tokens equal to HF fp32's / bf16's; margin: HF "
          "fp32's logit margin at the first greedy divergence; hf16=32: HF bf16's greedy vs fp32's")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "label": label, "thresholds": {"max_abs": args.max_abs, "max_rel": args.max_rel,
                                                                     "near_tie": args.near_tie},
                       "results": results}, f, indent=2)
    print("hf_compare: %s" % ("ok" if all_ok else "FAILED"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

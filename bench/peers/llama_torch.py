"""Shared pieces of the real-model peers (llama_peer.py) and tests/hf_compare.py: SmolLM2-135M's GGUF (DESIGN.md
§6.1) loaded into HF transformers, and a plain PyTorch Llama forward over the same weights with a static KV cache
indexed by (row, position). Imported by those scripts (they put this directory on sys.path); not a script.

  load_tokenizer(path)                      the HF tokenizer built from the GGUF's metadata
  load_hf_model(torch, path, dtype, device) (LlamaForCausalLM, loader name): the GGUF's tensors dequantised exactly
                                            (fp32), Q/K rows un-permuted, then cast to `dtype` (round to nearest even)
  chat_prompts(tokenizer, count)            token ids of built-in chat prompts (ChatML, generation prompt added)
  parse_layers("0-11,18-29")                [0 .. 11, 18 .. 29]
  layer_subset_hf_model(torch, model, layers)
                                            an HF draft whose modules ARE the target's for those layers (shared
                                            parameters, no copy), attention layer_idx renumbered for its own cache
  LlamaWeights(torch, hf_model, device)     the weights as smcgraph holds them: matrices bf16 (RNE of the exact
                                            dequantised value; QKV and gate/up concatenated), norms fp32, tied head
  LlamaTorch(weights, layers, rows, max_len, exact, logits_dtype)
      .forward(tokens, positions)           tokens / positions [R, T] (int64) -> logits [R, T, V]; the KV of all the
                                            forward's tokens is written at (row, position) first, then every query
                                            attends to the row's keys at positions <= its own (columns=[R]: only
                                            those tokens' logits; logits=False: KV only)
      .copy_rows(dst, src, length)          KV of rows src over rows dst, positions < length (SMC resampling)

Two numerics, like toy_torch's exact / fast forwards:
  exact=True   smcgraph's Llama numerics contract (/tmp/plan, mirrored in DESIGN.md §6.1): fp32 tensors holding the
               bf16 weights, fp32 matmuls (TF32 off), bf16 rounding exactly at the contract's points (normed
               activations, q / k / v after RoPE, the KV cache, the attention output, the SwiGLU product), fp32
               residual, attention and softmax; logits fp32 (rounded to bf16 when logits_dtype is bf16). For
               validation against smcgraph's tokens and for tests/hf_compare.py --emulate.
  exact=False  what a PyTorch implementation runs for speed: bf16 weights and activations through cuBLAS (fp32
               accumulation; fp32 output via torch.mm(out_dtype=) where this torch has it), fp32 residual, RoPE and
               norms, SDPA attention over the static cache (GQA by folding each KV head's query heads into query
               rows, so the cache is never copied). For timing.
RoPE: transformers un-permutes the GGUF's Q/K rows, so the rotation pairs are (i, i + head_dim / 2) (rotate-half),
which is the contract's adjacent-pair rotation of the GGUF layout with the head dimensions reordered (same q . k).
inv_freq[i] = float(base ** (-2 i / head_dim)) computed in double; angle = float(p) * inv_freq[i] in fp32.
"""

import copy
import importlib.util
import os

CHAT_MESSAGES = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Summarise the plot of Romeo and Juliet.",
]


def gguf_location(path):
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    directory, name = gguf_location(path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def chat_prompts(tokenizer, count):
    """Token ids of the first `count` built-in chat prompts (cycled), through the GGUF's chat template."""
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": CHAT_MESSAGES[i % len(CHAT_MESSAGES)]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    return prompts


def parse_layers(text):
    """'0-27' or '0-11,18-29' (inclusive ranges and single indices) -> increasing list of layer indices."""
    layers = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "-" in item:
            first, last = (int(x) for x in item.split("-", 1))
            layers.extend(range(first, last + 1))
        else:
            layers.append(int(item))
    if not layers or sorted(set(layers)) != layers or layers[0] < 0:
        raise ValueError("layer list %r must be increasing, non-negative and non-empty" % text)
    return layers


# ------------------------------------------------------------------------------------------------------------------
# Loading the GGUF into transformers


def load_hf_model(torch, path, dtype, device, loader="gguf"):
    """(model, loader): a dense transformers LlamaForCausalLM holding the GGUF's weights dequantised exactly (fp32),
    Q/K rows un-permuted, then cast to `dtype` (round to nearest even).
      loader "gguf" (default): the `gguf` package (llama.cpp's reader and dequantiser) does the dequantisation,
        this module un-permutes Q/K exactly as transformers' GGUF loader does (TensorProcessor); the tensors are
        bit for bit those of transformers' legacy GGUF loader (checked against transformers 5.23's from_pretrained).
      loader "transformers": from_pretrained(gguf_file=, quantization_config=GgufConfig(dequantize=True)); needs
        `accelerate`. Without dequantize=True, transformers >= 5.17 keeps the weights packed in GgufLinear modules
        computing in fp32, which is neither a dense fp32 nor a bf16 model, hence the flag (and the default above).
      "auto": transformers when accelerate is importable, else gguf."""
    if loader == "auto":
        loader = "transformers" if importlib.util.find_spec("accelerate") is not None else "gguf"
    if loader == "transformers":
        from transformers import AutoModelForCausalLM

        directory, name = gguf_location(path)
        kwargs = {}
        try:
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(gguf_file=path, dequantize=True)
        except ImportError:  # older transformers: its GGUF loader always dequantises
            pass
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype, **kwargs)
        if any(type(m).__name__.startswith("Gguf") for m in model.modules()):
            raise RuntimeError("transformers kept GGUF-packed modules; use loader gguf")
    elif loader == "gguf":
        model = _load_with_gguf_package(torch, path).to(dtype)
    else:
        raise ValueError("loader %r: expected auto, transformers or gguf" % loader)
    return model.to(device).eval(), loader


def _reverse_permute(weights, heads):
    """Undo llama.cpp's convert permutation of Q/K rows (transformers' TensorProcessor._reverse_permute_weights)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _load_with_gguf_package(torch, path):
    import gguf
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(path)

    def field(key, default=None):
        value = reader.fields.get(key)
        return default if value is None else value.contents()

    architecture = field("general.architecture")
    if architecture != "llama":
        raise ValueError("%s: general.architecture = %r, expected llama" % (path, architecture))
    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv", heads))
    hidden = int(field("llama.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    config = LlamaConfig(
        vocab_size=int(field("llama.vocab_size", len(field("tokenizer.ggml.tokens")))),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_hidden_layers=int(field("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(field("llama.context_length")),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(field("llama.rope.freq_base"))},
        tie_word_embeddings=tied,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
    )
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
    state = {}
    for name, tensor in tensors.items():
        values = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".")
            if kind == "attn_q":
                values = _reverse_permute(values, heads)
            elif kind == "attn_k":
                values = _reverse_permute(values, kv_heads)
            target = "model.layers.%s.%s.%s" % (layer, per_layer[kind], suffix)
        else:
            target = names[name]
        state[target] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # a writable copy
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [key for key in missing if not (tied and key == "lm_head.weight")]:
        raise ValueError("%s: tensors missing %s, unexpected %s" % (path, missing, unexpected))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its inv_freq buffer was on meta
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def layer_subset_hf_model(torch, target, layers):
    """An HF LlamaForCausalLM running `layers` of `target`: embedding, decoder layers, final norm and head ARE the
    target's modules (shared parameters, nothing copied). Each chosen layer is a shallow copy with its own module
    table, whose attention (also a shallow copy) gets layer_idx = its index in the draft, so the draft's own cache
    (sized by the draft config's num_hidden_layers) is indexed 0 .. len(layers) - 1."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layers]
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    blocks = []
    for draft_index, layer in enumerate(layers):
        block = copy.copy(target.model.layers[layer])
        block._modules = dict(block._modules)  # replacing self_attn below must not touch the target's block
        attention = copy.copy(block.self_attn)
        attention.layer_idx = draft_index
        block._modules["self_attn"] = attention
        blocks.append(block)
    draft.model.layers = torch.nn.ModuleList(blocks)
    draft.generation_config = copy.deepcopy(target.generation_config)
    left = [name for name, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError("layer_subset_hf_model: tensors left on the meta device: %s" % left)
    return draft.eval()


# ------------------------------------------------------------------------------------------------------------------
# The plain PyTorch forward


class LlamaWeights:
    """The model's weights on `device` as smcgraph holds them (matrices bf16 = RNE of the exact dequantised fp32
    value; norm weights fp32), taken from an HF model loaded in fp32. Matrices in HF orientation [out, in]."""

    def __init__(self, torch, hf_model, device):
        self.torch = torch
        config = hf_model.config
        self.layers = config.num_hidden_layers
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.vocab = config.vocab_size
        self.eps = float(config.rms_norm_eps)
        rope = getattr(config, "rope_parameters", None) or {}
        self.rope_base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        if hf_model.model.embed_tokens.weight.dtype != torch.float32:
            raise ValueError("LlamaWeights needs the HF model in fp32 (exact dequantised values)")
        bf16 = torch.bfloat16

        def matrix(*tensors):
            return torch.cat([t.detach() for t in tensors], 0).to(device=device, dtype=bf16).contiguous()

        def norm(t):
            return t.detach().to(device=device, dtype=torch.float32).contiguous()

        self.embed = matrix(hf_model.model.embed_tokens.weight)
        head = hf_model.get_output_embeddings().weight
        self.head = self.embed if head.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr() else matrix(head)
        self.final_norm = norm(hf_model.model.norm.weight)
        self.blocks = []
        for block in hf_model.model.layers:
            attention, mlp = block.self_attn, block.mlp
            self.blocks.append({
                "attn_norm": norm(block.input_layernorm.weight),
                "ffn_norm": norm(block.post_attention_layernorm.weight),
                "qkv": matrix(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight),
                "o": matrix(attention.o_proj.weight),
                "gate_up": matrix(mlp.gate_proj.weight, mlp.up_proj.weight),
                "down": matrix(mlp.down_proj.weight),
            })
        self._exact = None

    def exact_copy(self):
        """The same values as fp32 tensors (for the exact forward's fp32 matmuls); built once."""
        if self._exact is None:
            f32 = self.torch.float32
            self._exact = {
                "embed": self.embed.to(f32),
                "head": self.head.to(f32),
                "blocks": [{k: v.to(f32) for k, v in b.items()} for b in self.blocks],
            }
        return self._exact


class LlamaTorch:
    """Weights + a static KV cache [layers, 2, rows, max_len, kv_heads, head_dim] for the given layer subset
    (max_len rounded up to a multiple of 16)."""

    def __init__(self, weights, layers=None, rows=1, max_len=256, exact=False, logits_dtype="fp32"):
        torch = self.torch = weights.torch
        self.w = weights
        self.layers = list(range(weights.layers)) if layers is None else list(layers)
        if any(not 0 <= layer < weights.layers for layer in self.layers):
            raise ValueError("layers %s outside 0 .. %d" % (self.layers, weights.layers - 1))
        max_len = -(-max_len // 16) * 16  # a multiple of 16: aligned attention masks for the fused SDPA kernels
        self.rows, self.max_len, self.exact = rows, max_len, exact
        if logits_dtype not in ("fp32", "bf16"):
            raise ValueError("logits_dtype %r: expected fp32 or bf16" % logits_dtype)
        self.logits_bf16 = logits_dtype == "bf16"
        device = self.device = weights.embed.device
        self.dtype = torch.float32 if exact else torch.bfloat16  # storage of activations / KV
        self.cache = torch.zeros(len(self.layers), 2, rows, max_len, weights.kv_heads, weights.head_dim,
                                 device=device, dtype=self.dtype)
        half = weights.head_dim // 2
        inv_freq = torch.tensor([float(weights.rope_base ** (-2.0 * i / weights.head_dim)) for i in range(half)],
                                dtype=torch.float64).to(device=device, dtype=torch.float32)
        angle = torch.arange(max_len, device=device, dtype=torch.float32).unsqueeze(1) * inv_freq
        self.cos, self.sin = torch.cos(angle), torch.sin(angle)  # [max_len, head_dim / 2] fp32
        self.key_positions = torch.arange(max_len, device=device)
        self.row_index = torch.arange(rows, device=device).unsqueeze(1)
        self.mm = self._exact_mm if exact else self._fast_mm()
        if exact:
            source = weights.exact_copy()
            self.embed, self.head, blocks = source["embed"], source["head"], source["blocks"]
        else:
            self.embed, self.head, blocks = weights.embed, weights.head, weights.blocks
        self.blocks = [blocks[layer] for layer in self.layers]

    # --- numerics helpers ---------------------------------------------------------------------------------------
    def round(self, t):
        """bf16 rounding (RNE); the exact forward keeps the rounded value in fp32."""
        t = t.to(self.torch.bfloat16)
        return t.float() if self.exact else t

    @staticmethod
    def _exact_mm(a, w):
        return a @ w.t()  # fp32 x fp32 (bf16 values): exact products, fp32 accumulation

    def _fast_mm(self):
        """bf16 x bf16 with fp32 output: torch.mm(out_dtype=fp32) where available (cuBLAS writes the fp32
        accumulator), else the bf16 result widened."""
        torch = self.torch
        try:
            probe = torch.ones(2, 8, device=self.device, dtype=torch.bfloat16)
            torch.mm(probe, probe.t(), out_dtype=torch.float32)

            def mm(a, w):
                return torch.mm(a.reshape(-1, a.shape[-1]), w.t(), out_dtype=torch.float32).reshape(
                    *a.shape[:-1], w.shape[0])
        except (TypeError, RuntimeError, NotImplementedError):

            def mm(a, w):
                return (a @ w.t()).float()
        return mm

    def rms_norm(self, x, weight):
        return self.round(x * self.torch.rsqrt(x.square().mean(-1, keepdim=True) + self.w.eps) * weight)

    def rope(self, t, cos, sin):
        """t [R, T, heads, head_dim] fp32; rotate pairs (i, i + head_dim / 2) by angle[position, i]."""
        half = t.shape[-1] // 2
        a, b = t[..., :half], t[..., half:]
        return self.torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    # --- forward --------------------------------------------------------------------------------------------------
    def forward(self, tokens, positions, columns=None, logits=True):
        """tokens, positions: [R, T] int64 (R = the model's rows); returns logits [R, T, V] (fp32, or bf16 for
        bf16 logits in the fast forward); with `columns` ([R] int64) only those tokens' logits [R, V]; with
        logits=False only the KV writes (None). Capturable: no host sync, no allocation that depends on values."""
        torch, w = self.torch, self.w
        rows, count = tokens.shape
        heads, kv_heads, head_dim = w.heads, w.kv_heads, w.head_dim
        x = self.embed[tokens].float()  # fp32 residual [R, T, H]
        cos = self.cos[positions].unsqueeze(2)  # [R, T, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(2)
        visible = self.key_positions <= positions.unsqueeze(-1)  # [R, T, S]: keys at positions <= the query's
        row_index = self.row_index[:rows]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for j, block in enumerate(self.blocks):
            n = self.rms_norm(x, block["attn_norm"])
            qkv = self.mm(n, block["qkv"]).float()
            q = qkv[..., :q_size].reshape(rows, count, heads, head_dim)
            k = qkv[..., q_size : q_size + kv_size].reshape(rows, count, kv_heads, head_dim)
            v = qkv[..., q_size + kv_size :].reshape(rows, count, kv_heads, head_dim)
            q, k, v = self.round(self.rope(q, cos, sin)), self.round(self.rope(k, cos, sin)), self.round(v)
            keys, values = self.cache[j, 0], self.cache[j, 1]  # [rows, S, kv_heads, head_dim]
            keys[row_index, positions] = k  # all tokens' KV first, then attention (as the C++ forward)
            values[row_index, positions] = v
            o = self.attention(q, keys[:rows], values[:rows], visible)  # [R, T, heads * head_dim]
            x = x + self.mm(self.round(o), block["o"])
            n = self.rms_norm(x, block["ffn_norm"])
            gate_up = self.mm(n, block["gate_up"]).float()
            g, u = gate_up.chunk(2, dim=-1)
            x = x + self.mm(self.round(g / (1.0 + torch.exp(-g)) * u), block["down"])
        if not logits:
            return None
        if columns is not None:
            x = x[row_index.squeeze(1), columns]  # [R, H]
        n = self.rms_norm(x, w.final_norm)
        if self.exact:
            logits = n @ self.head.t()
            return self.round(logits) if self.logits_bf16 else logits
        return n @ self.head.t() if self.logits_bf16 else self.mm(n, self.head)

    def attention(self, q, keys, values, visible):
        """q [R, T, heads, d]; keys / values [R, S, kv_heads, d]; visible [R, T, S] -> [R, T, heads * d]."""
        torch = self.torch
        rows, count, heads, head_dim = q.shape
        kv_heads = keys.shape[2]
        if self.exact:  # fp32 scores, softmax and weighted sum; query head h reads kv head h // (heads / kv_heads)
            group = heads // kv_heads
            qg = q.reshape(rows, count, kv_heads, group, head_dim)
            scores = torch.einsum("rtkgd,rskd->rkgts", qg, keys) / float(head_dim) ** 0.5
            scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            o = torch.einsum("rkgts,rskd->rtkgd", p, values)
            return o.reshape(rows, count, heads * head_dim)
        # GQA without copying the cache: the `group` query heads of one KV head become extra query rows.
        group = heads // kv_heads
        qg = q.reshape(rows, count, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        mask = visible[:, None, None].expand(rows, 1, group, count, visible.shape[-1])
        o = torch.nn.functional.scaled_dot_product_attention(
            qg.reshape(rows, kv_heads, group * count, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask.reshape(rows, 1, group * count, -1), scale=float(head_dim) ** -0.5)
        o = o.reshape(rows, kv_heads, group, count, head_dim).permute(0, 3, 1, 2, 4)
        return o.reshape(rows, count, heads * head_dim)

    def copy_rows(self, dst, src, length):
        """Rows src's KV over rows dst (index tensors), positions < length: SMC resampling's reshuffle."""
        self.cache[:, :, dst, :length] = self.cache[:, :, src, :length]

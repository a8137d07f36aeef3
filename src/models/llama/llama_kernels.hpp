// Launchers of the Llama forward's kernels (internal). One forward = embed, then per layer
//   QKV GEMM (RMSNorm prologue; RoPE, q store and KV write epilogue) -> attention (split-KV) -> O GEMM (+=
//   residual)
//   -> gate/up GEMM (RMSNorm prologue, SwiGLU epilogue) -> down GEMM (+= residual),
// then the LM head (LtHead): up to kSmallHeadMaxTokens tokens one own kernel with cuBLASLt's bits, more
// tokens cuBLASLt's matmul after an RMSNorm kernel; or the own GEMM (RMSNorm prologue, logits epilogue) where
// cuBLASLt is off or offers no algorithm. Every launcher validates its shape, takes
// the stream last, never allocates or synchronizes, and reads every value that changes between replays from
// device memory.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/types.hpp"

namespace smcgraph::llama {

/// What the GEMM does around Y[T, N] = A[T, K] W[N, K]^T (bf16 operands, fp32 accumulation).
enum class GemmEpilogue : int {
  kQkvRope = 0,     ///< A = RMSNorm(x); RoPE on q and k columns; q -> q_out, k and v -> KV at out_slots
  kResidualAdd = 1, ///< A = a_bf16; residual[T, N] += Y
  kSwiGlu = 2,      ///< A = RMSNorm(x); gate/up rows interleaved in groups of 8: act[T, N / 2] = silu(g) * u
  kLogits = 3,      ///< A = RMSNorm(x); logits[T, N] = Y (fp32 or bf16), live rows only
};

/// Rows of gate and of up that alternate in the fused gate/up weight (LlamaWeights::kGateUpGroup / 2).
inline constexpr int kSwiGluGroup = 8;

/// Which GEMM kernel a launch takes (the same bits either way, llama_gemm.cu says why): by the token count,
/// the narrow / wide tiles whatever the count, or the K-pipelined tiles (kQkvRope, kResidualAdd and kSwiGlu
/// with N a multiple of 32; pipelined_tiles()). LlamaModel reads it from SMCGRAPH_GEMM_TILES (by_size,
/// narrow_wide, pipelined), for tests and A/B runs.
enum class GemmTiles : uint8_t { kBySize = 0, kNarrowWide = 1, kPipelined = 2 };
/// How the narrow and wide GEMM blocks stage bf16 A rows (the O and down projections' inputs) in shared
/// memory: through registers (each warp loads whole rows, every load in flight before the first store; the
/// default) or with cp.async (16 bytes a thread at a time). The same bytes either way; LlamaModel reads
/// SMCGRAPH_GEMM_A_STAGING (registers, cp_async).
enum class GemmAStaging : uint8_t { kRegisters = 0, kCpAsync = 1 };
/// How the narrow blocks with their W rows in shared memory (4 and 8 warps, up to 384 tokens) load their
/// tensor-core fragments: ldmatrix with explicit m16n8k16 MMAs (the default) or wmma's loads and 16 x 16 x 16
/// steps. The same HMMA instructions in the same order, so the same bits; LlamaModel reads
/// SMCGRAPH_GEMM_FRAGMENTS (ldmatrix, wmma).
enum class GemmFragments : uint8_t { kLdmatrix = 0, kWmma = 1 };

struct GemmArgs {
  int tokens = 0, n = 0, k = 0; ///< T, N, K (N and K multiples of 16)
  int tokens_per_row = 1;       ///< token t belongs to row t / tokens_per_row
  /// Tokens between rows of positions, out_slots (kQkvRope) and logits (kLogits), >= tokens_per_row
  /// (ForwardArgs::io_stride(); forward_layout.cuh).
  int64_t io_row_stride = 0;
  const uint16_t* weight = nullptr; ///< [N, K] bf16, row-major
  /// [T, K] A rows: kResidualAdd's input; for kQkvRope and kSwiGlu on pipelined tiles, rms_norm_rows' output
  /// for x (those tiles read it instead of normalising x themselves).
  const uint16_t* a_bf16 = nullptr;
  const float* x = nullptr; ///< [T, K] fp32 residual stream (the RMSNorm prologue)
  int64_t x_row_stride = 0; ///< floats between the rows of x; 0 means K (dense)
  const float* norm_weight = nullptr;
  float eps = 1e-5f;
  float* residual = nullptr; ///< [T, N] (kResidualAdd)
  /// kResidualAdd: `residual` may be read before the PDL wait: its last writer completed before the last
  /// kernel of the chain that triggers after its own wait (a kernel without trigger_early) passed that wait,
  /// and this kernel starts only after that (pdl.hpp). The forward sets it: the O and down projections run
  /// two launches after the last write of the residual stream, behind QKV and gate/up.
  bool residual_ready_before_wait = false;
  /// The tiling (in the padding after the bool above, so the kernels' parameter block keeps its size).
  GemmTiles tiles = GemmTiles::kBySize;
  /// Warps of a narrow block: 8 (a warp per partial accumulator of a K slice), 4 (a warp per slice) or 0, by
  /// the token count (8 up to 16 tokens); the same bits either way (llama_gemm.cu). LlamaModel reads it from
  /// SMCGRAPH_GEMM_NARROW_WARPS (by_size, 8, 4).
  uint8_t narrow_warps = 0;
  GemmAStaging a_staging = GemmAStaging::kRegisters;  ///< bf16 A rows (narrow and wide blocks)
  GemmFragments fragments = GemmFragments::kLdmatrix; ///< narrow blocks' fragment loads (W in shared memory)
  /// Let the next launch start (PDL's trigger) at the top of this kernel instead of after its pdl_wait(): the
  /// next kernel's CTAs then become resident, and stage their weights, one kernel earlier. Only where every
  /// read that kernel makes before its own wait is of weights or of data whose last writer completed before
  /// this kernel's predecessor passed its wait (LlamaModel::forward sets it; pdl.hpp).
  bool trigger_early = false;
  /// Launch with the weights marked streaming in L2 (an access-policy window, cudaAccessPropertyStreaming;
  /// the GEMM tiles and the small LM heads; the cuBLASLt head through its stream's window): the same values,
  /// other lines kept in L2 instead of the weights, which a forward reads once. LlamaModel reads
  /// SMCGRAPH_LLAMA_WEIGHT_CACHE.
  bool stream_weights = false;
  uint16_t* out_bf16 = nullptr; ///< q [T, q_dim] (kQkvRope) or act [T, N / 2] (kSwiGlu)
  void* logits = nullptr;       ///< [T, logits_cols] (kLogits); columns >= logits_cols are dropped
  int logits_cols = 0;
  DType logits_dtype = DType::kFloat32;
  const uint8_t* live = nullptr; ///< [rows]
  // kQkvRope
  int q_dim = 0, kv_dim = 0, head_dim = 0, pool_size = 0;
  const float* inv_freq = nullptr;    ///< [head_dim / 2]
  const int32_t* positions = nullptr; ///< [T]
  const int32_t* out_slots = nullptr; ///< [T]
  uint16_t* kv = nullptr;             ///< this layer's KV [pool_size, 2, kv_dim]
};

/// Rows a prefill GEMM through cuBLASLt takes at once (PrefillGemms: its fp32 scratch holds this many).
inline constexpr int kPrefillChunkTokens = 4096;

/// The epilogue of kQkvRope or kSwiGlu on fp32 GEMM rows: y holds rows first .. first + tokens - 1 of the
/// [T, N] product (row-major, N wide); the same per-element steps as the GEMM kernels' epilogues
/// (llama_gemm.cu), so the outputs are those of the same fp32 values there.
void gemm_epilogue_fp32(GemmEpilogue epilogue, const GemmArgs& args, int first, int tokens, const float* y,
                        cudaStream_t stream);

/// The layer GEMMs of a prefill through cuBLASLt (llama_prefill_gemm.cu): one algorithm pinned per shape
/// (QKV, O, gate/up, down), split-K off, checked with cublasLtMatmulAlgoCheck at 15 row counts from 1 to
/// kPrefillChunkTokens at construction; run() takes A rows in a_bf16 (rms_norm_rows(x) for the norm
/// epilogues), adds into `residual` for kResidualAdd and otherwise writes `scratch` ([min(max_tokens,
/// kPrefillChunkTokens), N] fp32) and runs gemm_epilogue_fp32(). run() returns false, doing nothing, where no
/// pinned algorithm serves the shape.
class PrefillGemms {
public:
  PrefillGemms(int hidden, int q_dim, int kv_dim, int ffn, int max_tokens);
  ~PrefillGemms();
  PrefillGemms(const PrefillGemms&) = delete;
  PrefillGemms& operator=(const PrefillGemms&) = delete;
  bool serves(int n, int k) const;
  bool run(GemmEpilogue epilogue, const GemmArgs& args, float* scratch, cudaStream_t stream);

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Sets the dynamic shared-memory limit of every GEMM variant for K up to `max_k` (call once, outside
/// capture).
void prepare_gemm(int max_k);
/// One launch.
void gemm(GemmEpilogue epilogue, const GemmArgs& args, cudaStream_t stream);
/// Whether gemm() runs these arguments on the pipelined tiles (GemmArgs::tiles; by size, below; kLogits
/// never: forcing them there throws). An RMSNorm epilogue on them then needs a_bf16 = rms_norm_rows(x) (the
/// caller launches that first).
bool pipelined_tiles(GemmEpilogue epilogue, const GemmArgs& args);
/// GemmTiles::kBySize: forwards of at least this many tokens take the pipelined tiles (the gate/up projection
/// from kPipelinedMinTokensGateUp). `llama_gemm_bench` (H100, SmolLM2's shapes, us cold, narrow / pipelined,
/// plus 1.4-1.5 us for the norm kernel of QKV and gate/up): gate/up 17.6 / 9.0 at 128 tokens and 38.1 / 16.3
/// at 320; QKV 6.3 / 5.4 at 128 and 11.8 / 8.3 at 320; O 4.5 / 5.3 at 128 and 8.7 / 6.2 at 320; down 11.4
/// / 11.6 at 128 and 20.6 / 13.6 at 320. In a forward the narrow kernels' weights load under the previous
/// kernel (PDL) and the norm kernel adds a launch, so 64-token forwards stay narrow (measured: a 64-row
/// decode of SmolLM2 took 963 us with pipelined gate/up against 917-920).
inline constexpr int kPipelinedMinTokens = 256;
inline constexpr int kPipelinedMinTokensGateUp = 128;

/// RMSNorm of `rows` rows of x (x_row_stride floats apart, 0: k) into out [rows, k] bf16: bf16(x *
/// rsqrt(mean(x^2) + eps) * gamma), the same arithmetic as the GEMMs' RMSNorm prologue (llama_head.cu).
void rms_norm_rows(int rows, int k, const float* x, int64_t x_row_stride, const float* gamma, float eps,
                   uint16_t* out, cudaStream_t stream);

/// Positions per attention chunk: one warp pass of the attention kernel (a lane per position). A token's
/// chunks are folded in a fixed order that depends on its own length only (batch invariance).
inline constexpr int kAttentionChunk = 32;

/// Which attention kernel a launch takes (the same bits either way): by the launch's size, a block per
/// query, or grouped blocks (a block per row, KV head and group of queries). LlamaModel reads it from
/// SMCGRAPH_ATTENTION_GROUPING (by_size, per_query, grouped), for tests and A/B runs.
enum class AttentionGrouping : int { kBySize = 0, kPerQuery = 1, kGrouped = 2 };

/// The grid of one attention() launch of `rows` x `tokens_per_row` tokens (`heads` query heads, `kv_heads` KV
/// heads) on a GPU of `multiprocessors` SMs: per-query blocks (rows x tokens x heads) or grouped blocks (rows
/// x KV heads x `groups` groups of `group_queries` <= 16 of a row's queries of one KV head, as even as they
/// go). kBySize takes grouped blocks
/// when the per-query grid is more than a wave of its blocks (3 an SM) and the grouped grid has a block for
/// every SM; below either, a block per query spreads the work widest (llama_attention.cu has the
/// measurements).
struct AttentionGrid {
  bool grouped = false;
  int64_t per_query_blocks = 0, groups = 0, grouped_blocks = 0;
  int group_queries = 0;
};
AttentionGrid attention_grid(AttentionGrouping grouping, int rows, int tokens_per_row, int heads,
                             int kv_heads, int multiprocessors);

/// Positions of a split: a token's positions are folded in splits of this many (16 chunks), the splits merged
/// in order (llama_attention.cu), so a long row's attention can spread over several blocks (split-KV) and
/// still give the same bits.
inline constexpr int kAttentionSplitPositions = 16 * kAttentionChunk;
/// Splits of a row of up to `max_seq_len` positions.
inline int attention_max_splits(int max_seq_len) {
  return (max_seq_len + kAttentionSplitPositions - 1) / kAttentionSplitPositions;
}
/// Launches of up to this many tokens may give a long token's splits blocks of their own (AttentionArgs'
/// split workspace holds this many tokens' split states).
inline constexpr int kAttentionSplitMaxTokens = 64;

struct AttentionArgs {
  int rows = 0, tokens_per_row = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int max_seq_len = 0, pool_size = 0;
  /// Tokens between rows of positions, >= tokens_per_row (ForwardArgs::io_stride()).
  int64_t io_row_stride = 0;
  float scale = 1.0f;           ///< 1 / sqrt(head_dim)
  const uint16_t* q = nullptr;  ///< [T, heads * head_dim] bf16, after RoPE
  const uint16_t* kv = nullptr; ///< this layer's KV [pool_size, 2, kv_heads * head_dim]
  const int32_t *slot_table = nullptr, *seq_lens = nullptr, *positions = nullptr;
  const uint8_t* live = nullptr;
  uint16_t* out = nullptr; ///< [T, heads * head_dim] bf16
  AttentionGrouping grouping = AttentionGrouping::kBySize;
  /// Split-KV workspace (null: every token's splits in its own block). With it, a launch of up to
  /// kAttentionSplitMaxTokens tokens may give each (token, head) of per-query blocks, or each (row, group, KV
  /// head) of grouped blocks, split_blocks blocks, block g folding splits g, g + split_blocks, ...:
  /// split_states holds [kAttentionSplitMaxTokens, heads, max_splits, head_dim + 2] floats (a query's entries
  /// by its token and head in either kernel), split_tickets [kAttentionSplitMaxTokens, heads] counters (a
  /// group takes its first query's; zero, and every launch leaves them zero). The launcher picks
  /// split_blocks.
  float* split_states = nullptr;
  uint32_t* split_tickets = nullptr;
  int max_splits = 1;   ///< attention_max_splits(max_seq_len), which the workspace is sized for
  int split_blocks = 1; ///< set by attention(): blocks a (token, head) or group, 1 without the workspace
  /// As GemmArgs::trigger_early: the next launch may start at the top of this kernel.
  bool trigger_early = false;
  /// Launches of at least this many tokens a row (prefill) take the tensor-core kernel where it serves
  /// (tensor_core_attention_serves: heads of 64 or 128 dimensions); 0: never
  /// (LlamaModelOptions::tensor_core_attention_tokens).
  int tensor_core_min_tokens = 0;
};

/// Whether attention() takes the tensor-core kernel for `args` (llama_attention_tc.cu):
/// tensor_core_min_tokens > 0, tokens_per_row >= it and head_dim 64 or 128. That kernel keeps attention()'s
/// contract and is batch- and chunk-invariant among its own launches, but it is not the CUDA-core kernel's
/// bits (it rounds the softmax weights to bf16 for the P V MMA).
bool tensor_core_attention_serves(const AttentionArgs& args);
/// Its shared-memory limit for `head_dim` (prepare_attention() calls it).
void prepare_tensor_core_attention(int head_dim);
/// One launch of it: a block per (row, 64 tokens, query head).
void tensor_core_attention(const AttentionArgs& args, cudaStream_t stream);

/// Which kernels the LM head takes (LlamaModel reads it from SMCGRAPH_LM_HEAD: by_size, small_bf16, cublaslt,
/// own_gemm). by_size: where the head's weights are Q8_0 in the file (LtHead::use_q8_weights), forwards of up
/// to kQ8HeadMaxTokens tokens take the int8 head, else up to kSmallHeadMaxTokens the small head (one kernel
/// each, the same bits as cuBLASLt's matmul: llama_head.cu); larger ones the norm kernel and cuBLASLt;
/// small_bf16: the small head and cuBLASLt, never the int8 head; cublaslt: the norm kernel and cuBLASLt at
/// every size; own_gemm: LtHead serves nothing and the forward runs gemm(kLogits).
enum class HeadKernels : uint8_t { kBySize = 0, kCublasLt = 1, kOwnGemm = 2, kSmallBf16 = 3 };

/// The most tokens (GEMM rows) a small-head launch takes.
inline constexpr int kSmallHeadMaxTokens = 16;
/// The most tokens an int8-head launch takes (LtHead::q8_max_tokens: fewer where the model's forwards have
/// fewer, none where its shared memory would not fit).
inline constexpr int kQ8HeadMaxTokens = 16;

/// The int8 head's weight layout (LlamaWeights::head_q8): `rows` rows of k int8 values (row-major) and their
/// 32-wide blocks' scales ([rows, k / 32]) into `values` (padded_rows x k, fragment order, zeros past rows)
/// and `scales` ([padded_rows / 16, k / 32, 16]). padded_rows: a multiple of 64 >= rows; k: a multiple of 32.
void q8_head_layout(const int8_t* row_values, const float* row_scales, int rows, int padded_rows, int k,
                    std::vector<int8_t>& values, std::vector<float>& scales);

/// The LM head through cuBLASLt (llama_head.cu): an RMSNorm kernel into `normed` ([tokens, k] bf16), then one
/// matmul with an algorithm chosen at construction and pinned for every token count (batch-invariant logits);
/// up to kSmallHeadMaxTokens tokens, one own kernel with the same bits instead (HeadKernels::kBySize; it
/// normalises the rows itself and streams its weights from before the PDL wait). The constructor checks the
/// latter against the pinned matmul on a probe built to show any difference in summation order
/// (llama_head.cu) and leaves it off where a bit differs. run()'s weights: [round_up(vocab, 64), hidden]
/// bf16. run() returns false, doing nothing, where it does not serve the call (no usable algorithm, a logits
/// layout with more than one token a row and a row stride, another dtype); the caller then runs
/// gemm(kLogits); so does HeadKernels::kOwnGemm. It writes the logits of every row, padding
/// rows included.
class LtHead {
public:
  LtHead(int vocab, int hidden, int max_tokens, DType logits_dtype, HeadKernels kernels);
  ~LtHead();
  LtHead(const LtHead&) = delete;
  LtHead& operator=(const LtHead&) = delete;
  bool usable() const;
  /// Whether run() takes one of the small heads (bf16 or int8) for `tokens` GEMM rows.
  bool small_head_serves(int tokens) const;
  /// What run() takes for `tokens` GEMM rows: "small_q8", "small", "cublaslt" or "own_gemm" (run() declines).
  const char* kernel(int tokens) const;
  /// Hands the int8 head its weights (LlamaWeights::head_q8 and head_q8_scales, which must outlive this
  /// head): with HeadKernels::kBySize, where the small head's probe passed and hidden % 32 == 0, forwards of
  /// up to q8_max_tokens() tokens then take it. Null values turn it off. The first call sets the kernels'
  /// shared-memory limits (outside capture); later ones only swap the pointers.
  void use_q8_weights(const int8_t* values, const float* scales);
  /// The most tokens the int8 head takes (0: off).
  int q8_max_tokens() const;
  bool run(const GemmArgs& args, uint16_t* normed, cudaStream_t stream);

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Sets the attention and embedding kernels' shared-memory carveout like the GEMMs' and the attention
/// kernel's dynamic shared memory for `head_dim` (call once, outside capture).
void prepare_attention(int head_dim);
/// One launch: one block per (row, token, query head), or, for launches of more than a wave of those, one
/// per (row, group of up to 16 queries, KV head); the tensor-core kernel where
/// tensor_core_attention_serves().
void attention(const AttentionArgs& args, cudaStream_t stream);

/// x[t] = token_embd[token of t] as fp32, token t of row r read at token_ids[r * token_row_stride + column]
/// (tokens clamped into [0, vocab); padding rows get zeros).
void embed(int tokens, int tokens_per_row, int64_t token_row_stride, int hidden, int vocab,
           const int32_t* token_ids, const uint8_t* live, const uint16_t* token_embd, float* x,
           cudaStream_t stream);

/// Residual-stream rows, `hidden` floats each (a multiple of 4; 16-byte aligned rows), in one launch: token j
/// < tokens of row r < rows goes to dst + r * dst_stride + j * hidden, from first + r * first_stride + j *
/// hidden (j < tokens - 1) or, the row's last, from last + r * last_stride. tokens = 1 copies rows (a draft
/// handing its last token's residual over; `first` unused); more assemble a resumed verify's stream from the
/// handed-over columns and its own last one (ForwardArgs::hidden).
void gather_rows(int rows, int tokens, int hidden, const float* first, int64_t first_stride,
                 const float* last, int64_t last_stride, float* dst, int64_t dst_stride, cudaStream_t stream);

} // namespace smcgraph::llama

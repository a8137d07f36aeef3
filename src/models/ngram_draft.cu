// NgramDraft (include/smcgraph/ngram_draft.hpp): the token store writes, then one block per logits row that
// gathers its row's history into shared memory, finds the longest recent n-gram match and writes the logits.
#include "smcgraph/ngram_draft.hpp"

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/smem_limit.hpp"
#include "kernels/pdl.cuh"
#include "models/forward_layout.cuh"
#include "smcgraph/error.hpp"

namespace smcgraph {
namespace {

constexpr int kStoreThreads = 256;
constexpr int kProposeThreads = 256;

struct NgramParams {
  int rows, tokens_per_row, tokens;
  const int32_t* token_ids;
  int64_t token_row_stride;
  const int32_t* positions;
  int64_t io_row_stride;
  const int32_t *slot_table, *seq_lens, *out_slots;
  const uint8_t* live;
  void* logits;
  bool last_token_logits;
  int vocab, pool_size, max_seq_len, min_ngram, max_ngram;
  float confidence;
  DType dtype;
  int32_t* store;
};

__global__ void __launch_bounds__(kStoreThreads) NgramStoreKernel(const NgramParams p) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= p.tokens || !p.live[t / p.tokens_per_row])
    return;
  const int slot = p.out_slots[detail::strided_token_index(t, p.tokens_per_row, p.io_row_stride)];
  if (slot <= 0 || slot >= p.pool_size)
    return; // slot 0 (the dummy) and ids outside the pool are never written
  const int32_t token = p.token_ids[detail::strided_token_index(t, p.tokens_per_row, p.token_row_stride)];
  p.store[slot] = min(max(token, 0), p.vocab - 1);
}

__global__ void __launch_bounds__(kProposeThreads) NgramProposeKernel(const NgramParams p) {
  extern __shared__ int32_t history[]; // [q + 1]
  __shared__ int best_end;
  detail::pdl_enter(); // the store kernel's writes are visible after the wait
  const int out_row = blockIdx.x;
  const int r = p.last_token_logits ? out_row : out_row / p.tokens_per_row;
  const int j = p.last_token_logits ? p.tokens_per_row - 1 : out_row % p.tokens_per_row;
  if (!p.live[r])
    return; // padding rows: no logits written
  const int64_t io = detail::strided_token_index(static_cast<int64_t>(r) * p.tokens_per_row + j,
                                                 p.tokens_per_row, p.io_row_stride);
  const int position = min(max(p.positions[io], 0), p.max_seq_len - 1);
  const int q = min(position, p.seq_lens[r] - 1); // last position of the history; < 0: none
  const int32_t* slots = p.slot_table + static_cast<int64_t>(r) * p.max_seq_len;
  for (int i = threadIdx.x; i <= q; i += blockDim.x) {
    const int slot = slots[i];
    history[i] = p.store[(slot >= 0 && slot < p.pool_size) ? slot : 0];
  }
  __syncthreads();
  int proposal = -1;
  for (int n = p.max_ngram; n >= p.min_ngram && proposal < 0; --n) { // block-uniform loop
    if (q < n)
      continue; // no earlier window of n tokens
    bool suffix_ok = true;
    for (int k = 0; k < n; ++k)
      suffix_ok = suffix_ok && history[q - k] >= 0;
    if (!suffix_ok)
      continue;
    if (threadIdx.x == 0)
      best_end = -1;
    __syncthreads();
    for (int e = q - 1 - static_cast<int>(threadIdx.x); e >= n - 1; e -= blockDim.x) {
      bool match = true;
      for (int k = 0; k < n && match; ++k)
        match = history[e - k] == history[q - k];
      if (match) { // this thread's candidates go downwards: the first match is its largest
        atomicMax(&best_end, e);
        break;
      }
    }
    __syncthreads();
    const int e = best_end;
    if (e >= 0 && history[e + 1] >= 0 && history[e + 1] < p.vocab)
      proposal = history[e + 1];
    __syncthreads(); // best_end is reset by the next n
  }
  const int64_t row = p.last_token_logits ? r : io;
  if (p.dtype == DType::kFloat32) {
    float* out = static_cast<float*>(p.logits) + row * p.vocab;
    for (int v = threadIdx.x; v < p.vocab; v += blockDim.x)
      out[v] = v == proposal ? p.confidence : 0.0f;
  } else {
    const __nv_bfloat16 confidence = __float2bfloat16_rn(p.confidence), zero = __float2bfloat16_rn(0.0f);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.logits) + row * p.vocab;
    for (int v = threadIdx.x; v < p.vocab; v += blockDim.x)
      out[v] = v == proposal ? confidence : zero;
  }
}

} // namespace

void validate_ngram_draft_options(const NgramDraftOptions& o) {
  constexpr const char* kWhere = "NgramDraftOptions";
  require(o.vocab >= 1, kWhere, "vocab", o.vocab, "must be >= 1");
  require(o.pool_size >= 2, kWhere, "pool_size", o.pool_size, "must be >= 2 (slot 0 is the dummy)");
  require(o.max_seq_len >= 1 && o.max_seq_len <= kNgramMaxSeqLen, kWhere, "max_seq_len", o.max_seq_len,
          "must be in [1, kNgramMaxSeqLen = 16384]");
  require(o.logits_dtype == DType::kFloat32 || o.logits_dtype == DType::kBFloat16, kWhere, "logits_dtype",
          dtype_name(o.logits_dtype), "must be fp32 or bf16");
  require(o.min_ngram >= 1, kWhere, "min_ngram", o.min_ngram, "must be >= 1");
  require(o.max_ngram >= o.min_ngram && o.max_ngram <= kNgramMaxN, kWhere, "max_ngram", o.max_ngram,
          "must be in [min_ngram, kNgramMaxN = 8]");
  require(std::isfinite(o.confidence) && o.confidence > 0.0f && o.confidence <= 1e4f, kWhere, "confidence",
          o.confidence, "must be finite and in (0, 1e4]");
}

NgramDraft::NgramDraft(const NgramDraftOptions& options) : options_(options) {
  validate_ngram_draft_options(options_);
  store_ = DeviceBuffer<int32_t>(static_cast<size_t>(options_.pool_size));
  detail::raise_smem_limit(NgramProposeKernel, static_cast<size_t>(options_.max_seq_len) * sizeof(int32_t));
  Stream stream;
  clear(stream);
  stream.synchronize();
}

void NgramDraft::clear(cudaStream_t stream) {
  store_.fill_bytes(0xff, stream); // -1: no token
}

void NgramDraft::forward(const ForwardArgs& args, cudaStream_t stream) {
  constexpr const char* kWhere = "NgramDraft::forward";
  if (!detail::require_forward_args(args, kWhere))
    return;
  const int64_t tokens = static_cast<int64_t>(args.rows) * args.tokens_per_row;
  require(tokens <= (int64_t{1} << 30), kWhere, "rows * tokens_per_row", tokens, "must be <= 2^30");
  // clang-format off
  const NgramParams p{
      .rows = args.rows, .tokens_per_row = args.tokens_per_row, .tokens = static_cast<int>(tokens),
      .token_ids = args.tokens, .token_row_stride = args.token_stride(), .positions = args.positions,
      .io_row_stride = args.io_stride(), .slot_table = args.slot_table, .seq_lens = args.seq_lens,
      .out_slots = args.out_slots, .live = args.live, .logits = args.logits,
      .last_token_logits = args.last_token_logits, .vocab = options_.vocab, .pool_size = options_.pool_size,
      .max_seq_len = options_.max_seq_len, .min_ngram = options_.min_ngram, .max_ngram = options_.max_ngram,
      .confidence = options_.confidence, .dtype = options_.logits_dtype, .store = store_.data()};
  // clang-format on
  detail::launch_pdl(NgramStoreKernel,
                     dim3(static_cast<unsigned>((tokens + kStoreThreads - 1) / kStoreThreads)),
                     dim3(kStoreThreads), 0, stream, p);
  const int64_t logit_rows = args.last_token_logits ? args.rows : tokens;
  detail::launch_pdl(NgramProposeKernel, dim3(static_cast<unsigned>(logit_rows)), dim3(kProposeThreads),
                     static_cast<size_t>(options_.max_seq_len) * sizeof(int32_t), stream, p);
}

} // namespace smcgraph

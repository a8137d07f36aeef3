// The embedded toy model (include/smcgraph/toy_model.hpp): host weight generation, then two kernels per
// forward (KV writes, then hidden states + LM head) and the launcher.
//
// Exactness: every float operation below is an explicit round-to-nearest intrinsic (__fadd_rn, __fdiv_rn,
// __fmaf_rn), so nvcc cannot contract or reorder them, and each reduction runs in one fixed order (window
// in increasing position, head in increasing h) whatever the tiling. tests/reference/toy_model_ref.cpp
// performs the same operations with std::fma and uncontracted float arithmetic.
//
// Cost: the LM head, tokens x vocab x hidden fused multiply-adds plus the logits stores. Its floor is
// max(logit bytes / memory bandwidth, FMAs / FP32 FMA peak, head bytes / bandwidth for a few tokens); at
// 512 rows x 5 tokens x 128256 x hidden 32 the FMA term (~10.5 G) is about the size of the fp32 store term
// (1.3 GB), so the inner loop keeps 8 x 8 accumulators per thread and reads shared memory 4 times per 64
// FMAs.
#include "smcgraph/toy_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "kernels/smem_limit.hpp"
#include "models/forward_layout.cuh"
#include "smcgraph/error.hpp"

namespace smcgraph {
namespace {

// LM-head tiling: a CTA of 8 warps computes TOKENS_PER_THREAD * 8 tokens x kVocabTile vocabulary entries per
// work item; a lane owns 8 vocabulary entries (two runs of 4, so every store instruction of a warp covers
// 512 contiguous bytes) of TOKENS_PER_THREAD tokens. The head is streamed through shared memory in chunks
// of kHiddenChunk rows of the transposed head, double buffered with cp.async.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVocabTile = 256;
constexpr int kHiddenChunk = 16;
constexpr int kWindowChunk = 16; // KV loads a thread issues at once while building the activations
constexpr int kKvThreads = 256;
static_assert(kVocabTile == 32 * 8, "a lane owns two runs of 4 vocabulary entries");
static_assert((kHiddenChunk * kVocabTile / 4) % kThreads == 0, "each thread copies whole 16-byte pieces");

// ---------------------------------------------------------------------------------------------------------
// Host weight generation
// ---------------------------------------------------------------------------------------------------------

enum class Tensor : uint64_t { kEmbedding = 1, kPosition = 2, kHead = 3, kBias = 4, kHeadNoise = 5 };

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t splitmix64_finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element `index` of `tensor`: the (index + 1)-th output of splitmix64 started at seed ^ mix(tensor),
// mapped to U(-scale, scale). Double arithmetic is exact up to the final rounding to float.
void fill_uniform(std::vector<float>& out, uint64_t seed, Tensor tensor, double scale) {
  const uint64_t state = seed ^ splitmix64_finalize(static_cast<uint64_t>(tensor) * kGolden);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t bits = splitmix64_finalize(state + (static_cast<uint64_t>(i) + 1) * kGolden);
    const double unit = (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53; // (0, 1), never 0.5 exactly
    out[i] = static_cast<float>((2.0 * unit - 1.0) * scale);
  }
}

std::string dtype_text(DType dtype) {
  return std::string(dtype_name(dtype)) + " (" + std::to_string(static_cast<int>(dtype)) + ")";
}

int round_up(int value, int multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// ---------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------

struct ToyForwardParams {
  int rows;
  int tokens_per_row;
  int tokens;               // rows * tokens_per_row
  const int32_t* token_ids; // rows token_row_stride apart
  int64_t token_row_stride; // >= tokens_per_row
  const int32_t* positions; // rows io_row_stride apart, as out_slots and logits
  int64_t io_row_stride;    // >= tokens_per_row
  const int32_t* slot_table;
  const int32_t* seq_lens;
  const int32_t* out_slots;
  const uint8_t* live;
  void* logits;
  bool vector_store;      // vocab % 4 == 0 and logits 16-byte aligned
  bool last_token_logits; // ForwardArgs::last_token_logits: logits of each row's last token, [rows, vocab]
  int logit_tokens;       // tokens that get logits: rows when last_token_logits, else tokens
  // model
  int vocab;
  int vocab_padded;
  int hidden;
  int window;
  int pool_size;
  int max_seq_len;
  const float* embedding;
  const float* position;
  const float* head_t;
  const float* bias;
  float* kv;
};

__device__ __forceinline__ int clamp_int(int value, int lo, int hi) {
  return min(max(value, lo), hi);
}

/// Where token `token` of the forward sits in positions, out_slots and (times vocab) logits.
__device__ __forceinline__ int64_t io_index(const ToyForwardParams& params, int64_t token) {
  return detail::strided_token_index(token, params.tokens_per_row, params.io_row_stride);
}

/// The forward's token whose logits are the i-th the LM head computes (i < logit_tokens), and where they go
/// (times vocab).
__device__ __forceinline__ int logit_source_token(const ToyForwardParams& params, int i) {
  return params.last_token_logits ? i * params.tokens_per_row + params.tokens_per_row - 1 : i;
}
__device__ __forceinline__ int64_t logit_index(const ToyForwardParams& params, int i) {
  return params.last_token_logits ? i : io_index(params, i);
}

// One thread per (token, h): writes the KV of every live token before any token reads KV (separate launch),
// so token j of a forward sees tokens < j of the same forward through the slot table.
__global__ void ToyKvWriteKernel(ToyForwardParams params) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int hidden = params.hidden;
  if (index >= static_cast<int64_t>(params.tokens) * hidden)
    return;
  const int token = static_cast<int>(index / hidden);
  const int h = static_cast<int>(index % hidden);
  const int row = token / params.tokens_per_row;
  if (!params.live[row])
    return;
  const int slot = params.out_slots[io_index(params, token)];
  if (slot <= 0 || slot >= params.pool_size)
    return; // slot 0 is the dummy; out-of-range writes are dropped
  const int32_t id =
      params.token_ids[detail::strided_token_index(token, params.tokens_per_row, params.token_row_stride)];
  const int token_id = clamp_int(id, 0, params.vocab - 1);
  const int position = clamp_int(params.positions[io_index(params, token)], 0, params.max_seq_len - 1);
  params.kv[static_cast<int64_t>(slot) * hidden + h] =
      __fadd_rn(params.embedding[static_cast<int64_t>(token_id) * hidden + h],
                params.position[(position % kToyPositionPeriod) * hidden + h]);
}

template <class OUT> struct LogitStore;
template <> struct LogitStore<float> {
  __device__ static void four(float* out, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(out) = make_float4(a, b, c, d);
  }
  __device__ static void one(float* out, float a) { *out = a; }
};
template <> struct LogitStore<__nv_bfloat16> {
  __device__ static void four(__nv_bfloat16* out, float a, float b, float c, float d) {
    const __nv_bfloat162 low = __floats2bfloat162_rn(a, b); // .x (a) lands at the lower address
    const __nv_bfloat162 high = __floats2bfloat162_rn(c, d);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&low);
    packed.y = *reinterpret_cast<const uint32_t*>(&high);
    *reinterpret_cast<uint2*>(out) = packed;
  }
  __device__ static void one(__nv_bfloat16* out, float a) { *out = __float2bfloat16_rn(a); }
};

// Shared memory of ToyLogitsKernel, in this order (the head buffers stay 16-byte aligned because
// TOKEN_TILE is a multiple of 8):
//   activations  float [hidden][TOKEN_TILE]
//   head         float [2][kHiddenChunk][kVocabTile]   (double buffer)
//   window_slots int   [TOKEN_TILE][kWindowChunk]
//   store, first, count  int [TOKEN_TILE] each
__host__ __device__ constexpr size_t logits_shared_bytes(int token_tile, int hidden) {
  return sizeof(float) * (static_cast<size_t>(hidden) * token_tile + 2 * kHiddenChunk * kVocabTile) +
         sizeof(int) * static_cast<size_t>(token_tile) * (kWindowChunk + 3);
}

// Hidden state -> LM head. Work items (token tile, vocab tile), token-tile major, are split into contiguous
// equal ranges, one per CTA of a grid sized to fill the device once; a CTA recomputes the activations only
// when its token tile changes (once or twice per CTA), and streams the head through shared memory.
template <int TOKENS_PER_THREAD, class OUT>
__global__ void __launch_bounds__(kThreads, 2) ToyLogitsKernel(ToyForwardParams params) {
  constexpr int TOKEN_TILE = kWarps * TOKENS_PER_THREAD;
  extern __shared__ float4 shared_raw[];
  const int hidden = params.hidden;
  float* activation_s = reinterpret_cast<float*>(shared_raw);
  float* head_s = activation_s + hidden * TOKEN_TILE;
  int* window_slots_s = reinterpret_cast<int*>(head_s + 2 * kHiddenChunk * kVocabTile);
  int* store_s = window_slots_s + TOKEN_TILE * kWindowChunk;
  int* first_s = store_s + TOKEN_TILE;
  int* count_s = first_s + TOKEN_TILE;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int token_tiles = (params.logit_tokens + TOKEN_TILE - 1) / TOKEN_TILE;
  const int vocab_tiles = params.vocab_padded / kVocabTile;
  const int64_t items = static_cast<int64_t>(token_tiles) * vocab_tiles;
  const int64_t item_begin = blockIdx.x * items / gridDim.x;
  const int64_t item_end = (blockIdx.x + 1) * items / gridDim.x;
  const int chunks = (hidden + kHiddenChunk - 1) / kHiddenChunk;

  // Copies head rows [chunk * kHiddenChunk, +kHiddenChunk) x vocab tile into buffer `buffer`. head_t has
  // hidden rounded up to kHiddenChunk rows and vocab to kVocabTile columns (zero padded): always readable.
  auto prefetch_head = [&](int vocab_tile, int chunk, int buffer) {
    float* destination = head_s + buffer * (kHiddenChunk * kVocabTile);
    const float* source = params.head_t + static_cast<int64_t>(chunk) * kHiddenChunk * params.vocab_padded +
                          static_cast<int64_t>(vocab_tile) * kVocabTile;
#pragma unroll
    for (int i = threadIdx.x; i < kHiddenChunk * kVocabTile / 4; i += kThreads) {
      const int h = i / (kVocabTile / 4);
      const int column = (i % (kVocabTile / 4)) * 4;
      __pipeline_memcpy_async(destination + h * kVocabTile + column,
                              source + static_cast<int64_t>(h) * params.vocab_padded + column, 16);
    }
    __pipeline_commit();
  };

  // activation_s[h][t] = g(mean of the window's KV) of the tile's tokens; 0 past the end, for padding rows
  // and for empty windows. The window is walked in chunks of kWindowChunk positions: first the chunk's slot
  // ids into shared memory, then every thread issues its (token, h) pair's kWindowChunk KV loads at once
  // and adds them in increasing position (threads run along h, so the loads coalesce).
  auto compute_activations = [&](int token_tile) {
    __syncthreads(); // the previous item's store loop may still read store_s
    for (int t = threadIdx.x; t < TOKEN_TILE; t += kThreads) {
      const int i = token_tile * TOKEN_TILE + t;
      int store = 0, first = 0, count = 0;
      if (i < params.logit_tokens) {
        const int token = logit_source_token(params, i);
        const int row = token / params.tokens_per_row;
        if (params.live[row]) {
          store = 1;
          const int position =
              clamp_int(params.positions[io_index(params, token)], 0, params.max_seq_len - 1);
          const int seq_len = params.seq_lens[row];
          const int last = seq_len <= 0 ? -1 : min(position, seq_len - 1);
          first = max(0, position - params.window + 1);
          count = max(0, last - first + 1);
        }
      }
      store_s[t] = store;
      first_s[t] = first;
      count_s[t] = count;
    }
    // No window holds more than max_seq_len positions, whatever the configured window.
    const int window = min(params.window, params.max_seq_len);
    for (int k_begin = 0; k_begin < window; k_begin += kWindowChunk) {
      __syncthreads(); // token info ready / the previous chunk's slot ids consumed
      for (int i = threadIdx.x; i < TOKEN_TILE * kWindowChunk; i += kThreads) {
        const int t = i / kWindowChunk;
        const int k = k_begin + i % kWindowChunk;
        int slot = 0; // positions past the window read slot 0 and are not added
        if (k < count_s[t]) {
          const int token = logit_source_token(params, token_tile * TOKEN_TILE + t);
          const int row = token / params.tokens_per_row;
          slot = params.slot_table[static_cast<int64_t>(row) * params.max_seq_len + first_s[t] + k];
          if (slot < 0 || slot >= params.pool_size)
            slot = 0;
        }
        window_slots_s[i] = slot;
      }
      __syncthreads();
      const bool last_chunk = k_begin + kWindowChunk >= window;
      for (int i = threadIdx.x; i < TOKEN_TILE * hidden; i += kThreads) {
        const int t = i / hidden;
        const int h = i % hidden;
        const int count = count_s[t];
        float values[kWindowChunk];
#pragma unroll
        for (int k = 0; k < kWindowChunk; ++k) {
          values[k] = params.kv[static_cast<int64_t>(window_slots_s[t * kWindowChunk + k]) * hidden + h];
        }
        float sum = k_begin == 0 ? 0.0f : activation_s[h * TOKEN_TILE + t];
#pragma unroll
        for (int k = 0; k < kWindowChunk; ++k) {
          if (k_begin + k < count)
            sum = __fadd_rn(sum, values[k]);
        }
        if (last_chunk) {
          if (count > 0) {
            const float mean = __fdiv_rn(sum, static_cast<float>(count));
            sum = __fdiv_rn(mean, __fadd_rn(1.0f, fabsf(mean)));
          } else {
            sum = 0.0f;
          }
        }
        activation_s[h * TOKEN_TILE + t] = sum;
      }
    }
    // The caller's next barrier publishes activation_s.
  };

  if (item_begin >= item_end)
    return; // uniform across the CTA: no barrier is skipped by part of it
  int current_token_tile = -1;
  int buffer = 0;
  {
    const int first_vocab_tile = static_cast<int>(item_begin % vocab_tiles);
    prefetch_head(first_vocab_tile, 0, 0);
  }
  float accumulator[TOKENS_PER_THREAD][8];
  int token_tile = static_cast<int>(item_begin / vocab_tiles);
  int vocab_tile = static_cast<int>(item_begin % vocab_tiles);
  for (int64_t item = item_begin; item < item_end; ++item) {
    const int v_low = vocab_tile * kVocabTile + lane * 4; // bias and head are zero padded to vocab_padded
    const int v_high = v_low + kVocabTile / 2;
    if (token_tile != current_token_tile) {
      compute_activations(token_tile);
      current_token_tile = token_tile;
    }
    {
      const float4 bias_low = __ldg(reinterpret_cast<const float4*>(params.bias + v_low));
      const float4 bias_high = __ldg(reinterpret_cast<const float4*>(params.bias + v_high));
#pragma unroll
      for (int t = 0; t < TOKENS_PER_THREAD; ++t) {
        accumulator[t][0] = bias_low.x;
        accumulator[t][1] = bias_low.y;
        accumulator[t][2] = bias_low.z;
        accumulator[t][3] = bias_low.w;
        accumulator[t][4] = bias_high.x;
        accumulator[t][5] = bias_high.y;
        accumulator[t][6] = bias_high.z;
        accumulator[t][7] = bias_high.w;
      }
    }
    const int next_vocab_tile = vocab_tile + 1 == vocab_tiles ? 0 : vocab_tile + 1;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      // Prefetch the next stage into the other buffer; it was last read before the previous barrier.
      const bool last_stage = chunk + 1 == chunks && item + 1 == item_end;
      if (!last_stage) {
        if (chunk + 1 < chunks) {
          prefetch_head(vocab_tile, chunk + 1, buffer ^ 1);
        } else {
          prefetch_head(next_vocab_tile, 0, buffer ^ 1);
        }
        __pipeline_wait_prior(1);
      } else {
        __pipeline_wait_prior(0);
      }
      __syncthreads();

      const float* head_chunk = head_s + buffer * (kHiddenChunk * kVocabTile);
      const float* activation_chunk =
          activation_s + chunk * kHiddenChunk * TOKEN_TILE + warp * TOKENS_PER_THREAD;
      auto accumulate = [&](int h) {
        const float4 w_low = *reinterpret_cast<const float4*>(head_chunk + h * kVocabTile + lane * 4);
        const float4 w_high =
            *reinterpret_cast<const float4*>(head_chunk + h * kVocabTile + kVocabTile / 2 + lane * 4);
        const float* activations = activation_chunk + h * TOKEN_TILE; // the same address across the warp
        float g[TOKENS_PER_THREAD];
        if constexpr (TOKENS_PER_THREAD % 4 == 0) {
#pragma unroll
          for (int t = 0; t < TOKENS_PER_THREAD; t += 4) {
            const float4 four = *reinterpret_cast<const float4*>(activations + t);
            g[t] = four.x;
            g[t + 1] = four.y;
            g[t + 2] = four.z;
            g[t + 3] = four.w;
          }
        } else {
#pragma unroll
          for (int t = 0; t < TOKENS_PER_THREAD; ++t)
            g[t] = activations[t];
        }
        // Exactly one fused multiply-add per (logit, h), in increasing h: the host reference's order.
#pragma unroll
        for (int t = 0; t < TOKENS_PER_THREAD; ++t) {
          accumulator[t][0] = __fmaf_rn(w_low.x, g[t], accumulator[t][0]);
          accumulator[t][1] = __fmaf_rn(w_low.y, g[t], accumulator[t][1]);
          accumulator[t][2] = __fmaf_rn(w_low.z, g[t], accumulator[t][2]);
          accumulator[t][3] = __fmaf_rn(w_low.w, g[t], accumulator[t][3]);
          accumulator[t][4] = __fmaf_rn(w_high.x, g[t], accumulator[t][4]);
          accumulator[t][5] = __fmaf_rn(w_high.y, g[t], accumulator[t][5]);
          accumulator[t][6] = __fmaf_rn(w_high.z, g[t], accumulator[t][6]);
          accumulator[t][7] = __fmaf_rn(w_high.w, g[t], accumulator[t][7]);
        }
      };
      const int chunk_length = min(kHiddenChunk, hidden - chunk * kHiddenChunk);
      if (chunk_length == kHiddenChunk) {
#pragma unroll
        for (int h = 0; h < kHiddenChunk; ++h)
          accumulate(h);
      } else {
        for (int h = 0; h < chunk_length; ++h)
          accumulate(h);
      }
      __syncthreads();
      buffer ^= 1;
    }

    OUT* logits = static_cast<OUT*>(params.logits);
#pragma unroll
    for (int t = 0; t < TOKENS_PER_THREAD; ++t) {
      const int t_in_tile = warp * TOKENS_PER_THREAD + t;
      if (!store_s[t_in_tile])
        continue;
      OUT* out = logits + logit_index(params, token_tile * TOKEN_TILE + t_in_tile) * params.vocab;
      if (params.vector_store) {
        // vocab % 4 == 0, so a run of 4 starting below vocab ends below it.
        if (v_low < params.vocab)
          LogitStore<OUT>::four(out + v_low, accumulator[t][0], accumulator[t][1], accumulator[t][2],
                                accumulator[t][3]);
        if (v_high < params.vocab)
          LogitStore<OUT>::four(out + v_high, accumulator[t][4], accumulator[t][5], accumulator[t][6],
                                accumulator[t][7]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (v_low + i < params.vocab)
            LogitStore<OUT>::one(out + v_low + i, accumulator[t][i]);
          if (v_high + i < params.vocab)
            LogitStore<OUT>::one(out + v_high + i, accumulator[t][4 + i]);
        }
      }
    }
    vocab_tile = next_vocab_tile;
    if (vocab_tile == 0)
      ++token_tile;
  }
}

// Tokens-per-thread variants, smallest first: a launch takes the smallest tile that holds all its tokens
// (capped at the largest), so a one-token draft step does not pay for 64-token tiles.
constexpr int kTokensPerThreadVariants[4] = {1, 2, 4, 8};
static_assert(logits_shared_bytes(kWarps * 8, kToyMaxHidden) <= 227 * 1024, "fits an sm_90 CTA");

template <class OUT> const void* logits_kernel(int variant) {
  switch (variant) {
  case 0:
    return reinterpret_cast<const void*>(&ToyLogitsKernel<1, OUT>);
  case 1:
    return reinterpret_cast<const void*>(&ToyLogitsKernel<2, OUT>);
  case 2:
    return reinterpret_cast<const void*>(&ToyLogitsKernel<4, OUT>);
  default:
    return reinterpret_cast<const void*>(&ToyLogitsKernel<8, OUT>);
  }
}

const void* logits_kernel(DType dtype, int variant) {
  return dtype == DType::kBFloat16 ? logits_kernel<__nv_bfloat16>(variant) : logits_kernel<float>(variant);
}

template <class OUT>
void launch_logits(int variant, int grid, size_t shared_bytes, const ToyForwardParams& params,
                   cudaStream_t stream) {
  switch (variant) {
  case 0:
    ToyLogitsKernel<1, OUT><<<grid, kThreads, shared_bytes, stream>>>(params);
    break;
  case 1:
    ToyLogitsKernel<2, OUT><<<grid, kThreads, shared_bytes, stream>>>(params);
    break;
  case 2:
    ToyLogitsKernel<4, OUT><<<grid, kThreads, shared_bytes, stream>>>(params);
    break;
  default:
    ToyLogitsKernel<8, OUT><<<grid, kThreads, shared_bytes, stream>>>(params);
    break;
  }
}

} // namespace

// -----------------------------------------------------------------------------------------------------------
// Host API
// -----------------------------------------------------------------------------------------------------------

void validate_toy_model_config(const ToyModelConfig& config) {
  constexpr const char* where = "ToyModelConfig";
  require(config.vocab >= 1, where, "vocab", config.vocab, "must be >= 1");
  require(config.hidden >= 1 && config.hidden <= kToyMaxHidden, where, "hidden", config.hidden,
          "must be in [1, 256]");
  require(config.window >= 1, where, "window", config.window, "must be >= 1");
  require(config.pool_size >= 2, where, "pool_size", config.pool_size,
          "must be >= 2 (slot 0 is the padding dummy)");
  require(config.max_seq_len >= 1, where, "max_seq_len", config.max_seq_len, "must be >= 1");
  require(config.logits_dtype == DType::kFloat32 || config.logits_dtype == DType::kBFloat16, where,
          "logits_dtype", dtype_text(config.logits_dtype), "must be fp32 or bf16");
  require(std::isfinite(config.head_perturbation) && config.head_perturbation >= 0.0f, where,
          "head_perturbation", config.head_perturbation, "must be finite and >= 0");
}

ToyModelWeights make_toy_model_weights(const ToyModelConfig& config) {
  validate_toy_model_config(config);
  ToyModelWeights weights;
  weights.vocab = config.vocab;
  weights.hidden = config.hidden;
  const size_t matrix = static_cast<size_t>(config.vocab) * config.hidden;
  weights.embedding.resize(matrix);
  weights.position.resize(static_cast<size_t>(kToyPositionPeriod) * config.hidden);
  weights.head.resize(matrix);
  weights.bias.resize(config.vocab);
  // Head scale: logits spread by a few units whether the window holds one token or many.
  const double head_scale = 1.5 * std::sqrt(32.0 / config.hidden);
  fill_uniform(weights.embedding, config.weight_seed, Tensor::kEmbedding, 4.0);
  fill_uniform(weights.position, config.weight_seed, Tensor::kPosition, 1.0);
  fill_uniform(weights.head, config.weight_seed, Tensor::kHead, head_scale);
  fill_uniform(weights.bias, config.weight_seed, Tensor::kBias, 1.0);
  if (config.head_perturbation > 0.0f) {
    std::vector<float> noise(matrix);
    fill_uniform(noise, config.weight_seed, Tensor::kHeadNoise, head_scale);
    for (size_t i = 0; i < matrix; ++i)
      weights.head[i] = std::fma(config.head_perturbation, noise[i], weights.head[i]);
  }
  return weights;
}

ToyModel::ToyModel(const ToyModelConfig& config) : config_(config) {
  validate_toy_model_config(config_); // before any CUDA call
  const ToyModelWeights weights = make_toy_model_weights(config_);
  const int hidden = config_.hidden;
  vocab_padded_ = round_up(config_.vocab, kVocabTile);
  hidden_padded_ = round_up(hidden, kHiddenChunk);

  std::vector<float> head_t(static_cast<size_t>(hidden_padded_) * vocab_padded_, 0.0f);
  for (int v = 0; v < config_.vocab; ++v) {
    for (int h = 0; h < hidden; ++h) {
      head_t[static_cast<size_t>(h) * vocab_padded_ + v] = weights.head[static_cast<size_t>(v) * hidden + h];
    }
  }
  std::vector<float> bias(vocab_padded_, 0.0f);
  std::copy(weights.bias.begin(), weights.bias.end(), bias.begin());

  embedding_ = DeviceBuffer<float>(weights.embedding.size());
  position_ = DeviceBuffer<float>(weights.position.size());
  head_t_ = DeviceBuffer<float>(head_t.size());
  bias_ = DeviceBuffer<float>(bias.size());
  kv_ = DeviceBuffer<float>(static_cast<size_t>(config_.pool_size) * hidden);
  // A private stream, synchronized before returning: the weights are ready for any stream, blocking or not.
  Stream upload;
  embedding_.copy_from_host(weights.embedding.data(), weights.embedding.size(), upload);
  position_.copy_from_host(weights.position.data(), weights.position.size(), upload);
  head_t_.copy_from_host(head_t.data(), head_t.size(), upload);
  bias_.copy_from_host(bias.data(), bias.size(), upload);
  kv_.fill_bytes(0, upload);
  upload.synchronize();

  multiprocessors_ = current_device_info().multiprocessors;
  for (int variant = 0; variant < 4; ++variant) {
    const void* kernel = logits_kernel(config_.logits_dtype, variant);
    const size_t shared_bytes = logits_shared_bytes(kWarps * kTokensPerThreadVariants[variant], hidden);
    detail::raise_smem_limit(kernel, shared_bytes);
    SMCGRAPH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm_[variant], kernel,
                                                                      kThreads, shared_bytes));
    blocks_per_sm_[variant] = std::max(1, blocks_per_sm_[variant]);
  }
}

ToyModelPair ToyModel::pair(const ToyModelConfig& config, float draft_perturbation) {
  require(std::isfinite(draft_perturbation) && draft_perturbation >= 0.0f, "ToyModel::pair",
          "draft_perturbation", draft_perturbation, "must be finite and >= 0");
  ToyModelConfig target_config = config;
  target_config.head_perturbation = 0.0f;
  ToyModelConfig draft_config = config;
  draft_config.head_perturbation = draft_perturbation;
  validate_toy_model_config(target_config);
  ToyModelPair models;
  models.target = std::make_unique<ToyModel>(target_config);
  models.draft = std::make_unique<ToyModel>(draft_config);
  return models;
}

void ToyModel::forward(const ForwardArgs& args, cudaStream_t stream) {
  constexpr const char* where = "ToyModel::forward";
  require(args.rows >= 0, where, "rows", args.rows, "must be >= 0");
  if (args.rows == 0)
    return;
  require(args.tokens_per_row >= 1, where, "tokens_per_row", args.tokens_per_row, "must be >= 1");
  const int64_t tokens = static_cast<int64_t>(args.rows) * args.tokens_per_row;
  require(tokens <= (int64_t{1} << 30), where, "rows * tokens_per_row", tokens, "must be <= 2^30");
  detail::require_row_strides(args, where);
  const char* const null_pointer = "must be a device pointer (got null)";
  require(args.tokens != nullptr, where, "tokens", "null", null_pointer);
  require(args.positions != nullptr, where, "positions", "null", null_pointer);
  require(args.slot_table != nullptr, where, "slot_table", "null", null_pointer);
  require(args.seq_lens != nullptr, where, "seq_lens", "null", null_pointer);
  require(args.out_slots != nullptr, where, "out_slots", "null", null_pointer);
  require(args.live != nullptr, where, "live", "null", null_pointer);
  require(args.logits != nullptr, where, "logits", "null", null_pointer);
  NvtxRange range("toy_model.forward");

  const bool vector_store = config_.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(args.logits) % 16 == 0;
  // clang-format off
  const ToyForwardParams params{
      .rows = args.rows, .tokens_per_row = args.tokens_per_row, .tokens = static_cast<int>(tokens),
      .token_ids = args.tokens, .token_row_stride = args.token_stride(), .positions = args.positions,
      .io_row_stride = args.io_stride(), .slot_table = args.slot_table, .seq_lens = args.seq_lens,
      .out_slots = args.out_slots, .live = args.live,
      .logits = args.logits, .vector_store = vector_store, .last_token_logits = args.last_token_logits,
      .logit_tokens = args.last_token_logits ? args.rows : static_cast<int>(tokens),
      .vocab = config_.vocab, .vocab_padded = vocab_padded_, .hidden = config_.hidden, .window = config_.window,
      .pool_size = config_.pool_size, .max_seq_len = config_.max_seq_len, .embedding = embedding_.data(),
      .position = position_.data(), .head_t = head_t_.data(), .bias = bias_.data(), .kv = kv_.data()};
  // clang-format on

  const int64_t kv_threads = tokens * config_.hidden;
  ToyKvWriteKernel<<<static_cast<unsigned>((kv_threads + kKvThreads - 1) / kKvThreads), kKvThreads, 0,
                     stream>>>(params);
  SMCGRAPH_CHECK_LAUNCH();

  const int64_t logit_tokens = params.logit_tokens;
  int variant = 3;
  for (int candidate = 0; candidate < 4; ++candidate) {
    if (logit_tokens <= kWarps * kTokensPerThreadVariants[candidate]) {
      variant = candidate;
      break;
    }
  }
  const int64_t token_tile = kWarps * kTokensPerThreadVariants[variant];
  const int64_t items = (logit_tokens + token_tile - 1) / token_tile * (vocab_padded_ / kVocabTile);
  const int grid = static_cast<int>(
      std::min<int64_t>(items, static_cast<int64_t>(multiprocessors_) * blocks_per_sm_[variant]));
  const size_t shared_bytes = logits_shared_bytes(kWarps * kTokensPerThreadVariants[variant], config_.hidden);
  if (config_.logits_dtype == DType::kBFloat16) {
    launch_logits<__nv_bfloat16>(variant, grid, shared_bytes, params, stream);
  } else {
    launch_logits<float>(variant, grid, shared_bytes, params, stream);
  }
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph

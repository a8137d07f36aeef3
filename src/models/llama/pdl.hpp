// Programmatic dependent launch for the Llama forward's kernel chain: the shared helpers of
// src/kernels/pdl.cuh (launch_pdl, pdl_wait, pdl_trigger; SMCGRAPH_DISABLE_PDL=1 turns it off). The GEMMs
// prefetch their weight tiles before pdl_wait(), which is where this chain gains most. By default each
// layer's O and down launches trigger at their top (SMCGRAPH_LLAMA_TRIGGER: early_o_down; after_wait, other
// subsets, early_all with QKV, early_max with every layer launch), so gate/up and the next layer's QKV start
// (and stage their weights) while O and down run; LlamaModel::forward says why their early reads stay safe.
#pragma once

#include "kernels/pdl.cuh"
#include "models/llama/llama_kernels.hpp"

namespace smcgraph::llama {
using detail::L2StreamingRange;
using detail::launch_pdl;
using detail::launch_pdl_streaming;
using detail::pdl_enabled;
using detail::pdl_trigger;
using detail::pdl_wait;
using detail::with_streaming_window;

/// The weights of a launch over GemmArgs (W [n, k] bf16, all of its rows: the layer GEMMs, and the LM head's
/// vocab_padded rows through cuBLASLt) as a streaming L2 range where GemmArgs::stream_weights asks for it.
inline L2StreamingRange weight_range(const GemmArgs& a) {
  if (!a.stream_weights)
    return {};
  return {a.weight, static_cast<size_t>(a.n) * a.k * sizeof(uint16_t)};
}

/// The PDL wait, then the trigger that lets the next launch start, unless this launch gave it at its top
/// (GemmArgs / AttentionArgs::trigger_early: the early-trigger kernels call pdl_trigger() first thing).
__device__ __forceinline__ void pdl_wait_then_trigger(bool triggered_early) {
  pdl_wait();
  if (!triggered_early)
    pdl_trigger();
}
} // namespace smcgraph::llama

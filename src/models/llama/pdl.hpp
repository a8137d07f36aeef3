// Programmatic dependent launch for the Llama forward's kernel chain: the shared helpers of
// src/kernels/pdl.cuh (launch_pdl, pdl_wait, pdl_trigger; SMCGRAPH_DISABLE_PDL=1 turns it off). The GEMMs
// prefetch their weight tiles before pdl_wait(), which is where this chain gains most.
#pragma once

#include "kernels/pdl.cuh"

namespace smcgraph::llama {
using detail::launch_pdl;
using detail::pdl_enabled;
using detail::pdl_trigger;
using detail::pdl_wait;
} // namespace smcgraph::llama

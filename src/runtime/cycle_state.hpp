// The engine's device state declared once: every buffer of Engine::State with its element type (the
// DeviceBuffer's), its extent, whether it starts zeroed, whether compact() moves it with its request, which
// cycle kinds have it, and the CycleBuffers pointer the cycle kernels reach it by. Allocation, zeroing, the
// typed views and compaction all walk this one table (cycle_state.cpp), so adding a buffer is one line here
// and a member in engine_state.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/engine_state.hpp"

namespace smcgraph::detail {

/// How many elements a buffer has, in terms of the engine's sizes: R rows (max_requests x N), Q request
/// slots, K draft steps, S = max_seq_len, the slot pool; the logits buffers count bytes of the model dtype.
enum class Extent : int {
  kOne,                ///< 1
  kFour,               ///< 4 (admission scalars)
  kPool,               ///< slot_pool_size
  kPoolWords,          ///< ceil(slot_pool_size / 32): a bit per slot
  kPoolSummaryWords,   ///< ceil(kPoolWords / 32): a bit per word of the above
  kRows,               ///< R
  kRequests,           ///< Q
  kRowsBySeq,          ///< R x S: a row's slot or token table
  kRowsByTwo,          ///< R x 2: the draft head's two tokens per row
  kRowsByKPlus1,       ///< R x (K + 1): a cycle's positions per row
  kRowsByK,            ///< R x K (or K x R): the draft positions
  kRowsByDraftSteps,   ///< R x max(K - 1, 1): the draft steps after the head
  kSeq,                ///< S
  kDraftLogitsBytes,   ///< logits of R x 2 tokens
  kTargetLogitsBytes,  ///< logits of R x (K + 1) tokens
  kStepLogitsBytes,    ///< logits of R x K tokens (speculative: q at every draft position)
  kPrefillLogitsBytes, ///< logits of one prefill chunk
};

/// Which cycle kinds allocate a buffer.
enum class Kinds : int { kBoth, kSpeculativeOnly };

/// One buffer of the table.
template <class T> struct StateBuffer {
  using element_type = T;
  const char* name;
  DeviceBuffer<T> Engine::State::*member;
  Extent extent;
  bool zeroed;    ///< zero-filled by the constructor (others are written before they are read)
  bool compacted; ///< compact() moves it with its request (its extent must be per row or per request)
  Kinds kinds;
  T* CycleBuffers::*view; ///< the cycle kernels' pointer to it, or nullptr
};

/// The sizes an Extent is measured in.
struct StateDims {
  size_t rows = 0, requests = 0, draft_steps = 0, max_seq_len = 0, pool = 0;
  size_t logits_row_bytes = 0;    ///< bytes of one row of vocab logits
  size_t prefill_logits_rows = 0; ///< rows of vocab logits admission's prefill writes (1 or the chunk)
  int particles = 1;
};
StateDims state_dims(const Engine::State& s);
size_t extent_count(Extent extent, const StateDims& dims);
/// Elements compact() moves per request for a buffer of this extent (0: not movable per request).
size_t elements_per_request(Extent extent, const StateDims& dims);

/// A row of the table without its types (tests and debugging).
struct StateBufferInfo {
  std::string name;
  size_t element_bytes = 0;
  Extent extent = Extent::kOne;
  bool zeroed = false, compacted = false, speculative_only = false, has_view = false;
};
std::vector<StateBufferInfo> describe_cycle_state();
/// What is wrong with the table, empty when nothing: a name, member or view used twice, a compacted buffer
/// whose extent is not per row or per request. (test_engine_cpu checks it is empty.)
std::string cycle_state_problems();

/// Engine::inspect: a copy of the named buffer, enqueued on the engine's stream after its work and waited
/// for.
StateBufferCopy copy_state_buffer(Engine::State& s, const std::string& name);
/// The table's names of the buffers this engine's cycle kind has.
std::vector<std::string> state_buffer_names(const Engine::State& s);

/// Allocates every buffer of the engine's kind (at least one element each); returns the bytes allocated.
size_t allocate_cycle_state(Engine::State& s);
/// Zero-fills every buffer of the engine's kind on its stream, once at construction (the table's `zeroed`
/// column marks those the stages need at zero).
void zero_cycle_state(Engine::State& s);
/// Points s.buffers (CycleBuffers) at the allocated buffers and sets its scalars.
void wire_cycle_views(Engine::State& s);
/// Moves request slot `from`'s rows and per-request values of every compacted buffer to slot `to`, on the
/// engine's stream (copies: refcounts do not change). The caller empties `from`.
void move_request_state(Engine::State& s, int from, int to);

} // namespace smcgraph::detail

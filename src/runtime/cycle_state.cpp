#include "runtime/cycle_state.hpp"

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "smcgraph/error.hpp"

namespace smcgraph::detail {
namespace {

using State = Engine::State;
using B = CycleBuffers;
/// A row's properties, combined with |: zero-filled at construction, moved by compact() with its request,
/// allocated by the speculative cycle only. kNone: written before it is read, stays with its row, both kinds.
enum Flag : unsigned { kNone = 0, kZeroed = 1u << 0, kMoved = 1u << 1, kSpec = 1u << 2 };

template <class T>
constexpr StateBuffer<T> buffer(const char* name, DeviceBuffer<T> State::*member, Extent extent,
                                unsigned flags, T* B::*view = nullptr) {
  return {name,
          member,
          extent,
          (flags & kZeroed) != 0,
          (flags & kMoved) != 0,
          (flags & kSpec) != 0 ? Kinds::kSpeculativeOnly : Kinds::kBoth,
          view};
}

// clang-format off
// name, member, extent, flags, CycleBuffers view
const auto kCycleState = std::make_tuple(
    // The slot pool and the row tables (slots.hpp; viewed through pool_view() / tables_view()).
    buffer("free_stack",         &State::free_stack,         Extent::kPool,              kZeroed),
    buffer("free_count",         &State::free_count,         Extent::kOne,               kZeroed),
    buffer("refcount",           &State::refcount,           Extent::kPool,              kZeroed),
    buffer("freed_bitmap",       &State::freed_bitmap,       Extent::kPoolWords,         kZeroed),
    buffer("freed_summary",      &State::freed_summary,      Extent::kPoolSummaryWords,  kZeroed),
    buffer("collect_ticket",     &State::collect_ticket,     Extent::kOne,               kZeroed,          &B::collect_ticket),
    buffer("slot_table",         &State::slot_table,         Extent::kRowsBySeq,         kZeroed | kMoved),
    buffer("token_table",        &State::token_table,        Extent::kRowsBySeq,         kZeroed | kMoved),
    buffer("seq_len",            &State::seq_len,            Extent::kRows,              kZeroed | kMoved),
    buffer("live",               &State::live,               Extent::kRows,              kZeroed | kMoved),
    // Per row and per request.
    buffer("finished",           &State::finished,           Extent::kRows,              kZeroed | kMoved, &B::finished),
    buffer("resampled",          &State::resampled,          Extent::kRequests,          kZeroed | kMoved, &B::resampled),
    buffer("release_mask",       &State::release_mask,       Extent::kRows,              kZeroed),
    buffer("request_mask",       &State::request_mask,       Extent::kRequests,          kZeroed),
    buffer("draft_temperature",  &State::draft_temperature,  Extent::kRows,              kZeroed | kMoved, &B::draft_temperature),
    buffer("target_temperature", &State::target_temperature, Extent::kRows,              kZeroed | kMoved, &B::target_temperature),
    buffer("alpha",              &State::alpha,              Extent::kRows,              kZeroed | kMoved, &B::alpha),
    buffer("tau",                &State::tau,                Extent::kRequests,          kZeroed | kMoved, &B::tau),
    buffer("logw",               &State::logw,               Extent::kRows,              kZeroed | kMoved, &B::logw),
    buffer("ess",                &State::ess,                Extent::kRequests,          kZeroed | kMoved, &B::ess),
    buffer("log_evidence",       &State::log_evidence,       Extent::kRequests,          kZeroed | kMoved, &B::log_evidence),
    buffer("row_flags",          &State::row_flags,          Extent::kRows,              kZeroed | kMoved, &B::row_flags),
    buffer("status",             &State::status,             Extent::kOne,               kZeroed,          &B::status),
    buffer("draw_counters",      &State::draw_counters,      Extent::kRequests,          kZeroed | kMoved, &B::draw_counters),
    buffer("seeds",              &State::seeds,              Extent::kRequests,          kZeroed | kMoved, &B::seeds),
    // Forward inputs, rebuilt every cycle.
    buffer("head_tokens",        &State::head_tokens,        Extent::kRowsByTwo,         kNone,            &B::head_tokens),
    buffer("head_positions",     &State::head_positions,     Extent::kRowsByTwo,         kNone,            &B::head_positions),
    buffer("head_out_slots",     &State::head_out_slots,     Extent::kRowsByTwo,         kNone,            &B::head_out_slots),
    buffer("head_seq_lens",      &State::head_seq_lens,      Extent::kRows,              kNone,            &B::head_seq_lens),
    buffer("step_positions",     &State::step_positions,     Extent::kRowsByDraftSteps,  kNone,            &B::step_positions),
    buffer("step_out_slots",     &State::step_out_slots,     Extent::kRowsByDraftSteps,  kNone,            &B::step_out_slots),
    buffer("step_seq_lens",      &State::step_seq_lens,      Extent::kRowsByDraftSteps,  kNone,            &B::step_seq_lens),
    buffer("verify_positions",   &State::verify_positions,   Extent::kRowsByKPlus1,      kNone,            &B::verify_positions),
    buffer("verify_out_slots",   &State::verify_out_slots,   Extent::kRowsByKPlus1,      kNone,            &B::verify_out_slots),
    buffer("verify_seq_lens",    &State::verify_seq_lens,    Extent::kRows,              kNone,            &B::verify_seq_lens),
    // Samples, scores and the commit's results.
    buffer("cycle_slots",        &State::cycle_slots,        Extent::kRowsByKPlus1,      kNone,            &B::cycle_slots),
    buffer("draft_tokens",       &State::draft_tokens,       Extent::kRowsByKPlus1,      kZeroed,          &B::draft_tokens),
    buffer("draft_logprobs",     &State::draft_logprobs,     Extent::kRowsByKPlus1,      kZeroed,          &B::draft_logprobs),
    buffer("scratch_logz",       &State::scratch_logz,       Extent::kRows,              kNone,            &B::scratch_logz),
    buffer("target_logprobs",    &State::target_logprobs,    Extent::kRowsByK,           kNone,            &B::target_logprobs),
    buffer("bonus_tokens",       &State::bonus_tokens,       Extent::kRows,              kZeroed,          &B::bonus_tokens),
    buffer("bonus_logprobs",     &State::bonus_logprobs,     Extent::kRows,              kNone,            &B::bonus_logprobs),
    buffer("bonus_logz",         &State::bonus_logz,         Extent::kRows,              kNone,            &B::bonus_logz),
    buffer("first_eos",          &State::first_eos,          Extent::kRows,              kZeroed,          &B::first_eos),
    buffer("ancestor",           &State::ancestor,           Extent::kRows,              kZeroed,          &B::ancestor),
    buffer("cycle_tokens",       &State::cycle_tokens,       Extent::kRowsByKPlus1,      kZeroed,          &B::cycle_tokens),
    buffer("committed",          &State::committed,          Extent::kRows,              kZeroed,          &B::committed),
    // The per-request draft length (AdaptiveDraftSteps; draft_steps.cu).
    buffer("request_draft_steps",&State::request_draft_steps,Extent::kRequests,          kZeroed | kMoved, &B::request_draft_steps),
    buffer("pinned_draft_steps", &State::pinned_draft_steps, Extent::kRequests,          kZeroed | kMoved, &B::pinned_draft_steps),
    buffer("acceptance_ema",     &State::acceptance_ema,     Extent::kRequests,          kZeroed | kMoved, &B::acceptance_ema),
    buffer("cycle_draft_steps",  &State::cycle_draft_steps,  Extent::kRequests,          kZeroed | kMoved, &B::cycle_draft_steps),
    buffer("step_live",          &State::step_live,          Extent::kRowsByDraftSteps,  kZeroed,          &B::step_live),
    buffer("decision_free_slots",&State::decision_free_slots,Extent::kOne,               kZeroed,          &B::decision_free_slots),
    buffer("kv_pressure",        &State::kv_pressure,        Extent::kOne,               kZeroed,          &B::kv_pressure),
    // The speculative cycle's verification and packing.
    buffer("draft_step_logits",  &State::draft_step_logits,  Extent::kStepLogitsBytes,   kZeroed | kSpec),
    buffer("packed_logprobs",    &State::packed_logprobs,    Extent::kRowsByK,           kSpec,            &B::packed_logprobs),
    buffer("packed_tokens",      &State::packed_tokens,      Extent::kRowsByK,           kSpec,            &B::packed_tokens),
    buffer("accepted",           &State::accepted,           Extent::kRows,              kZeroed | kSpec,  &B::accepted),
    buffer("next_tokens",        &State::next_tokens,        Extent::kRows,              kZeroed | kSpec,  &B::next_tokens),
    buffer("packed_offsets",     &State::packed_offsets,     Extent::kRows,              kSpec,            &B::packed_offsets),
    buffer("packed_total",       &State::packed_total,       Extent::kOne,               kSpec,            &B::packed_total),
    // Model outputs (the model's logits dtype) and admission scratch (the output block is pinned host memory
    // the cycle's last launch writes directly: Engine::State::outputs_host).
    buffer("draft_logits",       &State::draft_logits,       Extent::kDraftLogitsBytes,  kZeroed),
    buffer("target_logits",      &State::target_logits,      Extent::kTargetLogitsBytes, kZeroed),
    buffer("prefill_logits",     &State::prefill_logits,     Extent::kPrefillLogitsBytes,kZeroed),
    buffer("positions_iota",     &State::positions_iota,     Extent::kSeq,               kNone),
    buffer("admit_scalars",      &State::admit_scalars,      Extent::kFour,              kNone),
    buffer("admit_floats",       &State::admit_floats,       Extent::kFour,              kNone));
// clang-format on

bool applies(Kinds kinds, const Engine::State& s) {
  return kinds == Kinds::kBoth || s.config.kind == CycleKind::kSpeculative;
}

template <class F> void for_each_buffer(F&& f) {
  std::apply([&](const auto&... entry) { (f(entry), ...); }, kCycleState);
}

} // namespace

StateDims state_dims(const Engine::State& s) {
  StateDims d;
  d.rows = static_cast<size_t>(s.rows);
  d.requests = static_cast<size_t>(s.config.max_requests);
  d.draft_steps = static_cast<size_t>(s.draft_steps);
  d.max_seq_len = static_cast<size_t>(s.config.max_seq_len);
  d.pool = static_cast<size_t>(s.config.slot_pool_size);
  d.logits_row_bytes = s.logits_bytes(1, 1);
  d.prefill_logits_rows = s.prefill_last_token ? 1 : static_cast<size_t>(s.prefill_chunk);
  d.particles = s.config.particles;
  return d;
}

size_t extent_count(Extent extent, const StateDims& d) {
  switch (extent) {
  case Extent::kOne:
    return 1;
  case Extent::kFour:
    return 4;
  case Extent::kPool:
    return d.pool;
  case Extent::kPoolWords:
    return (d.pool + 31) / 32;
  case Extent::kPoolSummaryWords:
    return ((d.pool + 31) / 32 + 31) / 32;
  case Extent::kRows:
    return d.rows;
  case Extent::kRequests:
    return d.requests;
  case Extent::kRowsBySeq:
    return d.rows * d.max_seq_len;
  case Extent::kRowsByTwo:
    return 2 * d.rows;
  case Extent::kRowsByKPlus1:
    return d.rows * (d.draft_steps + 1);
  case Extent::kRowsByK: // at least one column: draft_steps = 0 keeps the buffers (never read) non-null
    return d.rows * std::max<size_t>(d.draft_steps, 1);
  case Extent::kRowsByDraftSteps:
    return d.rows * (d.draft_steps > 1 ? d.draft_steps - 1 : 1);
  case Extent::kSeq:
    return d.max_seq_len;
  // Logits blocks: [rows, 2] for the draft head, [rows, K + 1] for the verify, K blocks of [rows] for the
  // speculative draft steps, [prefill_chunk] for admission (one row when the prefill forwards write their
  // last token's logits only); a row of vocab logits each.
  case Extent::kDraftLogitsBytes:
    return d.rows * 2 * d.logits_row_bytes;
  case Extent::kTargetLogitsBytes:
    return d.rows * (d.draft_steps + 1) * d.logits_row_bytes;
  case Extent::kStepLogitsBytes:
    return d.rows * std::max<size_t>(d.draft_steps, 1) * d.logits_row_bytes;
  case Extent::kPrefillLogitsBytes:
    return d.prefill_logits_rows * d.logits_row_bytes;
  }
  return 0;
}

size_t elements_per_request(Extent extent, const StateDims& d) {
  const size_t n = static_cast<size_t>(d.particles);
  switch (extent) {
  case Extent::kRows:
    return n;
  case Extent::kRequests:
    return 1;
  case Extent::kRowsBySeq:
    return n * d.max_seq_len;
  default:
    return 0;
  }
}

std::vector<StateBufferInfo> describe_cycle_state() {
  std::vector<StateBufferInfo> rows;
  for_each_buffer([&](const auto& entry) {
    using Element = typename std::remove_cvref_t<decltype(entry)>::element_type;
    rows.push_back({entry.name, sizeof(Element), entry.extent, entry.zeroed, entry.compacted,
                    entry.kinds == Kinds::kSpeculativeOnly, entry.view != nullptr});
  });
  return rows;
}

std::string cycle_state_problems() {
  std::string problems;
  auto note = [&](const std::string& text) { problems += (problems.empty() ? "" : "; ") + text; };
  size_t index = 0;
  for_each_buffer([&](const auto& a) {
    size_t other = 0;
    for_each_buffer([&](const auto& b) {
      if (other++ <= index)
        return;
      if (std::string(a.name) == b.name)
        note(std::string("name ") + a.name + " twice");
      if constexpr (std::is_same_v<decltype(a.member), decltype(b.member)>) {
        if (a.member == b.member)
          note(std::string(a.name) + " and " + b.name + " are the same member");
        if (a.view != nullptr && a.view == b.view)
          note(std::string(a.name) + " and " + b.name + " have the same view");
      }
    });
    StateDims probe;
    probe.particles = 2;
    probe.max_seq_len = 3;
    if (a.compacted && elements_per_request(a.extent, probe) == 0)
      note(std::string(a.name) + " is compacted but its extent is not per row or per request");
    ++index;
  });
  return problems;
}

StateBufferCopy copy_state_buffer(Engine::State& s, const std::string& name) {
  constexpr const char* kWhere = "Engine::inspect";
  StateBufferCopy copy;
  bool found = false;
  for_each_buffer([&](const auto& entry) {
    if (found || name != entry.name)
      return;
    found = true;
    require(applies(entry.kinds, s), kWhere, "name", name, "is not a buffer of this engine's cycle kind");
    const auto& buffer = s.*entry.member;
    copy.name = name;
    copy.element_bytes = sizeof(typename std::remove_cvref_t<decltype(entry)>::element_type);
    copy.bytes.resize(buffer.bytes());
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpyAsync(copy.bytes.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost, s.stream));
  });
  require(found, kWhere, "name", name,
          "is not a buffer of the cycle state (see Engine::state_buffer_names())");
  s.stream.synchronize();
  return copy;
}

std::vector<std::string> state_buffer_names(const Engine::State& s) {
  std::vector<std::string> names;
  for_each_buffer([&](const auto& entry) {
    if (applies(entry.kinds, s))
      names.push_back(entry.name);
  });
  return names;
}

size_t allocate_cycle_state(Engine::State& s) {
  const StateDims dims = state_dims(s);
  size_t total = 0;
  for_each_buffer([&](const auto& entry) {
    if (!applies(entry.kinds, s))
      return;
    auto& target = s.*entry.member;
    using Buffer = std::remove_reference_t<decltype(target)>;
    target = Buffer(std::max<size_t>(extent_count(entry.extent, dims), 1));
    total += target.bytes();
  });
  return total;
}

void zero_cycle_state(Engine::State& s) {
  // The `zeroed` buffers must start at zero (the stages rely on it). The others are written before any stage
  // reads them, and are zeroed too, once here at construction: Engine::inspect() then never copies undefined
  // bytes (compute-sanitizer's initcheck flags such a copy).
  for_each_buffer([&](const auto& entry) {
    if (applies(entry.kinds, s))
      (s.*entry.member).fill_bytes(0, s.stream);
  });
}

void wire_cycle_views(Engine::State& s) {
  CycleBuffers& b = s.buffers;
  b.pool = s.pool_view();
  b.tables = s.tables_view();
  b.particles = s.config.particles;
  b.draft_steps = s.draft_steps;
  b.max_rows = s.rows;
  b.eos_id = s.config.eos_id;
  b.policy = draft_steps_policy(s.config);
  for_each_buffer([&](const auto& entry) {
    if (entry.view != nullptr && applies(entry.kinds, s))
      b.*entry.view = (s.*entry.member).data();
  });
}

void move_request_state(Engine::State& s, int from, int to) {
  const StateDims dims = state_dims(s);
  for_each_buffer([&](const auto& entry) {
    if (!entry.compacted || !applies(entry.kinds, s))
      return;
    auto& buffer = s.*entry.member;
    using T = std::remove_reference_t<decltype(*buffer.data())>;
    const size_t per_request = elements_per_request(entry.extent, dims);
    require(per_request > 0, "Engine::compact", entry.name, static_cast<int>(entry.extent),
            "is marked compacted but its extent is not per row or per request");
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(buffer.data() + static_cast<size_t>(to) * per_request,
                                        buffer.data() + static_cast<size_t>(from) * per_request,
                                        sizeof(T) * per_request, cudaMemcpyDeviceToDevice, s.stream));
  });
}

} // namespace smcgraph::detail

// The byte layout the engine-validation fuzz target reads (fuzz_engine_validation.cpp) and the CPU suite
// writes its seeds in (test_engine_cpu.cpp, when SMCGRAPH_FUZZ_CORPUS_DIR is set): an EngineConfig, a
// RequestParams and a prompt, little-endian, fields in declaration order. A short input reads zeros for the
// missing bytes, so every byte string decodes to some input.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "smcgraph/engine.hpp"

namespace smcgraph::fuzz {

struct EngineFuzzInput {
  EngineConfig config;
  RequestParams params;
  std::vector<int32_t> prompt;
};

inline constexpr size_t kMaxFuzzBuckets = 16;
inline constexpr size_t kMaxFuzzPrompt = 1 << 16;

class ByteReader {
public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <class T> T read() {
    uint8_t bytes[sizeof(T)] = {};
    for (size_t i = 0; i < sizeof(T) && at_ < size_; ++i)
      bytes[i] = data_[at_++];
    T value;
    std::memcpy(&value, bytes, sizeof(T));
    return value;
  }
  size_t remaining() const { return size_ - at_; }

private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

class ByteWriter {
public:
  template <class T> void write(const T& value) {
    // Grow, then copy into the new tail (a range insert from a local array trips GCC 12's
    // -Wstringop-overflow, a false positive).
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &value, sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(out_); }

private:
  std::vector<uint8_t> out_;
};

inline EngineFuzzInput decode_engine_fuzz_input(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  EngineFuzzInput decoded;
  EngineConfig& c = decoded.config;
  c.kind = static_cast<CycleKind>(in.read<uint8_t>());
  c.vocab = in.read<int32_t>();
  c.draft_steps = in.read<int32_t>();
  c.particles = in.read<int32_t>();
  c.max_requests = in.read<int32_t>();
  const size_t buckets = in.read<uint8_t>() % (kMaxFuzzBuckets + 1);
  for (size_t i = 0; i < buckets; ++i)
    c.buckets.push_back(in.read<int32_t>());
  c.max_seq_len = in.read<int32_t>();
  c.slot_pool_size = in.read<int32_t>();
  c.draft_temperature = in.read<float>();
  c.target_temperature = in.read<float>();
  c.alpha = in.read<float>();
  c.tau = in.read<float>();
  c.eos_id = in.read<int32_t>();
  const uint8_t flags = in.read<uint8_t>();
  c.use_graphs = (flags & 1) != 0;
  c.spin_wait = (flags & 2) != 0;
  AdaptiveDraftSteps& a = c.adaptive;
  a.enabled = (flags & 4) != 0;
  a.min_steps = in.read<int32_t>();
  a.mid_steps = in.read<int32_t>();
  a.smoothing = in.read<float>();
  a.initial_acceptance = in.read<float>();
  a.high_threshold = in.read<float>();
  a.low_threshold = in.read<float>();
  a.pressure_cap = in.read<int32_t>();
  a.pressure_free_fraction = in.read<float>();
  c.prefill_chunk = in.read<int32_t>();
  RequestParams& p = decoded.params;
  p.seed = in.read<uint64_t>();
  p.draft_temperature = in.read<float>();
  p.target_temperature = in.read<float>();
  p.alpha = in.read<float>();
  p.tau = in.read<float>();
  p.max_new_tokens = in.read<int32_t>();
  p.draft_steps = in.read<int32_t>();
  // The prompt: its length, then that many tokens (fewer when the input ends first).
  size_t length = in.read<uint32_t>() % (kMaxFuzzPrompt + 1);
  length = std::min(length, in.remaining() / sizeof(int32_t));
  decoded.prompt.resize(length);
  for (int32_t& token : decoded.prompt)
    token = in.read<int32_t>();
  return decoded;
}

inline std::vector<uint8_t> encode_engine_fuzz_input(const EngineConfig& c, const RequestParams& p,
                                                     const std::vector<int32_t>& prompt) {
  ByteWriter out;
  out.write(static_cast<uint8_t>(c.kind));
  out.write<int32_t>(c.vocab);
  out.write<int32_t>(c.draft_steps);
  out.write<int32_t>(c.particles);
  out.write<int32_t>(c.max_requests);
  const size_t buckets = std::min(c.buckets.size(), kMaxFuzzBuckets);
  out.write(static_cast<uint8_t>(buckets));
  for (size_t i = 0; i < buckets; ++i)
    out.write<int32_t>(c.buckets[i]);
  out.write<int32_t>(c.max_seq_len);
  out.write<int32_t>(c.slot_pool_size);
  out.write<float>(c.draft_temperature);
  out.write<float>(c.target_temperature);
  out.write<float>(c.alpha);
  out.write<float>(c.tau);
  out.write<int32_t>(c.eos_id);
  out.write(
      static_cast<uint8_t>((c.use_graphs ? 1 : 0) | (c.spin_wait ? 2 : 0) | (c.adaptive.enabled ? 4 : 0)));
  out.write<int32_t>(c.adaptive.min_steps);
  out.write<int32_t>(c.adaptive.mid_steps);
  out.write<float>(c.adaptive.smoothing);
  out.write<float>(c.adaptive.initial_acceptance);
  out.write<float>(c.adaptive.high_threshold);
  out.write<float>(c.adaptive.low_threshold);
  out.write<int32_t>(c.adaptive.pressure_cap);
  out.write<float>(c.adaptive.pressure_free_fraction);
  out.write<int32_t>(c.prefill_chunk);
  out.write<uint64_t>(p.seed);
  out.write<float>(p.draft_temperature);
  out.write<float>(p.target_temperature);
  out.write<float>(p.alpha);
  out.write<float>(p.tau);
  out.write<int32_t>(p.max_new_tokens);
  out.write<int32_t>(p.draft_steps);
  const size_t length = std::min(prompt.size(), kMaxFuzzPrompt);
  out.write(static_cast<uint32_t>(length));
  for (size_t i = 0; i < length; ++i)
    out.write<int32_t>(prompt[i]);
  return out.take();
}

} // namespace smcgraph::fuzz

// Draw-counter advance (one node per cycle) and a Philox cross-check kernel for the tests.
#include "smcgraph/sample.hpp"
#include "smcgraph/error.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/random.cuh"

namespace smcgraph {
namespace {

__global__ void AdvanceDrawCountersKernel(uint32_t* draw_counters, int count) {
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count)
    device::advance_draw_counter(draw_counters, i);
}

__global__ void PhiloxWordsKernel(uint64_t seed, uint32_t draw_counter, uint32_t particle,
                                  uint32_t stream_word, uint32_t* out, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count)
    return;
  const uint4 words =
      device::philox_group(seed, static_cast<uint32_t>(i >> 2), draw_counter, particle, stream_word);
  out[i] = device::group_word(words, static_cast<uint32_t>(i & 3));
}

} // namespace

void advance_draw_counters(uint32_t* draw_counters, int count, cudaStream_t stream) {
  require(count >= 0, "advance_draw_counters", "count", count, "must be >= 0");
  if (count == 0)
    return;
  require(draw_counters != nullptr, "advance_draw_counters", "draw_counters", "null",
          "must be a device pointer");
  constexpr int kThreads = 256;
  detail::launch_pdl(AdvanceDrawCountersKernel, dim3(static_cast<int>(detail::ceil_div(count, kThreads))),
                     dim3(kThreads), 0, stream, draw_counters, count);
}

void philox_words(uint64_t seed, uint32_t draw_counter, uint32_t particle, uint32_t stream_word,
                  uint32_t* out, int count, cudaStream_t stream) {
  require(count >= 0, "philox_words", "count", count, "must be >= 0");
  if (count == 0)
    return;
  require(out != nullptr, "philox_words", "out", "null", "must be a device pointer");
  constexpr int kThreads = 256;
  PhiloxWordsKernel<<<static_cast<int>(detail::ceil_div(count, kThreads)), kThreads, 0, stream>>>(
      seed, draw_counter, particle, stream_word, out, count);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace smcgraph

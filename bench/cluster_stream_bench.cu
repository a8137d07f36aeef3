// cluster_stream_bench: how fast one thread-block cluster streams a decode layer's weights from HBM into
// shared memory, and what a cluster barrier between the layer's dependent stages costs. These two numbers
// decide whether a decode forward run by one cluster (its stages separated by cluster barriers, the next
// stage's weights already streaming while the current one finishes) could beat the PDL chain of five kernels
// a layer that LlamaModel runs today (SmolLM2-135M at 8 rows on an H200: 13.3 us a layer of the critical path
// against a floor of 4.28 us: 1.66 us of weights plus 5 nodes). bench/stage_chain_bench measured a persistent
// kernel with *grid* barriers and lost: there a stage's weight copy could only start after the barrier. Here
// the copies run ahead of the barriers through a ring of shared-memory slots.
//
// Every variant streams `layers` layers of `layer_bytes` (default 30 x 7,077,888 bytes: SmolLM2-135M's layer
// in bf16, 212 MB, more than L2 holds), each cut into `stages` stages (default 5) whose bytes are split
// evenly over the grid's CTAs. A CTA streams its share through `ring` slots of `slot` bytes
// (cp.async.bulk completing an mbarrier; thread 0 refills a slot once the CTA has read it) and sums every
// 32-bit word it receives, so nothing can be skipped; the host checks the sum.
//
//   cluster C, barriers   one cluster of C CTAs (one an SM); after each stage a cluster barrier (release /
//                         acquire), as a forward's dependent stages would need; the ring keeps streaming
//   cluster C, streaming  the same without barriers: the cluster's streaming rate
//   cluster C, barriers only  no bytes: the barriers' own cost a stage
//   all SMs, streaming    one CTA an SM, no cluster: this method's rate over the whole device
//
//   build/bench/cluster_stream_bench [--layers N] [--layer-bytes B] [--stages S] [--slot B] [--ring N]
//
// Prints us a layer, GB/s and the fraction of the copy bandwidth (bench_util's measure_copy_bandwidth_gbs)
// for each variant. Not run in the test suite (timing only); exits 77 without a device.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cooperative_groups.h>
#include <cuda/ptx>
#include <cuda_runtime.h>

#include "bench_util.hpp"
#include "cli.hpp"
#include "kernels/cluster_barrier.cuh"
#include "kernels/pdl.cuh"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace {

using smcgraph::DeviceBuffer;
using smcgraph::Stream;
namespace bench = smcgraph::bench;

constexpr int kThreads = 256;
constexpr int kMaxRing = 16;

struct StreamArgs {
  const uint8_t* weights;
  int64_t layer_bytes; ///< bytes a layer occupies in `weights`
  int layers, stages;
  int64_t share;  ///< bytes a CTA streams of each stage (a multiple of 16; 0: barriers only)
  int slot_bytes; ///< a ring slot (a multiple of 16)
  int ring;       ///< slots
  unsigned long long* sum;
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

/// Issues chunk `chunk` of this CTA's stream into slot chunk % ring (thread 0 only).
__device__ __forceinline__ void issue_chunk(const StreamArgs& a, uint8_t* slots, uint64_t* full,
                                            int64_t chunk, int64_t chunks_per_stage) {
  const int64_t stage_index = chunk / chunks_per_stage; // over all layers
  const int64_t within = (chunk % chunks_per_stage) * a.slot_bytes;
  const int bytes = static_cast<int>(min64(a.slot_bytes, a.share - within));
  const int64_t layer = stage_index / a.stages, stage = stage_index % a.stages;
  const int64_t stage_bytes = a.layer_bytes / a.stages / 16 * 16; // bulk copies need 16-byte alignment
  const uint8_t* source = a.weights + layer * a.layer_bytes + stage * stage_bytes +
                          static_cast<int64_t>(blockIdx.x) * a.share + within;
  const int slot = static_cast<int>(chunk % a.ring);
  namespace ptx = cuda::ptx;
  ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[slot],
                                 static_cast<uint32_t>(bytes));
  ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, slots + static_cast<int64_t>(slot) * a.slot_bytes,
                     source, static_cast<uint32_t>(bytes), &full[slot]);
}

template <bool BARRIERS> __global__ void __launch_bounds__(kThreads) StreamKernel(const StreamArgs a) {
  extern __shared__ __align__(128) uint8_t slots[];
  __shared__ __align__(8) uint64_t full[kMaxRing];
  if (a.share == 0) { // barriers only
    for (int i = 0; i < a.layers * a.stages; ++i)
      smcgraph::detail::cluster_barrier();
    return;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.ring; ++s)
      cuda::ptx::mbarrier_init(&full[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncthreads();
  const int64_t chunks_per_stage = (a.share + a.slot_bytes - 1) / a.slot_bytes;
  const int64_t chunks = chunks_per_stage * a.stages * a.layers;
  if (threadIdx.x == 0)
    for (int64_t c = 0; c < min64(a.ring, chunks); ++c)
      issue_chunk(a, slots, full, c, chunks_per_stage);
  unsigned long long sum = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int slot = static_cast<int>(c % a.ring);
    const uint32_t parity = static_cast<uint32_t>((c / a.ring) & 1);
    while (!cuda::ptx::mbarrier_try_wait_parity(&full[slot], parity)) {
    }
    const int64_t within = (c % chunks_per_stage) * a.slot_bytes;
    const int bytes = static_cast<int>(min64(a.slot_bytes, a.share - within));
    const uint4* words = reinterpret_cast<const uint4*>(slots + static_cast<int64_t>(slot) * a.slot_bytes);
    for (int i = threadIdx.x; i < bytes / 16; i += kThreads) {
      const uint4 v = words[i];
      sum += static_cast<unsigned long long>(v.x) + v.y + v.z + v.w;
    }
    __syncthreads(); // every thread is done with the slot: it may be refilled
    if (threadIdx.x == 0 && c + a.ring < chunks)
      issue_chunk(a, slots, full, c + a.ring, chunks_per_stage);
    if constexpr (BARRIERS) {
      if ((c + 1) % chunks_per_stage == 0) // the stage's last chunk: the cluster meets
        smcgraph::detail::cluster_barrier();
    }
  }
  atomicAdd(a.sum, sum);
}

struct Options {
  int layers = 30, stages = 5, ring = 6;
  int64_t layer_bytes = 7077888; // SmolLM2-135M: 3,538,944 bf16 weights a layer
  int slot_bytes = 32768;
};

Options parse(int argc, char** argv) {
  using smcgraph::cli::parse_integer;
  Options o;
  smcgraph::cli::Flags flags(argc, argv);
  while (flags.next()) {
    const std::string& flag = flags.flag();
    if (flag == "--help") {
      flags.no_value();
      std::printf("cluster_stream_bench [--layers N] [--layer-bytes B] [--stages S] [--slot B] [--ring N]\n");
      std::exit(0);
    } else if (flag == "--layers") {
      o.layers = parse_integer(flag, flags.value(), 1, 1000);
    } else if (flag == "--layer-bytes") {
      o.layer_bytes = parse_integer<int64_t>(flag, flags.value(), 0, int64_t{1} << 30);
      if (o.layer_bytes % 16 != 0)
        throw smcgraph::cli::bad_value(flag, std::to_string(o.layer_bytes), "must be a multiple of 16");
    } else if (flag == "--stages") {
      o.stages = parse_integer(flag, flags.value(), 1, 64);
    } else if (flag == "--slot") {
      o.slot_bytes = parse_integer(flag, flags.value(), 16, 65536);
      if (o.slot_bytes % 16 != 0)
        throw smcgraph::cli::bad_value(flag, std::to_string(o.slot_bytes), "must be a multiple of 16");
    } else if (flag == "--ring") {
      o.ring = parse_integer(flag, flags.value(), 1, kMaxRing);
    } else {
      throw smcgraph::cli::UsageError{"unknown flag '" + flags.raw() + "' (see --help)"};
    }
  }
  return o;
}

struct Variant {
  std::string name;
  int ctas, cluster; ///< grid and cluster size (1: no cluster)
  bool barriers, bytes;
};

} // namespace

int run(const Options& o) {
  if (!bench::have_cuda_device("cluster_stream_bench"))
    return 77;
  Stream stream;
  const int sms = smcgraph::current_device_info().multiprocessors;
  const double copy_gbs = bench::measure_copy_bandwidth_gbs(stream);
  const size_t dynamic_smem = static_cast<size_t>(o.ring) * o.slot_bytes;
  for (const void* kernel : {reinterpret_cast<const void*>(StreamKernel<true>),
                             reinterpret_cast<const void*>(StreamKernel<false>)}) {
    SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(dynamic_smem)));
    SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  // Weights: word w of the buffer holds (w % 251) + 1, so a chunk read twice or skipped changes the sum.
  const int64_t total_bytes = static_cast<int64_t>(o.layers) * o.layer_bytes;
  std::vector<uint32_t> host(static_cast<size_t>((total_bytes + 3) / 4));
  for (size_t w = 0; w < host.size(); ++w)
    host[w] = static_cast<uint32_t>(w % 251) + 1;
  DeviceBuffer<uint32_t> d_weights(std::max<size_t>(host.size(), 1));
  if (!host.empty())
    d_weights.copy_from_host(host.data(), host.size(), stream);
  DeviceBuffer<unsigned long long> d_sum(1);

  std::printf("cluster_stream_bench on %s (%d SMs): copy %.0f GB/s (read + write); %d layers x %lld bytes "
              "(%.1f MB), %d stages a layer, ring %d x %d bytes; floor a layer %.2f us\n",
              bench::device_name().c_str(), sms, copy_gbs, o.layers, static_cast<long long>(o.layer_bytes),
              total_bytes / 1e6, o.stages, o.ring, o.slot_bytes, o.layer_bytes / (copy_gbs * 1e3));
  const std::vector<Variant> variants = {
      {"cluster 16, barriers", 16, 16, true, true},       {"cluster 16, streaming", 16, 16, false, true},
      {"cluster 16, barriers only", 16, 16, true, false}, {"cluster 8, barriers", 8, 8, true, true},
      {"cluster 8, streaming", 8, 8, false, true},        {"cluster 8, barriers only", 8, 8, true, false},
      {"all SMs, streaming", sms, 1, false, true}};
  bool all_ok = true;
  for (const Variant& v : variants) {
    StreamArgs a{};
    a.weights = reinterpret_cast<const uint8_t*>(d_weights.data());
    a.layer_bytes = o.layer_bytes;
    a.layers = o.layers;
    a.stages = o.stages;
    const int64_t stage_bytes = o.layer_bytes / o.stages / 16 * 16; // as the kernel cuts it
    a.share = v.bytes ? stage_bytes / v.ctas / 16 * 16 : 0;
    a.slot_bytes = o.slot_bytes;
    a.ring = o.ring;
    a.sum = d_sum.data();
    const void* kernel = v.barriers ? reinterpret_cast<const void*>(StreamKernel<true>)
                                    : reinterpret_cast<const void*>(StreamKernel<false>);
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(v.ctas));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = dynamic_smem;
    cudaLaunchAttribute attribute = smcgraph::detail::cluster_attribute(static_cast<unsigned>(v.cluster));
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters < 1) {
      (void)cudaGetLastError();
      std::printf("%-28s not schedulable on this device (cluster of %d, %zu bytes of shared memory)\n",
                  v.name.c_str(), v.cluster, dynamic_smem);
      continue;
    }
    const auto launch = [&](cudaStream_t s) {
      config.stream = s;
      void* params[] = {&a};
      SMCGRAPH_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, params));
    };
    // Validate: the sum of every word streamed.
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(d_sum.data(), 0, sizeof(unsigned long long), stream));
    launch(stream);
    unsigned long long got = 0;
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(&got, d_sum.data(), sizeof(got), cudaMemcpyDeviceToHost, stream));
    stream.synchronize();
    unsigned long long expected = 0;
    for (int layer = 0; layer < o.layers && a.share > 0; ++layer)
      for (int stage = 0; stage < o.stages; ++stage)
        for (int b = 0; b < v.ctas; ++b) {
          const int64_t first = layer * o.layer_bytes + stage * stage_bytes + b * a.share;
          for (int64_t byte = first; byte < first + a.share; byte += 4)
            expected += host[static_cast<size_t>(byte / 4)];
        }
    const bool ok = got == expected;
    all_ok = all_ok && ok;
    const bench::Timing t = bench::time_graph(launch, stream, 1, 20, 3);
    const double streamed = static_cast<double>(a.share) * v.ctas * o.stages * o.layers;
    const double gbs = streamed / (t.median_us * 1e3);
    std::printf("%-28s %9.2f us a layer (min %.2f), %6.0f GB/s, %.3f of copy, %.3f us a stage; check %s\n",
                v.name.c_str(), t.median_us / o.layers, t.min_us / o.layers, gbs, gbs / copy_gbs,
                t.median_us / (o.layers * o.stages), ok ? "ok" : "FAILED (sum differs)");
  }
  return all_ok ? 0 : 1;
}

int main(int argc, char** argv) {
  return smcgraph::cli::run_main("cluster_stream_bench", [&] { return run(parse(argc, argv)); });
}

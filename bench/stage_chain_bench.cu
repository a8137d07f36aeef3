// stage_chain_bench: what one dependent stage of a decode forward costs on the critical path, as a separate
// kernel in a programmatic-dependent-launch chain (how LlamaModel::forward runs its 151 kernels today) and
// as a stage of one persistent kernel whose stages are separated by a grid barrier (a global arrival counter
// per stage). It answers whether a persistent per-forward kernel would shorten the forward's chain.
//
// A stage has the shape of the forward's O and down projections at 8 tokens: y[t, :] = 0.5 x[t, :] +
// 0.5 tanh(x[t, :] W^T / H), H = 576, one block per 16 output columns (36 blocks), W bf16 [H, H] per stage.
// Each block copies its 16 rows of W (18 KB) into shared memory before it waits for the previous stage
// (the PDL wait, or the barrier), then reads the whole x [8, 576] (from L2), computes its [8, 16] tile and
// stores it. 150 stages, like the forward's 150 layer kernels.
//
// A third form runs every stage in one thread-block cluster of 16 CTAs (8 where 16 cannot be placed), one an
// SM: CTA r computes columns r * 36 .. of every stage, its W rows stream through a ring of shared-memory
// slots (cp.async.bulk completing an mbarrier) up to 4 stages ahead (2 with 8 CTAs), and a stage's
// activations travel through distributed shared memory: each CTA keeps its [8 x 36] slice of y, one cluster
// barrier, then every CTA gathers x = the 16 slices from its peers. It answers whether a forward run by one
// cluster could beat the PDL chain (the persistent kernel loses because its weight copies wait for the grid
// barrier).
//
//   build/bench/stage_chain_bench            (prints us per stage for each variant)
//
// Validation first: every variant's final activations must be bit-identical (the same per-thread arithmetic)
// and match a host reference (fp32 dot products, tolerance 1e-4).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cooperative_groups.h>
#include <cuda/ptx>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include "bench_util.hpp"
#include "kernels/cluster_barrier.cuh"
#include "kernels/pdl.cuh"
#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

namespace {

using smcgraph::DeviceBuffer;
using smcgraph::Stream;
namespace bench = smcgraph::bench;

constexpr int kTokens = 8, kHidden = 576, kCols = 16, kThreads = 128, kStages = 150;
constexpr int kWorkingBlocks = kHidden / kCols;
/// y = tanh(2 x W^T / sqrt(H)): activations stay of order 1 over the 150 stages.
constexpr float kScale = 2.0f / 24.0f; // sqrt(576) = 24
static_assert(kTokens * kCols == kThreads, "one output a thread");
constexpr size_t kWeightTileElements = static_cast<size_t>(kCols) * kHidden;
/// W rows in shared memory are padded (bank spread: 16 rows of 1,168 bytes start on 8 different banks).
constexpr int kSharedRow = kHidden + 8;
constexpr size_t kSharedTileElements = static_cast<size_t>(kCols) * kSharedRow;

/// y[t, c] = tanh(x[t, :] . W[c, :] * kScale) from x's row and W's bf16 row in shared memory: four partial
/// sums over k mod 4, added as (d0 + d1) + (d2 + d3) (every variant's arithmetic, so their outputs are the
/// same bits).
__device__ __forceinline__ float stage_output(const float* x_row, const uint16_t* w_row) {
  const float4* xr = reinterpret_cast<const float4*>(x_row);
  const uint2* wr = reinterpret_cast<const uint2*>(w_row);
  float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int k = 0; k < kHidden / 4; ++k) {
    const float4 xv = xr[k];
    const uint2 wv = wr[k];
    dot[0] = fmaf(xv.x, __uint_as_float(wv.x << 16), dot[0]);
    dot[1] = fmaf(xv.y, __uint_as_float(wv.x & 0xffff0000u), dot[1]);
    dot[2] = fmaf(xv.z, __uint_as_float(wv.y << 16), dot[2]);
    dot[3] = fmaf(xv.w, __uint_as_float(wv.y & 0xffff0000u), dot[3]);
  }
  const float sum = (dot[0] + dot[1]) + (dot[2] + dot[3]);
  return tanhf(sum * kScale);
}

/// One stage's tile: block `block` of the stage computes columns block * 16 .. + 15 of y from x. Without
/// COMPUTE it only copies its tile of x to y (a dependent stage that moves almost nothing).
template <bool COMPUTE>
__device__ void stage_tile(const float* x, float* y, const uint16_t* w_tile, float* x_shared, int block) {
  if constexpr (!COMPUTE) {
    const int t = threadIdx.x / kCols, column = block * kCols + threadIdx.x % kCols;
    y[t * kHidden + column] = __ldcg(x + t * kHidden + column);
    return;
  }
  // x [8, 576] into shared memory (float4 loads, all issued before any is used).
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* xs4 = reinterpret_cast<float4*>(x_shared);
  for (int i = threadIdx.x; i < kTokens * kHidden / 4; i += kThreads)
    xs4[i] = __ldcg(x4 + i);
  __pipeline_wait_prior(0); // this block's W tile
  __syncthreads();
  const int t = threadIdx.x / kCols, j = threadIdx.x % kCols;
  y[t * kHidden + block * kCols + j] = stage_output(x_shared + t * kHidden, w_tile + j * kSharedRow);
}

/// Starts the copy of a stage's W tile (16 rows of W) into shared memory.
__device__ void prefetch_tile(const uint16_t* w_stage, uint16_t* w_tile, int block) {
  const uint16_t* rows = w_stage + static_cast<size_t>(block) * kWeightTileElements;
  constexpr int kVectorsPerRow = kHidden / 8;
  for (int v = threadIdx.x; v < kCols * kVectorsPerRow; v += kThreads) {
    const int row = v / kVectorsPerRow, column = (v % kVectorsPerRow) * 8;
    __pipeline_memcpy_async(w_tile + row * kSharedRow + column, rows + row * kHidden + column, 16);
  }
  __pipeline_commit();
}

constexpr size_t kStageSmem = kSharedTileElements * sizeof(uint16_t) + kTokens * kHidden * sizeof(float);

/// Variant A: one kernel per stage, launched with PDL; W copied before the wait.
template <bool COMPUTE>
__global__ void __launch_bounds__(kThreads) StageKernel(const float* x, float* y, const uint16_t* w_stage) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* w_tile = reinterpret_cast<uint16_t*>(smem);
  float* x_shared = reinterpret_cast<float*>(smem + kSharedTileElements * sizeof(uint16_t));
  if (COMPUTE)
    prefetch_tile(w_stage, w_tile, blockIdx.x);
  smcgraph::detail::pdl_wait();
  smcgraph::detail::pdl_trigger();
  stage_tile<COMPUTE>(x, y, w_tile, x_shared, blockIdx.x);
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

/// Variant B: every stage in one kernel; stage s waits until all gridDim.x blocks arrived at counters[s - 1]
/// (the first kWorkingBlocks blocks compute, the others only take part in the barriers). W of stage s + 1 is
/// copied (into the other buffer) before the wait for stage s.
template <bool COMPUTE>
__global__ void __launch_bounds__(kThreads)
    PersistentKernel(float* buffer0, float* buffer1, const uint16_t* w, unsigned* counters) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* w_tiles[2] = {reinterpret_cast<uint16_t*>(smem),
                          reinterpret_cast<uint16_t*>(smem) + kSharedTileElements};
  float* x_shared = reinterpret_cast<float*>(smem + 2 * kSharedTileElements * sizeof(uint16_t));
  const bool working = blockIdx.x < kWorkingBlocks;
  if (COMPUTE && working)
    prefetch_tile(w, w_tiles[0], blockIdx.x);
  for (int s = 0; s < kStages; ++s) {
    if (s > 0) { // wait for stage s - 1
      if (threadIdx.x == 0)
        while (load_acquire(counters + s - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    if (working) {
      const float* x = s % 2 == 0 ? buffer0 : buffer1;
      float* y = s % 2 == 0 ? buffer1 : buffer0;
      stage_tile<COMPUTE>(x, y, w_tiles[s % 2], x_shared, blockIdx.x);
      if (COMPUTE && s + 1 < kStages)
        prefetch_tile(w + static_cast<size_t>(s + 1) * kHidden * kHidden, w_tiles[(s + 1) % 2], blockIdx.x);
    }
    __syncthreads(); // the block's stores are done
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(counters + s, 1u);
    }
  }
}

constexpr size_t kPersistentSmem =
    2 * kSharedTileElements * sizeof(uint16_t) + kTokens * kHidden * sizeof(float);

template <bool COMPUTE>
void launch_persistent(int blocks, float* b0, float* b1, const uint16_t* w, unsigned* counters,
                       cudaStream_t stream) {
  SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(counters, 0, kStages * sizeof(unsigned), stream));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kPersistentSmem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative; // every block resident at once (the barriers need it)
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  SMCGRAPH_CUDA_CHECK(cudaLaunchKernelEx(&config, PersistentKernel<COMPUTE>, b0, b1, w, counters));
}

template <bool COMPUTE> void launch_chain(float* b0, float* b1, const uint16_t* w, cudaStream_t stream) {
  for (int s = 0; s < kStages; ++s)
    smcgraph::detail::launch_pdl(StageKernel<COMPUTE>, dim3(kWorkingBlocks), dim3(kThreads), kStageSmem,
                                 stream, s % 2 == 0 ? b0 : b1, s % 2 == 0 ? b1 : b0,
                                 w + static_cast<size_t>(s) * kHidden * kHidden);
}

/// Variant C: the stages in one cluster of CTAS CTAs (module comment). Thread (t, j) of CTA r computes y[t, r
/// * kColsPer + j] with stage_tile's arithmetic (the same bits). COMPUTE = false: the stage copies x's
/// columns (the gather and the barrier alone).
template <int CTAS> constexpr int kClusterCols = kHidden / CTAS;
/// Ring slots (a stage's W rows each): 4 for 16 CTAs, 2 for 8 (their rows are twice as many).
template <int CTAS> constexpr int kClusterRing = CTAS >= 16 ? 4 : 2;
template <int CTAS> constexpr int kClusterThreads = kTokens* kClusterCols<CTAS>;
template <int CTAS> constexpr size_t kClusterSlotBytes = kClusterCols<CTAS>* kSharedRow * sizeof(uint16_t);
template <int CTAS>
constexpr size_t kClusterSmem = kClusterRing<CTAS>* kClusterSlotBytes<CTAS> +
                                kTokens* kHidden * sizeof(float) +
                                2 * kTokens* kClusterCols<CTAS> * sizeof(float);

/// Thread 0: stage s's W rows of this CTA into ring slot s % kClusterRing<CTAS> (one bulk copy a row, to
/// padded rows).
template <int CTAS>
__device__ void cluster_issue_stage(const uint16_t* w, uint16_t* ring, uint64_t* full, int s, int rank) {
  constexpr int kCols = kClusterCols<CTAS>;
  const int slot = s % kClusterRing<CTAS>;
  constexpr uint32_t kRowBytes = kHidden * sizeof(uint16_t);
  namespace ptx = cuda::ptx;
  ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[slot],
                                 kCols * kRowBytes);
  const uint16_t* rows = w + (static_cast<size_t>(s) * kHidden + static_cast<size_t>(rank) * kCols) * kHidden;
  uint16_t* tile = ring + static_cast<size_t>(slot) * kCols * kSharedRow;
  for (int row = 0; row < kCols; ++row)
    ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, tile + row * kSharedRow,
                       rows + static_cast<size_t>(row) * kHidden, kRowBytes, &full[slot]);
}

template <int CTAS, bool COMPUTE>
__global__ void __launch_bounds__(kClusterThreads<CTAS>)
    ClusterKernel(const float* x0, float* out, const uint16_t* w) {
  constexpr int kCols = kClusterCols<CTAS>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kClusterRing<CTAS>];
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem);
  float* x_shared = reinterpret_cast<float*>(smem + kClusterRing<CTAS> * kClusterSlotBytes<CTAS>);
  float* slices = x_shared + kTokens * kHidden; // [2][kTokens][kCols]: this CTA's y, by stage parity
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  if (COMPUTE && threadIdx.x == 0) {
    for (int i = 0; i < kClusterRing<CTAS>; ++i)
      cuda::ptx::mbarrier_init(&full[i], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    for (int s = 0; s < kClusterRing<CTAS> && s < kStages; ++s)
      cluster_issue_stage<CTAS>(w, ring, full, s, rank);
  }
  const int t = threadIdx.x / kCols, j = threadIdx.x % kCols, column = rank * kCols + j;
  for (int s = 0; s < kStages; ++s) {
    // x of this stage: x0 from global memory, then the peers' slices of the stage before (DSMEM).
    if (s == 0) {
      for (int i = threadIdx.x; i < kTokens * kHidden; i += kClusterThreads<CTAS>)
        x_shared[i] = x0[i];
    } else {
      for (int i = threadIdx.x; i < kTokens * kHidden; i += kClusterThreads<CTAS>) {
        const int token = i / kHidden, c = i % kHidden;
        const float* peer = cluster.map_shared_rank(slices, static_cast<unsigned>(c / kCols));
        x_shared[i] = peer[((s - 1) % 2) * kTokens * kCols + token * kCols + c % kCols];
      }
    }
    __syncthreads();
    float value;
    if constexpr (COMPUTE) {
      const int slot = s % kClusterRing<CTAS>;
      const uint32_t parity = (s / kClusterRing<CTAS>) % 2;
      while (!cuda::ptx::mbarrier_try_wait_parity(&full[slot], parity)) {
      }
      // stage_tile's arithmetic for output (t, column).
      value = stage_output(x_shared + t * kHidden,
                           ring + static_cast<size_t>(slot) * kCols * kSharedRow + j * kSharedRow);
    } else {
      value = x_shared[t * kHidden + column];
    }
    slices[(s % 2) * kTokens * kCols + t * kCols + j] = value;
    if (s == kStages - 1)
      out[t * kHidden + column] = value;
    __syncthreads(); // the slot and x_shared are read
    if (COMPUTE && threadIdx.x == 0 && s + kClusterRing<CTAS> < kStages)
      cluster_issue_stage<CTAS>(w, ring, full, s + kClusterRing<CTAS>, rank);
    // This stage's slices are written everywhere; the peers' reads of the last ones are done (they gathered
    // before arriving), so the next stage may overwrite the other half. The last barrier also keeps every
    // CTA's shared memory alive until its peers have gathered from it.
    smcgraph::detail::cluster_barrier();
  }
}

template <int CTAS, bool COMPUTE> cudaLaunchConfig_t cluster_config(cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(CTAS);
  config.blockDim = dim3(kClusterThreads<CTAS>);
  config.dynamicSmemBytes = kClusterSmem<CTAS>;
  *attribute = smcgraph::detail::cluster_attribute(CTAS);
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

/// Whether a cluster of CTAS of ClusterKernel can be placed on this device (after the attributes are set).
template <int CTAS> bool cluster_schedulable() {
  for (const void* kernel : {reinterpret_cast<const void*>(ClusterKernel<CTAS, true>),
                             reinterpret_cast<const void*>(ClusterKernel<CTAS, false>)}) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kClusterSmem<CTAS>)) != cudaSuccess ||
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
  }
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config = cluster_config<CTAS, true>(&attribute);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, ClusterKernel<CTAS, true>, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return clusters >= 1;
}

template <int CTAS, bool COMPUTE>
void launch_cluster(const float* x0, float* out, const uint16_t* w, cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config = cluster_config<CTAS, COMPUTE>(&attribute);
  config.stream = stream;
  SMCGRAPH_CUDA_CHECK(cudaLaunchKernelEx(&config, ClusterKernel<CTAS, COMPUTE>, x0, out, w));
}

std::vector<float> reference(std::vector<float> x, const std::vector<uint16_t>& w) {
  std::vector<float> y(x.size());
  for (int s = 0; s < kStages; ++s) {
    for (int t = 0; t < kTokens; ++t)
      for (int c = 0; c < kHidden; ++c) {
        double dot = 0.0;
        for (int k = 0; k < kHidden; ++k)
          dot += static_cast<double>(x[t * kHidden + k]) *
                 bench::bf16_to_float(w[(static_cast<size_t>(s) * kHidden + c) * kHidden + k]);
        y[t * kHidden + c] = static_cast<float>(std::tanh(dot * kScale));
      }
    std::swap(x, y);
  }
  return x;
}

} // namespace

int main() {
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::printf("stage_chain_bench: no CUDA device (skipped)\n");
      return 77;
    }
    Stream stream;
    for (const void* kernel : {reinterpret_cast<const void*>(StageKernel<true>),
                               reinterpret_cast<const void*>(StageKernel<false>)})
      SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kStageSmem)));
    for (const void* kernel : {reinterpret_cast<const void*>(PersistentKernel<true>),
                               reinterpret_cast<const void*>(PersistentKernel<false>)})
      SMCGRAPH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kPersistentSmem)));
    const int sms = smcgraph::current_device_info().multiprocessors;
    int per_sm = 0;
    SMCGRAPH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PersistentKernel<true>,
                                                                      kThreads, kPersistentSmem));
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> x0(static_cast<size_t>(kTokens) * kHidden);
    for (float& v : x0)
      v = uniform(rng);
    std::vector<uint16_t> w(static_cast<size_t>(kStages) * kHidden * kHidden);
    for (uint16_t& v : w)
      v = bench::float_to_bf16(uniform(rng));
    DeviceBuffer<float> b0(x0.size()), b1(x0.size());
    DeviceBuffer<uint16_t> d_w(w.size());
    DeviceBuffer<unsigned> counters(kStages);
    d_w.copy_from_host(w.data(), w.size(), stream);
    const std::vector<float> expected = reference(x0, w);

    // kStages is even: the last stage writes buffer 0.
    auto run_once = [&](const std::function<void(cudaStream_t)>& work) {
      b0.copy_from_host(x0.data(), x0.size(), stream);
      work(stream);
      std::vector<float> out(x0.size());
      b0.copy_to_host(out.data(), out.size(), stream);
      stream.synchronize();
      return out;
    };
    struct Variant {
      const char* name;
      std::function<void(cudaStream_t)> work;
    };
    // The grid barrier needs every block resident: one block per SM, and at least one must fit.
    smcgraph::require(per_sm >= 1, "stage_chain_bench", "persistent blocks per SM", per_sm,
                      "must be >= 1 (the grid barrier needs every block resident)");
    const int grid_all = sms;
    float* p0 = b0.data();
    float* p1 = b1.data();
    const uint16_t* pw = d_w.data();
    unsigned* pc = counters.data();
    std::vector<Variant> variants = {
        {"PDL chain: 150 kernels of 36 blocks", [=](cudaStream_t s) { launch_chain<true>(p0, p1, pw, s); }},
        {"persistent, 36 blocks, a barrier per stage",
         [=](cudaStream_t s) { launch_persistent<true>(kWorkingBlocks, p0, p1, pw, pc, s); }},
        {"persistent, one block per SM (36 compute), a barrier per stage",
         [=](cudaStream_t s) { launch_persistent<true>(grid_all, p0, p1, pw, pc, s); }},
    };
    // The same chains with stages that only copy their tile (no weights, no dot products).
    std::vector<Variant> copies = {
        {"PDL chain, copy stages", [=](cudaStream_t s) { launch_chain<false>(p0, p1, pw, s); }},
        {"persistent, 36 blocks, copy stages",
         [=](cudaStream_t s) { launch_persistent<false>(kWorkingBlocks, p0, p1, pw, pc, s); }},
        {"persistent, one block per SM, copy stages",
         [=](cudaStream_t s) { launch_persistent<false>(grid_all, p0, p1, pw, pc, s); }},
    };
    // One cluster (module comment): 16 CTAs where the device places such a cluster, else 8, else none.
    if (cluster_schedulable<16>()) {
      variants.push_back({"one cluster of 16 CTAs, weights streamed ahead, a cluster barrier per stage",
                          [=](cudaStream_t s) { launch_cluster<16, true>(p0, p0, pw, s); }});
      copies.push_back({"one cluster of 16 CTAs, copy stages (gather + barrier)",
                        [=](cudaStream_t s) { launch_cluster<16, false>(p0, p0, pw, s); }});
    } else if (cluster_schedulable<8>()) {
      variants.push_back({"one cluster of 8 CTAs, weights streamed ahead, a cluster barrier per stage",
                          [=](cudaStream_t s) { launch_cluster<8, true>(p0, p0, pw, s); }});
      copies.push_back({"one cluster of 8 CTAs, copy stages (gather + barrier)",
                        [=](cudaStream_t s) { launch_cluster<8, false>(p0, p0, pw, s); }});
    } else {
      std::printf("stage_chain_bench: no cluster of 16 or 8 CTAs can be placed here; the cluster variant is "
                  "skipped\n");
    }
    std::vector<float> first;
    bool ok = true;
    for (const Variant& v : variants) {
      const std::vector<float> got = run_once(v.work);
      double worst = 0.0, magnitude = 0.0;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, static_cast<double>(std::abs(got[i] - expected[i])));
        magnitude += std::abs(expected[i]) / got.size();
      }
      const bool same =
          first.empty() || std::memcmp(got.data(), first.data(), got.size() * sizeof(float)) == 0;
      if (first.empty())
        first = got;
      std::printf(
          "validation %-62s max |delta| vs host %.2e (mean |y| %.3f), bit-identical to the first: %s\n",
          v.name, worst, magnitude, same ? "yes" : "NO");
      ok = ok && worst <= 1e-3 && same;
    }
    for (const Variant& v : copies) { // an even number of copies returns x0
      const std::vector<float> got = run_once(v.work);
      const bool same = std::memcmp(got.data(), x0.data(), got.size() * sizeof(float)) == 0;
      std::printf("validation %-62s output == input: %s\n", v.name, same ? "yes" : "NO");
      ok = ok && same;
    }
    variants.insert(variants.end(), copies.begin(), copies.end());
    if (!ok) {
      std::printf("stage_chain_bench: validation FAILED\n");
      return 1;
    }
    const double node_floor = bench::node_floor_us(stream);
    std::printf("\n%s, %d SMs; graph node floor %.3f us; %d stages of [%d x %d] x [%d x %d]^T\n",
                bench::device_name().c_str(), sms, node_floor, kStages, kTokens, kHidden, kHidden, kHidden);
    for (const Variant& v : variants) {
      const bench::Timing timing = bench::time_graph(v.work, stream, 1, 30, 5);
      std::printf("%-66s %8.1f us a chain, %.2f us a stage (min %.2f)\n", v.name, timing.median_us,
                  timing.median_us / kStages, timing.min_us / kStages);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stage_chain_bench: %s\n", e.what());
    return 1;
  }
}

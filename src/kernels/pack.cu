// verify_and_pack() and pack_accepted(): the fused verify-and-pack of the speculative cycle (DESIGN.md §3).
//
// One launch, a static grid of tiles x splits CTAs. A tile is a run of rows (<= 32); each of its `splits`
// CTAs computes the tile's accepted counts itself (a greedy ballot scan of <= 256 draft positions, or a
// read of given counts), scans them in-tile, and copies its 1/splits share of the tile's packed bytes.
// Tiles are chained by a decoupled look-back (Merrill & Garland 2016): split 0 of each tile publishes the
// tile's count, then its inclusive prefix; a CTA needs its tile's exclusive prefix only to store, so the
// first batch of loads is in flight while it looks back. One warp a CTA looks back and hands the offset to
// the others through shared memory (SMCGRAPH_PACK_LOOKBACK=warps: every warp looks back itself, as before):
// with 528 CTAs x 8 warps polling 16 status words, b 32, gamma 128, kv 2048 fp16 took 15.37 us at acceptance
// 0.9 against 12.09-12.15 with one warp a CTA, 9.21 against 6.73-6.84 at 0.3 (verify_pack_bench, NVIDIA H200;
// small launches within 0.1 us). A tile's packed rows are contiguous in the output, so a CTA's share maps to
// one contiguous destination range.
//
// Grid sizing: a tile covers <= 256 draft positions (one per thread), the splits give every CTA >= 16 KiB
// (one batch of 256 threads x 4 x 16-byte copies) and, for big payloads, about total / (4 x SMs), so the
// copy spreads over the whole GPU whatever the batch size. Where that share is above 16 KiB (16-byte copies),
// the copy loop takes 8 vectors a thread a batch instead of 4 (wide_copy), so a share of up to 32 KiB is one
// batch with all its loads in flight: b 32, gamma 128, kv 2048 fp16 went from 15.66-15.84 to 15.17-15.27 us
// at acceptance 0.9 and from 11.13-11.23 to 9.07-9.33 at 0.3 (verify_pack_bench, NVIDIA H200).
//
// Source order (wide launches: SMCGRAPH_PACK_ORDER=packed turns it off) and preload (small single-tile
// launches with PayloadView::ready_before_wait: pack_preloads): each CTA copies its share of its tile's
// payload as stored, every position accepted or not, and loads the first batch of it before the verify
// (before the PDL wait when the payload is marked ready), so that batch's memory latency hides under the
// verify and the scan (and the previous kernel) instead of following them; once the counts are scanned it
// stores the accepted positions where the packed layout puts them, and later batches load only accepted ones.
// The bytes are the same; the first batch also reads its rejected positions.
//
// Greedy launches of at most kLaneScanMaxSteps draft steps (a speculative cycle's verify) verify a lane a
// row instead, in every warp at once, and each warp scans the counts into its own copy of the prefix: no
// shared atomics and no CTA barrier before a warp stores. b 32, gamma 8, kv 128 fp16, payload preloaded went
// from 3.14-3.15 to 2.70-2.71 us a launch in a graph, gamma 8, kv 2048 from 3.22-3.23 to 2.76-2.77
// (verify_pack_bench, NVIDIA H200). Chained launches (more than 32 rows) take it too: every thread reads the
// launch's generation itself (no barrier publishes a shared copy before its first use) and warp 0 of the
// tile's leader publishes the tile's count; b 256, gamma 8, kv 1024 went from 6.37 to 5.82 us, b 32 gamma 8
// kv 128 2.71 -> 2.68, b 4 2.39-2.40 -> 2.46 (the shared kernel's code; same call, three rounds). Launches of
// more draft steps, or with given counts, keep the ballot scan and one prefix a CTA.
//
// Graph safety: tile statuses carry the launch's generation; the last CTA to finish (an exit counter)
// resets the counter and advances the generation, so a replay finds the workspace ready and stale statuses
// never match. A single-tile launch touches no workspace at all. Forward progress relies on CTAs being
// dispatched in blockIdx order, as CUB's single-pass scan does: a CTA only waits for lower-indexed ones.
#include <algorithm>
#include <cstdint>

#include <cub/warp/warp_reduce.cuh>
#include <cub/warp/warp_scan.cuh>
#include <cuda/atomic>

#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "smcgraph/verify.hpp"
#include "kernels/pdl.cuh"
#include "kernels/launch_checks.hpp"
#include "kernels/verify_device.cuh"
#include "runtime/env.hpp"

namespace smcgraph {
using detail::ceil_div;
namespace {

// ---------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------

constexpr int kPackThreads = 256;
constexpr int kPackWarps = kPackThreads / 32;
constexpr int kMaxRowsPerTile = 32; // the in-tile scan is one warp
constexpr int kTilePositions = 256; // draft positions a tile verifies: one per thread
constexpr int kVerifyBatch = 4;     // (row, window) items per warp whose loads are issued together
/// Greedy launches of at most this many draft steps verify a lane a row in every warp (lane_scan).
constexpr int kLaneScanMaxSteps = 8;
constexpr int kCopyUnroll = 4; // vectors in flight per thread (the preload, and launches of <= 16 KiB a CTA)
constexpr int kWideCopyUnroll = 8; // vectors in flight per thread where a CTA's share is above 16 KiB
constexpr int kCtasPerSm = 4;      // CTAs per SM the copy aims at for big payloads
constexpr int64_t kMinChunkBytes = int64_t{kPackThreads} * kCopyUnroll * 16;
static_assert(kMaxRowsPerTile == 32, "the in-tile scan is one full warp");
static_assert(kTilePositions % kPackThreads == 0, "a tile's positions map onto the CTA's threads");

// Workspace words: the exit counter, the generation, then one status word per tile:
// generation << 32 | flag << 30 | value (value = the tile's count or inclusive prefix, < 2^30).
constexpr int kExitWord = 0;
constexpr int kGenerationWord = 1;
constexpr int kStatusWords = 2;
constexpr int kValueBits = 30;
constexpr uint32_t kValueMask = (1u << kValueBits) - 1u;
constexpr uint32_t kTileAggregate = 1;
constexpr uint32_t kTileInclusive = 2;
constexpr int64_t kMaxPackedRows = kValueMask;

using Word = unsigned long long;
using DeviceAtomicWord = cuda::atomic_ref<Word, cuda::thread_scope_device>;

template <int BYTES> struct VectorOf;
template <> struct VectorOf<16> { using type = uint4; };
template <> struct VectorOf<8> { using type = uint2; };
template <> struct VectorOf<4> { using type = uint32_t; };
template <> struct VectorOf<2> { using type = uint16_t; };

struct PackArgs {
  TokenVerifyInputs verify{};            ///< greedy mode: what to verify
  VerifyOutputs verdict{};               ///< greedy mode: where the verdict goes
  const int32_t* accepted_in = nullptr;  ///< counts mode
  const int32_t* next_in = nullptr;      ///< counts mode, packed tokens with include_next
  const int32_t* draft_tokens = nullptr; ///< packed tokens
  int64_t draft_row_stride = 0;
  int rows = 0, draft_steps = 0, include_next = 0;
  const char* payload = nullptr;
  int64_t payload_row_stride_bytes = 0, position_bytes = 0;
  PackOutputs out{};
  int rows_per_tile = 0, tiles = 0, splits = 0;
  int preload = 0; ///< pack_preloads: this CTA's share of the stored payload is loaded before the PDL wait
  Word* workspace = nullptr;
  int cta_lookback = 0; ///< one warp a CTA looks back and shares the offset (else every warp does its own)
};

__device__ __forceinline__ void publish(Word* status, uint32_t generation, uint32_t flag, uint32_t value) {
  DeviceAtomicWord(*status).store((Word{generation} << 32) | (Word{flag} << kValueBits) | value,
                                  cuda::memory_order_relaxed);
}

/// The exclusive prefix of `tile`: the calling warp reads the statuses of the 32 preceding tiles at a time,
/// waits until each has at least its count, and sums back to the nearest inclusive prefix.
__device__ uint32_t look_back(Word* statuses, int tile, uint32_t generation,
                              typename cub::WarpReduce<uint32_t>::TempStorage& storage) {
  const int lane = threadIdx.x % 32;
  uint32_t exclusive = 0;
  for (int window_end = tile;; window_end -= 32) {
    const int predecessor = window_end - 1 - lane;
    uint32_t flag = kTileInclusive, value = 0; // before tile 0: an inclusive 0
    if (predecessor >= 0) {
      DeviceAtomicWord status(statuses[predecessor]);
      Word word = status.load(cuda::memory_order_relaxed);
      while ((word >> 32) != generation || ((word >> kValueBits) & 3u) == 0) {
        __nanosleep(32);
        word = status.load(cuda::memory_order_relaxed);
      }
      flag = static_cast<uint32_t>(word >> kValueBits) & 3u;
      value = static_cast<uint32_t>(word) & kValueMask;
    }
    const unsigned inclusive = __ballot_sync(0xffffffffu, flag == kTileInclusive);
    const int stop = inclusive ? __ffs(inclusive) - 1 : 31; // lane 0 is the nearest predecessor
    const uint32_t sum = cub::WarpReduce<uint32_t>(storage).Sum(lane <= stop ? value : 0u);
    exclusive += __shfl_sync(0xffffffffu, sum, 0);
    __syncwarp();
    if (inclusive)
      return exclusive;
  }
}

/// The tile row holding packed unit `unit`: the last r with prefix[r] * units_per_position <= unit.
__device__ __forceinline__ int row_of(const int32_t* prefix, int tile_rows, int64_t unit,
                                      int64_t units_per_position) {
  int low = 0, high = tile_rows - 1;
  while (low < high) {
    const int middle = (low + high + 1) / 2;
    if (int64_t{prefix[middle]} * units_per_position <= unit) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

/// Stored unit `unit` of a tile whose rows hold `row_units` units each (its positions in order, accepted or
/// not): its row, its index inside the row, and so its source address and, once the tile's counts are
/// scanned, whether it is packed and where (packed unit prefix[row] x units_per_position + in_row).
struct StoredUnit {
  int row, in_row;
  __device__ __forceinline__ StoredUnit(int unit, int row_units)
      : row(unit / row_units), in_row(unit - unit / row_units * row_units) {}
  __device__ __forceinline__ const char* source(const char* tile_payload, int64_t row_stride_bytes,
                                                int vector_bytes) const {
    return tile_payload + row * row_stride_bytes + int64_t{in_row} * vector_bytes;
  }
  __device__ __forceinline__ bool packed(const int32_t* prefix, int units_per_position) const {
    return in_row < (prefix[row + 1] - prefix[row]) * units_per_position;
  }
  /// < the tile's stored units, so 32-bit (the launcher keeps those below 2^31)
  __device__ __forceinline__ int packed_unit(const int32_t* prefix, int units_per_position) const {
    return prefix[row] * units_per_position + in_row;
  }
};

template <int VECTOR_BYTES, bool COUNTS_GIVEN, int UNROLL, bool SOURCE_ORDER = false>
__global__ void __launch_bounds__(kPackThreads, UNROLL == kWideCopyUnroll ? kCtasPerSm : 0)
    VerifyPackKernel(const PackArgs args) {
  using Vector = typename VectorOf<VECTOR_BYTES>::type;
  using WarpScan = cub::WarpScan<int32_t>;
  using WarpReduce = cub::WarpReduce<uint32_t>;
  __shared__ uint32_t first_rejected[kMaxRowsPerTile]; // per tile row: position << 8 | reason
  __shared__ int32_t prefix[kMaxRowsPerTile + 1]; // in-tile exclusive prefix of packed counts; [32] = tile's
  __shared__ int32_t warp_prefix[kPackWarps][kMaxRowsPerTile + 1]; // lane_scan: each warp's own copy
  __shared__ typename WarpScan::TempStorage scan_storage[kPackWarps];
  __shared__ typename WarpReduce::TempStorage reduce_storage[kPackWarps];
  __shared__ uint32_t generation;

  const int tile = blockIdx.x / args.splits;
  const int split = blockIdx.x - tile * args.splits;
  const bool leader = split == 0;
  const bool chained = args.tiles > 1;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row0 = tile * args.rows_per_tile;
  const int tile_rows = min(args.rows_per_tile, args.rows - row0);
  Word* const statuses = args.workspace + kStatusWords;
  const char* const tile_payload = args.payload + row0 * args.payload_row_stride_bytes;
  const int64_t units_per_position = args.position_bytes / VECTOR_BYTES;
  // Greedy launches of at most kLaneScanMaxSteps draft steps (one window a row) verify the tile in every warp
  // at once, a lane a row (1'), and each warp scans the counts into its own copy of the prefix, so no warp
  // waits for another (no shared atomics, no barrier) before its stores or its look-back; else one prefix
  // for the CTA.
  const bool lane_scan = !COUNTS_GIVEN && args.draft_steps <= kLaneScanMaxSteps;
  int32_t* const tile_prefix = lane_scan ? warp_prefix[warp] : prefix;

  // 0. The CTA's 1/splits of the tile's stored units (row r's positions in order, accepted or not; rows in
  // order), which the copy goes over in source order: SOURCE_ORDER (wide launches) and preload (small ones).
  // Both load their first batch before the PDL wait (the caller vouched that the payload was complete before
  // the previous kernel began: PayloadView::ready_before_wait), so its memory latency hides under that
  // kernel's tail, the verify and the scan; the accepted units are stored once the counts are scanned.
  // 32-bit: the launcher keeps a tile's stored units below 2^31 (a preloaded payload is at most
  // multiprocessors x 16 KiB).
  const bool by_source = SOURCE_ORDER || (UNROLL == kCopyUnroll && args.preload); // wide: never preloads
  const int row_units =
      by_source ? (args.draft_steps + args.include_next) * static_cast<int>(units_per_position) : 0;
  const int source_units = tile_rows * row_units;
  const int source_begin = static_cast<int>(int64_t{source_units} * split / args.splits);
  const int source_end = static_cast<int>(int64_t{source_units} * (split + 1) / args.splits);
  const auto load_stored = [&](int first, Vector(&data)[UNROLL], bool packed_only) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int unit = first + u * kPackThreads + static_cast<int>(threadIdx.x);
      if (unit < source_end) {
        const StoredUnit stored(unit, row_units);
        if (!packed_only || stored.packed(tile_prefix, static_cast<int>(units_per_position)))
          data[u] = *reinterpret_cast<const Vector*>(
              stored.source(tile_payload, args.payload_row_stride_bytes, VECTOR_BYTES));
      }
    }
  };
  const auto store_packed = [&](int first, const Vector(&data)[UNROLL], char* destination) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int unit = first + u * kPackThreads + static_cast<int>(threadIdx.x);
      if (unit < source_end) {
        const StoredUnit stored(unit, row_units);
        if (stored.packed(tile_prefix, static_cast<int>(units_per_position)))
          *reinterpret_cast<Vector*>(
              destination + int64_t{stored.packed_unit(tile_prefix, static_cast<int>(units_per_position))} *
                                VECTOR_BYTES) = data[u];
      }
    }
  };
  Vector preloaded[UNROLL];
  if (by_source) // source order and preload: the payload is ready before the wait (the launcher checks)
    load_stored(source_begin, preloaded, false);
  detail::pdl_enter(); // PDL: launched while its predecessor finishes (kernels/pdl.cuh)

  // The launch's generation: thread 0 shares it through shared memory (the barriers after the verify publish
  // it); lane_scan, where no barrier comes before the first use, has every thread read it itself.
  uint32_t lane_generation = 0;
  if (chained && (lane_scan || threadIdx.x == 0)) {
    const auto word = static_cast<uint32_t>(
        DeviceAtomicWord(args.workspace[kGenerationWord]).load(cuda::memory_order_relaxed));
    lane_generation = word;
    if (threadIdx.x == 0)
      generation = word;
  }
  const auto launch_generation = [&] { return lane_scan ? lane_generation : generation; };

  // 1'. lane_scan: lane r of every warp finds row r's first rejection itself (its positions in order, the
  // first rejecting one wins, with the reason the ballot scan below would give).
  uint32_t lane_first = device::kNoRejection;
  if (lane_scan && lane < tile_rows) {
    const TokenVerifyInputs& in = args.verify;
    const int32_t* const draft = in.draft_tokens + (row0 + lane) * in.draft_row_stride;
    const int32_t* const target = in.target_tokens + (row0 + lane) * in.target_row_stride;
    int32_t d[kLaneScanMaxSteps], t[kLaneScanMaxSteps];
#pragma unroll
    for (int j = 0; j < kLaneScanMaxSteps; ++j) {
      d[j] = j < in.draft_steps ? draft[j] : 0;
      t[j] = j < in.draft_steps ? target[j] : 0;
    }
    // The range check and the rejection's encoding are spelled out here and below rather than taken from
    // verify_device.cuh (out_of_range, first_rejection's encoding): through those helpers ptxas kept the
    // flags as 16-bit values and every small launch took 0.1 us longer (verify_pack_bench, NVIDIA H200, three
    // rounds: b 32, gamma 8, kv 128 2.71-2.72 -> 2.84 us; b 4 2.37-2.39 -> 2.48).
#pragma unroll
    for (int j = kLaneScanMaxSteps - 1; j >= 0; --j) { // backwards: the last one found is the first
      const bool bad = d[j] < 0 || d[j] >= in.vocab;
      if (j < in.draft_steps && (bad || d[j] != t[j]))
        lane_first = (static_cast<uint32_t>(j) << 8) | (bad ? (kFlagTokenOutOfRange & 0xffu) : 0u);
    }
  }

  // 1. The tile's first rejections: one ballot per (row, 32-position window), loads batched per warp.
  if (!COUNTS_GIVEN && !lane_scan) { // CTA-uniform
    const TokenVerifyInputs& in = args.verify;
    if (threadIdx.x < kMaxRowsPerTile)
      first_rejected[threadIdx.x] = device::kNoRejection;
    __syncthreads();
    const int windows = (in.draft_steps + 31) / 32;
    const int items = tile_rows * windows;
    // Source order holds its first copy batch in registers meanwhile: fewer token loads at a time there.
    constexpr int kItems = SOURCE_ORDER ? 1 : kVerifyBatch;
    for (int batch = warp; batch < items; batch += kPackWarps * kItems) { // warp-uniform
      int32_t draft[kItems], target[kItems];
#pragma unroll
      for (int b = 0; b < kItems; ++b) {
        const int item = batch + b * kPackWarps;
        const int r = item / windows;
        const int j = (item - r * windows) * 32 + lane;
        const bool inside = item < items && j < in.draft_steps;
        draft[b] = inside ? in.draft_tokens[(row0 + r) * in.draft_row_stride + j] : 0;
        target[b] = inside ? in.target_tokens[(row0 + r) * in.target_row_stride + j] : 0;
      }
#pragma unroll
      for (int b = 0; b < kItems; ++b) {
        const int item = batch + b * kPackWarps;
        if (item >= items)
          break; // warp-uniform: one ballot per window
        const int r = item / windows;
        const int base = (item - r * windows) * 32;
        const bool inside = base + lane < in.draft_steps;
        const bool bad = inside && (draft[b] < 0 || draft[b] >= in.vocab);
        const bool reject = inside && (bad || draft[b] != target[b]);
        const uint32_t found = device::first_rejection(reject, bad ? kFlagTokenOutOfRange : 0u, base);
        if (lane == 0 && found != device::kNoRejection)
          atomicMin(&first_rejected[r], found);
      }
    }
    __syncthreads();
  }

  // 2. In-tile exclusive scan of the packed counts (k + include_next); split 0 publishes the tile's count.
  // lane_scan: every warp scans into its own prefix.
  if (lane_scan || warp == 0) { // warp-uniform
    int32_t count = 0;
    if (lane < tile_rows) {
      int accepted;
      if constexpr (COUNTS_GIVEN) {
        accepted = min(max(args.accepted_in[row0 + lane], 0), args.draft_steps);
      } else {
        const uint32_t first = lane_scan ? lane_first : first_rejected[lane];
        accepted = first == device::kNoRejection ? args.draft_steps : static_cast<int>(first >> 8);
      }
      count = accepted + args.include_next;
    }
    int32_t exclusive, aggregate;
    WarpScan(scan_storage[warp]).ExclusiveSum(count, exclusive, aggregate);
    tile_prefix[lane] = exclusive;
    if (lane == 0) {
      tile_prefix[kMaxRowsPerTile] = aggregate;
      if (chained && leader && warp == 0) // lane_scan: every warp scans; warp 0 publishes
        publish(statuses + tile, launch_generation(), tile == 0 ? kTileInclusive : kTileAggregate,
                static_cast<uint32_t>(aggregate));
    }
  }
  if (lane_scan) // CTA-uniform
    __syncwarp();
  else
    __syncthreads();

  // 3. This CTA's share of the tile's packed units: loads, (first batch only) the look-back, stores.
  const int32_t tile_count = tile_prefix[kMaxRowsPerTile];
  const int64_t tile_units = by_source ? 0 : int64_t{tile_count} * units_per_position; // by source: 3'
  const int64_t begin = tile_units * split / args.splits;
  const int64_t end = tile_units * (split + 1) / args.splits;
  bool have_offset = !chained || tile == 0;
  uint32_t tile_offset = 0;
  __shared__ uint32_t shared_offset;
  const auto find_offset = [&] { // warp-collective; CTA-collective with cta_lookback
    if (have_offset)
      return;
    if (args.cta_lookback) {
      if (warp == 0) {
        const uint32_t offset = look_back(statuses, tile, launch_generation(), reduce_storage[0]);
        if (lane == 0)
          shared_offset = offset;
      }
      __syncthreads();
      tile_offset = shared_offset;
    } else {
      tile_offset = look_back(statuses, tile, launch_generation(), reduce_storage[warp]);
    }
    have_offset = true;
    if (leader && warp == 0 && lane == 0)
      publish(statuses + tile, launch_generation(), kTileInclusive,
              tile_offset + static_cast<uint32_t>(tile_count));
  };
  for (int64_t batch = begin; batch < end; batch += kPackThreads * UNROLL) { // CTA-uniform
    Vector data[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t unit = batch + u * kPackThreads + threadIdx.x;
      if (unit < end) {
        const int r = row_of(tile_prefix, tile_rows, unit, units_per_position);
        const int64_t in_row = unit - int64_t{tile_prefix[r]} * units_per_position;
        data[u] = *reinterpret_cast<const Vector*>(tile_payload + r * args.payload_row_stride_bytes +
                                                   in_row * VECTOR_BYTES);
      }
    }
    find_offset(); // the loads above are in flight meanwhile
    char* const destination =
        static_cast<char*>(args.out.packed) + int64_t{tile_offset} * args.position_bytes;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t unit = batch + u * kPackThreads + threadIdx.x;
      if (unit < end)
        *reinterpret_cast<Vector*>(destination + unit * VECTOR_BYTES) = data[u];
    }
  }
  if (by_source) { // CTA-uniform
    // 3'. In source order: unit i of row r's stored positions is packed when i < row r's packed count x
    // units_per_position, at packed unit tile_prefix[r] x units_per_position + i of the tile. The first batch
    // was loaded before the verify; later ones (SOURCE_ORDER) load only the packed units.
    find_offset();
    char* const destination =
        static_cast<char*>(args.out.packed) + int64_t{tile_offset} * args.position_bytes;
    store_packed(source_begin, preloaded, destination);
    if constexpr (SOURCE_ORDER) {
      for (int batch = source_begin + kPackThreads * UNROLL; batch < source_end;
           batch += kPackThreads * UNROLL) { // CTA-uniform
        Vector data[UNROLL];
        load_stored(batch, data, true);
        store_packed(batch, data, destination);
      }
    }
  }
  if (leader)
    find_offset(); // split 0 publishes the inclusive prefix and writes offsets even with nothing to copy

  // 4. Split 0 writes the per-row outputs, the total and the packed tokens: warp 0 a row's outputs and its
  // next token (include_next), every thread the accepted draft tokens of positions (r, j) at the same time
  // (no barrier between the two: both need only the scanned prefix).
  if (leader) {
    if (warp == 0 && lane < tile_rows) {
      const int row = row0 + lane;
      const int accepted = tile_prefix[lane + 1] - tile_prefix[lane] - args.include_next;
      args.out.offsets[row] = static_cast<int32_t>(tile_offset) + tile_prefix[lane];
      int32_t next = kInvalidToken;
      if constexpr (!COUNTS_GIVEN) {
        const uint32_t first = lane_scan ? lane_first : first_rejected[lane];
        uint32_t flags = first == device::kNoRejection ? 0u : (first & 0xffu);
        next = args.verify.target_tokens[row * args.verify.target_row_stride + accepted];
        if (next < 0 || next >= args.verify.vocab) {
          flags |= kFlagTokenOutOfRange;
          next = kInvalidToken;
        }
        device::write_verdict(args.verdict, row, accepted, args.draft_steps, next, flags);
      } else if (args.next_in != nullptr) {
        next = args.next_in[row];
      }
      if (args.include_next && args.out.packed_tokens != nullptr)
        args.out.packed_tokens[tile_offset + tile_prefix[lane] + accepted] = next;
    }
    if (tile == args.tiles - 1 && threadIdx.x == 0)
      *args.out.total = static_cast<int32_t>(tile_offset) + tile_count;
    if (args.out.packed_tokens != nullptr) { // CTA-uniform
#pragma unroll 1
      for (int p = threadIdx.x; p < tile_rows * args.draft_steps; p += kPackThreads) {
        const int r = p / args.draft_steps, j = p - r * args.draft_steps;
        if (j < tile_prefix[r + 1] - tile_prefix[r] - args.include_next)
          args.out.packed_tokens[tile_offset + tile_prefix[r] + j] =
              args.draft_tokens[(row0 + r) * args.draft_row_stride + j];
      }
    }
  }

  // 5. The last CTA out leaves the workspace ready for the next launch.
  if (chained) {
    __syncthreads(); // every warp is done with the statuses
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(args.workspace + kExitWord, Word{1}) == gridDim.x - 1) {
        args.workspace[kExitWord] = 0;
        args.workspace[kGenerationWord] = static_cast<uint32_t>(generation + 1u);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------------------

/// Bytes of one tile's stored payload (its rows' positions, accepted or not): what the splits share.
int64_t stored_tile_bytes(const PackLaunchShape& shape, int rows, int positions, int64_t position_bytes) {
  return int64_t{std::min(rows, shape.rows_per_tile)} * positions * position_bytes;
}

PackLaunchShape shape_for(int rows, int draft_steps, int positions, int64_t position_bytes, bool counts_given,
                          int multiprocessors) {
  PackLaunchShape shape;
  shape.rows_per_tile =
      counts_given ? kMaxRowsPerTile : std::clamp(kTilePositions / draft_steps, 1, kMaxRowsPerTile);
  shape.tiles = static_cast<int>(ceil_div(rows, shape.rows_per_tile));
  const int64_t tile_bytes = stored_tile_bytes(shape, rows, positions, position_bytes);
  const int64_t total_bytes = int64_t{rows} * positions * position_bytes;
  // A/B switches for the copy's grid (SMCGRAPH_PACK_CTAS_PER_SM, SMCGRAPH_PACK_MIN_CHUNK_KIB): unset, the
  // constants above.
  static const int64_t ctas_per_sm =
      detail::env_integer("SMCGRAPH_PACK_CTAS_PER_SM", 1, 64, "must be 1 to 64 CTAs an SM")
          .value_or(kCtasPerSm);
  static const int64_t min_chunk_bytes =
      1024 * detail::env_integer("SMCGRAPH_PACK_MIN_CHUNK_KIB", 1, 1024, "must be 1 to 1024 KiB")
                 .value_or(kMinChunkBytes / 1024);
  const int64_t chunk_bytes =
      std::max(min_chunk_bytes, ceil_div(total_bytes, int64_t{multiprocessors} * ctas_per_sm));
  shape.splits = static_cast<int>(std::max<int64_t>(1, ceil_div(tile_bytes, chunk_bytes)));
  return shape;
}

/// Whether a launch of `shape` preloads (pack_preloads): one tile (no look-back), the whole payload fits
/// 16 KiB a CTA on one CTA an SM, and every CTA's share of the tile's stored units is one batch of the copy
/// loop. Chained launches do not: 32 rows x 128 positions of 256 bytes (16 tiles x 4 CTAs) went from 4.15 to
/// 4.38 us a launch at acceptance 0.3 on an H200 (4.18 -> 4.38 on an H100), while single-tile launches
/// gained 0.3-1.4 us (verify_pack_bench).
bool preloads(const PackLaunchShape& shape, int rows, int positions, int64_t position_bytes, int vector_bytes,
              int multiprocessors) {
  const int64_t total_bytes = int64_t{rows} * positions * position_bytes;
  const int64_t tile_units = stored_tile_bytes(shape, rows, positions, position_bytes) / vector_bytes;
  return shape.tiles == 1 && total_bytes <= int64_t{multiprocessors} * kMinChunkBytes &&
         ceil_div(tile_units, int64_t{shape.splits}) <= int64_t{kPackThreads} * kCopyUnroll;
}

/// Widest copy unit (16, 8, 4 or 2 bytes) that divides a position and keeps every access aligned.
int vector_bytes_for(const void* payload, const void* packed, int64_t position_bytes,
                     int64_t row_stride_bytes) {
  for (int bytes : {16, 8, 4}) {
    if (position_bytes % bytes == 0 && row_stride_bytes % bytes == 0 &&
        reinterpret_cast<uintptr_t>(payload) % bytes == 0 && reinterpret_cast<uintptr_t>(packed) % bytes == 0)
      return bytes;
  }
  return 2;
}

/// Whether a launch's copy loop takes kWideCopyUnroll vectors a thread a batch: where a CTA's share of its
/// tile's stored payload is above one batch of kCopyUnroll (big payloads: shape_for gives them about
/// total / (4 x SMs) each), so that share is one batch and all its loads are in flight at once, on 16-byte
/// copies (the 64-register cap of 4 CTAs an SM holds 8 of them). SMCGRAPH_PACK_COPY=narrow keeps kCopyUnroll
/// everywhere (A/B runs).
bool wide_copy(const PackLaunchShape& shape, int rows, int positions, int64_t position_bytes,
               int vector_bytes) {
  static const bool narrow_only = detail::env_choice<bool>("smcgraph::verify_and_pack", "SMCGRAPH_PACK_COPY",
                                                           {{"wide", false}, {"narrow", true}});
  const int64_t tile_bytes = stored_tile_bytes(shape, rows, positions, position_bytes);
  return !narrow_only && vector_bytes == 16 && ceil_div(tile_bytes, int64_t{shape.splits}) > kMinChunkBytes;
}

template <bool COUNTS_GIVEN, int UNROLL>
void launch_unrolled(int vector_bytes, const PackArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(int64_t{args.tiles} * args.splits));
  switch (vector_bytes) {
  case 16:
    detail::launch_pdl(VerifyPackKernel<16, COUNTS_GIVEN, UNROLL>, dim3(grid), dim3(kPackThreads), 0, stream,
                       args);
    break;
  case 8:
    detail::launch_pdl(VerifyPackKernel<8, COUNTS_GIVEN, UNROLL>, dim3(grid), dim3(kPackThreads), 0, stream,
                       args);
    break;
  case 4:
    detail::launch_pdl(VerifyPackKernel<4, COUNTS_GIVEN, UNROLL>, dim3(grid), dim3(kPackThreads), 0, stream,
                       args);
    break;
  default:
    detail::launch_pdl(VerifyPackKernel<2, COUNTS_GIVEN, UNROLL>, dim3(grid), dim3(kPackThreads), 0, stream,
                       args);
    break;
  }
}

/// Whether a wide launch copies in source order (VerifyPackKernel's step 0): a payload ready before the PDL
/// wait and a caller who expects at least kSourceOrderMinPacked of it packed (PayloadView); a tile's stored
/// units below 2^31 (32-bit unit indices). SMCGRAPH_PACK_ORDER=packed never does, =source whenever the
/// payload is ready, whatever the hint (A/B runs). NVIDIA H200, verify_pack_bench, b 32, gamma 128, kv 2048
/// fp16, packed / source order, two rounds in one call: ready, acceptance 0.9 12.30, 12.24 -> 11.08, 11.01
/// us; 0.3 6.94, 7.02 -> 8.48, 8.48 (it reads 3.6x the bytes it packs). Not ready (loads right after the
/// wait, ahead of the verify's token loads): 12.33, 12.29 -> 14.36, 14.37 at 0.9, so it needs the ready
/// payload.
bool source_order(const PackLaunchShape& shape, int rows, int positions, const PayloadView& payload,
                  int64_t position_bytes, int vector_bytes) {
  enum class Order { kByHint, kPacked, kSource };
  static const Order order = detail::env_choice<Order>(
      "smcgraph::verify_and_pack", "SMCGRAPH_PACK_ORDER",
      {{"hint", Order::kByHint}, {"packed", Order::kPacked}, {"source", Order::kSource}});
  const bool wanted = order == Order::kSource ||
                      (order == Order::kByHint && payload.expected_packed_fraction >= kSourceOrderMinPacked);
  return payload.ready_before_wait && wanted &&
         stored_tile_bytes(shape, rows, positions, position_bytes) / vector_bytes < INT32_MAX;
}

/// How a launch copies: preload (small, ready), wide (8 vectors a thread a batch) and, if wide, source order.
struct CopyPlan {
  bool preload = false, wide = false, source_order = false;
};
CopyPlan copy_plan(const PackLaunchShape& shape, int rows, int positions, const PayloadView& payload,
                   int64_t position_bytes, int vector_bytes, int multiprocessors) {
  CopyPlan plan;
  plan.preload = payload.ready_before_wait &&
                 preloads(shape, rows, positions, position_bytes, vector_bytes, multiprocessors);
  plan.wide = !plan.preload && wide_copy(shape, rows, positions, position_bytes, vector_bytes);
  plan.source_order =
      plan.wide && source_order(shape, rows, positions, payload, position_bytes, vector_bytes);
  return plan;
}

template <bool COUNTS_GIVEN>
void launch(int vector_bytes, bool wide, bool by_source, const PackArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(int64_t{args.tiles} * args.splits));
  if (wide && by_source) {
    detail::launch_pdl(VerifyPackKernel<16, COUNTS_GIVEN, kWideCopyUnroll, true>, grid, dim3(kPackThreads), 0,
                       stream, args);
  } else if (wide) {
    detail::launch_pdl(VerifyPackKernel<16, COUNTS_GIVEN, kWideCopyUnroll>, grid, dim3(kPackThreads), 0,
                       stream, args);
  } else {
    launch_unrolled<COUNTS_GIVEN, kCopyUnroll>(vector_bytes, args, stream);
  }
}

void validate_payload(const char* where, const PayloadView& payload, int positions) {
  require(payload.data != nullptr, where, "payload.data", "null", "must be a device pointer");
  require(payload.dtype == DType::kFloat32 || payload.dtype == DType::kBFloat16 ||
              payload.dtype == DType::kFloat16,
          where, "payload.dtype", static_cast<int>(payload.dtype), "must be fp32, bf16 or fp16");
  require(payload.width >= 1, where, "payload.width", payload.width, "must be >= 1");
  require(payload.row_stride >= int64_t{positions} * payload.width, where, "payload.row_stride",
          payload.row_stride, "must be >= (draft_steps + include_next) * width");
  require(reinterpret_cast<uintptr_t>(payload.data) % dtype_bytes(payload.dtype) == 0, where, "payload.data",
          payload.data, "must be aligned to its element size");
  require(payload.expected_packed_fraction >= 0.0f && payload.expected_packed_fraction <= 1.0f, where,
          "payload.expected_packed_fraction", payload.expected_packed_fraction, "must be in [0, 1]");
}

/// The fields both launchers fill alike, from their rows (a TokenVerifyInputs or an AcceptedRows).
template <class Rows> PackArgs rows_args(const Rows& rows, bool include_next) {
  return {.draft_tokens = rows.draft_tokens,
          .draft_row_stride = rows.draft_row_stride,
          .rows = rows.rows,
          .draft_steps = rows.draft_steps,
          .include_next = include_next ? 1 : 0};
}

/// Shared tail of both launchers: outputs, workspace, shape, launch.
template <bool COUNTS_GIVEN>
void launch_pack(const char* where, PackArgs args, const PayloadView& payload, const PackOutputs& out,
                 PackWorkspace& workspace, cudaStream_t stream) {
  const int positions = args.draft_steps + args.include_next;
  const int64_t worst_rows = int64_t{args.rows} * positions;
  require(worst_rows <= kMaxPackedRows, where, "rows * (draft_steps + include_next)", worst_rows,
          "must be < 2^30");
  validate_payload(where, payload, positions);
  out.validate(where, worst_rows);
  require(reinterpret_cast<uintptr_t>(out.packed) % dtype_bytes(payload.dtype) == 0, where, "out.packed",
          out.packed, "must be aligned to the payload's element size");
  require(workspace.max_rows() >= args.rows, where, "workspace.max_rows", workspace.max_rows(),
          "must be >= rows");

  const int element_bytes = dtype_bytes(payload.dtype);
  args.payload = static_cast<const char*>(payload.data);
  args.position_bytes = int64_t{payload.width} * element_bytes;
  args.payload_row_stride_bytes = payload.row_stride * element_bytes;
  args.out = out;
  args.workspace = workspace.words();
  static const bool cta_lookback = detail::env_choice<bool>(
      "smcgraph::verify_and_pack", "SMCGRAPH_PACK_LOOKBACK", {{"cta", true}, {"warps", false}});
  args.cta_lookback = cta_lookback ? 1 : 0;
  const int multiprocessors = current_device_info().multiprocessors;
  const PackLaunchShape shape =
      shape_for(args.rows, args.draft_steps, positions, args.position_bytes, COUNTS_GIVEN, multiprocessors);
  require(int64_t{shape.tiles} * shape.splits <= INT32_MAX, where, "grid (tiles * splits)",
          int64_t{shape.tiles} * shape.splits, "must be < 2^31");
  args.rows_per_tile = shape.rows_per_tile;
  args.tiles = shape.tiles;
  args.splits = shape.splits;
  const int vector_bytes =
      vector_bytes_for(payload.data, out.packed, args.position_bytes, args.payload_row_stride_bytes);
  const CopyPlan plan =
      copy_plan(shape, args.rows, positions, payload, args.position_bytes, vector_bytes, multiprocessors);
  args.preload = plan.preload;
  launch<COUNTS_GIVEN>(vector_bytes, plan.wide, plan.source_order, args, stream);
  SMCGRAPH_CHECK_LAUNCH();
}

} // namespace

void PackOutputs::validate(const char* where, int64_t required_rows) const {
  require(packed != nullptr, where, "out.packed", "null", "must be a device pointer");
  require(capacity_rows >= required_rows, where, "out.capacity_rows", capacity_rows,
          "must be >= rows * (draft_steps + include_next)");
  require(offsets != nullptr, where, "out.offsets", "null", "must be a device pointer");
  require(total != nullptr, where, "out.total", "null", "must be a device pointer");
}

PackWorkspace::PackWorkspace(int max_rows, cudaStream_t stream) : max_rows_(max_rows) {
  require(max_rows >= 1, "smcgraph::PackWorkspace", "max_rows", max_rows, "must be >= 1");
  words_ =
      DeviceBuffer<unsigned long long>(static_cast<size_t>(kStatusWords) + static_cast<size_t>(max_rows));
  // Zeroed on the caller's stream (CUB style): work enqueued on it after the constructor sees the zeros.
  words_.fill_bytes(0, stream);
}

PackWorkspace::PackWorkspace(int max_rows) : PackWorkspace(max_rows, nullptr) {
  // The zeroing ran on the default stream, which the caller's non-blocking streams do not wait for: wait
  // here, so any stream may use the workspace at once.
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

PackLaunchShape pack_launch_shape(int rows, int draft_steps, int width, DType dtype, bool include_next,
                                  bool counts_given) {
  constexpr const char* kWhere = "smcgraph::pack_launch_shape";
  require(rows >= 1, kWhere, "rows", rows, "must be >= 1");
  require(draft_steps >= 1 && draft_steps <= kMaxVerifyDraftSteps, kWhere, "draft_steps", draft_steps,
          "must be in [1, kMaxVerifyDraftSteps]");
  require(width >= 1, kWhere, "width", width, "must be >= 1");
  return shape_for(rows, draft_steps, draft_steps + (include_next ? 1 : 0),
                   int64_t{width} * dtype_bytes(dtype), counts_given, current_device_info().multiprocessors);
}

namespace {

/// The copy plan a launch of this shape would take with this payload (pack_preloads, pack_source_order):
/// `vector_bytes` checked as the launcher would pick it (16, 8, 4 or 2, dividing a position's bytes).
CopyPlan query_copy_plan(const char* where, int rows, int draft_steps, const PayloadView& payload,
                         bool include_next, bool counts_given, int vector_bytes) {
  require(vector_bytes == 16 || vector_bytes == 8 || vector_bytes == 4 || vector_bytes == 2, where,
          "vector_bytes", vector_bytes, "must be 16, 8, 4 or 2");
  const int64_t position_bytes = int64_t{payload.width} * dtype_bytes(payload.dtype);
  require(position_bytes % vector_bytes == 0, where, "vector_bytes", vector_bytes,
          "must divide a position's bytes (width * dtype size)");
  const PackLaunchShape shape =
      pack_launch_shape(rows, draft_steps, payload.width, payload.dtype, include_next, counts_given);
  return copy_plan(shape, rows, draft_steps + (include_next ? 1 : 0), payload, position_bytes, vector_bytes,
                   current_device_info().multiprocessors);
}

} // namespace

bool pack_preloads(int rows, int draft_steps, int width, DType dtype, bool include_next, bool counts_given,
                   int vector_bytes) {
  const PayloadView ready{nullptr, dtype, width, 0, /*ready_before_wait=*/true};
  return query_copy_plan("smcgraph::pack_preloads", rows, draft_steps, ready, include_next, counts_given,
                         vector_bytes)
      .preload;
}

bool pack_source_order(int rows, int draft_steps, const PayloadView& payload, bool include_next,
                       bool counts_given, int vector_bytes) {
  return query_copy_plan("smcgraph::pack_source_order", rows, draft_steps, payload, include_next,
                         counts_given, vector_bytes)
      .source_order;
}

void verify_and_pack(const TokenVerifyInputs& inputs, const PayloadView& payload, bool include_next,
                     const VerifyOutputs& verdict, const PackOutputs& out, PackWorkspace& workspace,
                     cudaStream_t stream) {
  constexpr const char* kWhere = "smcgraph::verify_and_pack";
  inputs.validate(kWhere);
  verdict.validate(kWhere);
  const NvtxRange range("verify_and_pack");
  PackArgs args = rows_args(inputs, include_next);
  args.verify = inputs;
  args.verdict = verdict;
  launch_pack<false>(kWhere, args, payload, out, workspace, stream);
}

void pack_accepted(const AcceptedRows& accepted, const PayloadView& payload, bool include_next,
                   const PackOutputs& out, PackWorkspace& workspace, cudaStream_t stream) {
  constexpr const char* kWhere = "smcgraph::pack_accepted";
  require(accepted.rows >= 1, kWhere, "accepted.rows", accepted.rows, "must be >= 1");
  require(accepted.draft_steps >= 1 && accepted.draft_steps <= kMaxVerifyDraftSteps, kWhere,
          "accepted.draft_steps", accepted.draft_steps, "must be in [1, kMaxVerifyDraftSteps]");
  require(accepted.accepted != nullptr, kWhere, "accepted.accepted", "null", "must be a device pointer");
  if (out.packed_tokens != nullptr) {
    require(accepted.draft_tokens != nullptr, kWhere, "accepted.draft_tokens", "null",
            "must be a device pointer when out.packed_tokens is given");
    require(accepted.draft_row_stride >= accepted.draft_steps, kWhere, "accepted.draft_row_stride",
            accepted.draft_row_stride, "must be >= draft_steps");
    require(!include_next || accepted.next_tokens != nullptr, kWhere, "accepted.next_tokens", "null",
            "must be a device pointer when out.packed_tokens and include_next are given");
  }
  const NvtxRange range("pack_accepted");
  PackArgs args = rows_args(accepted, include_next);
  args.accepted_in = accepted.accepted;
  args.next_in = accepted.next_tokens;
  launch_pack<true>(kWhere, args, payload, out, workspace, stream);
}

} // namespace smcgraph

// sample(): one token per row from softmax(alpha * logits / T), its log-prob and log Z, in one read of the
// logits from memory (the two-level race re-reads one sub-tile: from shared memory in cluster mode, from L2
// in ticket mode). The kernel itself lives in logits_pass.cuh (shared with score()).
#include "kernels/logits_pass.cuh"

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"
#include "kernels/launch_checks.hpp"
#include "kernels/smem_limit.hpp"
#include "kernels/walk_plan.hpp"
#include "runtime/env.hpp"

namespace smcgraph {
using detail::ceil_div;
namespace detail {
using PassKernel = void (*)(PassArgs);
} // namespace detail

int sample_tile_length(DType dtype) {
  static_assert(detail::kSplitLength<DType::kBFloat16> == detail::kSplitLength<DType::kFloat16>,
                "fp16 and bf16 share a tile length");
  return dtype == DType::kFloat32 ? detail::kSplitLength<DType::kFloat32>
                                  : detail::kSplitLength<DType::kBFloat16>;
}

int sample_splits(int vocab, DType dtype) {
  require(vocab >= 1, "sample_splits", "vocab", vocab, "must be >= 1");
  return static_cast<int>(ceil_div(vocab, sample_tile_length(dtype)));
}

static_assert(kSampleSubTilesPerTile == detail::kSubTiles, "the public sub-tile count is the kernel's");

int sample_subtile_length(DType dtype) {
  return sample_tile_length(dtype) / kSampleSubTilesPerTile;
}

int sample_subtile(int vocab_id, DType dtype) {
  require(vocab_id >= 0, "sample_subtile", "vocab_id", vocab_id, "must be >= 0");
  // As the pass folds a tile: 16-byte vectors, vector q of a tile to thread q % 256, thread t in warp t / 32.
  const int tile_length = sample_tile_length(dtype);
  const int vector_length = dtype == DType::kFloat32 ? detail::DTypeTraits<DType::kFloat32>::kPerVector
                                                     : detail::DTypeTraits<DType::kBFloat16>::kPerVector;
  const int vector = (vocab_id % tile_length) / vector_length;
  const int warp = (vector % detail::kPassThreads) / detail::kWarpSize;
  return (vocab_id / tile_length) * kSampleSubTilesPerTile + warp;
}

SampleWorkspace::SampleWorkspace(int max_jobs, int max_vocab)
    : SampleWorkspace(max_jobs, max_vocab, nullptr) {
  // The zeroing ran on the default stream, which the caller's non-blocking streams do not wait for: wait
  // here, so any stream may use the workspace at once.
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

namespace detail {
/// The staged walk instances' shared memory, set up outside any capture (a workspace comes before its
/// launches): their staging's dynamic bytes (kWalkStagingBytes, more than the 48 KiB a kernel gets unasked)
/// and the carveout that holds four of their CTAs an SM.
void prepare_walk_instances() {
  for (const PassKernel kernel :
       {LogitsPassKernel<DType::kFloat32, kPassMinBlocksStaged, PassWalk::kStaged>,
        LogitsPassKernel<DType::kBFloat16, kPassMinBlocksStaged, PassWalk::kStaged>,
        LogitsPassKernel<DType::kFloat16, kPassMinBlocksStaged, PassWalk::kStaged>}) {
    prepare_max_shared_kernel(kernel, kWalkStagingBytes);
  }
}
} // namespace detail

namespace {
/// The partials' allocation: a PassState per sub-tile, then a SubTileWinner per sub-tile (the early race's,
/// SampleWorkspaceAccess::winners).
size_t partial_bytes(int max_partials) {
  return static_cast<size_t>(max_partials) * (sizeof(detail::PassState) + sizeof(detail::SubTileWinner));
}
} // namespace

SampleWorkspace::SampleWorkspace(int max_jobs, int max_vocab, cudaStream_t stream)
    : max_jobs_(max_jobs), max_vocab_(max_vocab) {
  require(max_jobs >= 1, "SampleWorkspace", "max_jobs", max_jobs, "must be >= 1");
  require(max_vocab >= 1, "SampleWorkspace", "max_vocab", max_vocab, "must be >= 1");
  // One state per sub-tile (kSampleSubTilesPerTile per tile) of each job; fp32 has the most tiles per vocab.
  const int64_t partials =
      static_cast<int64_t>(max_jobs) * sample_splits(max_vocab, DType::kFloat32) * kSampleSubTilesPerTile;
  require(partials < (int64_t{1} << 31), "SampleWorkspace", "max_jobs * sub-tiles", partials,
          "must be < 2^31");
  max_partials_ = static_cast<int>(partials);
  detail::prepare_walk_instances();
  bytes_ = partial_bytes(max_partials_) + static_cast<size_t>(max_jobs) * 4;
  // Counted in device_memory_stats() like every DeviceBuffer.
  partials_ = detail::device_allocate(partial_bytes(max_partials_));
  try {
    tickets_ = static_cast<uint32_t*>(detail::device_allocate(static_cast<size_t>(max_jobs) * 4));
    // Zeroed on the caller's stream (CUB style): work enqueued on it after the constructor sees the zeros.
    SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(tickets_, 0, static_cast<size_t>(max_jobs) * 4, stream));
  } catch (...) { // the destructor will not run: free what the constructor took
    detail::device_free(partials_, partial_bytes(max_partials_));
    detail::device_free(tickets_, static_cast<size_t>(max_jobs) * 4);
    throw;
  }
}

SampleWorkspace::~SampleWorkspace() {
  detail::device_free(partials_, partial_bytes(max_partials_));
  detail::device_free(tickets_, static_cast<size_t>(max_jobs_) * 4);
  partials_ = nullptr;
  tickets_ = nullptr;
}

SampleWorkspace::SampleWorkspace(SampleWorkspace&& other) noexcept {
  *this = std::move(other);
}

SampleWorkspace& SampleWorkspace::operator=(SampleWorkspace&& other) noexcept {
  if (this != &other) {
    std::swap(max_jobs_, other.max_jobs_);
    std::swap(max_vocab_, other.max_vocab_);
    std::swap(max_partials_, other.max_partials_);
    std::swap(bytes_, other.bytes_);
    std::swap(partials_, other.partials_);
    std::swap(tickets_, other.tickets_);
  }
  return *this;
}

namespace detail {
namespace {

std::atomic<bool>& sampler_clusters() {
  static std::atomic<bool> enabled = !env_flag("SMCGRAPH_DISABLE_SAMPLER_CLUSTER");
  return enabled;
}

/// The pass kernel's instance <dtype, MIN_BLOCKS, WALK>.
template <int MIN_BLOCKS, PassWalk WALK = PassWalk::kNone> PassKernel pass_instance(DType dtype) {
  switch (dtype) {
  case DType::kFloat32:
    return LogitsPassKernel<DType::kFloat32, MIN_BLOCKS, WALK>;
  case DType::kBFloat16:
    return LogitsPassKernel<DType::kBFloat16, MIN_BLOCKS, WALK>;
  case DType::kFloat16:
    return LogitsPassKernel<DType::kFloat16, MIN_BLOCKS, WALK>;
  }
  return nullptr;
}

/// The pass kernel of a dtype: the kPassMinBlocks instance, or the kPassMinBlocksLarge one (`large`).
PassKernel pass_kernel(DType dtype, bool large = false) {
  return large ? pass_instance<kPassMinBlocksLarge>(dtype) : pass_instance<kPassMinBlocks>(dtype);
}

/// set_sample_walk_min_jobs()'s setting: 0 (the default) walks the launches that fill their waves of walk
/// CTAs (walk_plan), INT_MAX none, n every launch of at least n jobs that walk mode can take.
std::atomic<int>& sampler_walk_min_jobs() {
  static std::atomic<int> min_jobs = [] {
    if (env_flag("SMCGRAPH_DISABLE_SAMPLER_WALK"))
      return std::numeric_limits<int>::max();
    return static_cast<int>(
        env_integer("SMCGRAPH_SAMPLER_WALK_MIN_JOBS", 0, std::numeric_limits<int>::max(),
                    "must be a whole number of jobs, 0 to 2147483647 (0: the default rule)")
            .value_or(0));
  }();
  return min_jobs;
}

/// The fill a walk's CTAs must reach (walk_plan). The register walk's measurements (one CTA a job,
/// kPassMinBlocksWalk an SM; the only walk until the fiftieth session): a walk CTA is slow, one tile after
/// another; it wins only where every SM runs as many of them as the others. NVIDIA H200 (132 SMs: waves of
/// 264), sample_bench graph us a launch, ticket -> walk, two rounds in one call: 256 x 128256 bf16 38.7-38.9
/// -> 33.1-33.2 (39.8% -> 46.6% of copy), fp32 57.2-57.3 -> 46.1-46.2, 256 x 49152 bf16 22.0 -> 16.0-16.1,
/// 256 x 32000 17.4-17.5 -> 12.4; 128 x 128256 bf16 25.3-25.5 -> 24.3 (one CTA an SM); but 64 / 96 / 192 x
/// 128256 bf16 16.0 / 20.7-20.8 / 30.9 -> 24.1 / 24.2 / 32.5, 128 x 128256 fp32 32.9-33.0 -> 36.4-36.5. The
/// toy cycle (bucket_sweep, V 128256 bf16, walking from 128 jobs): SMC at 64 requests (512-row samples,
/// 2,560-job scores) 1,962.3 -> 1,930.9 us, but SMC at 8 and speculative at 64 requests (320-job scores: 1.2
/// waves) 371.3 -> 380.2 and 374.5 -> 402.3. With this rule (one call, walk off -> default): the toy SMC
/// cycle at 64 requests 1,958.0 -> 1,936.1 us (non-model 633.2 -> 612.8), the other toy and real-model cycles
/// within noise (none of their launches walks), 1 / 8 / 64 / 128 / 192 x 128256 bf16 unchanged.
constexpr double kWalkMinWaveFill = 0.95;

/// The staged walk's short walks (walk_plan), off by default: SMCGRAPH_SAMPLER_SHORT_WALK_TILES=n also walks
/// launches whose walkers walk at most n tiles each and are at least one CTA an SM, whatever fill of the wave
/// they reach. Alone they win (n = 4): NVIDIA H200, sample_bench us a launch, two
/// rounds in one call (fifty-first session), ticket mode -> the staged walk (forced), in the chain / after a
/// kernel that flushed L2: x 128256 bf16 (16 tiles), 24 rows (8 walkers of 2 tiles, 192 CTAs) 12.36 / 12.6
/// -> 10.2 / 12.7, 32 rows 12.95 / 13.65 -> 10.44 / 13.7, 48 rows 14.35 / 16.8 -> 14.35 / 14.55, 80 rows (6
/// walkers of 3) 19.0 / 21.8-22.1 -> 17.9 / 19.2-19.5, 96 rows (4 of 4) 20.35 / 23.8-24.3 -> 20.3
/// / 19.6-19.9, 112 rows 23.1 / 26.1 -> 20.8 / 22.8; x 128256 fp32 (32 tiles), 16 rows (16 of 2) 11.75
/// / 13.0-13.2 -> 10.45 / 11.05-11.35, 24 rows 14.2 / 15.2 -> 13.2-13.3 / 12.8-12.9; x 49152 bf16 (6 tiles),
/// 48 rows (3 of 2, 144 CTAs) 11.93 / 12.5-12.7 -> 9.77 / 12.1-12.2, 64 rows 12.31 / 12.9-13.0 -> 9.94
/// / 12.5, 128 rows 14.57 / 18.05 -> 14.3 / 14.5-14.8, 192 rows (2 of 3) 18.54 / 22.0-22.3 -> 17.28 / 17.27,
/// 224 rows 19.83 / 23.1 -> 17.64 / 19.8-20.1; at 96 / 112 x 49152 the chain lost 12.9 -> 14.0 and 13.66
/// -> 14.1 where the cold launch won 16.3-16.6 -> 13.8-13.9 and 17.0-17.5 -> 14.0-14.2. Below one CTA an SM
/// the walk lost (16 x 128256 bf16, 8 walkers of 2 tiles: 8.86 / 11.6-11.8 -> 8.65 / 12.2-12.35; 16 x 49152,
/// 48 CTAs: 6.87 / 11.7 -> 8.08 / 11.8; 1-8 x 128256 bf16: 6.9-7.2 / 11.1-11.4 -> 8.2-8.4 / 11.8-12.0), and
/// longer walks lost in the chain (x 128256 bf16, 160 and 192 rows, 6 and 8 tiles a walker: 25.8
/// -> 26.6, 29.4 -> 31.1; fp32, 80 to 112 rows, 6 to 8 tiles: 23.0-28.9 -> 24.1-30.1).
/// In the cycles they lost (bucket_sweep, one call, two rounds, off -> 4): the toy SMC cycle (V 128256 bf16,
/// N 8, K 4) at 1 request 156.6-157.0 -> 162.5-163.1 us, the toy speculative cycle at 8 requests 148.9-149.4
/// -> 152.1-152.5 (their 40-job score launches, 8 walkers of 2 tiles, are the only launches that changed),
/// and the SmolLM2 SMC cycle at 8 requests (its 64 x 49152 samples) 4,325.2 -> 4,331.5 (one round, non-model
/// 55.2 -> 63.6); no cycle won, so the default stays the rule above. (A guess, not measured: in those cycles
/// the staged instance runs from code no other launch keeps in the caches, which the benchmark's chain does
/// not show.) sample_bench's own grid in that call, off -> 4: 64 x 32000 fp32 10.9 / 11.7 -> 9.3 / 10.0, 8 x
/// 151936 fp32 11.8 / 11.5 -> 10.9 / 11.2, 64 x 151936 bf16 18.35 / 21.9-22.0 -> 18.1 / 19.5-19.8, the
/// rest unchanged.
constexpr int kShortWalkTiles = 0;

/// kShortWalkTiles, or SMCGRAPH_SAMPLER_SHORT_WALK_TILES (0: no short walks; 4: the setting measured).
int short_walk_tiles() {
  static const int tiles =
      static_cast<int>(env_integer("SMCGRAPH_SAMPLER_SHORT_WALK_TILES", 0, kMaxWalkSubTiles,
                                   "must be a whole number of tiles a walker, 0 to 512 (0: no short walks)")
                           .value_or(kShortWalkTiles));
  return tiles;
}

/// set_sample_walk_max_walkers()'s setting: 0 (the default rule), n at most n CTAs a walked job.
std::atomic<int>& sampler_walk_max_walkers() {
  static std::atomic<int> walkers = static_cast<int>(
      env_integer("SMCGRAPH_SAMPLER_WALKERS", 0, std::numeric_limits<int>::max(),
                  "must be a whole number of CTAs a job, 0 to 2147483647 (0: the default rule)")
          .value_or(0));
  return walkers;
}

/// plan_walk (walk_plan.hpp) on this device, with set_sample_walk_min_jobs()'s and
/// set_sample_walk_max_walkers()'s settings:
/// - the register walk (one CTA a job, kPassMinBlocksWalk an SM) where its CTAs fill at least
///   kWalkMinWaveFill of the waves they take (256 x 128256 bf16 on an H200);
/// - else the staged walk, with as many walkers a job as a wave of its CTAs (kPassMinBlocksStaged an SM)
///   holds for the launch's jobs, each walking at least two tiles, where they fill at least kWalkMinWaveFill
///   of the waves they take (64 and 128 x 128256 on an H200), or, with short walks set
///   (SMCGRAPH_SAMPLER_SHORT_WALK_TILES=n, default off), where a walker walks at most n tiles and the CTAs
///   are at least one an SM;
/// - else no walk.
/// A forced walk (setting > 0) takes the staged walk's walkers (capped), the register walk at one.
/// NVIDIA H200, sample_bench graph us a launch, ticket -> staged walk (fiftieth session, two rounds, in the
/// chain / after a kernel that flushed L2): 64 x 128256 bf16 15.9 / 18.1 -> 15.0 / 16.0, fp32 22.7 / 24.0 ->
/// 20.0 / 21.0, 128 x 128256 bf16 24.6 / 28.2 -> 21.6 / 23.2, fp32 31.9 / 34.3 -> 31.4 / 32.8. At 256 rows a
/// first (unrolled) staged walk of two walkers a job tied the register walk in bf16 (30.4 us) and lost in
/// fp32 (43.7 -> 50.0), 256 x 49152 bf16 (15.1 -> 16.3) and 256 x 32000 (11.9 -> 13.2).
WalkPlan walk_plan(int64_t jobs, int splits) {
  WalkPlanContext context;
  context.sms = current_device_info().multiprocessors;
  context.register_blocks = kPassMinBlocksWalk;
  context.staged_blocks = kPassMinBlocksStaged;
  context.max_subtiles = kMaxWalkSubTiles;
  context.subtiles_per_tile = kSubTiles;
  context.min_wave_fill = kWalkMinWaveFill;
  context.short_walk_tiles = short_walk_tiles();
  context.min_jobs_setting = sampler_walk_min_jobs().load(std::memory_order_relaxed);
  context.max_walkers_setting = sampler_walk_max_walkers().load(std::memory_order_relaxed);
  return plan_walk(jobs, splits, context);
}

constexpr int kLargePassWaves = 4;

/// Whether a launch of `jobs` jobs of `splits` tiles runs in cluster mode (logits_pass.cuh): within the
/// mode's limits, and the current device runs `kernel` as clusters of `splits` CTAs (Hopper or later, at
/// least one such cluster resident; asked once per device, kernel and splits). Never fails: a no answers
/// false (the ticket mode then runs).
bool cluster_schedulable(PassKernel kernel, int64_t jobs, int splits) {
  if (splits < 2 || splits > kMaxClusterTiles || jobs * splits > kMaxClusterCtas ||
      !sampler_clusters().load(std::memory_order_relaxed))
    return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    return false;
  static std::mutex mutex;
  static std::map<std::tuple<int, PassKernel, int>, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, kernel, splits);
  if (const auto it = known.find(key); it != known.end())
    return it->second;
  bool ok = false, refused = false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    refused = true;
  } else if (major >= 9) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(splits));
    config.blockDim = dim3(kPassThreads);
    cudaLaunchAttribute attribute = cluster_attribute(static_cast<unsigned>(splits));
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    refused = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess;
    ok = !refused && clusters > 0;
  }
  // A refused query must not leave its error for the caller's next check; an earlier launch's error stays the
  // caller's to see, so the error state is cleared after a refusal only.
  if (refused)
    (void)cudaGetLastError();
  known.emplace(key, ok);
  return ok;
}

/// How a pass of `jobs` jobs of `splits` tiles meets: in clusters where they can be scheduled, else walking
/// where walk_plan says so, else through tickets. launch_logits_pass and sample_uses_clusters / _walk ask
/// here.
struct PassMeeting {
  bool cluster;
  WalkPlan walk;
};
PassMeeting pass_meeting(DType dtype, int64_t jobs, int splits) {
  const bool cluster = cluster_schedulable(pass_kernel(dtype), jobs, splits);
  WalkPlan walk = cluster ? WalkPlan{} : walk_plan(jobs, splits);
  return {cluster, walk};
}

} // namespace

void launch_logits_pass(const char* where, PassArgs args, SampleWorkspace& workspace, cudaStream_t stream) {
  const LogitsView& logits = args.logits;
  const DType dtype = logits.dtype;
  require(logits.data != nullptr, where, "logits.data", "null", "must be a device pointer");
  require(logits.rows >= 1, where, "logits.rows", logits.rows, "must be >= 1");
  require(logits.positions >= 1, where, "logits.positions", logits.positions, "must be >= 1");
  require(logits.vocab >= 1, where, "logits.vocab", logits.vocab, "must be >= 1");
  require(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, where,
          "logits.dtype", static_cast<int>(dtype), "must be fp32, bf16 or fp16");
  require(logits.positions == 1 || logits.position_stride >= logits.vocab, where, "logits.position_stride",
          logits.position_stride, "must be >= vocab");
  require(logits.rows == 1 ||
              logits.row_stride >= (logits.positions - 1) * logits.position_stride + logits.vocab,
          where, "logits.row_stride", logits.row_stride, "must cover positions * vocab logits");
  require_device_pointers(where, {{"params.temperature", args.params.temperature}});
  require_random(args.random, where);
  require_device_pointers(where, {{"row_flags", args.row_flags}, {"status", args.status}});
  const int64_t jobs = static_cast<int64_t>(logits.rows) * logits.positions;
  require(jobs <= workspace.max_jobs(), where, "rows * positions", jobs,
          "exceeds the workspace (SampleWorkspace max_jobs)");

  args.splits = sample_splits(logits.vocab, dtype);
  const int64_t partials = jobs * args.splits * kSubTiles; // one state per sub-tile of each job
  require(partials <= SampleWorkspaceAccess::max_partials(workspace), where, "rows * positions * sub-tiles",
          partials, "exceeds the workspace");
  args.partials = static_cast<PassState*>(SampleWorkspaceAccess::partials(workspace));
  args.winners = SampleWorkspaceAccess::winners(workspace);
  args.tickets = SampleWorkspaceAccess::tickets(workspace);

  // With programmatic dependent launch: the pass waits for its predecessor before any read.
  const PassMeeting meeting = pass_meeting(dtype, jobs, args.splits);
  args.cluster = meeting.cluster;
  args.walk = meeting.walk.walk;
  args.walkers = meeting.walk.staged() ? meeting.walk.walkers : 1;
  args.walk_tiles = meeting.walk.staged() ? meeting.walk.tiles : 0;
  const int64_t wave = int64_t{current_device_info().multiprocessors} * kPassMinBlocks;
  const PassKernel kernel =
      meeting.walk.staged() ? pass_instance<kPassMinBlocksStaged, PassWalk::kStaged>(dtype)
      : args.walk           ? pass_instance<kPassMinBlocksWalk, PassWalk::kRegisters>(dtype)
                  : pass_kernel(dtype, !args.cluster && jobs * args.splits > kLargePassWaves * wave);
  // The CTAs of sample positions (one a row: score()'s other positions draw nothing) fit one wave of the pass
  // kernel (kPassMinBlocks CTAs an SM): every one draws its race noise early (PassArgs::early_noise). A
  // register-walk CTA draws it while its first tile loads; the staged walk's last walker draws it after the
  // merge (fewer registers live on the walk).
  args.early_noise = args.walk ? !meeting.walk.staged() : int64_t{logits.rows} * args.splits <= wave;
  // SMCGRAPH_SAMPLER_NOISE=late: only the job's last CTA draws (A/B runs; the same bits).
  static const bool late_noise =
      env_choice<bool>("smcgraph::sample", "SMCGRAPH_SAMPLER_NOISE", {{"early", false}, {"late", true}});
  if (late_noise && !args.walk)
    args.early_noise = false;
  // Those launches also race early (PassArgs::early_race); SMCGRAPH_SAMPLER_RACE=late keeps the element race
  // after the merge (A/B runs; the same bits).
  static const bool late_race =
      env_choice<bool>("smcgraph::sample", "SMCGRAPH_SAMPLER_RACE", {{"early", false}, {"late", true}});
  args.early_race = !args.walk && args.early_noise && !late_race;
  const int64_t ctas = args.walk ? jobs * args.walkers : jobs * args.splits;
  launch_pdl_clustered(kernel, dim3(static_cast<unsigned>(ctas)), dim3(kPassThreads),
                       meeting.walk.staged() ? kWalkStagingBytes : 0,
                       args.cluster ? static_cast<unsigned>(args.splits) : 1u, stream, args);
}

} // namespace detail

void set_sample_clusters(bool enabled) {
  detail::sampler_clusters().store(enabled, std::memory_order_relaxed);
}

bool sample_clusters_enabled() {
  return detail::sampler_clusters().load(std::memory_order_relaxed);
}

void set_sample_walk_min_jobs(int jobs) {
  require(jobs >= 0, "set_sample_walk_min_jobs", "jobs", jobs,
          "must be >= 0 (0: launches that fill their waves; INT_MAX: walk mode off)");
  detail::sampler_walk_min_jobs().store(jobs, std::memory_order_relaxed);
}

int sample_walk_min_jobs() {
  return detail::sampler_walk_min_jobs().load(std::memory_order_relaxed);
}

void set_sample_walk_max_walkers(int walkers) {
  require(walkers >= 0, "set_sample_walk_max_walkers", "walkers", walkers,
          "must be >= 0 (0: the default rule; n: at most n CTAs a walked job)");
  detail::sampler_walk_max_walkers().store(walkers, std::memory_order_relaxed);
}

int sample_walk_max_walkers() {
  return detail::sampler_walk_max_walkers().load(std::memory_order_relaxed);
}

bool sample_uses_walk(int jobs, int vocab, DType dtype) {
  require(jobs >= 1, "sample_uses_walk", "jobs", jobs, "must be >= 1");
  return detail::pass_meeting(dtype, jobs, sample_splits(vocab, dtype)).walk.walk;
}

bool sample_uses_clusters(int jobs, int vocab, DType dtype) {
  require(jobs >= 1, "sample_uses_clusters", "jobs", jobs, "must be >= 1");
  return detail::pass_meeting(dtype, jobs, sample_splits(vocab, dtype)).cluster;
}

void sample(const LogitsView& logits, const RowParams& params, const RowRandom& random, uint32_t stream_word,
            const SampleOutputs& out, SampleWorkspace& workspace, cudaStream_t stream) {
  constexpr const char* kWhere = "smcgraph::sample";
  require(logits.positions == 1, kWhere, "logits.positions", logits.positions, "must be 1 (use score())");
  detail::require_device_pointers(
      kWhere, {{"out.tokens", out.tokens}, {"out.logprobs", out.logprobs}, {"out.logz", out.logz}});
  require(out.row_stride >= 1, kWhere, "out.row_stride", out.row_stride, "must be >= 1");
  // clang-format off
  const detail::PassArgs args{.logits = logits, .params = params, .random = random, .stream_word = stream_word,
                              .sample_tokens = out.tokens, .sample_logprobs = out.logprobs,
                              .sample_row_stride = out.row_stride, .sample_logz = out.logz,
                              .row_flags = out.row_flags, .status = out.status};
  // clang-format on
  detail::launch_logits_pass(kWhere, args, workspace, stream);
}

} // namespace smcgraph

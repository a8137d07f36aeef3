#include "bench_util.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "smcgraph/error.hpp"
#include "smcgraph/runtime.hpp"

#include <sys/wait.h>

namespace smcgraph::bench {
namespace {

/// Median / min / p90 of per-launch times (microseconds).
Timing summarize(std::vector<double> us) {
  require(!us.empty(), "smcgraph::bench::summarize", "samples", 0, "need at least one timing");
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  const double median = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  const size_t p90_index = std::min(n - 1, static_cast<size_t>(std::ceil(0.9 * static_cast<double>(n))) - 1);
  return Timing{median, us.front(), us[p90_index]};
}

/// Times `repetitions` calls of `issue` with events recorded back to back between them: event i+1 - event i
/// is call i's device time as long as the host keeps ahead of the GPU. No sync between warm-up and timing,
/// so the first timed call does not start on an idle stream and absorb the host's launch latency.
Timing time_issues(const std::function<void()>& issue, cudaStream_t stream, int repetitions, int warmup,
                   double launches_per_issue) {
  require(repetitions >= 1, "smcgraph::bench timing", "repetitions", repetitions, "must be >= 1");
  require(warmup >= 0, "smcgraph::bench timing", "warmup", warmup, "must be >= 0");
  for (int i = 0; i < warmup; ++i)
    issue();
  std::deque<Event> events; // Event is neither copyable nor movable; a deque never relocates elements
  for (int i = 0; i <= repetitions; ++i)
    events.emplace_back(true);
  events[0].record(stream);
  for (int i = 0; i < repetitions; ++i) {
    issue();
    events[i + 1].record(stream);
  }
  events.back().synchronize();
  SMCGRAPH_CUDA_CHECK(cudaGetLastError());
  std::vector<double> us(repetitions);
  for (int i = 0; i < repetitions; ++i) {
    us[i] = 1000.0 * static_cast<double>(events[i + 1].elapsed_ms_since(events[i])) / launches_per_issue;
  }
  return summarize(std::move(us));
}

struct GraphOwner {
  cudaGraph_t graph = nullptr;
  ~GraphOwner() {
    if (graph)
      cudaGraphDestroy(graph);
  }
};
struct GraphExecOwner {
  cudaGraphExec_t exec = nullptr;
  ~GraphExecOwner() {
    if (exec)
      cudaGraphExecDestroy(exec);
  }
};

/// Captures `work` `launches` times into a graph; on any failure ends the capture so the stream stays usable.
void capture(const std::function<void(cudaStream_t)>& work, cudaStream_t stream, int launches,
             GraphOwner& owner) {
  SMCGRAPH_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < launches; ++i)
      work(stream);
  } catch (...) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial); // may itself fail (an invalidated capture); nothing to add
    if (partial)
      cudaGraphDestroy(partial);
    cudaGetLastError();
    throw;
  }
  SMCGRAPH_CUDA_CHECK(cudaStreamEndCapture(stream, &owner.graph));
}

/// An empty `__global__` as hand-written PTX, loaded through the runtime's library API (these benches are
/// compiled by the host compiler, so they cannot define kernels). PTX 7.0 / sm_70 JIT-compiles on any
/// driver that runs an H100 or later.
constexpr const char* kEmptyKernelPtx = R"(.version 7.0
.target sm_70
.address_size 64

.visible .entry smcgraph_bench_empty_kernel()
{
	ret;
}
)";

/// A kernel of hand-written PTX (`entry` in `ptx`), loaded through the runtime's library API and unloaded
/// with it. A cudaKernel_t cast to a function pointer is accepted by cudaLaunchKernel (CUDA >= 12.0).
class PtxKernel {
public:
  PtxKernel(const char* ptx, const char* entry) {
    SMCGRAPH_CUDA_CHECK(cudaLibraryLoadData(&library_, ptx, nullptr, nullptr, 0, nullptr, nullptr, 0));
    SMCGRAPH_CUDA_CHECK(cudaLibraryGetKernel(&kernel_, library_, entry));
  }
  ~PtxKernel() {
    if (library_)
      cudaLibraryUnload(library_);
  }
  PtxKernel(const PtxKernel&) = delete;
  PtxKernel& operator=(const PtxKernel&) = delete;

  void launch(dim3 grid, dim3 block, void** params, cudaStream_t stream) const {
    SMCGRAPH_CUDA_CHECK(
        cudaLaunchKernel(reinterpret_cast<const void*>(kernel_), grid, block, params, 0, stream));
  }

private:
  cudaLibrary_t library_ = nullptr;
  cudaKernel_t kernel_ = nullptr;
};

/// The PTX of launch_cold_kernel(): a grid-stride read of `words` 32-bit words of `buffer` (0: none), then
/// kColdInstructions multiply-adds in four independent chains, each with its own immediate (so ptxas can
/// fold nothing and every one is a distinct instruction), whose sum is stored only if it equals a value it
/// never takes (the work stays live).
constexpr int kColdInstructions = 16384; // 16 B a Hopper SASS instruction: 256 KiB of code

std::string cold_kernel_ptx() {
  std::string ptx = R"(.version 7.0
.target sm_70
.address_size 64

.visible .entry smcgraph_bench_cold_kernel(.param .u64 buffer, .param .u64 words, .param .u64 sink)
{
  .reg .pred %p<3>;
  .reg .b32 %r<16>;
  .reg .b64 %rd<12>;
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %ntid.x;
  mov.u32 %r4, %nctaid.x;
  mad.lo.u32 %r5, %r2, %r3, %r1;
  mul.lo.u32 %r6, %r3, %r4;
  ld.param.u64 %rd1, [buffer];
  ld.param.u64 %rd2, [words];
  ld.param.u64 %rd9, [sink];
  cvt.u64.u32 %rd3, %r5;
  cvt.u64.u32 %rd4, %r6;
  mov.u32 %r7, %r5;
  add.u32 %r8, %r5, 1;
  add.u32 %r9, %r5, 2;
  add.u32 %r10, %r5, 3;
READ:
  setp.ge.u64 %p1, %rd3, %rd2;
  @%p1 bra CODE;
  shl.b64 %rd5, %rd3, 2;
  add.u64 %rd6, %rd1, %rd5;
  ld.global.cg.u32 %r11, [%rd6];
  xor.b32 %r7, %r7, %r11;
  add.u64 %rd3, %rd3, %rd4;
  bra READ;
CODE:
)";
  for (int i = 0; i < kColdInstructions; ++i) {
    const int chain = 7 + i % 4;
    ptx += "  mad.lo.u32 %r" + std::to_string(chain) + ", %r" + std::to_string(chain) + ", %r5, " +
           std::to_string(2654435761u * static_cast<uint32_t>(i + 1) | 1u) + ";\n";
  }
  ptx += R"(  add.u32 %r12, %r7, %r8;
  add.u32 %r12, %r12, %r9;
  add.u32 %r12, %r12, %r10;
  setp.eq.u32 %p2, %r12, 1234567;
  @%p2 st.global.u32 [%rd9], %r12;
  ret;
}
)";
  return ptx;
}

class ColdKernel {
public:
  ColdKernel()
      : kernel_(cold_kernel_ptx().c_str(), "smcgraph_bench_cold_kernel"),
        flush_(static_cast<size_t>(l2_rotation_bytes())), sink_(1) {
    int device = 0;
    SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
    SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device));
    flush_.fill_bytes(0x3c, nullptr);
    SMCGRAPH_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void launch(cudaStream_t stream, bool l2_flush) {
    void* buffer = flush_.data();
    uint64_t words = l2_flush ? flush_.bytes() / 4 : 0;
    void* sink = sink_.data();
    void* params[] = {&buffer, &words, &sink};
    kernel_.launch(dim3(static_cast<unsigned>(2 * multiprocessors_)), dim3(256), params, stream);
  }

private:
  PtxKernel kernel_;
  int multiprocessors_ = 1;
  DeviceBuffer<unsigned char> flush_;
  DeviceBuffer<uint32_t> sink_;
};

const PtxKernel& empty_kernel() {
  static const PtxKernel kernel(kEmptyKernelPtx, "smcgraph_bench_empty_kernel"); // loaded once per process
  return kernel;
}

} // namespace

void launch_empty_kernel(cudaStream_t stream) {
  empty_kernel().launch(dim3(1), dim3(1), nullptr, stream);
}

void launch_cold_kernel(cudaStream_t stream, bool l2_flush) {
  static ColdKernel kernel; // loaded once per process
  kernel.launch(stream, l2_flush);
}

BareGraphLaunch::BareGraphLaunch(int nodes) {
  if (nodes < 1)
    throw Error("BareGraphLaunch: nodes = " + std::to_string(nodes) + ", want >= 1");
  for (int i = 0; i < 2; ++i) {
    GraphOwner owner;
    capture(
        [&](cudaStream_t s) {
          for (int n = 0; n < nodes; ++n)
            launch_empty_kernel(s);
          // The engine's graphs end with the event the host waits on (Engine's capture).
          SMCGRAPH_CUDA_CHECK(cudaEventRecordWithFlags(events_[i].get(), s, cudaEventRecordExternal));
        },
        stream_, 1, owner);
    *graphs_[i].out() = owner.graph;
    owner.graph = nullptr;
    SMCGRAPH_CUDA_CHECK(cudaGraphInstantiate(execs_[i].out(), graphs_[i], 0));
    SMCGRAPH_CUDA_CHECK(cudaGraphUpload(execs_[i], stream_));
  }
  stream_.synchronize();
}

BareGraphLaunch::~BareGraphLaunch() {
  cudaStreamSynchronize(stream_); // no throw from a destructor; the handles go once the launches drained
}

double BareGraphLaunch::launch() {
  const auto t0 = std::chrono::steady_clock::now();
  SMCGRAPH_CUDA_CHECK(cudaGraphLaunch(execs_[launches_ % 2], stream_));
  const auto t1 = std::chrono::steady_clock::now();
  ++launches_;
  return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

void BareGraphLaunch::synchronize() {
  stream_.synchronize();
}

double measure_copy_bandwidth_gbs(cudaStream_t stream) {
  constexpr size_t kBytes = size_t{1} << 30;
  constexpr int kWarmup = 3, kRepetitions = 20;
  DeviceBuffer<unsigned char> d_source(kBytes), d_destination(kBytes);
  // Non-zero bytes in both, so every page is backed and nothing can be elided as zeros.
  d_source.fill_bytes(0x5a, stream);
  d_destination.fill_bytes(0xa5, stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto copy = [&] {
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpyAsync(d_destination.data(), d_source.data(), kBytes, cudaMemcpyDeviceToDevice, stream));
  };
  const Timing timing = time_issues(copy, stream, kRepetitions, kWarmup, 1.0);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return 2.0 * static_cast<double>(kBytes) / (timing.median_us * 1e3); // read + written, 1e9 B/s
}

Timing time_graph(const std::function<void(cudaStream_t)>& work, cudaStream_t stream, int launches_per_graph,
                  int repetitions, int warmup) {
  require(launches_per_graph >= 1, "smcgraph::bench::time_graph", "launches_per_graph", launches_per_graph,
          "must be >= 1");
  GraphOwner graph;
  capture(work, stream, launches_per_graph, graph);
  GraphExecOwner exec;
  SMCGRAPH_CUDA_CHECK(cudaGraphInstantiate(&exec.exec, graph.graph, 0));
  SMCGRAPH_CUDA_CHECK(cudaGraphUpload(exec.exec, stream));
  const auto replay = [&] { SMCGRAPH_CUDA_CHECK(cudaGraphLaunch(exec.exec, stream)); };
  const Timing timing = time_issues(replay, stream, repetitions, warmup, launches_per_graph);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return timing;
}

Timing time_eager(const std::function<void(cudaStream_t)>& work, cudaStream_t stream, int repetitions,
                  int warmup) {
  const auto call = [&] { work(stream); };
  const Timing timing = time_issues(call, stream, repetitions, warmup, 1.0);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return timing;
}

double node_floor_us(cudaStream_t stream) {
  // One eager launch first: with lazy module loading the first launch loads the code, outside any capture.
  launch_empty_kernel(stream);
  SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return time_graph(launch_empty_kernel, stream, 100, 50, 5).median_us;
}

std::string device_name() {
  int device = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  SMCGRAPH_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  return properties.name;
}

int l2_cache_bytes() {
  int device = 0, l2_bytes = 0;
  SMCGRAPH_CUDA_CHECK(cudaGetDevice(&device));
  SMCGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  return l2_bytes;
}

int64_t l2_rotation_bytes() {
  const int l2_bytes = l2_cache_bytes();
  return 3 * static_cast<int64_t>(l2_bytes > 0 ? l2_bytes : 50 << 20);
}

bool have_cuda_device(const char* bench) {
  if (cuda_device_count() > 0)
    return true;
  std::fprintf(stderr, "%s: no CUDA device\n", bench);
  return false;
}

Csv::Csv(const std::string& path) : path_(path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code error;
    std::filesystem::create_directories(parent, error);
    if (error)
      throw Error("smcgraph::bench::Csv: cannot create directory " + parent.string() + ": " +
                  error.message());
  }
  out_.open(path, std::ios::out | std::ios::trunc);
  if (!out_)
    throw Error("smcgraph::bench::Csv: cannot open " + path + " for writing");
}

void Csv::row(const std::vector<std::string>& cells) {
  std::string line;
  for (size_t i = 0; i < cells.size(); ++i) {
    if (i > 0)
      line += ',';
    const std::string& cell = cells[i];
    if (cell.find_first_of(",\"\n\r") == std::string::npos) {
      line += cell;
    } else {
      line += '"';
      for (const char c : cell) {
        if (c == '"')
          line += '"';
        line += c;
      }
      line += '"';
    }
  }
  line += '\n';
  out_ << line;
  out_.flush();
  if (!out_)
    throw Error("smcgraph::bench::Csv: write to " + path_ + " failed");
}

std::string format(double value, int decimals) {
  if (std::isnan(value))
    return "nan";
  if (std::isinf(value))
    return value > 0 ? "inf" : "-inf";
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", std::clamp(decimals, 0, 17), value);
  return text;
}

uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return 0x7fc0; // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float bf16_to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int run_command(const std::string& command) {
  std::fflush(stdout);
  std::fflush(stderr);
  const int status = std::system(command.c_str());
  if (status == -1)
    return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

std::string find_peer_script(const std::string& given, const char* name, const char* argv0) {
  if (!given.empty())
    return given;
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path executable_dir = fs::absolute(fs::path(argv0), error).parent_path();
  for (const fs::path& candidate :
       {fs::path("bench") / "peers" / name, executable_dir / ".." / ".." / "bench" / "peers" / name,
        executable_dir / ".." / "bench" / "peers" / name}) {
    if (fs::exists(candidate, error))
      return candidate.lexically_normal().string();
  }
  return "";
}

} // namespace smcgraph::bench

// Shared pieces of the benchmarks: the bandwidth and launch floors, graph and eager timing with CUDA
// events, the device name, a tiny CSV writer and bf16 rounding on the host.
//
// Every bench validates its output first, then times, then prints the fraction of its floor:
//
//   smcgraph::Stream stream;
//   const double copy_gbs = smcgraph::bench::measure_copy_bandwidth_gbs(stream);
//   const auto timing = smcgraph::bench::time_graph([&](cudaStream_t s) { my_launcher(..., s); }, stream);
//   const double gbs = bytes_read / (timing.median_us * 1e3);  // 1 GB/s = 1e9 B/s
//   std::printf("%.1f%% of copy bandwidth\n", 100 * gbs / copy_gbs);
//
// Functions throw smcgraph::Error on any CUDA failure; none of them exits.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/runtime.hpp"

namespace smcgraph::bench {

/// Device-to-device cudaMemcpyAsync of 1 GiB (source filled with non-zero bytes), counting bytes read plus
/// bytes written (2 GiB per copy); median of 20 copies after warm-up. GB/s = 1e9 B/s. A kernel that only
/// reads N bytes at the same total DRAM throughput would reach N / time = this number, so
/// `bytes_read / time / copy_gbs` is its fraction of the bandwidth floor.
double measure_copy_bandwidth_gbs(cudaStream_t stream);

/// Per-launch times in microseconds.
struct Timing {
  double median_us, min_us, p90_us;
};

/// Captures `work` launches_per_graph times (in order, one call after the other) into one graph,
/// instantiates it, replays it `warmup` times, then times `repetitions` replays with CUDA events (issued
/// back to back so the GPU does not wait for the host) and reports replay time / launches_per_graph.
/// `work` is called during capture only, so a lambda with a counter can rotate among buffers.
/// `stream` must not be the legacy default stream.
Timing time_graph(const std::function<void(cudaStream_t)>& work, cudaStream_t stream,
                  int launches_per_graph = 20, int repetitions = 50, int warmup = 5);

/// Calls `work` eagerly `warmup` times, then times `repetitions` calls with CUDA events between them (so a
/// call whose kernels are shorter than the host launch cost reports the launch-bound rate).
Timing time_eager(const std::function<void(cudaStream_t)>& work, cudaStream_t stream, int repetitions = 50,
                  int warmup = 5);

/// Per-node time of a graph of 100 empty-kernel nodes in a chain (median): the floor of any kernel that
/// moves almost nothing.
double node_floor_us(cudaStream_t stream);

/// Launches the chain's empty kernel (the node floor's) once on `stream`: a predecessor that does not let a
/// programmatic dependent launch start early, so the next kernel runs alone.
void launch_empty_kernel(cudaStream_t stream);

/// A kernel that leaves the launch after it cold, as a cycle leaves a stage kernel: on 2 CTAs an SM it
/// executes about 256 KiB of distinct instructions (more than an SM's instruction caches hold), and, when
/// `l2_flush` is true, first reads l2_rotation_bytes() of its own buffer (evicting L2). Not a programmatic
/// predecessor either. Loaded once per process (its PTX is generated and JIT-compiled at the first call).
void launch_cold_kernel(cudaStream_t stream, bool l2_flush);

/// The driver's own host cost of launching a captured cycle, the floor of Engine::step()'s host time: two
/// graphs of `nodes` empty kernels and an event record node (a cycle's shape), launched in turn on a stream
/// of their own. launch() times one cudaGraphLaunch on the host (microseconds); call it where step() would
/// be called (the GPU running the engine's previous cycle), so both see the same driver and GPU state.
class BareGraphLaunch {
public:
  explicit BareGraphLaunch(int nodes);
  ~BareGraphLaunch();
  BareGraphLaunch(const BareGraphLaunch&) = delete;
  BareGraphLaunch& operator=(const BareGraphLaunch&) = delete;
  double launch();
  /// Waits for every launch so far.
  void synchronize();

private:
  Stream stream_;
  Event events_[2];
  detail::UniqueHandle<cudaGraph_t, cudaGraphDestroy> graphs_[2];
  detail::UniqueHandle<cudaGraphExec_t, cudaGraphExecDestroy> execs_[2];
  int launches_ = 0;
};

/// The current device's name ("NVIDIA H200").
std::string device_name();

/// The current device's L2 size in bytes (0 when it does not say).
int l2_cache_bytes();

/// Bytes a bench rotates its input buffers over, so that a buffer is read again only after more than the L2
/// holds (it measures HBM, not L2): 3x the current device's L2 (150 MB when the device does not say).
int64_t l2_rotation_bytes();

/// True when a CUDA device is visible; otherwise prints "<bench>: no CUDA device" to stderr.
bool have_cuda_device(const char* bench);

/// A CSV file: the constructor creates the parent directories and truncates the file; the first row()
/// written is the header. Cells holding ',' '"' or a newline are quoted. Every row is flushed.
class Csv {
public:
  explicit Csv(const std::string& path);
  void row(const std::vector<std::string>& cells);

private:
  std::string path_;
  std::ofstream out_;
};

/// `value` with `decimals` digits after the point ("nan" / "inf" / "-inf" for non-finite values).
std::string format(double value, int decimals);

/// bf16 bits of a float, rounded to nearest even as __float2bfloat16_rn (NaN stays NaN), and back.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t value);

/// `text` in single quotes for a POSIX shell.
std::string shell_quote(const std::string& text);

/// Runs `command` through the shell (stdout and stderr flushed first); its exit status, 128 when a signal
/// ended it, -1 when it could not start.
int run_command(const std::string& command);

/// `given` when not empty, else bench/peers/<name> found from the repository root (the cwd) or from the
/// executable `argv0` in <root>/<build>/bench/; "" when absent.
std::string find_peer_script(const std::string& given, const char* name, const char* argv0);

} // namespace smcgraph::bench

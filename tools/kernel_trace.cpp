// A CUPTI injection library: the GPU start and end of every kernel a program runs, graph nodes included, as
// the program runs them (no serialisation, programmatic dependent launch overlap kept), summed up per kernel.
// It answers what Nsight Compute cannot (it times each kernel alone) and what the project's GPU machines lack
// Nsight Systems for: where the time of a captured cycle goes between and inside its kernels.
//
//   CUDA_INJECTION64_PATH=$PWD/build/libsmcgraph_kernel_trace.so SMCGRAPH_TRACE_SKIP=0.5
//       build/bench/bucket_sweep --model smollm2 --requests 1 --kinds spec   (one command line)
//
// At exit it prints to stderr, per kernel (name without arguments, template arguments kept), in order of
// first appearance: launches, mean duration, and the mean gap before it (its start minus the end of the
// kernel that ended last before it started; negative when it overlapped that one), then the totals: busy time
// (union of kernel intervals), gaps, and span. SMCGRAPH_TRACE_SKIP (a fraction in [0, 1)) drops that leading
// share of the records (warm-up, capture, prefill); SMCGRAPH_TRACE_CSV=path also writes every kept record
// (name, start_ns, end_ns, graph_id). Records are kept up to 4 million.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <cupti.h>

#include "kernel_name.hpp"

namespace {

struct Record {
  uint32_t name; // index into names
  uint32_t graph_id;
  uint64_t start, end;
};

std::mutex g_mutex;
std::vector<Record> g_records;
std::vector<std::string> g_names;
std::map<std::string, uint32_t> g_name_index;
constexpr size_t kMaxRecords = 4u << 20;
constexpr size_t kBufferBytes = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    if (g_records.size() >= kMaxRecords)
      continue;
    const std::string name = smcgraph::tools::kernel_short_name(kernel->name ? kernel->name : "?");
    auto [it, inserted] = g_name_index.emplace(name, static_cast<uint32_t>(g_names.size()));
    if (inserted)
      g_names.push_back(name);
    g_records.push_back({it->second, kernel->graphId, kernel->start, kernel->end});
  }
  std::free(buffer);
}

void report() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<Record> records = g_records;
  std::sort(records.begin(), records.end(),
            [](const Record& a, const Record& b) { return a.start < b.start; });
  double skip = 0.0;
  if (const char* text = std::getenv("SMCGRAPH_TRACE_SKIP"))
    skip = std::clamp(std::atof(text), 0.0, 0.99);
  records.erase(records.begin(), records.begin() + static_cast<ptrdiff_t>(skip * records.size()));
  if (records.empty()) {
    std::fprintf(stderr, "kernel_trace: no kernel records\n");
    return;
  }
  struct Stat {
    uint64_t launches = 0;
    double duration_ns = 0, gap_ns = 0;
    size_t first = 0;
  };
  std::map<uint32_t, Stat> stats;
  uint64_t last_end = records.front().start, busy = 0, gaps = 0, covered_until = records.front().start;
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    Stat& s = stats[r.name];
    if (s.launches == 0)
      s.first = i;
    ++s.launches;
    s.duration_ns += static_cast<double>(r.end - r.start);
    s.gap_ns += static_cast<double>(static_cast<int64_t>(r.start) - static_cast<int64_t>(last_end));
    if (r.start > covered_until) {
      gaps += r.start - covered_until;
      busy += r.end - r.start;
      covered_until = r.end;
    } else if (r.end > covered_until) {
      busy += r.end - covered_until;
      covered_until = r.end;
    }
    last_end = std::max(last_end, r.end);
  }
  std::vector<std::pair<uint32_t, Stat>> ordered(stats.begin(), stats.end());
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
  std::fprintf(stderr, "kernel_trace: %zu kernel records kept (skip %.2f)\n", records.size(), skip);
  std::fprintf(stderr, "%10s %12s %12s %12s  %s\n", "launches", "mean_us", "gap_us", "total_us", "kernel");
  for (const auto& [name, s] : ordered)
    std::fprintf(stderr, "%10llu %12.3f %12.3f %12.1f  %s\n", static_cast<unsigned long long>(s.launches),
                 s.duration_ns / s.launches / 1e3, s.gap_ns / s.launches / 1e3, s.duration_ns / 1e3,
                 g_names[name].c_str());
  const uint64_t span = covered_until - records.front().start;
  std::fprintf(stderr, "kernel_trace: span %.1f us, busy (union of kernels) %.1f us, idle gaps %.1f us\n",
               span / 1e3, busy / 1e3, gaps / 1e3);
  if (const char* path = std::getenv("SMCGRAPH_TRACE_CSV")) {
    if (FILE* out = std::fopen(path, "w")) {
      std::fprintf(out, "name,start_ns,end_ns,graph_id\n");
      for (const Record& r : records)
        std::fprintf(out, "\"%s\",%llu,%llu,%u\n", g_names[r.name].c_str(),
                     static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end),
                     r.graph_id);
      std::fclose(out);
    } else {
      std::fprintf(stderr, "kernel_trace: cannot write SMCGRAPH_TRACE_CSV=%s\n", path);
    }
  }
}

} // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not be enabled\n");
    return 0;
  }
  std::atexit(report);
  return 1;
}

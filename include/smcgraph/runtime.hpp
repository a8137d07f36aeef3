// RAII device and pinned host buffers, streams, events and NVTX ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "smcgraph/error.hpp"

namespace smcgraph {

/// What smcgraph itself holds right now. Counted: every DeviceBuffer and PinnedBuffer, hence every library
/// object built from them (engine tables, SampleWorkspace, PackWorkspace, model weights and KV, a cuBLAS
/// workspace allocated as a DeviceBuffer). Not counted: memory CUDA allocates on its own (graph instantiation
/// and upload, module loading, library handles' internals), a caller's own cudaMalloc, other processes. Leak
/// and drift checks read this instead of cudaMemGetInfo, which sees the whole device.
///
///   const smcgraph::DeviceMemoryStats before = smcgraph::device_memory_stats();
///   { smcgraph::Engine engine(config, draft, target); /* ... */ }
///   assert(smcgraph::device_memory_stats().device_bytes == before.device_bytes);
struct DeviceMemoryStats {
  int64_t device_allocations = 0; ///< live cudaMalloc allocations made by smcgraph (all devices)
  int64_t device_bytes = 0;       ///< their bytes
  int64_t peak_device_bytes = 0;  ///< the largest device_bytes seen since the process started
  int64_t pinned_allocations = 0; ///< live cudaMallocHost allocations made by smcgraph
  int64_t pinned_bytes = 0;       ///< their bytes
};
/// A snapshot of the process-wide counters (atomic reads; thread-safe, no CUDA call, no synchronization).
DeviceMemoryStats device_memory_stats();

namespace detail {
/// cudaMalloc / cudaMallocHost that update the counters above; they throw smcgraph::Error on failure and
/// count only allocations that succeeded. The frees never throw (destructors call them) and take the size
/// the allocation was made with.
void* device_allocate(size_t bytes);
void device_free(void* d_pointer, size_t bytes) noexcept;
void* pinned_allocate(size_t bytes);
void pinned_free(void* h_pointer, size_t bytes) noexcept;

/// What DeviceBuffer and PinnedBuffer share: `count` elements from `Allocate`, handed back to `Free` with
/// the size they were allocated with. Move-only.
template <class T, void* (*Allocate)(size_t), void (*Free)(void*, size_t) noexcept> class OwnedBuffer {
public:
  OwnedBuffer() = default;
  explicit OwnedBuffer(size_t count) : count_(count) {
    if (count_ > 0)
      data_ = static_cast<T*>(Allocate(count_ * sizeof(T)));
  }
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;
  OwnedBuffer(OwnedBuffer&& other) noexcept { swap(other); }
  OwnedBuffer& operator=(OwnedBuffer&& other) noexcept {
    OwnedBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~OwnedBuffer() {
    if (data_)
      Free(data_, count_ * sizeof(T)); // never throws: a failed free leaves nothing to recover
  }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  size_t size() const noexcept { return count_; }
  void swap(OwnedBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
  }

protected:
  T* data_ = nullptr;
  size_t count_ = 0;
};

/// What Stream and Event hold: a CUDA handle, destroyed by `Destroy` (when it was created) with its owner.
/// Not copyable; converts to the handle.
template <class Handle, cudaError_t (*Destroy)(Handle)> class UniqueHandle {
public:
  UniqueHandle() = default;
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() {
    if (handle_)
      Destroy(handle_);
  }
  /// Where the create call writes the handle.
  Handle* out() noexcept { return &handle_; }
  operator Handle() const noexcept { return handle_; }

private:
  Handle handle_ = nullptr;
};
} // namespace detail

/// Owns `count` elements of device memory (cudaMalloc, counted in device_memory_stats()). Move-only.
///
///   smcgraph::DeviceBuffer<float> d_logits(rows * vocab);
///   d_logits.copy_from_host(h_logits.data(), h_logits.size(), stream);
template <class T>
class DeviceBuffer : public detail::OwnedBuffer<T, detail::device_allocate, detail::device_free> {
  using Base = detail::OwnedBuffer<T, detail::device_allocate, detail::device_free>;
  using Base::count_;
  using Base::data_;

public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : Base(count) {}

  size_t bytes() const noexcept { return count_ * sizeof(T); }

  void copy_from_host(const T* h_source, size_t count, cudaStream_t stream) {
    require(count <= count_, "DeviceBuffer::copy_from_host", "count", count, "exceeds the buffer size");
    SMCGRAPH_CUDA_CHECK(cudaMemcpyAsync(data_, h_source, count * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  void copy_to_host(T* h_destination, size_t count, cudaStream_t stream) const {
    require(count <= count_, "DeviceBuffer::copy_to_host", "count", count, "exceeds the buffer size");
    SMCGRAPH_CUDA_CHECK(
        cudaMemcpyAsync(h_destination, data_, count * sizeof(T), cudaMemcpyDeviceToHost, stream));
  }
  /// Sets every byte to `byte` (tests use 0xff to poison outputs).
  void fill_bytes(int byte, cudaStream_t stream) {
    if (count_ > 0)
      SMCGRAPH_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes(), stream));
  }
  void swap(DeviceBuffer& other) noexcept { Base::swap(other); }
};

/// Owns `count` elements of page-locked host memory (cudaMallocHost, counted in device_memory_stats()), for
/// asynchronous copies.
template <class T>
class PinnedBuffer : public detail::OwnedBuffer<T, detail::pinned_allocate, detail::pinned_free> {
  using Base = detail::OwnedBuffer<T, detail::pinned_allocate, detail::pinned_free>;

public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t count) : Base(count) {}

  T& operator[](size_t i) noexcept { return this->data_[i]; }
  const T& operator[](size_t i) const noexcept { return this->data_[i]; }
  void swap(PinnedBuffer& other) noexcept { Base::swap(other); }
};

/// A non-blocking CUDA stream.
class Stream {
public:
  Stream() { SMCGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(stream_.out(), cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const noexcept { return stream_; }
  operator cudaStream_t() const noexcept { return stream_; }
  void synchronize() const { SMCGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

private:
  detail::UniqueHandle<cudaStream_t, cudaStreamDestroy> stream_;
};

/// A CUDA event; `timing` enables cudaEventElapsedTime.
class Event {
public:
  explicit Event(bool timing = false) {
    SMCGRAPH_CUDA_CHECK(
        cudaEventCreateWithFlags(event_.out(), timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const noexcept { return event_; }
  void record(cudaStream_t stream) { SMCGRAPH_CUDA_CHECK(cudaEventRecord(event_, stream)); }
  void synchronize() const { SMCGRAPH_CUDA_CHECK(cudaEventSynchronize(event_)); }
  /// Waits by polling cudaEventQuery: the thread stays on its core, so the host calls that follow do not
  /// pay for a wake-up (a blocking wait of milliseconds made the next cudaGraphLaunch 2-5x slower on H200).
  void spin_wait() const;
  /// True when all work before the record has completed (never blocks).
  bool ready() const;
  /// Milliseconds between `start` and this event (both recorded with timing enabled).
  float elapsed_ms_since(const Event& start) const;

private:
  detail::UniqueHandle<cudaEvent_t, cudaEventDestroy> event_;
};

/// An NVTX range that lasts for the scope (shows up in Nsight timelines; costs nothing without a tool).
class NvtxRange {
public:
  explicit NvtxRange(const char* name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

/// Device facts the launchers size their grids with (cached per device; no synchronization).
struct DeviceInfo {
  int device = 0;
  int multiprocessors = 0;
  int compute_major = 0;
  int compute_minor = 0;
  int shared_memory_optin_bytes = 0;      ///< largest dynamic shared memory a block may opt in to
  int access_policy_max_window_bytes = 0; ///< largest L2 access-policy window (0: none)
};
const DeviceInfo& current_device_info();

/// Number of CUDA devices, 0 when none is usable (never throws for "no device").
int cuda_device_count();

} // namespace smcgraph

// The launch shape of the cycle's per-row stage kernels (admission, forward inputs, commit, output packing):
// one thread per bucket row, kRowThreads a block; the kernel returns for r >= rows.
#pragma once

#include <utility>

#include <cuda_runtime_api.h>

#include "kernels/launch_checks.hpp"
#include "kernels/pdl.cuh"
#include "smcgraph/error.hpp"

namespace smcgraph::detail {

constexpr int kRowThreads = 128;

/// kernel<<<ceil(rows / kRowThreads), kRowThreads, 0, stream>>>(args...) with programmatic dependent launch
/// (kernels/pdl.cuh: the kernel must begin with pdl_enter()).
template <class... Params, class... Args>
void launch_per_row(void (*kernel)(Params...), int rows, cudaStream_t stream, Args&&... args) {
  const auto blocks = static_cast<unsigned>(ceil_div(rows, kRowThreads));
  launch_pdl(kernel, dim3(blocks), dim3(kRowThreads), 0, stream, std::forward<Args>(args)...);
}

} // namespace smcgraph::detail

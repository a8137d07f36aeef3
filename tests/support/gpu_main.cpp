// main() of every GPU test binary: exit 77 (meson's SKIP) when no CUDA device exists, unless
// SMCGRAPH_REQUIRE_GPU=1, which turns a missing GPU into a failure. Any other CUDA error fails.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  const bool no_device = status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
                         (status == cudaSuccess && count == 0);
  if (status != cudaSuccess && !no_device) {
    std::fprintf(stderr, "cudaGetDeviceCount failed: %s\n", cudaGetErrorString(status));
    return 1;
  }
  if (no_device) {
    const char* require = std::getenv("SMCGRAPH_REQUIRE_GPU");
    if (require != nullptr && std::strcmp(require, "1") == 0) {
      std::fprintf(stderr, "no CUDA device (%s) and SMCGRAPH_REQUIRE_GPU=1: failing\n",
                   cudaGetErrorString(status));
      return 1;
    }
    std::fprintf(stderr, "no CUDA device (%s): skipping (exit 77)\n", cudaGetErrorString(status));
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}

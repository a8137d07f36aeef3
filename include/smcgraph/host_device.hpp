// SMCGRAPH_HOST_DEVICE: functions that compile for the host and, under nvcc, for the device too (philox.hpp's
// counter-based generator, the sampler's order keys), so the CPU tests and host references run the kernels'
// own code.
#pragma once

#if defined(__CUDACC__)
#define SMCGRAPH_HOST_DEVICE __host__ __device__
#else
#define SMCGRAPH_HOST_DEVICE
#endif

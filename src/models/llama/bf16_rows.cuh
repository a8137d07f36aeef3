// Device helpers the Llama kernels share for bf16 activations: the bf16 bits of a float or of a pair, and the
// RMSNorm output of four elements, packed as the GEMM A operands are stored (llama_gemm.cu's prologue, the
// cuBLASLt LM head's norm kernel in llama_head.cu; the pairs: the int8 head's weights, the tensor-core
// attention's P and output).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace smcgraph::llama {

/// The bf16 bits of `value`, rounded to nearest even.
__device__ __forceinline__ uint16_t float_to_bf16_bits(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

/// bf16(low) | bf16(high) << 16, both rounded to nearest even: a pair as an MMA operand register holds it
/// (the lower column in the low half).
__device__ __forceinline__ uint32_t bf16x2_bits(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

/// x.x^2 + x.y^2 + x.z^2 + x.w^2.
__device__ __forceinline__ float sum_of_squares(float4 x) {
  return x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
}

/// bf16(x * inv_rms * gamma) for four elements, packed in element order (x.x in the low half of .x).
__device__ __forceinline__ uint2 rms_scaled_bf16x4(float4 x, float inv_rms, float4 gamma) {
  const uint32_t lo = float_to_bf16_bits(x.x * inv_rms * gamma.x) |
                      static_cast<uint32_t>(float_to_bf16_bits(x.y * inv_rms * gamma.y)) << 16;
  const uint32_t hi = float_to_bf16_bits(x.z * inv_rms * gamma.z) |
                      static_cast<uint32_t>(float_to_bf16_bits(x.w * inv_rms * gamma.w)) << 16;
  return make_uint2(lo, hi);
}

} // namespace smcgraph::llama

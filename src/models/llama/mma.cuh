// Tensor-core steps the Llama GEMMs share (llama_gemm.cu's pipelined tiles, llama_head.cu's small-token LM
// head): ldmatrix loads of bf16 fragments from shared memory and the m16n8k16 bf16 MMA with fp32
// accumulation (HMMA.16816.F32.BF16 on sm_90).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace smcgraph::llama {

/// Four 8 x 8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i; register i holds matrix i's
/// fragment (lane l: row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// ldmatrix_x4 transposed: register i holds the transpose of matrix i's fragment (lane l: rows 2 (l % 4) and
/// 2 (l % 4) + 1 of column l / 4), the B operand of row-major K x N storage (attention's V rows).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// Two 8 x 8 b16 matrices (lanes 0-15 give the row addresses).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

// Where lane `lane` points ldmatrix in a 16 x 16 tile (row, column within the tile), and where it finds its
// accumulator values, for the m16n8k16 fragments the Llama kernels use:
// - A (16 rows x 16 K, row-major, ldmatrix_x4): rows lane % 16 at column (lane / 16) 8, so registers 0-3 are
//   a0 (rows 0-7, K 0-7), a1 (rows 8-15, K 0-7), a2 (rows 0-7, K 8-15), a3 (rows 8-15, K 8-15).
// - B pair (16 N rows of K-contiguous storage, ldmatrix_x4): rows lane % 8 + (lane / 16) 8 at column
//   ((lane / 8) % 2) 8, so registers 0-1 / 2-3 are the B operands of the n8 fragments of rows 0-7 / 8-15.
// - B (8 N rows, ldmatrix_x2): rows lane % 8 at column ((lane / 8) % 2) 8.
// - Accumulator d: d0, d1 in row lane / 4 and d2, d3 in row lane / 4 + 8, each pair at columns 2 (lane % 4)
//   and the next.
__device__ __forceinline__ int a_fragment_row(int lane) {
  return lane % 16;
}
__device__ __forceinline__ int a_fragment_column(int lane) {
  return (lane / 16) * 8;
}
__device__ __forceinline__ int b_pair_row(int lane) {
  return lane % 8 + (lane / 16) * 8;
}
__device__ __forceinline__ int b_row(int lane) {
  return lane % 8;
}
__device__ __forceinline__ int b_column(int lane) {
  return ((lane / 8) % 2) * 8;
}
__device__ __forceinline__ int accumulator_row(int lane) {
  return lane / 4;
}
__device__ __forceinline__ int accumulator_column(int lane) {
  return 2 * (lane % 4);
}

/// d += a b for one m16n8k16 step (bf16 in, fp32 accumulate).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

} // namespace smcgraph::llama

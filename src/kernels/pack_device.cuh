// The pack stage in one CTA (pack.cu holds its general launch, verify_and_pack / pack_accepted, for any
// number of rows): the accepted draft tokens of rows < THREADS and one float of payload per position (their
// target log-probs in the speculative cycle), packed in row order with exclusive offsets and the total. The
// cycle's single-CTA end (commit.cu) runs it beside the commit, so the speculative cycle needs no pack node
// for buckets of up to one CTA of rows; the host reference is reference::pack, as for pack_accepted.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

namespace smcgraph::device {

/// What the single-CTA pack reads and writes: pack_accepted(AcceptedRows{accepted, rows, draft_steps,
/// draft_tokens, draft_row_stride}, PayloadView{payload, fp32, rows, 1, payload_row_stride}, no next token)
/// into PackOutputs{packed_payload, ..., offsets, total, packed_tokens}.
struct AcceptedPack {
  const int32_t* accepted = nullptr; ///< [rows], clamped to [0, draft_steps]; null: no pack
  int draft_steps = 0;
  const int32_t* draft_tokens = nullptr; ///< row r's d_1 .. d_K at r * draft_row_stride
  int64_t draft_row_stride = 0;
  const float* payload = nullptr; ///< row r's K values at r * payload_row_stride
  int64_t payload_row_stride = 0;
  float* packed_payload = nullptr;
  int32_t* packed_tokens = nullptr;
  int32_t* offsets = nullptr; ///< [rows] exclusive
  int32_t* total = nullptr;   ///< [1]
};

/// Every thread of the CTA calls it (a block scan); thread r packs row r < rows.
template <int THREADS>
__device__ __forceinline__ void
pack_accepted_block(const AcceptedPack& p, int rows,
                    typename cub::BlockScan<int, THREADS>::TempStorage& temp) {
  const int r = static_cast<int>(threadIdx.x);
  const int count = r < rows ? min(max(p.accepted[r], 0), p.draft_steps) : 0;
  int offset = 0, total = 0;
  cub::BlockScan<int, THREADS>(temp).ExclusiveSum(count, offset, total);
  if (r < rows) {
    p.offsets[r] = offset;
    for (int j = 0; j < count; ++j) {
      p.packed_tokens[offset + j] = p.draft_tokens[r * p.draft_row_stride + j];
      p.packed_payload[offset + j] = p.payload[r * p.payload_row_stride + j];
    }
  }
  if (r == 0)
    *p.total = total;
}

} // namespace smcgraph::device

// The decoding kernel's tiles (decode/kernel.cuh), which the host reads too: its split count and shared memory.
#pragma once

#include "cuteflash/common/tiles.h"

namespace cuteflash {

// The decoding kernel (decode/): a block of 4 warps reads a key row 8 elements per lane, by the power of two
// of lanes that covers the head dim, each lane `steps` rows of K and of V per chunk; a chunk is the keys of one
// pass. In registers (the sm70 family): 8 rows for a single query row, 4 beside the registers of 8 rows. With
// cp.async (the sm80 family), `stages` chunks in shared memory, kept in flight while the block computes. Several
// query rows (head dims up to 128) use tensor cores, 16 keys of a warp per product: mma.sync in the sm80 family,
// and WMMA in the sm70 family for more rows than its CUDA cores take (kDecodeMaxRows). The host's split count
// rounds to chunks.
constexpr int kDecodeMaxRows = 8;
constexpr int kDecodeMaxMmaRows = 16;
constexpr int decode_lanes_per_key(int head_dim) {
  return head_dim <= 32 ? 4 : head_dim <= 64 ? 8 : head_dim <= 128 ? 16 : 32;
}
constexpr bool decode_mma(int head_dim, int rows, bool async) {
  return async && rows > 1 && decode_lanes_per_key(head_dim) < 32;
}
constexpr bool decode_wmma(int head_dim, int rows, bool async) {
  return !async && rows > kDecodeMaxRows && decode_lanes_per_key(head_dim) < 32;
}
constexpr bool decode_tensor_cores(int head_dim, int rows, bool async) {
  return decode_mma(head_dim, rows, async) || decode_wmma(head_dim, rows, async);
}
// (8 where a whole warp reads one key row, so that a chunk holds at least 32 keys: a lane's share of a row.)
constexpr int decode_steps(int head_dim, int rows, bool async) {
  const int keys_per_step = 32 / decode_lanes_per_key(head_dim);
  if (decode_tensor_cores(head_dim, rows, async)) return keys_per_step >= 4 ? 4 : 16 / keys_per_step;
  if (keys_per_step == 1) return 8;
  return rows == 1 && !async ? 8 : 4;
}
// Two stages (one chunk in flight while one is computed), three for a single query row at head dims up to 64: on an
// H100 a third stage costs a single row at head dim 128 about 3 % (64k keys; a batch of 8 over 8k; two blocks per
// SM), and at head dim 64 it is worth 3.6 % to a batch of 32 over 8k keys (measured with four blocks per SM).
constexpr int decode_stages(int head_dim, int rows) { return decode_lanes_per_key(head_dim) >= 16 || rows > 1 ? 2 : 3; }
constexpr int decode_chunk(int head_dim, int rows, bool async) {
  return 4 * (32 / decode_lanes_per_key(head_dim)) * decode_steps(head_dim, rows, async);
}
// Its shared memory in bytes (DecodeTraits::SharedStorage): the stages, or the WMMA tiles (Q's, and each warp's K,
// V and S of a chunk), or, after them, O's parts of the 4 warps; the scores of a chunk and the rows' rescale factors
// where the warps share a softmax; two statistics per row, or per warp and row where each warp keeps its own.
constexpr int decode_smem_bytes(int head_dim, int rows, bool async) {
  const int chunk = decode_chunk(head_dim, rows, async);
  const int ring = async ? decode_stages(head_dim, rows) * 2 * decode_steps(head_dim, rows, async) * 128 * 16 : 0;
  const int o_part = 4 * rows * head_dim * 4;
  const int warp_keys = chunk / 4, ld = head_dim + 8;
  const int wmma = decode_wmma(head_dim, rows, async)
                       ? 16 * ld * 2 + 4 * (2 * warp_keys * ld * 2 + 16 * (warp_keys + 8) * 4 + 16 * 4)
                       : 0;
  const int front = ring > o_part ? (ring > wmma ? ring : wmma) : (o_part > wmma ? o_part : wmma);
  const bool own = rows == 1 || decode_tensor_cores(head_dim, rows, async);
  const int shared_softmax = own ? 4 + 4 : rows * chunk * 4 + rows * 4;  // scores, rescale factors
  return front + (shared_softmax + 8 * (own ? 4 * rows : rows) + 15) / 16 * 16;
}
// The most query rows per key-value head that the decoding kernel serves (seqlen_q x the GQA group): 8, and 16
// where it runs the products on tensor cores (head dims up to 128), the rows as the products' m = 16. A kernel is
// compiled for 1, 8 or 16 rows (decode_kernel_rows) and skips the rows past a call's.
constexpr int decode_max_rows(int head_dim) {
  return decode_lanes_per_key(head_dim) < 32 ? kDecodeMaxMmaRows : kDecodeMaxRows;
}
constexpr int decode_kernel_rows(int rows) {
  return rows == 1 ? 1 : rows <= kDecodeMaxRows ? kDecodeMaxRows : kDecodeMaxMmaRows;
}

}  // namespace cuteflash

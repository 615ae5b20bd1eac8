// The decoding kernel's tiles (decode/kernel.cuh), which the host reads too: its split count and shared memory.
#pragma once

#include "cuteflash/common/tiles.h"

namespace cuteflash {

// The decoding kernel (decode/): a block of 4 warps reads a key row 8 elements per lane, by the power of two
// of lanes that covers the head dim, each lane `steps` rows of K and of V per chunk; a chunk is the keys of one
// pass. In registers (a family without cp.async): 8 rows for a single query row, 4 beside the registers of 8 rows.
// With cp.async, `stages` chunks in shared memory, kept in flight while the block computes. Several query rows (head
// dims up to 128) run on the family's tensor cores from its DecodeConfig's tensor_min_rows on, 16 keys of a warp per
// product. The host's split count rounds to chunks.
constexpr int kDecodeMaxRows = 8;
constexpr int kDecodeMaxMmaRows = 16;
constexpr int decode_lanes_per_key(int head_dim) {
  return head_dim <= 32 ? 4 : head_dim <= 64 ? 8 : head_dim <= 128 ? 16 : 32;
}
// A family's choices for its decoding kernel (its FamilyTraits::kDecode): whether a chunk's K and V come with cp.async
// into a ring of shared-memory stages (else into registers, one chunk at a time, at the top of its pass); the fewest
// query rows its pass on tensor cores takes (head dims up to 128; fewer rows run on CUDA cores); and the shared
// memory of that pass's own tiles, where it has some besides the stages (a head dim and its warp's keys of a chunk).
struct DecodeConfig {
  bool async;
  int tensor_min_rows;
  int (*tensor_tile_bytes)(int head_dim, int warp_keys);  // null: none
};
constexpr bool decode_tensor_cores(int head_dim, int rows, DecodeConfig f) {
  return rows >= f.tensor_min_rows && decode_lanes_per_key(head_dim) < 32;
}
// (8 where a whole warp reads one key row, so that a chunk holds at least 32 keys: a lane's share of a row.)
constexpr int decode_steps(int head_dim, int rows, DecodeConfig f) {
  const int keys_per_step = 32 / decode_lanes_per_key(head_dim);
  if (decode_tensor_cores(head_dim, rows, f)) return keys_per_step >= 4 ? 4 : 16 / keys_per_step;
  if (keys_per_step == 1) return 8;
  return rows == 1 && !f.async ? 8 : 4;
}
// Two stages (one chunk in flight while one is computed), three for a single query row at head dims up to 64: on an
// H100 a third stage costs a single row at head dim 128 about 3 % (64k keys; a batch of 8 over 8k; two blocks per
// SM), and at head dim 64 it is worth 3.6 % to a batch of 32 over 8k keys (measured with four blocks per SM).
constexpr int decode_stages(int head_dim, int rows) { return decode_lanes_per_key(head_dim) >= 16 || rows > 1 ? 2 : 3; }
constexpr int decode_chunk(int head_dim, int rows, DecodeConfig f) {
  return 4 * (32 / decode_lanes_per_key(head_dim)) * decode_steps(head_dim, rows, f);
}
// Its shared memory in bytes (DecodeStorage): the stages, or the tensor-core pass's tiles, or, after them, O's parts
// of the 4 warps; the scores of a chunk and the rows' rescale factors where the warps share a softmax; two statistics
// per row, or per warp and row where each warp keeps its own.
constexpr int decode_smem_bytes(int head_dim, int rows, DecodeConfig f) {
  const int chunk = decode_chunk(head_dim, rows, f);
  const int ring = f.async ? decode_stages(head_dim, rows) * 2 * decode_steps(head_dim, rows, f) * 128 * 16 : 0;
  const int o_part = 4 * rows * head_dim * 4;
  const bool tensor_cores = decode_tensor_cores(head_dim, rows, f);
  const int tiles = tensor_cores && f.tensor_tile_bytes != nullptr ? f.tensor_tile_bytes(head_dim, chunk / 4) : 0;
  const int front = ring > o_part ? (ring > tiles ? ring : tiles) : (o_part > tiles ? o_part : tiles);
  const bool own = rows == 1 || tensor_cores;
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

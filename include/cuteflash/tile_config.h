// Tile sizes per (family, head dim, direction). constexpr so that both the kernels (as template
// arguments) and the host (to choose a variant that fits the device's shared memory) read one table.
#pragma once

namespace cuteflash {

struct TileConfig {
  int block_m;  // query rows per thread block
  int block_n;  // key/value rows per main-loop step
  int n_warps;

  constexpr int smem_bytes_fwd(int head_dim, int elem_bytes) const {
    return (block_m + 2 * block_n) * head_dim * elem_bytes;  // sQ (reused for sO), sK, sV
  }
};

// Head dims that get a kernel; other head dims run the next larger one with the extra columns
// masked off. Few instantiations keep the build short.
constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

constexpr int round_up_head_dim(int d) {
  for (int hd : kHeadDims) {
    if (d <= hd) return hd;
  }
  return -1;
}

// sm80 forward, for devices with large shared memory (A100: 163 KB, H100/H200: 227 KB).
// 128x128 with 4 warps for d <= 64 and 128x64 for d <= 128 follow FlashAttention-2's choices on sm80/sm90;
// larger head dims use 8 warps so that the O accumulator stays within the register file. Causal d <= 64
// takes 128x64, which needs no local memory (128x128 spills there) and is 5-8 % faster on H200; without
// a mask 128x128 is the faster one.
constexpr TileConfig sm80_fwd_tile(int head_dim, bool causal) {
  return head_dim <= 64    ? TileConfig{128, causal ? 64 : 128, 4}
         : head_dim <= 128 ? TileConfig{128, 64, 4}
                           : TileConfig{128, 64, 8};
}

// The opt-in shared memory per block of sm86, sm89 and sm120 GPUs (99 KB).
constexpr int kSmallSmemBytes = 101376;

// sm80 forward for devices with about 99 KB of shared memory per block (sm86, sm89, sm120): the
// large-memory tile of head dims 224 and 256 does not fit there.
constexpr TileConfig sm80_fwd_tile_small_smem(int head_dim, bool causal) {
  return head_dim <= 192 ? sm80_fwd_tile(head_dim, causal) : TileConfig{64, 64, 4};
}

// sm80 backward tile: block_m query rows per inner step, block_n key rows per thread block, 8 warps.
// The block keeps dK and dV for its keys in registers. The atom counts say how the 8 warps split each
// product: atom_m_sdp warps along the queries of S and dP (the rest along the keys), atom_n_dkv along
// the keys of dK and dV, atom_m_dq along the queries of dQ. q_stages = 2 double-buffers Q, so that the
// next block's Q loads while this block's products run.
struct BwdTile {
  int block_m;
  int block_n;
  int atom_m_sdp;
  int atom_n_dkv;
  int atom_m_dq;
  int q_stages;

  // sQ (q_stages buffers), sdO, sK, sV, and sP, sdS (block_m x block_n each).
  constexpr int smem_bytes(int head_dim, int elem_bytes) const {
    return (((q_stages + 1) * block_m + 2 * block_n) * head_dim + 2 * block_m * block_n) * elem_bytes;
  }
};

// The opt-in shared memory per block of H100/H200 (227 KB) and A100 (163 KB).
constexpr int kSmemSm90Bytes = 232448;
constexpr int kSmemSm80Bytes = 166912;

// The backward tiles to try for a head dim, best first (i < kBwdTileChoices): the preferred tile,
// then smaller ones for smaller shared memory. Key blocks of 128 only up to head dim 128 (dK and dV
// live in registers).
constexpr int kBwdTileChoices = 5;
constexpr BwdTile sm80_bwd_tile_choice(int head_dim, int i) {
  // dQ's warps split the head dim in 64-column tiles when there are whole ones, else in 32-column tiles.
  const int dq = head_dim % 64 == 0 ? 2 : 4;
  if (i == 0) {
    return head_dim <= 64    ? BwdTile{128, 128, 4, 4, 4, 2}
           : head_dim <= 128 ? BwdTile{64, 128, 2, 4, dq, 2}
                             : BwdTile{64, 64, 2, 4, 4, 2};
  }
  if (head_dim > 128 && i < 3) return sm80_bwd_tile_choice(head_dim, 0);
  return i == 1   ? BwdTile{64, 128, 2, 4, dq, 2}
         : i == 2 ? BwdTile{64, 128, 2, 4, dq, 1}
         : i == 3 ? BwdTile{64, 64, 2, 4, 4, 2}
                  : BwdTile{64, 64, 2, 4, 4, 1};
}

// The backward tile for a head dim on a device offering smem_budget bytes per block: the first choice
// that fits. Where none fits, the tile of the smallest budget (of the three above) where one does, so
// that no kernel is compiled that could never run: its launch reports the shortfall.
constexpr BwdTile sm80_bwd_tile(int head_dim, int smem_budget) {
  for (int budget : {smem_budget, kSmemSm80Bytes, kSmemSm90Bytes}) {
    if (budget < smem_budget) continue;
    for (int i = 0; i < kBwdTileChoices; ++i) {
      BwdTile t = sm80_bwd_tile_choice(head_dim, i);
      if (t.smem_bytes(head_dim, 2) <= budget) return t;
    }
  }
  return sm80_bwd_tile_choice(head_dim, 0);
}

// ---- sm70 family (Volta: 96 KB of shared memory per block, Turing: 64 KB) ----
// The launchers try the choices i < kSm70TileChoices from the first and compile only those some GPU of
// the family would run (sm70/launch.h).
constexpr int kSm70TileChoices = 3;

// sm70 forward: block_m = 16 query rows x row tiles per warp x n_warps. Up to head dim 128, 32 query rows
// per warp (each K and V fragment serves two 16-row tiles) x 32 keys per step: 48 KB at d=64 (two blocks
// per SM on a V100, one on a T4), 73 KB at d=128 (V100); about 10 % faster without a mask than 16 rows per
// warp x 64 keys. Above, 64 x 64. Then 64 x 32, and 32 x 32 on 2 warps (T4 at head dims 192-256).
constexpr TileConfig sm70_fwd_tile_choice(int head_dim, int i) {
  if (i == 0) return head_dim <= 128 ? TileConfig{128, 32, 4} : TileConfig{64, 64, 4};
  return i == 1 ? TileConfig{64, 32, 4} : TileConfig{32, 32, 2};
}

// How a step of the sm70 backward gets its Q and dO (kBlockM rows each) into shared memory while the
// step before runs (Volta has no cp.async).
enum class Sm70QStaging {
  // Loaded into registers during the step before, stored at the step's top. At head dim 64, where the
  // products are short and the loads' latency would show.
  kRegisters,
  // Prefetched into L2 during the step before, copied at the step's top, holding no registers through
  // the products. Above head dim 64, where registers are the scarcest (dK and dV take 64 of 128 at d=128):
  // 8 % faster there than kRegisters, with which ptxas spills the loaded registers at once.
  kPrefetch,
  // Two shared regions that trade roles each step: one holds the step's Q and dO, the other S and dP and
  // then, once P and dS are made, the next step's Q and dO: a step begins with one barrier instead of a
  // copy between two. Costs a region, and the warps' staging tiles, which then cannot alias the scratch:
  // 96 KB at d=128, all a V100 has. 3.5 % faster than kPrefetch at d=128, slower at d=64.
  kPingPong,
};

// sm70 backward: block_m query rows per step, block_n keys per thread block, 8 warps.
struct Sm70BwdTile {
  int block_m;
  int block_n;
  Sm70QStaging staging;
};

// 32 x 64, with kPingPong above head dim 64 (V100 up to d=128); 32 x 32; 16 x 32 (T4 at head dims 192-256).
constexpr Sm70BwdTile sm70_bwd_tile_choice(int head_dim, int i) {
  const Sm70QStaging staging = head_dim <= 64 ? Sm70QStaging::kRegisters : Sm70QStaging::kPrefetch;
  if (i == 0) return {32, 64, head_dim <= 64 ? staging : Sm70QStaging::kPingPong};
  return i == 1 ? Sm70BwdTile{32, 32, staging} : Sm70BwdTile{16, 32, staging};
}

// The decoding kernel (decode.cuh): a block of 4 warps reads a key row 8 elements per lane, by the power of two
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
// The most splits of the keys a forward pass makes (the decoding kernel, and the tiled kernels for KV caches), and
// the fewest keys per split that the tiled kernels and the decoding kernel's tensor-core path choose: fewer would
// cost more in Q's load, O's fp32 part and its merge per split than their keys.
constexpr int kMaxSplits = 128;
constexpr int kMinKeysPerSplit = 256;

}  // namespace cuteflash

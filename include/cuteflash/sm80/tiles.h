// The sm80 family's tiles per (head dim, direction). constexpr: the kernels take them as template arguments, the
// launchers read them to choose the variant that fits the device's shared memory.
#pragma once

#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"

namespace cuteflash {

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

}  // namespace cuteflash

namespace cuteflash::sm80 {

// What the host (host/registry.h, through the generated dispatch) and the shared decoding kernel know of the family.
struct FamilyTraits {
  // The decoding kernel (decode/) reads the keys with cp.async, through shared memory, and runs from 2 query rows on
  // on tensor cores (decode_pass.cuh: mma.sync on the stages, no tiles of its own).
  static constexpr DecodeConfig kDecode{true, 2, nullptr};
  // D = rowsum(dO * O) may live in dq's memory where the pass is not deterministic: the atomic path writes dq only
  // in its last kernel, which reads dq_accum, not D.
  static constexpr bool kRowsumInDq = true;
  // The forward tile by which the tiled kernels' key splits are planned (api.cpp's tiled_split_count).
  static constexpr TileConfig split_tile(int head_dim) { return sm80_fwd_tile(head_dim, false); }
};

}  // namespace cuteflash::sm80

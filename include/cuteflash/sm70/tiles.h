// The sm70 family's tiles (Volta: 96 KB of shared memory per block, Turing: 64 KB). The launchers try the choices
// i < kSm70TileChoices from the first and compile only those some GPU of the family would run (sm70/launch.h).
#pragma once

#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"

namespace cuteflash {

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

}  // namespace cuteflash

namespace cuteflash::sm70 {

// What the host (host/registry.h, through the generated dispatch) and the shared decoding kernel know of the family.
// The decoding kernel's WMMA tiles (decode_pass.cuh), rows padded by 16 bytes: Q's 16 rows, and per warp (4) its
// keys' K and V rows of a chunk, its S (fp32, 16 x its keys, rows padded by 8) and its rows' rescale factors.
constexpr int decode_wmma_tile_bytes(int head_dim, int warp_keys) {
  const int ld = head_dim + 8;
  return 16 * ld * 2 + 4 * (2 * warp_keys * ld * 2 + 16 * (warp_keys + 8) * 4 + 16 * 4);
}

struct FamilyTraits {
  // The decoding kernel (decode/) reads the keys into registers (Volta has no cp.async), and runs more query rows
  // than its CUDA cores take on WMMA (decode_pass.cuh), through tiles of its own.
  static constexpr DecodeConfig kDecode{false, kDecodeMaxRows + 1, &decode_wmma_tile_bytes};
  // D = rowsum(dO * O) needs its own buffer: the dK/dV kernel's last block of a head converts dQ while other blocks
  // still read D.
  static constexpr bool kRowsumInDq = false;
  // The forward tile by which the tiled kernels' key splits are planned (api.cpp's tiled_split_count).
  static constexpr TileConfig split_tile(int head_dim) { return sm70_fwd_tile_choice(head_dim, 0); }
};

}  // namespace cuteflash::sm70

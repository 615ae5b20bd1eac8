// The sm75 family's tiles (Turing: T4, RTX 20xx). Chosen for a T4, which no machine here has: 64 KB of shared
// memory per block and per SM, 64 K registers and at most 1024 threads per SM, 40 SMs, 320 GB/s.
#pragma once

#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"
#include "cuteflash/sm70/tiles.h"
#include "cuteflash/sm80/tiles.h"

namespace cuteflash {

// sm75 forward: block_m query rows of 16 per warp, block_n keys per step. Q, K and V tiles in shared memory:
// (block_m + 2 block_n) x head_dim halves. 128 x 128 on 8 warps up to head dim 64 (48 KB: one block of 8 warps
// per SM, O in 32 and S in 64 registers per thread); 128 x 64 on 8 warps up to 128 (64 KB, all an SM has; O 64
// and S 32 registers); above, 64 x 32 on 4 warps (at most 64 KB at 256, where O alone takes 128 registers).
constexpr TileConfig sm75_fwd_tile(int head_dim) {
  return head_dim <= 64 ? TileConfig{128, 128, 8} : head_dim <= 128 ? TileConfig{128, 64, 8} : TileConfig{64, 32, 4};
}

// A T4 offers 64 KB of shared memory per block: every kernel head dim's tile fits it.
constexpr bool sm75_fwd_tiles_fit(int smem_bytes) {
  for (int head_dim : kHeadDims) {
    if (sm75_fwd_tile(head_dim).smem_bytes_fwd(head_dim, 2) > smem_bytes) return false;
  }
  return true;
}
static_assert(sm75_fwd_tiles_fit(65536));

// sm75 backward (the sm80 family's kernel, 8 warps; BwdTile in sm80/tiles.h), within a T4's 64 KB: a thread block
// holds dK and dV of its 64 keys in registers (32 each at head dim 64, 64 at 128). Up to head dim 64, 64 query rows
// a step with Q double-buffered (56 KB); at 96 Q single (64 KB); at 128, 32 rows with Q double (64 KB; 64 rows would
// need 80). Above, no 8-warp tile fits: dS's 16-column warp tiles need 128 keys of S at 16 rows, and 32 x 32 needs
// 68 KB; those head dims run the sm70 family's backward (bwd_launch.cuh).
constexpr int kSm75BwdMaxHeadDim = 128;
constexpr BwdTile sm75_bwd_tile(int head_dim) {
  return head_dim <= 64   ? BwdTile{64, 64, 2, 4, 4, 2}
         : head_dim <= 96 ? BwdTile{64, 64, 2, 4, 4, 1}
                          : BwdTile{32, 64, 2, 4, 2, 2};
}

constexpr bool sm75_bwd_tiles_fit(int smem_bytes) {
  for (int head_dim : kHeadDims) {
    if (head_dim <= kSm75BwdMaxHeadDim && sm75_bwd_tile(head_dim).smem_bytes(head_dim, 2) > smem_bytes) return false;
  }
  return true;
}
static_assert(sm75_bwd_tiles_fit(65536));

}  // namespace cuteflash

namespace cuteflash::sm75 {

// What the host (host/registry.h, through the generated dispatch) and the shared decoding kernel know of the family.
struct FamilyTraits {
  // The decoding kernel is the sm70 family's (decode_launch.cuh): keys read into registers, WMMA for several rows.
  static constexpr DecodeConfig kDecode = sm70::FamilyTraits::kDecode;
  // D = rowsum(dO * O) needs its own buffer: above head dim 128 the backward is the sm70 family's (see kRowsumInDq
  // there).
  static constexpr bool kRowsumInDq = false;
  // The forward tile by which the tiled kernels' key splits are planned (api.cpp's tiled_split_count).
  static constexpr TileConfig split_tile(int head_dim) { return sm75_fwd_tile(head_dim); }
};

}  // namespace cuteflash::sm75

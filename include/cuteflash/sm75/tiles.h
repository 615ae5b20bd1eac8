// The sm75 family's tiles (Turing: T4, RTX 20xx). Chosen for a T4, which no machine here has: 64 KB of shared
// memory per block and per SM, 64 K registers and at most 1024 threads per SM, 40 SMs, 320 GB/s.
#pragma once

#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"
#include "cuteflash/sm70/tiles.h"

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

}  // namespace cuteflash

namespace cuteflash::sm75 {

// What the host (host/registry.h, through the generated dispatch) and the shared decoding kernel know of the family.
struct FamilyTraits {
  // The decoding kernel is the sm70 family's (decode_launch.cuh): keys read into registers, WMMA for several rows.
  static constexpr DecodeConfig kDecode = sm70::FamilyTraits::kDecode;
  // (No backward yet: the registry lists the forward only.)
  static constexpr bool kRowsumInDq = false;
  // The forward tile by which the tiled kernels' key splits are planned (api.cpp's tiled_split_count).
  static constexpr TileConfig split_tile(int head_dim) { return sm75_fwd_tile(head_dim); }
};

}  // namespace cuteflash::sm75

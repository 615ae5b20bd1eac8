// The sm90 family's tiles (Hopper: H100, H200, GH200; 227 KB of shared memory per block, 64 K registers per SM).
// Plain C++: the host (dispatch.cpp, through host/registry.h) reads FamilyTraits.
#pragma once

#include "cuteflash/common/tiles.h"
#include "cuteflash/sm80/tiles.h"

namespace cuteflash {

// sm90 forward: a producer warpgroup issues the TMA loads of Q and of K and V into `stages` buffers each; consumer
// warpgroups of 64 query rows each compute S = Q K^T and O += P V with wgmma. The shared memory holds Q and the
// stages of K and V: (block_m + 2 stages block_n) x head_dim elements.
struct Sm90FwdTile {
  int block_m;  // query rows per thread block: 64 per consumer warpgroup
  int block_n;  // keys per step
  int stages;   // K and V buffers

  constexpr int consumer_warpgroups() const { return block_m / 64; }
  constexpr int threads() const { return 128 * (consumer_warpgroups() + 1); }
  constexpr int smem_bytes(int head_dim, int elem_bytes) const {
    return (block_m + 2 * stages * block_n) * head_dim * elem_bytes;
  }
};

// The keys per step shrink as the head dim grows, so that S (block_n / 2 fp32 registers a consumer thread), P (block_n
// / 4) and O (head_dim / 2) fit a consumer's registers, and Q, K and V the shared memory. Up to head dim 64, three
// consumer warpgroups (192 rows; 160 registers a thread) of 128 keys; above, two (128 rows; 240 registers; at 96 three
// leave ptxas too few registers to keep the products asynchronous): 128 keys up to 96, at 128 176 without a mask
// (212 KB) and 128 causal (fewer keys beside the diagonal masked for nothing), 112 up to 192 (216 KB), 80 above
// (224 KB at 256).
constexpr Sm90FwdTile sm90_fwd_tile(int head_dim, bool causal) {
  return head_dim <= 64    ? Sm90FwdTile{192, 128, 2}
         : head_dim <= 96  ? Sm90FwdTile{128, 128, 2}
         : head_dim <= 128 ? Sm90FwdTile{128, causal ? 128 : 176, 2}
         : head_dim <= 192 ? Sm90FwdTile{128, 112, 2}
                           : Sm90FwdTile{128, 80, 2};
}

// The forward tile of the kernels with options (windows, softcap, ALiBi): the causal one, but of two consumer
// warpgroups up to head dim 64, where three leave ptxas too few registers beside the options' values to keep the
// products asynchronous (it serialises the wgmma).
constexpr Sm90FwdTile sm90_fwd_options_tile(int head_dim) {
  return head_dim <= 64 ? Sm90FwdTile{128, 128, 2} : sm90_fwd_tile(head_dim, true);
}

// sm90 backward: a thread block owns block_n keys and walks the query blocks of block_m rows that see them, Q and dO
// in `stages` buffers each; two consumer warpgroups hold the keys' dK and dV in registers: 64 keys each up to head dim
// 128 (head_dim / 2 fp32 of each a thread); above, 64 keys together, each warpgroup half of the head dim (head_dim / 4
// of each a thread). The shared memory holds K, V, the stages of Q and dO, and two buffers of dS (and of P above 128),
// (2 block_n + 2 stages block_m) x head_dim + 2 (or 4) block_n x block_m elements, the stages' lse and D in fp32, and
// up to 128 a block's dQ in fp32, block_m x head_dim (above, each thread adds its dQ to global memory itself).
struct Sm90BwdTile {
  int block_m;
  int block_n;
  int stages;

  // 64 keys a block (above head dim 128): the consumer warpgroups split the head dim (BwdTraits::kSplitsHeadDim).
  constexpr bool splits_head_dim() const { return block_n == 64; }
  constexpr int smem_bytes(int head_dim, int elem_bytes) const {
    return ((2 * block_n + 2 * stages * block_m) * head_dim + (splits_head_dim() ? 4 : 2) * block_n * block_m) *
               elem_bytes +
           ((splits_head_dim() ? 0 : block_m * head_dim) + 2 * stages * block_m) * 4;
  }
};

// 128 query rows a step up to head dim 64 (the step's products then carry as much work as at 128, and dQ's wgmma are
// 64 x head_dim a warpgroup), 64 above (S^T, dP^T and the rows' statistics fill the registers); 64 keys a block above
// 128 (dK and dV of 64 keys x 256 take 128 registers a thread, split between the warpgroups).
constexpr Sm90BwdTile sm90_bwd_tile(int head_dim) {
  return head_dim <= 64 ? Sm90BwdTile{128, 128, 2} : head_dim <= 128 ? Sm90BwdTile{64, 128, 2} : Sm90BwdTile{64, 64, 2};
}

// The forward tile of the kernels that read a paged cache: that of the kernels with options, with a third buffer of K
// and of V where the shared memory holds it (head dims up to 128), so that the loads of a block's 16-row slices, each
// behind its page's lookup, start a block earlier.
constexpr Sm90FwdTile sm90_fwd_paged_tile(int head_dim) {
  const Sm90FwdTile tile = sm90_fwd_options_tile(head_dim);
  const Sm90FwdTile deeper{tile.block_m, tile.block_n, 3};
  return deeper.smem_bytes(head_dim, 2) + 1024 <= kSmemSm90Bytes ? deeper : tile;
}

constexpr bool sm90_tiles_fit(int smem_bytes) {
  for (int head_dim : kHeadDims) {
    for (bool causal : {false, true}) {
      // 1 KB for the barriers and the alignment of the swizzled tiles.
      if (sm90_fwd_tile(head_dim, causal).smem_bytes(head_dim, 2) + 1024 > smem_bytes) return false;
    }
    if (sm90_fwd_options_tile(head_dim).smem_bytes(head_dim, 2) + 1024 > smem_bytes) return false;
    if (sm90_bwd_tile(head_dim).smem_bytes(head_dim, 2) + 1024 > smem_bytes) return false;
  }
  return true;
}
static_assert(sm90_tiles_fit(kSmemSm90Bytes));

}  // namespace cuteflash

namespace cuteflash::sm90 {

// What the host (host/registry.h, through the generated dispatch) knows of the family; its decoding kernel, and the
// DecodeConfig the host plans it with, are the sm80 family's (the registry's decode_from).
struct FamilyTraits {
  // D = rowsum(dO * O) may live in dq's memory: the main kernel reads it before dq is written (from dq_accum, by the
  // kernel after it). Calls its backward does not take run the sm80 family's, whose rule this is too.
  static constexpr bool kRowsumInDq = true;
  static_assert(kRowsumInDq == sm80::FamilyTraits::kRowsumInDq);
  // The forward tile by which the tiled kernels' key splits are planned: that of the kernels with options, which read
  // the KV caches (a block of 8 or more warps a multiprocessor).
  static constexpr TileConfig split_tile(int head_dim) {
    const Sm90FwdTile tile = sm90_fwd_options_tile(head_dim);
    return TileConfig{tile.block_m, tile.block_n, tile.threads() / 32};
  }
};

}  // namespace cuteflash::sm90

// Compile-time configuration of one sm75 kernel: the sm80 family's tiles, shared-memory layouts and epilogue copies
// with Turing's instructions: mma.sync.m16n8k8 (fp16, fp32 accumulation) fed by ldmatrix, and global-to-shared
// copies through registers (Turing has no cp.async).
#pragma once

#include <cute/tensor.hpp>

#include "cuteflash/sm75/tiles.h"
#include "cuteflash/sm80/traits.h"

namespace cuteflash::sm75 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits : sm80::FwdTraits<half_t, kHeadDim_, kBlockM_, kBlockN_, kNWarps_> {
  using Base = sm80::FwdTraits<half_t, kHeadDim_, kBlockM_, kBlockN_, kNWarps_>;

  // m16n8k8 atoms, warps stacked along M (16 rows each, so the softmax's rows never leave a warp), tiles of 32
  // columns by 8 of K: one ldmatrix.x2 feeds a warp's 16 x 8 of Q, one ldmatrix.x4 its 32 keys x 8 of K, and one
  // ldmatrix.x4.trans 32 columns x 8 keys of V^T. An m16n8 accumulator is the A operand of the next product as it is
  // (acc_as_a_operand<8>).
  using TiledMma = TiledMMA<MMA_Atom<SM75_16x8x8_F32F16F16F32_TN>, Layout<Shape<Int<kNWarps_>, _1, _1>>,
                            Tile<Int<16 * kNWarps_>, _32, _8>>;
  static constexpr int kMmaK = 8;
  static_assert(kBlockM_ == 16 * kNWarps_ && kBlockN_ % 32 == 0 && kHeadDim_ % 32 == 0);
  using SmemCopyAtomA = Copy_Atom<SM75_U32x2_LDSM_N, half_t>;
  using SmemCopyAtomB = Copy_Atom<SM75_U32x4_LDSM_N, half_t>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, half_t>;

  // Global -> shared: 16 bytes per thread through a register, in the sm80 family's thread layout.
  static constexpr bool kCpAsync = false;
  using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, half_t>{},
                                                    typename Base::GmemThreadLayout{}, typename Base::GmemValLayout{}));
};

template <int kHeadDim>
struct FwdTraitsSelect {
  static constexpr TileConfig kTile = sm75_fwd_tile(kHeadDim);
  using type = FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.n_warps>;
};

// The backward's products with m16n8k8: a warp's k-slice of each operand is 16 rows (or columns) by 8, one ldmatrix.x2
// (.trans for the transposed ones).
struct BwdInstructions {
  using MmaAtom = MMA_Atom<SM75_16x8x8_F32F16F16F32_TN>;
  static constexpr int kMmaK = 8;
  using SmemCopyAtom = Copy_Atom<SM75_U32x2_LDSM_N, half_t>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x4_LDSM_T, half_t>;
  using GmemCopyAtom = Copy_Atom<UniversalCopy<uint128_t>, half_t>;
  static constexpr bool kCpAsync = false;  // the query blocks come a step ahead through registers (bwd_kernel.cuh)
};

template <int kHeadDim>
struct BwdTraitsSelect {
  static constexpr BwdTile kTile = sm75_bwd_tile(kHeadDim);
  using type = sm80::BwdTraits<half_t, kHeadDim, kTile.block_m, kTile.block_n, kTile.atom_m_sdp, kTile.atom_n_dkv,
                               kTile.atom_m_dq, kTile.q_stages, BwdInstructions>;
};

// The deterministic backward's dQ kernel: the forward's shape (sm80/bwd_kernel.cuh's DqTraits), Turing's instructions.
template <int kHeadDim>
using DqTraits = FwdTraits<kHeadDim, 64, 64, 4>;

}  // namespace cuteflash::sm75

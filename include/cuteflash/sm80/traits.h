// Compile-time configuration of one sm80 kernel: element type, tile shape, MMA, shared-memory layouts
// and the copies between global, shared and register memory.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "cuteflash/sm80/tiles.h"

namespace cuteflash::sm80 {

using namespace cute;

// mma.sync.m16n8k16 with fp32 accumulation.
template <typename Element>
using MmaAtomOf = std::conditional_t<std::is_same_v<Element, half_t>, MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, half_t> || std::is_same_v<Element, bfloat16_t>);

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  // mma.sync.m16n8k16, fp32 accumulation. Warps are stacked along M (each owns kBlockM / kNWarps query
  // rows, so the row statistics of the softmax never leave a warp); the 16-wide N tile lets one
  // ldmatrix.x4 feed two n8 MMAs.
  using MmaAtom = MmaAtomOf<Element>;
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;
  static_assert(kBlockM % (16 * kNWarps) == 0);
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0);

  // Shared memory: rows of 64 (or 32) elements, XOR-swizzled in 16-byte chunks so that the ldmatrix
  // reads of 8 rows and the 16-byte cp.async writes of a row both hit 8 different bank groups.
  static constexpr int kSmemRowElems = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRowElems == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                                              Layout<Shape<_8, Int<kSmemRowElems>>, Stride<Int<kSmemRowElems>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V read as V^T, (kHeadDim, kBlockN), for the B operand of O += P V.
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutO = SmemLayoutQ;

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomA = SmemCopyAtom;  // the forward's Q, for S = Q K^T
  using SmemCopyAtomB = SmemCopyAtom;  // its K
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;
  static constexpr int kMmaK = 16;  // the MMA's K, for acc_as_a_operand

  // Global <-> shared: 16 bytes (8 elements) per thread per copy, a row of the smem atom per
  // kGmemThreadsPerRow threads, so each warp reads whole 128-byte (or 64-byte) row segments.
  static constexpr int kGmemElemsPerCopy = 8;
  static constexpr int kGmemThreadsPerRow = kSmemRowElems / kGmemElemsPerCopy;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemThreadLayout =
      Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemValLayout = Layout<Shape<_1, Int<kGmemElemsPerCopy>>>;
  static constexpr bool kCpAsync = true;  // GmemTiledCopyQKV and the paged copies are cp.async
  using GmemTiledCopyQKV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                                                    GmemThreadLayout{}, GmemValLayout{}));
  using GmemTiledCopyO =
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreadLayout{}, GmemValLayout{}));
  static_assert(kBlockM % (kNThreads / kGmemThreadsPerRow) == 0);
  static_assert(kBlockN % (kNThreads / kGmemThreadsPerRow) == 0);

  struct SharedStorage {
    // sO reuses sQ: Q is last read by the final S = Q K^T, before the epilogue writes O.
    union {
      array_aligned<Element, cosize_v<SmemLayoutQ>> q;
      array_aligned<Element, cosize_v<SmemLayoutO>> o;
    };
    array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>> v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes == TileConfig{kBlockM, kBlockN, kNWarps}.smem_bytes_fwd(kHeadDim, sizeof(Element)));
};

// The traits of the tile chosen for a head dim and mask, on a large- or a small-shared-memory device.
template <typename Element, int kHeadDim, bool kSmallSmem, bool kCausal = false>
struct FwdTraitsSelect {
  static constexpr TileConfig kTile =
      kSmallSmem ? sm80_fwd_tile_small_smem(kHeadDim, kCausal) : sm80_fwd_tile(kHeadDim, kCausal);
  using type = FwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.n_warps>;
};

// The instructions the backward's tiles are made of: its MMA (kMmaK deep), the ldmatrix copies that feed it (normal and
// transposed, one k-slice of a warp's operand each) and the global-to-shared copy (kCpAsync: asynchronous). A family
// with other instructions passes its own (sm75/traits.h).
template <typename Element>
struct BwdInstructions {
  using MmaAtom = MmaAtomOf<Element>;
  static constexpr int kMmaK = 16;
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using GmemCopyAtom = Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>;
  static constexpr bool kCpAsync = true;
};

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kAtomMSdP, int kAtomNdKV, int kAtomMdQ,
          int kQStages_, typename Instructions = BwdInstructions<Element_>>
struct BwdTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, half_t> || std::is_same_v<Element, bfloat16_t>);

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step of the loop
  static constexpr int kBlockN = kBlockN_;  // key rows of this thread block
  static constexpr int kQStages = kQStages_;
  static constexpr BwdTile kTile{kBlockM, kBlockN, kAtomMSdP, kAtomNdKV, kAtomMdQ, kQStages};
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;

  // Each product's warps: kAtom* of them along its first mode, the rest along the second; the 16-wide
  // tile in that second mode lets one ldmatrix.x4 feed two n8 MMAs (m16n8k16). No row statistics are needed (P
  // comes from the saved log-sum-exp), so the warps may split the keys of S and dP.
  using MmaAtom = typename Instructions::MmaAtom;
  using MmaK = Int<Instructions::kMmaK>;
  template <int kAtomM>
  using WarpTiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kAtomM>, Int<kNWarps / kAtomM>, _1>>,
                                Tile<Int<16 * kAtomM>, Int<16 * kNWarps / kAtomM>, MmaK>>;
  // S = Q K^T, dP = dO V^T: (kBlockM, kBlockN). Each warp's two n8 tiles in the 16-wide tile are 16 adjacent
  // columns, as dropout's units need (dropout.cuh, for_each_kept).
  static constexpr int kWarpsNSdP = kNWarps / kAtomMSdP;
  using TiledMmaSdP =
      TiledMMA<MmaAtom, Layout<Shape<Int<kAtomMSdP>, Int<kWarpsNSdP>, _1>>,
               Tile<Int<16 * kAtomMSdP>, Layout<Shape<_8, Int<kWarpsNSdP>, _2>, Stride<_1, _16, _8>>, MmaK>>;
  using TiledMmadKV = WarpTiledMma<kAtomNdKV>;  // dV += P^T dO, dK += dS^T Q: (kBlockN, kHeadDim)
  using TiledMmadQ = WarpTiledMma<kAtomMdQ>;    // dQ = dS K: (kBlockM, kHeadDim)
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (16 * kNWarps / kAtomMSdP) == 0);
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * kNWarps / kAtomNdKV) == 0);
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * kNWarps / kAtomMdQ) == 0);
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0);

  using Fwd = FwdTraits<Element, kHeadDim, 128, kBlockN, 8>;  // for the shared smem atom and copies
  using SmemLayoutQ = decltype(tile_to_shape(typename Fwd::SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Fwd::SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Transposed views, read with ldmatrix.trans: Q^T and dO^T (kHeadDim, kBlockM), K^T (kHeadDim, kBlockN).
  using SmemLayoutQt =
      decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // P and dS, (kBlockM, kBlockN), and their transposes (kBlockN, kBlockM).
  using SmemLayoutAtomPdS = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt =
      decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  using SmemCopyAtom = typename Instructions::SmemCopyAtom;
  using SmemCopyAtomTransposed = typename Instructions::SmemCopyAtomTransposed;
  using SmemCopyAtomPdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  static constexpr int kGmemThreadsPerRow = Fwd::kGmemThreadsPerRow;
  using GmemThreadLayout =
      Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>;
  static constexpr bool kCpAsync = Instructions::kCpAsync;  // GmemTiledCopy is cp.async
  using GmemTiledCopy = decltype(make_tiled_copy(typename Instructions::GmemCopyAtom{}, GmemThreadLayout{},
                                                 typename Fwd::GmemValLayout{}));
  static_assert(kBlockM % (kNThreads / kGmemThreadsPerRow) == 0);

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ> * kQStages> q;  // stage s at q.data() + s * size(SmemLayoutQ)
    array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    array_aligned<Element, cosize_v<SmemLayoutPdS>> p;
    array_aligned<Element, cosize_v<SmemLayoutPdS>> ds;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes == kTile.smem_bytes(kHeadDim, sizeof(Element)));
};

// The traits of the backward tile for a device with smem_budget bytes of shared memory per block.
template <typename Element, int kHeadDim, int kSmemBudget>
struct BwdTraitsSelect {
  static constexpr BwdTile kTile = sm80_bwd_tile(kHeadDim, kSmemBudget);
  using type = BwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.atom_m_sdp, kTile.atom_n_dkv,
                         kTile.atom_m_dq, kTile.q_stages>;
};

}  // namespace cuteflash::sm80

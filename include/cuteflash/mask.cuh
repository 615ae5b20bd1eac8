// The mask of a sequence (mask.h's policy, built from the params and the sequence) and its application to
// a score tile.
#pragma once

#include "cuteflash/mask.h"
#include "cuteflash/params.h"
#include "cuteflash/sequence.cuh"
#include "cuteflash/utils.cuh"

namespace cuteflash {

// Which keys each query row of the sequence sees. Cheap to rebuild at each use: a copy kept across a
// kernel's main loop holds registers that the loop needs (it spilled in the sm80 forward kernel).
__device__ __forceinline__ MaskPolicy<false> mask_policy(FwdParams const& p, Sequence const& seq) {
  return MaskPolicy<false>::make(seq.seqlen_q, seq.seqlen_k, p.causal);
}

// s: scores in (rows, cols) view; coord: the matching (row, col) positions inside the tile.
// row0/col0: the tile's first query row and key column. Scores of keys a row does not see become -inf
// (keys past seqlen_k included); a row's first key is tested only where the policy bounds the left side.
template <bool kWindow, typename STensor, typename CoordTensor>
__device__ __forceinline__ void apply_mask(STensor& s, CoordTensor const& coord, int row0, int col0,
                                           MaskPolicy<kWindow> const& mask) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row = row0 + get<0>(coord(mi, 0));
    const int begin = mask.key_begin(row), end = mask.key_end(row);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      const int key = col0 + get<1>(coord(mi, ni));
      if ((mask.left_bounded() && key < begin) || key >= end) s(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace cuteflash

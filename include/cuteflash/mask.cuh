// The mask of a problem (mask.h's policy, built from the params) and its application to a score tile.
#pragma once

#include "cuteflash/mask.h"
#include "cuteflash/params.h"
#include "cuteflash/utils.cuh"

namespace cuteflash {

// Which keys each query row of the problem sees.
__device__ __forceinline__ MaskPolicy mask_policy(FwdParams const& p) {
  return MaskPolicy::make(p.seqlen_q, p.seqlen_k, p.causal);
}

// s: scores in (rows, cols) view; coord: the matching (row, col) positions inside the tile.
// row0/col0: the tile's first query row and key column. Scores of keys a row does not see become -inf
// (keys past seqlen_k included). kLeftEdge: whether rows may have a first key above 0 (a window's left side);
// without one only key_end is tested, which keeps the forward kernels' masked steps within their registers.
template <bool kLeftEdge = true, typename STensor, typename CoordTensor>
__device__ __forceinline__ void apply_mask(STensor& s, CoordTensor const& coord, int row0, int col0,
                                           MaskPolicy const& mask) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row = row0 + get<0>(coord(mi, 0));
    const int begin = kLeftEdge ? mask.key_begin(row) - col0 : 0, end = mask.key_end(row) - col0;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      const int col = get<1>(coord(mi, ni));
      if ((kLeftEdge && col < begin) || col >= end) s(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace cuteflash

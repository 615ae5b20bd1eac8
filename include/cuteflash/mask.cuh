// Masking of the score tile S: keys past seqlen_k, and keys past a row's causal limit.
#pragma once

#include "cuteflash/utils.cuh"

namespace cuteflash {

// s: scores in (rows, cols) view; coord: the matching (row, col) positions inside the tile.
// row0/col0: the tile's first query row and key column. Masked scores become -inf.
template <typename STensor, typename CoordTensor>
__device__ __forceinline__ void apply_mask(STensor& s, CoordTensor const& coord, int row0, int col0, int seqlen_q,
                                           int seqlen_k, bool causal) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    int row = row0 + get<0>(coord(mi, 0));
    int limit = causal ? min(seqlen_k, row + seqlen_k - seqlen_q + 1) : seqlen_k;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      if (col0 + get<1>(coord(mi, ni)) >= limit) s(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace cuteflash

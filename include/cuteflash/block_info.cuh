// Which key blocks a query block visits, and which of them need masking.
#pragma once

#include "cuteflash/params.h"
#include "cuteflash/utils.cuh"

namespace cuteflash {

template <int kBlockM, int kBlockN>
struct KeyRange {
  int n_block_max;  // key blocks [0, n_block_max) are visited; 0 when the query block sees no key

  // Key blocks at or above this index hold a key past seqlen_k or past some row's causal limit:
  // they are visited first (the loop runs downwards) and masked; the rest run unmasked.
  int n_block_first_masked;

  __device__ KeyRange(FwdParams const& p, int m_block) {
    n_block_max = ceil_div(p.seqlen_k, kBlockN);
    // Causal: row i sees keys j <= i + seqlen_k - seqlen_q. Keys are bounded by the block's last row
    // for the visit and by its first row for the masking.
    int first_unmasked_limit = p.seqlen_k;  // keys < this are unmasked for every row of the block
    if (p.causal) {
      int shift = p.seqlen_k - p.seqlen_q;
      int last_key = min((m_block + 1) * kBlockM - 1 + shift, p.seqlen_k - 1);
      n_block_max = last_key < 0 ? 0 : min(n_block_max, last_key / kBlockN + 1);
      first_unmasked_limit = min(first_unmasked_limit, m_block * kBlockM + shift + 1);
    }
    // Blocks entirely below the limit need no mask; the limit can be <= 0 (every block masked).
    n_block_first_masked = first_unmasked_limit <= 0 ? 0 : first_unmasked_limit / kBlockN;
    n_block_first_masked = min(n_block_first_masked, n_block_max);
  }
};

}  // namespace cuteflash

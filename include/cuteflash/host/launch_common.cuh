// The launchers of the kernels that every family shares (common/) and that its kernels launch: the merge of a forward
// pass's key splits and the backward's preprocess. Each family's sources compile them for their own targets. (The KV
// cache append and the dropout mask: host/probe_kernels.cuh.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/split_merge.cuh"
#include "cuteflash/host/launch.h"

namespace cuteflash {

// Merges p.num_splits (> 1) splits into p.o and p.lse.
template <typename Element, int kHeadDim>
void merge_splits(FwdParams const& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const dim3 grid(unsigned((rows + 3) / 4));
  if (p.num_splits <= 4) {  // the tiled kernels' splits of many rows, mostly
    launch(&merge_splits_kernel<Element, kHeadDim, 4>, grid, 128, 0, stream, p, "split merge");
  } else {
    launch(&merge_splits_kernel<Element, kHeadDim, 16>, grid, 128, 0, stream, p, "split merge");
  }
}

// D = rowsum(dO * O) per query row, and the zeroing of the dq_accum regions the pass adds to.
template <typename Element, int kHeadDim>
void launch_bwd_preprocess(BwdParams const& p, cudaStream_t stream) {
  using Pre = Preprocess<Element, kHeadDim>;
  const int rows = p.deterministic ? p.seqlen_q : dq_accum_rows(p.seqlen_q);
  dim3 grid(ceil_div(rows, Pre::kRowsPerBlock), p.nheads, p.batch);
  for_batch_kind(p, [&](auto batch_kind) {
    launch(&bwd_preprocess_kernel<Element, kHeadDim, batch_kind()>, grid, Pre::kThreads, 0, stream, p,
           "backward preprocess");
  });
}

}  // namespace cuteflash

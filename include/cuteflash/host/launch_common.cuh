// The launchers of the kernels that every family shares (common/): the merge of a forward pass's key splits, the
// backward's preprocess, the KV cache append and the dropout mask. Each family's sources compile them for their
// own targets; the append and the mask live in the family's probe source (src/kernels/generate.py), with internal
// linkage, so that each family calls its own.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/cache_append.cuh"
#include "cuteflash/common/dropout_mask.cuh"
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

static void run_append_kv(AppendParams const& a, cudaStream_t stream) {
  const int64_t total = int64_t(a.batch) * a.seqlen_new * a.nheads_k * (a.head_dim / 8);
  if (total == 0) return;
  const int blocks = int(std::min<int64_t>((total + 255) / 256, 8192));
  launch(&append_kv_kernel, dim3(blocks), 256, 0, stream, a, "KV cache append");
}

static void launch_dropout_mask(FwdParams const& p, uint8_t* keep, int rows, int cols, cudaStream_t stream) {
  const int64_t units = int64_t(rows / 2) * (cols / 4);
  const dim3 grid(unsigned(std::min<int64_t>((units + 255) / 256, 1024)), p.nheads, p.batch);
  dropout_mask_kernel<<<grid, 256, 0, stream>>>(p, keep, rows, cols);
  check_cuda(cudaGetLastError(), "launching the dropout mask kernel");
}

}  // namespace cuteflash

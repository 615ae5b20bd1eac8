// The kernels of a family that depend on no head dim, in the family's probe source only (src/kernels/generate.py):
// the KV cache append and the dropout mask (return_attn_probs). Kernels and launchers have internal linkage, so that
// each family calls its own, compiled for its own targets, and no other source carries a copy.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuteflash/common/cache_append.cuh"
#include "cuteflash/common/dropout_mask.cuh"
#include "cuteflash/host/launch.h"

namespace cuteflash {

static void run_append_kv(AppendParams const& a, cudaStream_t stream) {
  const int64_t total = a.chunks();
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

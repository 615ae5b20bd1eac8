// The dropout mask of a whole call as bytes, for return_attn_probs (dropout.cuh draws it). Included by each
// family's probe source (src/kernels/generate.py), each compiled for its own targets: kernel and launcher have
// internal linkage, so that each family calls its own.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuteflash/common/dropout.cuh"

namespace cuteflash {

// The mask of a whole call, for return_attn_probs: keep[((b * nheads + h) * rows + i) * cols + j] = 1 where
// element (i, j) of (batch index b, head h) is kept, for i < rows, j < cols (multiples of 16); a thread per unit.
static __global__ void dropout_mask_kernel(const FwdParams p, uint8_t* keep, int rows, int cols) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t units = int64_t(rows / 2) * (cols / 4);
  const Dropout dropout = Dropout::make(p, b, h);
  uint8_t* out = keep + (int64_t(b) * p.nheads + h) * rows * cols;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int pair = int(u / (cols / 4)), unit = int(u % (cols / 4));
    const int row = pair / 8 * 16 + pair % 8;      // the unit's upper row
    const int col = unit / 4 * 16 + unit % 4 * 2;  // and first column
    const uint2 draw = dropout.draw(dropout.row_counter(row), col);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      const int r = row + 8 * (e / 4), c = col + e % 2 + 8 * (e % 4 / 2);
      out[int64_t(r) * cols + c] = dropout_keeps(e < 4 ? draw.x : draw.y, e % 4, dropout.threshold);
    }
  }
}

}  // namespace cuteflash

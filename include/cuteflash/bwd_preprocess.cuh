// The backward pass's first kernel, shared by both families: D = rowsum(dO * O) per query row, in fp32;
// and the per-row statistics the main kernels read (the forward's lse and this D).
#pragma once

#include "cuteflash/launch.h"
#include "cuteflash/params.h"

namespace cuteflash {

// One warp per query row, 16-byte loads (head_dim is a multiple of 8 and rows are 16-byte aligned).
template <typename Element>
__global__ void bwd_preprocess_kernel(const BwdParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  auto const* o = static_cast<Element const*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride +
                  head * p.o_head_stride;
  auto const* dout = static_cast<Element const*>(p.dout) + batch * p.do_batch_stride + row * p.do_row_stride +
                     head * p.do_head_stride;
  float sum = 0.f;
  for (int c = lane * 8; c < p.head_dim; c += 32 * 8) {
    uint4 o8 = *reinterpret_cast<uint4 const*>(o + c);
    uint4 do8 = *reinterpret_cast<uint4 const*>(dout + c);
    auto const* oe = reinterpret_cast<Element const*>(&o8);
    auto const* doe = reinterpret_cast<Element const*>(&do8);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) sum += static_cast<float>(oe[j]) * static_cast<float>(doe[j]);
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) p.d_rowsum[(int64_t(batch) * p.nheads + head) * p.seqlen_q + row] = sum;
}

// The lse (times log2 e) and D of a query row; rows past seqlen_q get P = 0 and dS = 0.
struct RowStats {
  float lse_log2;
  float d;
  __device__ RowStats(BwdParams const& p, int64_t row_stats, int row) {
    bool valid = row < p.seqlen_q;
    lse_log2 = valid ? p.lse[row_stats + row] * 1.4426950408889634f : INFINITY;
    d = valid ? p.d_rowsum[row_stats + row] : 0.f;
  }
};

template <typename Element>
void launch_bwd_preprocess(BwdParams const& p, cudaStream_t stream) {
  constexpr int kWarps = 4;
  dim3 grid(ceil_div(p.seqlen_q, kWarps), p.nheads, p.batch);
  launch(&bwd_preprocess_kernel<Element>, grid, kWarps * 32, 0, stream, p, "backward preprocess");
}

}  // namespace cuteflash

// The merge of a forward pass whose keys were split across thread blocks (flash-decoding; params.h's num_splits):
// the decoding kernel's splits, and the tiled kernels' where a KV-cache call's query tiles alone leave SMs idle.
// Split s of a row wrote its O, divided by its own row sum, to o_accum and its log-sum-exp to lse_accum; a split
// that saw none of the row's keys wrote lse -inf, and its O is not read.
#pragma once

#include <cutlass/array.h>

#include "cuteflash/launch.h"
#include "cuteflash/params.h"

namespace cuteflash {

// A warp per (sequence, head, query row), lane j with columns 8j..8j+7: O = sum_s exp(lse_s - lse) O_s with
// lse = log sum_s exp(lse_s); a row no split saw gets O = 0 and lse = +inf. A fixed-length batch; kHeadDim: the
// row length of o_accum (the kernel's head dim).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(128) merge_splits_kernel(const FwdParams p) {
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int i = int(row % p.seqlen_q), head = int(row / p.seqlen_q % p.nheads),
            batch = int(row / p.seqlen_q / p.nheads);
  float max_lse = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) max_lse = fmaxf(max_lse, p.lse_accum[s * rows + row]);
  CUTE_UNROLL
  for (int o = 16; o >= 1; o /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, o));
  float sum = 0.f;
  if (max_lse != -INFINITY) {
    for (int s = lane; s < p.num_splits; s += 32) sum += __expf(p.lse_accum[s * rows + row] - max_lse);
  }
  CUTE_UNROLL
  for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
  const float lse = max_lse == -INFINITY ? INFINITY : max_lse + __logf(sum);
  const int col = lane * 8;
  if (col < p.head_dim) {
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (max_lse != -INFINITY) {
#pragma unroll 8  // the splits' loads in flight together
      for (int s = 0; s < p.num_splits; ++s) {
        const float split_lse = p.lse_accum[s * rows + row];
        if (split_lse == -INFINITY) continue;  // saw nothing, wrote no O
        const float w = __expf(split_lse - lse);
        float const* src = p.o_accum + (s * rows + row) * kHeadDim + col;
        const float4 a = *reinterpret_cast<float4 const*>(src), b = *reinterpret_cast<float4 const*>(src + 4);
        o[0] += w * a.x, o[1] += w * a.y, o[2] += w * a.z, o[3] += w * a.w;
        o[4] += w * b.x, o[5] += w * b.y, o[6] += w * b.z, o[7] += w * b.w;
      }
    }
    cutlass::Array<Element, 8> out;
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) out[e] = Element(o[e]);
    *reinterpret_cast<cutlass::Array<Element, 8>*>(p.o.at<Element>(batch, head, i) + col) = out;
  }
  if (lane == 0) p.lse[int64_t(batch) * p.stats_batch_stride + int64_t(head) * p.stats_head_stride + i] = lse;
}

// Host side: merges p.num_splits (> 1) splits into p.o and p.lse.
template <typename Element, int kHeadDim>
void merge_splits(FwdParams const& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  launch(&merge_splits_kernel<Element, kHeadDim>, dim3(unsigned((rows + 3) / 4)), 128, 0, stream, p, "split merge");
}

// Where split `split` of row i of (batch, head) keeps its part (params.h): o_accum + row * kHeadDim, lse_accum + row.
CUTEFLASH_HOST_DEVICE int64_t split_row(FwdParams const& p, int split, int batch, int head, int i) {
  return ((int64_t(split) * p.batch + batch) * p.nheads + head) * p.seqlen_q + i;
}

}  // namespace cuteflash

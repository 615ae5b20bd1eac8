// The merge of a forward pass whose keys were split across thread blocks (flash-decoding; params.h's num_splits):
// the decoding kernel's splits, and the tiled kernels' where a KV-cache call's query tiles alone leave SMs idle.
// Split s of a row wrote its O, divided by its own row sum, to o_accum and its log-sum-exp to lse_accum; a split
// that saw none of the row's keys wrote lse -inf, and its O is not read.
#pragma once

#include <cutlass/array.h>

#include "cuteflash/launch.h"
#include "cuteflash/params.h"
#include "cuteflash/tile_config.h"

namespace cuteflash {

// A warp per (sequence, head, query row), lane j with columns 8j..8j+7: O = sum_s exp(lse_s - lse) O_s with
// lse = log sum_s exp(lse_s); a row no split saw gets O = 0 and lse = +inf. A fixed-length batch; kHeadDim: the
// row length of o_accum (the kernel's head dim). Lane j reads the log-sum-exp of splits j, j + 32, ... for the
// row's, and the O and log-sum-exp of kInFlight splits at a time, all issued before any is waited for: up to
// kInFlight splits cost one round trip to memory (2.9 us for 16 splits of 32 rows on an H100; reading O only once
// the log-sum-exps are in takes four, 6.5 us). The registers for kInFlight splits limit the warps per SM, which a
// merge of many rows needs more than loads in flight: for few splits, kInFlight is small.
template <typename Element, int kHeadDim, int kInFlight>
__global__ void __launch_bounds__(128) merge_splits_kernel(const FwdParams p) {
  constexpr int kLseRegs = kMaxSplits / 32;
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  const int i = int(row % p.seqlen_q), head = int(row / p.seqlen_q % p.nheads),
            batch = int(row / p.seqlen_q / p.nheads);
  float own[kLseRegs];  // the log-sum-exp of split lane + 32 j
  CUTE_UNROLL
  for (int j = 0; j < kLseRegs; ++j) {
    const int s = lane + 32 * j;
    own[j] = s < p.num_splits ? p.lse_accum[s * rows + row] : -INFINITY;
  }
  const int col = lane * 8;
  const bool has_cols = col < p.head_dim;
  float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float max_lse = -INFINITY, lse = INFINITY;
  for (int s0 = 0; s0 < p.num_splits; s0 += kInFlight) {
    float4 part[kInFlight][2];
    float part_lse[kInFlight];
    CUTE_UNROLL
    for (int k = 0; k < kInFlight; ++k) {
      part_lse[k] = s0 + k < p.num_splits ? p.lse_accum[(s0 + k) * rows + row] : -INFINITY;
      if (s0 + k < p.num_splits && has_cols) {
        float const* src = p.o_accum + ((s0 + k) * rows + row) * kHeadDim + col;
        part[k][0] = *reinterpret_cast<float4 const*>(src);
        part[k][1] = *reinterpret_cast<float4 const*>(src + 4);
      }
    }
    if (s0 == 0) {  // the row's log-sum-exp, while the loads above are in flight
      CUTE_UNROLL
      for (int j = 0; j < kLseRegs; ++j) max_lse = fmaxf(max_lse, own[j]);
      CUTE_UNROLL
      for (int m = 16; m >= 1; m /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, m));
      float sum = 0.f;
      if (max_lse != -INFINITY) {
        CUTE_UNROLL
        for (int j = 0; j < kLseRegs; ++j) sum += __expf(own[j] - max_lse);  // 0 for -inf
      }
      CUTE_UNROLL
      for (int m = 16; m >= 1; m /= 2) sum += __shfl_xor_sync(0xffffffff, sum, m);
      lse = max_lse == -INFINITY ? INFINITY : max_lse + __logf(sum);
    }
    if (max_lse == -INFINITY) break;  // no split saw the row (the whole warp)
    CUTE_UNROLL
    for (int k = 0; k < kInFlight; ++k) {
      if (has_cols && part_lse[k] != -INFINITY) {  // -inf: saw nothing and wrote no O, or past the splits
        const float w = __expf(part_lse[k] - lse);
        const float4 a = part[k][0], b = part[k][1];
        o[0] += w * a.x, o[1] += w * a.y, o[2] += w * a.z, o[3] += w * a.w;
        o[4] += w * b.x, o[5] += w * b.y, o[6] += w * b.z, o[7] += w * b.w;
      }
    }
  }
  if (has_cols) {
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
  const dim3 grid(unsigned((rows + 3) / 4));
  if (p.num_splits <= 4) {  // the tiled kernels' splits of many rows, mostly
    launch(&merge_splits_kernel<Element, kHeadDim, 4>, grid, 128, 0, stream, p, "split merge");
  } else {
    launch(&merge_splits_kernel<Element, kHeadDim, 16>, grid, 128, 0, stream, p, "split merge");
  }
}

// Where split `split` of row i of (batch, head) keeps its part (params.h): o_accum + row * kHeadDim, lse_accum + row.
CUTEFLASH_HOST_DEVICE int64_t split_row(FwdParams const& p, int split, int batch, int head, int i) {
  return ((int64_t(split) * p.batch + batch) * p.nheads + head) * p.seqlen_q + i;
}

}  // namespace cuteflash

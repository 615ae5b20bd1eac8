// The merge of a forward pass whose keys were split across thread blocks (flash-decoding; params.h's num_splits):
// the decoding kernel's splits, and the tiled kernels' where a KV-cache call's query tiles alone leave SMs idle.
// Split s of a row wrote its O, divided by its own row sum, to o_accum and its log-sum-exp to lse_accum; a split
// that saw none of the row's keys wrote lse -inf, and its O is not read. A kernel of its own merges them, or, with
// split_counters, the decoding kernel's last split of each (sequence, key-value head) does (decode/); both run
// merge_split_row, so the result does not depend on which.
#pragma once

#include <cutlass/array.h>

#include "cuteflash/common/params.h"
#include "cuteflash/common/sequence.cuh"
#include "cuteflash/common/tiles.h"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

// Where split `split` of row i of (batch, head) keeps its part (params.h): o_accum + row * kHeadDim, lse_accum + row.
CUTEFLASH_HOST_DEVICE int64_t split_row(FwdParams const& p, int split, int batch, int head, int i) {
  return ((int64_t(split) * p.batch + batch) * p.nheads + head) * p.seqlen_q + i;
}

// n floats from global memory through L2 (other blocks of a running kernel wrote them), in loads of 16 bytes
// where n allows.
template <int N>
__device__ __forceinline__ void load_floats_cg(float const* src, float (&dst)[N]) {
  if constexpr (N % 4 == 0) {
    CUTE_UNROLL
    for (int j = 0; j < N; j += 4) {
      const float4 x = __ldcg(reinterpret_cast<float4 const*>(src + j));
      dst[j] = x.x, dst[j + 1] = x.y, dst[j + 2] = x.z, dst[j + 3] = x.w;
    }
  } else if constexpr (N % 2 == 0) {
    CUTE_UNROLL
    for (int j = 0; j < N; j += 2) {
      const float2 x = __ldcg(reinterpret_cast<float2 const*>(src + j));
      dst[j] = x.x, dst[j + 1] = x.y;
    }
  } else {
    CUTE_UNROLL
    for (int j = 0; j < N; ++j) dst[j] = __ldcg(src + j);
  }
}

// One warp merges row i of (batch, head) over its splits into p.o and p.lse: O = sum_s exp(lse_s - lse) O_s with
// lse = log sum_s exp(lse_s), summed in split order; a row no split saw gets O = 0 and lse = +inf. Lane j holds
// columns kCols j .. kCols j + kCols - 1 (kHeadDim: o_accum's row length) and the log-sum-exps of splits j,
// j + 32, ...; it reads the O and log-sum-exp of kInFlight splits at a time, all issued before any is waited for
// (up to kInFlight splits cost one round trip to memory; reading O only once the log-sum-exps are in would take
// two). The registers for kInFlight splits limit the warps per SM, which a merge of many rows needs more than loads
// in flight: for few splits, kInFlight is small.
template <typename Element, int kHeadDim, int kInFlight>
__device__ __forceinline__ void merge_split_row(FwdParams const& p, int batch, int head, int i, int lane) {
  constexpr int kLseRegs = kMaxSplits / 32;
  constexpr int kCols = kHeadDim / 32;
  const int64_t row = split_row(p, 0, batch, head, i), split_stride = split_row(p, 1, 0, 0, 0);
  float own[kLseRegs];  // the log-sum-exp of split lane + 32 j
  CUTE_UNROLL
  for (int j = 0; j < kLseRegs; ++j) {
    const int s = lane + 32 * j;
    own[j] = s < p.num_splits ? __ldcg(p.lse_accum + s * split_stride + row) : -INFINITY;
  }
  const int col = lane * kCols;
  const bool has_cols = col < p.head_dim;
  float o[kCols];
  CUTE_UNROLL
  for (int e = 0; e < kCols; ++e) o[e] = 0.f;
  float max_lse = -INFINITY, lse = INFINITY;
  for (int s0 = 0; s0 < p.num_splits; s0 += kInFlight) {
    float part[kInFlight][kCols];
    float part_lse[kInFlight];
    CUTE_UNROLL
    for (int k = 0; k < kInFlight; ++k) {
      const int64_t at = (s0 + k) * split_stride + row;
      part_lse[k] = s0 + k < p.num_splits ? __ldcg(p.lse_accum + at) : -INFINITY;
      if (s0 + k < p.num_splits && has_cols) load_floats_cg(p.o_accum + at * kHeadDim + col, part[k]);
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
        CUTE_UNROLL
        for (int e = 0; e < kCols; ++e) o[e] += w * part[k][e];
      }
    }
  }
  Element* out = p.o.at<Element>(batch, head, i) + col;
  if constexpr ((kCols & (kCols - 1)) == 0) {  // 1, 2, 4 or 8 columns: one aligned store (head_dim % 8 == 0)
    if (has_cols) {
      cutlass::Array<Element, kCols> x;
      CUTE_UNROLL
      for (int e = 0; e < kCols; ++e) x[e] = Element(o[e]);
      *reinterpret_cast<cutlass::Array<Element, kCols>*>(out) = x;
    }
  } else {
    CUTE_UNROLL
    for (int e = 0; e < kCols; ++e) {
      if (col + e < p.head_dim) out[e] = Element(o[e]);
    }
  }
  if (lane == 0) p.lse[int64_t(batch) * p.stats_batch_stride + int64_t(head) * p.stats_head_stride + i] = lse;
}

// A warp per (sequence, head, query row) of a fixed-length batch.
template <typename Element, int kHeadDim, int kInFlight>
static __global__ void __launch_bounds__(128) merge_splits_kernel(const FwdParams p) {
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp
  const int i = int(row % p.seqlen_q), head = int(row / p.seqlen_q % p.nheads),
            batch = int(row / p.seqlen_q / p.nheads);
  merge_split_row<Element, kHeadDim, kInFlight>(p, batch, head, i, threadIdx.x % 32);
}

// The end of a split of the keys of a query block (splits_keys): O, divided by the split's row sums, goes to
// o_accum (above) in fp32, its log-sum-exp to lse_accum (-inf for a row that saw no key of the split).
// acc: the accumulators' (rows, cols) view, coord: the (row, col) of each value in the block, row0: the block's
// first row. kStaged: O goes through the block's shared memory (smem, kRowsTile x kHeadDim floats, free when
// called), so that each thread stores 16 bytes at a time; else straight from the accumulators, 8 bytes at a time.
// Which is faster depends on the kernel: each changes the spills of some kernels' key loops (fwd_block).
template <bool kStaged, int kRowsTile, int kHeadDim, int kNThreads, int kRows, typename AccRowCol, typename CoordRowCol>
__device__ __forceinline__ void store_partial(FwdParams const& p, Sequence const& seq, int head, int row0,
                                              AccRowCol const& acc, CoordRowCol const& coord,
                                              float const (&row_lse)[kRows], int rows_left, float* smem, unsigned tid) {
  float* dst = p.o_accum + split_row(p, key_split(p), seq.batch, head, row0) * kHeadDim;  // the block's row 0
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int row = get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(acc); ni += 2) {  // a column pair of mma's accumulator, then the next n8 tile
      const int col = get<1>(coord(mi, ni));
      const float2 pair = make_float2(acc(mi, ni), acc(mi, ni + 1));
      if constexpr (kStaged) {
        *reinterpret_cast<float2*>(smem + row * kHeadDim + col) = pair;
      } else if (row < rows_left && col < p.head_dim) {
        *reinterpret_cast<float2*>(dst + row * kHeadDim + col) = pair;
      }
    }
    if (get<1>(coord(mi, 0)) == 0 && row < rows_left) {
      p.lse_accum[split_row(p, key_split(p), seq.batch, head, row0 + row)] =
          row_lse[mi] == INFINITY ? -INFINITY : row_lse[mi];
    }
  }
  if constexpr (kStaged) {
    __syncthreads();
    constexpr int kChunks = kHeadDim / 4;  // of 16 bytes, per row
    CUTE_UNROLL
    for (int i = int(tid); i < kRowsTile * kChunks; i += kNThreads) {
      const int row = i / kChunks, col = i % kChunks * 4;
      if (row < rows_left && col < p.head_dim) {
        *reinterpret_cast<float4*>(dst + row * kHeadDim + col) = *reinterpret_cast<float4 const*>(smem + i * 4);
      }
    }
  }
}

}  // namespace cuteflash

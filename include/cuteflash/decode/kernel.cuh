// The decoding kernel: attention of the few query rows that share a key-value head (seqlen_q times the GQA group,
// at most kDecodeMaxRows, or kDecodeMaxMmaRows on tensor cores) against many keys, for every family. With so few
// rows, reading K and V is the whole cost, so the kernel is built for it: rather than tensor-core tiles of 64 or
// more rows, each lane loads 16 bytes of a key row at a time, a paged cache is read row by row, and the keys are
// split across thread blocks where batch x heads alone cannot fill the GPU (flash-decoding), each split's result
// merged by its log-sum-exp.
//
// A thread block (4 warps) takes one split of one (sequence, key-value head) and walks its keys in chunks
// (block.cuh), fetched kStages - 1 chunks ahead with cp.async where the family has it, at the top of each pass
// otherwise. A pass computes a chunk: a single query row on CUDA cores (single_row_pass.cuh), several rows on CUDA
// cores (shared_rows_pass.cuh), or several rows on the family's tensor cores (the family's decode_pass.cuh). At the
// end the warps' parts of O are summed, and the last split to finish merges the splits.
#pragma once

#include <type_traits>

#include "cuteflash/common/softmax.cuh"
#include "cuteflash/common/split_merge.cuh"
#include "cuteflash/decode/block.cuh"
#include "cuteflash/decode/shared_rows_pass.cuh"
#include "cuteflash/decode/single_row_pass.cuh"

namespace cuteflash {

// The splits whose parts a warp of the last split reads at once when it merges them (split_merge.cuh): 16, what batch
// 1 over 16 key-value heads gets on an H100 (fewer heads get more splits, merged in several rounds of loads). The
// single-row kernel keeps 128 registers per thread with it, so 4 blocks still fit an SM.
constexpr int kDecodeMergeInFlight = 16;

template <typename Traits>
using DecodePass =
    std::conditional_t<Traits::kRows == 1, DecodeSingleRowPass<Traits>,
                       std::conditional_t<Traits::kTensorCores, typename Traits::Family::template TensorPass<Traits>,
                                          DecodeSharedRowsPass<Traits>>>;

template <typename Traits>
constexpr int decode_storage_bytes() {
  constexpr int bytes = int(sizeof(DecodeStorage<Traits, DecodePass<Traits>>));
  static_assert(bytes == decode_smem_bytes(Traits::kHeadDim, Traits::kRows, Traits::kConfig));
  return bytes;
}

// O / l and the log-sum-exp of each row from the warps' parts and statistics: to o and lse, or to this split's
// o_accum and lse_accum.
template <typename Traits, typename Block>
__device__ __forceinline__ void decode_write(Block& b) {
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kRows, kHeadDim = Traits::kHeadDim, kWarps = Traits::kWarps;
  FwdParams const& p = b.p;
  auto& smem = b.smem;
  constexpr int kColChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kRows * kColChunks; idx += Traits::kThreads) {
    const int r = idx / kColChunks, c = idx % kColChunks * 8;
    if (r >= b.rows || c >= p.head_dim) continue;
    const int i = r / b.group, head = b.head_of(r);
    // The row's max and sum, and each warp's weight: with kOwnSoftmax, the warps' statistics merged.
    float m = smem.row_max[r], l = smem.row_sum[r], weight[kWarps];
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) weight[w] = 1.f;
    if constexpr (Traits::kOwnSoftmax) {
      m = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, smem.row_max[w * kRows + r]);
      l = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        const float m_w = smem.row_max[w * kRows + r];
        weight[w] = part_weight(m_w, m);
        l += weight[w] * smem.row_sum[w * kRows + r];
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key: O = 0
    float o[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      float x = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) x += weight[w] * smem.o_part[w][r][c + e];
      o[e] = x * inv;
    }
    const float lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    if (p.num_splits == 1) {
      cutlass::Array<Element, 8> out;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) out[e] = Element(o[e]);
      *reinterpret_cast<cutlass::Array<Element, 8>*>(p.o.at<Element>(b.seq.batch, head, b.seq.q_row0 + i) + c) = out;
      if (c == 0) p.lse[b.seq.stats(p, head) + i] = l > 0.f ? lse : INFINITY;
    } else {
      const int64_t row = split_row(p, b.split, b.seq.batch, head, i);
      float* dst = p.o_accum + row * kHeadDim + c;
      *reinterpret_cast<float4*>(dst) = make_float4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(o[4], o[5], o[6], o[7]);
      if (c == 0) p.lse_accum[row] = lse;
    }
  }
}

// With split_counters, the last split of this (sequence, key-value head) to finish merges its rows: each split's
// parts are made visible device-wide before it counts itself in, and the last one sets the count back to zero for
// the next call on the stream (no other split of this call touches it again).
template <typename Traits, typename Block>
__device__ __forceinline__ void decode_merge(Block& b) {
  FwdParams const& p = b.p;
  if (p.num_splits > 1 && p.split_counters != nullptr) {
    __threadfence();
    __syncthreads();                  // (every thread's parts are written and fenced; o_part is no longer read)
    float& last = b.smem.row_max[0];  // 1: this split is the last
    if (threadIdx.x == 0) {
      int* counter = p.split_counters + blockIdx.z * gridDim.y + blockIdx.y;
      const bool is_last = atomicAdd(counter, 1) == p.num_splits - 1;
      if (is_last) *counter = 0;
      last = is_last ? 1.f : 0.f;
    }
    __syncthreads();
    if (last != 0.f) {
      __threadfence();  // the other splits' parts, counted in before my count, are read after it
      for (int r = b.warp; r < b.rows; r += Traits::kWarps) {
        merge_split_row<typename Traits::Element, Traits::kHeadDim, kDecodeMergeInFlight>(p, b.seq.batch, b.head_of(r),
                                                                                          r / b.group, b.lane);
      }
    }
  }
}

// Split blockIdx.x of the keys of key-value head blockIdx.y of sequence blockIdx.z.
template <typename Traits>
static __global__ void __launch_bounds__(Traits::kThreads) decode_kernel(const FwdParams p) {
  using Pass = DecodePass<Traits>;
  extern __shared__ uint4 smem_raw[];
  DecodeBlock<Traits, Pass> b(p, *reinterpret_cast<DecodeStorage<Traits, Pass>*>(smem_raw));
  Pass pass;
  pass.init(b);
  b.walk(pass);
  // O's parts summed over the keys of a warp, then over the warps; O / l and the log-sum-exp.
  pass.reduce(b);
  __syncthreads();  // the stages' memory becomes o_part
  pass.store(b);
  __syncthreads();
  decode_write<Traits>(b);
  decode_merge<Traits>(b);
}

}  // namespace cuteflash

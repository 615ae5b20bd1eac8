// The backward pass's kernels and helpers shared by both families: first D = rowsum(dO * O) per query
// row, in fp32; the per-row statistics the main kernels read (the forward's lse and this D); and the
// dq_accum regions (params.h) with the conversion of a row-major one into dq.
#pragma once

#include "cuteflash/common/params.h"
#include "cuteflash/common/sequence.cuh"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

// The dq_accum region of one (sequence, head): dq_accum_rows(seq.seqlen_q) x kHeadDim floats.
template <int kHeadDim>
__device__ __forceinline__ float* dq_accum_region(BwdParams const& p, Sequence const& seq, int head) {
  return p.dq_accum +
         (head * p.dq_accum_head_rows + int64_t(seq.batch) * p.dq_accum_batch_rows + seq.q_row0) * kHeadDim;
}

// The count of a (batch, head)'s dK/dV thread blocks that have added their share of dQ.
__device__ __forceinline__ int* dq_blocks_done(BwdParams const& p, int batch, int head) {
  return p.dq_blocks_done + batch * p.nheads + head;
}

// D for one query row per kThreadsPerRow threads, 16-byte loads (head_dim is a multiple of 8 and rows
// are 16-byte aligned). Unless the pass is deterministic, the same threads zero the row's dq_accum,
// padding rows included, and the first zeroes the count of blocks done.
template <typename Element, int kHeadDim>
struct Preprocess {
  static constexpr int kThreads = 128;
  static constexpr int kThreadsPerRow = kHeadDim / 8 <= 4 ? 4 : kHeadDim / 8 <= 8 ? 8 : kHeadDim / 8 <= 16 ? 16 : 32;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
};

template <typename Element, int kHeadDim>
__device__ __forceinline__ void bwd_preprocess_rows(BwdParams const& p, Sequence const& seq, int head, int row) {
  using Pre = Preprocess<Element, kHeadDim>;
  const int lane = threadIdx.x % Pre::kThreadsPerRow;
  if (!p.deterministic && row < dq_accum_rows(seq.seqlen_q)) {
    float4* acc = reinterpret_cast<float4*>(dq_accum_region<kHeadDim>(p, seq, head) + row * kHeadDim);
    for (int c = lane; c < kHeadDim / 4; c += Pre::kThreadsPerRow) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const unsigned active = __ballot_sync(0xffffffff, row < seq.seqlen_q);  // whole groups of kThreadsPerRow lanes
  if (row >= seq.seqlen_q) return;
  auto const* o = p.o.at<Element const>(seq.batch, head, seq.q_row0 + row);
  auto const* dout = p.dout.at<Element const>(seq.batch, head, seq.q_row0 + row);
  float sum = 0.f;
  for (int c = lane * 8; c < p.head_dim; c += Pre::kThreadsPerRow * 8) {
    uint4 o8 = *reinterpret_cast<uint4 const*>(o + c);
    uint4 do8 = *reinterpret_cast<uint4 const*>(dout + c);
    auto const* oe = reinterpret_cast<Element const*>(&o8);
    auto const* doe = reinterpret_cast<Element const*>(&do8);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) sum += static_cast<float>(oe[j]) * static_cast<float>(doe[j]);
  }
  CUTE_UNROLL
  for (int offset = Pre::kThreadsPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(active, sum, offset);
  if (lane == 0) p.d_rowsum[seq.stats(p, head) + row] = sum;
}

template <typename Element, int kHeadDim, Variant V>
static __global__ void __launch_bounds__(Preprocess<Element, kHeadDim>::kThreads)
    bwd_preprocess_kernel(const BwdParams p) {
  using Pre = Preprocess<Element, kHeadDim>;
  const int head = blockIdx.y;
  if (!p.deterministic && blockIdx.x == 0 && threadIdx.x == 0) *dq_blocks_done(p, blockIdx.z, head) = 0;
  auto tiles = [&](Sequence const& seq) {
    return ceil_div(p.deterministic ? seq.seqlen_q : dq_accum_rows(seq.seqlen_q), Pre::kRowsPerBlock);
  };
  for_each_tile<V>(p, blockIdx.x, tiles, [&](Sequence const& seq, int tile) {
    bwd_preprocess_rows<Element, kHeadDim>(p, seq, head, tile * Pre::kRowsPerBlock + threadIdx.x / Pre::kThreadsPerRow);
  });
}

// The lse and D of a query row; rows past seqlen_q get P = 0 and dS = 0. lse is kept as loaded and
// scaled by log2(e) where it is used, so that a kernel can issue the loads well before it needs them.
struct RowStats {
  float lse;
  float d;
  // row_stats: the row statistics' offset of the sequence and head (Sequence::stats).
  __device__ RowStats(BwdParams const& p, int64_t row_stats, int row, int seqlen_q) {
    bool valid = row < seqlen_q;
    lse = valid ? p.lse[row_stats + row] : INFINITY;
    d = valid ? p.d_rowsum[row_stats + row] : 0.f;
  }
  __device__ float lse_log2() const { return lse * 1.4426950408889634f; }
};

// dq = dq_accum for rows [row0, row_end) of one (sequence, head) whose region is laid out row-major,
// (dq_accum_rows, kHeadDim), by the kThreads threads of a thread block: 16-byte loads from L2 (another block's
// atomics wrote the region; L1 may not be coherent with them), kUnroll in flight per thread, 8-byte stores (head_dim
// is a multiple of 8).
template <typename Element, int kHeadDim, int kThreads>
__device__ void convert_dq_rowmajor(BwdParams const& p, Sequence const& seq, int head, int row0, int row_end) {
  constexpr int kChunks = kHeadDim / 4;  // of 4 floats per row
  constexpr int kUnroll = 8;
  auto const* acc = reinterpret_cast<float4 const*>(dq_accum_region<kHeadDim>(p, seq, head) + row0 * kHeadDim);
  auto* dq = p.dq.at<Element>(seq.batch, head, seq.q_row0 + row0);
  const int chunks = (row_end - row0) * kChunks;
  for (int first = threadIdx.x; first < chunks; first += kThreads * kUnroll) {
    float4 x[kUnroll];
    CUTE_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * kThreads < chunks) x[u] = __ldcg(acc + first + u * kThreads);
    }
    CUTE_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int chunk = first + u * kThreads;
      const int row = chunk / kChunks, col = chunk % kChunks * 4;
      if (chunk < chunks && col < p.head_dim) {
        alignas(8) Element out[4] = {Element(x[u].x), Element(x[u].y), Element(x[u].z), Element(x[u].w)};
        *reinterpret_cast<uint2*>(dq + row * p.dq.row_stride + col) = *reinterpret_cast<uint2 const*>(out);
      }
    }
  }
}

}  // namespace cuteflash

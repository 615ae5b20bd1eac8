// What the decoding kernel's two passes on CUDA cores (single_row_pass.cuh, shared_rows_pass.cuh) share: each lane
// holds its 8 columns of every query row and of its part of O (summed over its keys), and the key slots of a warp
// (kLanesPerKey lanes each) sum their parts at the end.
#pragma once

#include "cuteflash/decode/block.cuh"

namespace cuteflash {

// kValues partial sums held by each of the kLanes lanes of a key slot (aligned lanes, a power of two), summed over
// the slot by a reduce-scatter: each round halves the values a lane holds (the half its lane bit o selects, plus the
// partner's of that half) until it holds kHeld; the lanes below the spread bits (kShift) then sum those. After it,
// x[j] of a lane is value spread(lane) kHeld + j's whole sum, which the lanes with the same spread bits share.
template <int kValues, int kLanes>
struct SlotReduceScatter {
  static constexpr int kSpread = kValues < kLanes ? kValues : kLanes;  // the lanes over which the values spread
  static constexpr int kHeld = kValues / kSpread;
  static constexpr int kShift = cute::log_2(unsigned(kLanes / kSpread));  // lane bits below the spread ones
  static_assert(kValues % kSpread == 0 && kLanes % kSpread == 0);

  __device__ __forceinline__ static int spread(int lane) { return (lane % kLanes) >> kShift; }

  __device__ __forceinline__ static void reduce(float (&x)[kValues], int lane) {
    CUTE_UNROLL
    for (int n = kValues, o = kLanes / 2; n > kHeld; n /= 2, o /= 2) {
      const bool upper = lane & o;
      CUTE_UNROLL
      for (int j = 0; j < n / 2; ++j) {
        const float give = upper ? x[j] : x[j + n / 2];
        x[j] = (upper ? x[j + n / 2] : x[j]) + __shfl_xor_sync(0xffffffff, give, o);
      }
    }
    CUTE_UNROLL
    for (int o = (1 << kShift) / 2; o >= 1; o /= 2) {
      CUTE_UNROLL
      for (int j = 0; j < kHeld; ++j) x[j] += __shfl_xor_sync(0xffffffff, x[j], o);
    }
  }
};

template <typename Traits>
struct DecodeCudaCoreRows : DecodePassBase {
  using Element = typename Traits::Element;
  static constexpr int kRows = Traits::kRows;
  static constexpr int kRowsHeld = kRows;  // every row's visible keys, in every lane

  float q[kRows][8];    // my columns of each query row
  float acc[kRows][8];  // my part of O: my columns, summed over my keys
  // Rows warp + j kWarps (with a single row, the row over my key slot's keys), in log2 units.
  float m_own[Traits::kRowsPerWarp], l_own[Traits::kRowsPerWarp];

  template <typename Block>
  __device__ __forceinline__ void init(Block& b) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) unpack8<Element>(b.query_piece(r, b.col), q[r]);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
    }
    CUTE_UNROLL
    for (int j = 0; j < Traits::kRowsPerWarp; ++j) {
      m_own[j] = -INFINITY;
      l_own[j] = 0.f;
    }
  }

  // O's parts summed over the key slots of my warp (each lane then holds its columns' sums).
  template <typename Block>
  __device__ __forceinline__ void sum_slots(Block& b) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        CUTE_UNROLL
        for (int o = Traits::kLanesPerKey; o < 32; o *= 2) acc[r][e] += __shfl_xor_sync(0xffffffff, acc[r][e], o);
      }
    }
  }

  // My warp's part of O, and the statistics of the rows my warp owns (with a single row, its own: at warp).
  template <typename Block>
  __device__ __forceinline__ void store(Block& b) {
    if (b.slot == 0 && b.col < Traits::kHeadDim) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) b.smem.o_part[b.warp][r][b.col + e] = acc[r][e];
      }
    }
    CUTE_UNROLL
    for (int j = 0; j < Traits::kRowsPerWarp; ++j) {
      const int r = Traits::kOwnSoftmax ? b.warp : b.warp + j * Traits::kWarps;
      if (r < Traits::kStats && b.lane == 0) {
        b.smem.row_max[r] = m_own[j];
        b.smem.row_sum[r] = l_own[j];
      }
    }
  }
};

}  // namespace cuteflash

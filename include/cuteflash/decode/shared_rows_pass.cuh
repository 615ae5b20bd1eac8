// The decoding kernel's pass for several query rows on CUDA cores: the warps write their keys' scores to shared
// memory, the warp that owns a row updates its running max and sum and turns the chunk's scores into
// probabilities, then every warp rescales its part of O and adds its keys' P V.
#pragma once

#include "cuteflash/decode/cuda_core_rows.cuh"

namespace cuteflash {

template <typename Traits>
struct DecodeSharedRowsPass : DecodeCudaCoreRows<Traits> {
  static_assert(!Traits::kOwnSoftmax);
  using Element = typename Traits::Element;
  using DecodeCudaCoreRows<Traits>::q;
  using DecodeCudaCoreRows<Traits>::acc;
  using DecodeCudaCoreRows<Traits>::m_own;
  using DecodeCudaCoreRows<Traits>::l_own;
  static constexpr int kRows = Traits::kRows;
  static constexpr int kWarps = Traits::kWarps;
  static constexpr int kChunk = Traits::kChunk;
  static constexpr int kLanesPerKey = Traits::kLanesPerKey;
  static constexpr int kKeysPerStep = Traits::kKeysPerStep;
  static constexpr int kSteps = Traits::kSteps;

  template <typename Block>
  __device__ void run(Block& b, int stage, int key0) {
    __syncthreads();  // every warp has read the previous chunk's probabilities
    write_scores(b, stage, key0);
    __syncthreads();
    softmax(b);
    __syncthreads();
    add_pv(b, stage);
  }

  // The dot products of the rows with a key are reduced over the key's lanes by a reduce-scatter, so that each lane
  // ends with the whole dot products of kHeld rows (the lanes below the spread bits with the same ones), scores
  // them and, one lane of them, writes the scores. At head dim 256 with 8 rows (32 lanes): 9 shuffles a key
  // instead of 40, and each row's score computed by its 4 lanes at once rather than by one lane after another.
  using Scatter = SlotReduceScatter<kRows, kLanesPerKey>;
  static constexpr int kHeld = Scatter::kHeld;
  // The rows whose visible keys a lane keeps: those it holds the dot products of.
  static constexpr int kRowsHeld = kHeld;
  __device__ __forceinline__ static int held_row(int held, int lane) { return Scatter::spread(lane) * kHeld + held; }

  template <typename Block>
  __device__ __forceinline__ void write_scores(Block& b, int stage, int key0) {
    const int lane = b.lane;
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float kf[8];
      unpack8<Element>(b.stage_at(stage, 0, s), kf);
      float x[kRows];
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        x[r] = 0.f;
        if (!b.live(r)) continue;
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) x[r] = fmaf(q[r][e], kf[e], x[r]);
      }
      Scatter::reduce(x, lane);  // x[j]: row held_row(j)'s dot product
      const int key_in_warp = s * kKeysPerStep + b.slot;
      CUTE_UNROLL
      for (int j = 0; j < kHeld; ++j) {
        const int r = held_row(j, lane);
        const float score = b.score(x[j], key0 + key_in_warp, r, b.key_begin[j], b.key_end[j], b.slope[j]);
        if (lane % (1 << Scatter::kShift) == 0 && b.live(r)) b.smem.scores[r][b.warp_key0 + key_in_warp] = score;
      }
    }
  }

  // The owning warps: each row's new max and sum, the rescale factor of O, the probabilities.
  template <typename Block>
  __device__ __forceinline__ void softmax(Block& b) {
    const int lane = b.lane;
    CUTE_UNROLL
    for (int j = 0; j < Traits::kRowsPerWarp; ++j) {
      const int r = b.warp + j * kWarps;
      if (r < kRows && b.live(r)) {
        float x[kChunk / 32];
        float block_max = -INFINITY;
        CUTE_UNROLL
        for (int t = 0; t < kChunk / 32; ++t) {
          x[t] = b.smem.scores[r][lane + 32 * t];
          block_max = fmaxf(block_max, x[t]);
        }
        CUTE_UNROLL
        for (int o = 16; o >= 1; o /= 2) block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, o));
        const RowStep step = online_step(m_own[j], fmaxf(m_own[j], block_max));
        float sum = 0.f;
        CUTE_UNROLL
        for (int t = 0; t < kChunk / 32; ++t) {
          const float prob = exp2_approx(x[t] - step.offset);
          b.smem.scores[r][lane + 32 * t] = prob;
          sum += prob;
        }
        CUTE_UNROLL
        for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
        const float alpha = step.alpha();
        l_own[j] = l_own[j] * alpha + sum;
        if (lane == 0) b.smem.alphas[r] = alpha;
      }
    }
  }

  // O = alpha O + P V over my keys.
  template <typename Block>
  __device__ __forceinline__ void add_pv(Block& b, int stage) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (!b.live(r)) continue;
      const float alpha = b.smem.alphas[r];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
    }
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float vf[8];
      unpack8<Element>(b.stage_at(stage, 1, s), vf);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (!b.live(r)) continue;
        const float prob = b.smem.scores[r][b.warp_key0 + s * kKeysPerStep + b.slot];
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(prob, vf[e], acc[r][e]);
      }
    }
  }

  template <typename Block>
  __device__ __forceinline__ void reduce(Block& b) {
    this->sum_slots(b);
  }
};

}  // namespace cuteflash

// The decoding kernel's pass for a single query row, on CUDA cores: each key slot of a warp (the kLanesPerKey lanes
// of one key of a load) keeps the running max and sum of its own keys, so the walk has no barrier between warps and
// no exchange through shared memory; reduce() merges the slots' statistics into the warp's.
#pragma once

#include "cuteflash/decode/cuda_core_rows.cuh"

namespace cuteflash {

template <typename Traits>
struct DecodeSingleRowPass : DecodeCudaCoreRows<Traits> {
  static_assert(Traits::kRows == 1 && Traits::kOwnSoftmax);
  using Element = typename Traits::Element;
  using DecodeCudaCoreRows<Traits>::q;
  using DecodeCudaCoreRows<Traits>::acc;
  using DecodeCudaCoreRows<Traits>::m_own;
  using DecodeCudaCoreRows<Traits>::l_own;
  static constexpr int kLanesPerKey = Traits::kLanesPerKey;
  static constexpr int kKeysPerStep = Traits::kKeysPerStep;
  static constexpr int kSteps = Traits::kSteps;
  // The slot's kSteps dot products are reduced over its lanes by a reduce-scatter, so that each lane ends with the
  // whole dot products of kHeld keys (other lanes hold the others) and scores and exponentiates only those; the
  // probabilities are then handed to every lane of the slot. At head dim 128 (16 lanes, 4 keys): 5 shuffles for the
  // dot products instead of 16, 2 for the chunk's max and 4 for the probabilities, and each key's score and
  // exponential computed by 4 lanes instead of 16.
  using Scatter = SlotReduceScatter<kSteps, kLanesPerKey>;
  static constexpr int kHeld = Scatter::kHeld;
  static constexpr int kSpreadShift = Scatter::kShift;

  // My key slot's part of a chunk: its scores, the running max and sum, O rescaled and its keys' P V added.
  template <typename Block>
  __device__ void run(Block& b, int stage, int key0) {
    const int lane = b.lane;
    float x[kSteps];
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float kf[8];
      unpack8<Element>(b.stage_at(stage, 0, s), kf);
      x[s] = 0.f;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) x[s] = fmaf(q[0][e], kf[e], x[s]);
    }
    Scatter::reduce(x, lane);  // x[j]: step spread kHeld + j's dot product
    const int spread = Scatter::spread(lane);
    float chunk_max = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kHeld; ++j) {
      x[j] = b.score(x[j], key0 + (spread * kHeld + j) * kKeysPerStep + b.slot, 0, b.key_begin[0], b.key_end[0],
                     b.slope[0]);
      chunk_max = fmaxf(chunk_max, x[j]);
    }
    CUTE_UNROLL
    for (int o = kLanesPerKey / 2; o >= (1 << kSpreadShift); o /= 2) {
      chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffff, chunk_max, o));
    }
    const RowStep step = online_step(m_own[0], fmaxf(m_own[0], chunk_max));
    const float alpha = step.alpha();
    l_own[0] *= alpha;  // of my kHeld keys of each chunk: summed over the spread lanes at the end
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc[0][e] *= alpha;
    CUTE_UNROLL
    for (int j = 0; j < kHeld; ++j) {
      x[j] = exp2_approx(x[j] - step.offset);
      l_own[0] += x[j];
    }
    const int slot_lane0 = lane & ~(kLanesPerKey - 1);
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      const float prob = __shfl_sync(0xffffffff, x[s % kHeld], slot_lane0 + ((s / kHeld) << kSpreadShift));
      float vf[8];
      unpack8<Element>(b.stage_at(stage, 1, s), vf);
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[0][e] = fmaf(prob, vf[e], acc[0][e]);
    }
  }

  // The slots' statistics become the warp's: O and l rescaled to the warp's max, then summed over the slots.
  template <typename Block>
  __device__ __forceinline__ void reduce(Block& b) {
    CUTE_UNROLL
    for (int o = kLanesPerKey / 2; o >= (1 << kSpreadShift); o /= 2) {  // the spread lanes' sums, the slot's
      l_own[0] += __shfl_xor_sync(0xffffffff, l_own[0], o);
    }
    float m = m_own[0];
    CUTE_UNROLL
    for (int o = kLanesPerKey; o < 32; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    const float f = part_weight(m_own[0], m);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc[0][e] *= f;
    l_own[0] *= f;
    CUTE_UNROLL
    for (int o = kLanesPerKey; o < 32; o *= 2) l_own[0] += __shfl_xor_sync(0xffffffff, l_own[0], o);
    m_own[0] = m;
    this->sum_slots(b);
  }
};

}  // namespace cuteflash

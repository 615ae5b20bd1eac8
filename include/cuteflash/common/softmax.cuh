// Online softmax over key blocks (FlashAttention-2): running row max m and row sum l, with the
// output accumulator rescaled whenever m grows. online_step is a row's step, which every kernel takes over its own
// view of the rows (which lanes share a row, where its scores live); OnlineSoftmax takes it over (rows, cols) views
// of MMA accumulators.
#pragma once

#include <type_traits>

#include "cuteflash/common/utils.cuh"

namespace cuteflash {

// A row's step: a block of scores s whose largest, with the row's running max m, is m_new. The block's probabilities
// are exp2(s scale_log2 - offset); the row's sum and output over the earlier blocks are multiplied by alpha().
struct RowStep {
  float m_old;   // the running max before the block
  float offset;  // m_new scale_log2; 0 while m_new = -inf (every score so far masked), so that their P is 0, not NaN
  float scale_log2;

  // exp2((m_old - m_new) scale_log2): 0 while m_old = -inf (nothing seen before). Computed where it is called, which
  // the kernels place among their reductions.
  __device__ __forceinline__ float alpha() const { return exp2_approx(m_old * scale_log2 - offset); }
};

__device__ __forceinline__ RowStep online_step(float& m, float m_new, float scale_log2 = 1.f) {
  const RowStep step{m, m_new == -INFINITY ? 0.f : m_new * scale_log2, scale_log2};
  m = m_new;
  return step;
}

// The weight of a part of a row's softmax (a warp's keys, a split's) whose running max is m_part, when the parts
// are merged at the row's max m: exp2(m_part - m), 0 for a part that saw no key.
__device__ __forceinline__ float part_weight(float m_part, float m) {
  return m_part == -INFINITY ? 0.f : exp2_approx(m_part - m);
}

// op over row mi of a (rows, cols) tensor, starting from init.
template <typename Tensor, typename Op>
__device__ __forceinline__ float row_reduce(Tensor const& t, int mi, float init, Op op) {
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(t); ++ni) init = op(init, t(mi, ni));
  return init;
}

struct Identity {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};

template <int kRows>
struct OnlineSoftmax {
  float m[kRows];  // running max of the raw scores S (not yet scaled)
  float l[kRows];  // this thread's part of the running sum of P; summed over the quad at the end

  __device__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.f;
    }
  }

  // Turns S into P = exp(scale * (S - m_new)) in place and rescales acc_o by exp(scale * (m_old - m_new)).
  // Each phase runs over all rows before the next, so that the rows' dependency chains interleave (10 %
  // faster than one row at a time, causal d=128 on H200). The row reductions are sequential: balanced
  // trees are 7 % slower at d=64.
  //
  // With a non-decreasing f (the softcap's tanh, mask.cuh), the scores are f(S): their row maxima are those of S
  // through f, so that f runs beside the exponential on each score rather than all its results being held for the
  // maxima (which spilled at head dim 128). A masked score (-inf) needs f applied before: f is for unmasked blocks.
  template <typename STensor, typename OTensor, typename F = Identity>
  __device__ __forceinline__ void update(STensor& s, OTensor& acc_o, float scale_log2, F f = {}) {
    float m_new[kRows];
    row_maxes(s, f, m_new);
    float offset[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const RowStep step = online_step(m[mi], m_new[mi], scale_log2);
      offset[mi] = step.offset;
      const float alpha = step.alpha();
      l[mi] *= alpha;
      CUTE_UNROLL
      for (int oi = 0; oi < size<1>(acc_o); ++oi) acc_o(mi, oi) *= alpha;
    }
    exponentiate(s, f, scale_log2, offset);
  }

  // update without acc_o, for a kernel whose product into acc_o is still in flight: the factors by which it must
  // multiply acc_o's rows afterwards (rescale) go to alpha.
  template <typename STensor, typename F = Identity>
  __device__ __forceinline__ void update_scores(STensor& s, float scale_log2, float (&alpha)[kRows], F f = {}) {
    float m_new[kRows];
    row_maxes(s, f, m_new);
    float offset[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const RowStep step = online_step(m[mi], m_new[mi], scale_log2);
      offset[mi] = step.offset;
      alpha[mi] = step.alpha();
      l[mi] *= alpha[mi];
    }
    exponentiate(s, f, scale_log2, offset);
  }

  template <typename OTensor>
  __device__ __forceinline__ static void rescale(OTensor& acc_o, float const (&alpha)[kRows]) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      CUTE_UNROLL
      for (int oi = 0; oi < size<1>(acc_o); ++oi) acc_o(mi, oi) *= alpha[mi];
    }
  }

  // Normalises acc_o by the row sums and returns the log-sum-exp of scale * S per row. A row that saw
  // no key gets O = 0 and lse = +inf (as flash-attn), so that exp(S - lse) = 0 in the backward pass.
  template <typename OTensor>
  __device__ __forceinline__ void finalize(OTensor& acc_o, float softmax_scale, float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float sum = quad_allreduce(l[mi], SumOp{});
      bool empty = sum == 0.f;  // a NaN sum (from NaN inputs) propagates to O and lse
      float inv = empty ? 0.f : 1.f / sum;
      // One fused multiply-add, written out: left to the compiler, kernels that differ elsewhere (reading a paged
      // cache or not) contract it differently, and a split pass's merge weighs O by it (split_merge.cuh).
      lse[mi] = empty ? INFINITY : fmaf(m[mi], softmax_scale, logf(sum));
      CUTE_UNROLL
      for (int oi = 0; oi < size<1>(acc_o); ++oi) acc_o(mi, oi) *= inv;
    }
  }

 private:
  // The rows' new maxima: of the running ones and the block's scores through f, over the quad that shares a row.
  template <typename STensor, typename F>
  __device__ __forceinline__ void row_maxes(STensor const& s, F f, float (&m_new)[kRows]) const {
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      m_new[mi] = std::is_same_v<F, Identity> ? row_reduce(s, mi, m[mi], MaxOp{})
                                              : MaxOp{}(m[mi], f(row_reduce(s, mi, -INFINITY, MaxOp{})));
    }
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) m_new[mi] = quad_allreduce(m_new[mi], MaxOp{});
  }

  // S into P = exp2(f(S) scale_log2 - offset) in place, and P's rows added to the running sums.
  template <typename STensor, typename F>
  __device__ __forceinline__ void exponentiate(STensor& s, F f, float scale_log2, float const (&offset)[kRows]) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2_approx(f(s(mi, ni)) * scale_log2 - offset[mi]);
    }
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) l[mi] = row_reduce(s, mi, l[mi], SumOp{});
  }
};

}  // namespace cuteflash

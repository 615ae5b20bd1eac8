// The mask of a sequence (mask.h's policy, built from the params and the sequence) and its application to
// a score tile.
#pragma once

#include <cstddef>
#include <type_traits>

#include "cuteflash/common/mask.h"
#include "cuteflash/common/params.h"
#include "cuteflash/common/sequence.cuh"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

// Which keys each query row of the sequence sees, for a kernel of variant V (has_options: with windows).
// Cheap to rebuild at each use: a copy kept across a kernel's main loop holds registers that the loop needs
// (it spilled in the sm80 forward kernel).
template <Variant V>
__device__ __forceinline__ MaskPolicy<has_options(V)> mask_policy(FwdParams const& p, Sequence const& seq) {
  if constexpr (has_options(V)) {
    return MaskPolicy<true>::make(seq.seqlen_q, seq.seqlen_k, p.causal, p.window_left, p.window_right);
  } else {
    return MaskPolicy<false>::make(seq.seqlen_q, seq.seqlen_k, p.causal);
  }
}

// tanh on the special function unit where there is one (sm75+; 2^-11 relative error, below fp16's rounding),
// else from exp2 (Volta).
__device__ __forceinline__ float tanh_fast(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  // tanh x = 1 - 2 / (e^2x + 1); e^2x overflowing to +inf gives 1, underflowing to 0 gives -1.
  return 1.f - 2.f / (exp2_approx(x * 2.885390081777927f) + 1.f);
#endif
}

// The general kernels' changes to a sequence's raw scores S = Q K^T before the mask and the softmax, in
// flash-attn's order: softcap (params.h), then ALiBi.
struct ScoreMods {
  float softcap;  // the factor inside tanh; 0: none
  float alibi;    // the head's ALiBi slope over the softmax's scale (0: none): S -= alibi |row + shift - key|
  int shift;      // seqlen_k - seqlen_q

  __device__ __forceinline__ static ScoreMods make(FwdParams const& p, Sequence const& seq, int head) {
    float slope = 0.f;
    if (p.alibi_slopes != nullptr) slope = p.alibi_slopes[seq.batch * p.alibi_batch_stride + head] / p.softmax_scale;
    return {p.softcap, slope, seq.seqlen_k - seq.seqlen_q};
  }

  // tanh(S softcap), and 1 - tanh^2 for the backward pass.
  __device__ __forceinline__ float cap(float s, float& dtanh) const {
    s = tanh_fast(s * softcap);
    dtanh = 1.f - s * s;
    return s;
  }
  // S's ALiBi term at distance dist = row + shift - key from the diagonal, a float, which the callers form from
  // a part per row or block and constants per element: an int-to-float conversion per score would run at a
  // quarter of the fp32 rate, beside the softmax's own work on each score.
  __device__ __forceinline__ float bias(float dist) const { return -alibi * fabsf(dist); }
};

// The softcap's tanh(S softcap) (params.h) as a function, for OnlineSoftmax::update.
struct Softcap {
  float softcap;
  __device__ __forceinline__ float operator()(float s) const { return tanh_fast(s * softcap); }
};

// ScoreMods on each score of a (rows, cols) view s with coord giving (row, col) in the tile whose first row and
// key are row0 and col0, for a kernel of variant V (sequence.cuh: the softcap where has_softcap); dtanh (like s, or
// nullptr_t) receives the softcap's factors for the backward pass.
template <Variant V, typename STensor, typename CoordTensor, typename DTanh>
__device__ __forceinline__ void apply_score_mods(STensor& s, CoordTensor const& coord, int row0, int col0,
                                                 ScoreMods const& mods, DTanh&& dtanh) {
  if constexpr (has_softcap(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      float unused;
      if constexpr (std::is_same_v<std::decay_t<DTanh>, std::nullptr_t>) {
        s(i) = mods.cap(s(i), unused);
      } else {
        s(i) = mods.cap(s(i), dtanh(i));
      }
    }
  }
  if (mods.alibi != 0.f) {
    // A thread's columns are its first one plus constants: the distances are a float per row minus constants.
    const int col_first = get<1>(coord(0, 0));
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
      const float dist0 = float(row0 + get<0>(coord(mi, 0)) + mods.shift - col0 - col_first);
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) += mods.bias(dist0 - float(get<1>(coord(mi, ni)) - col_first));
    }
  }
}

// One step of a kernel's main loop over the blocks of `blocks`: step(block, masked, no_alibi), both flags
// compile-time, the mask only where blocks.masked(block) says and ALiBi only in a call with slopes (no_alibi
// drops it from the step's ScoreMods). Each combination is a copy of the step (which must be always_inline),
// because nvcc issues an option's work in a step that has it behind a run-time test, predicated off, in every
// step rather than branching around it; a block that needs the mask runs the copy with every option.
// kAlibiApart = false: two copies, ALiBi tested at run time in both.
template <Variant V, bool kAlibiApart = true, typename Step>
__device__ __forceinline__ void step_with_options(FwdParams const& p, BlockRange const& blocks, int block,
                                                  Step&& step) {
  if (blocks.masked(block)) {
    step(block, cute::true_type{}, cute::false_type{});
  } else if (has_options(V) && (!kAlibiApart || p.alibi_slopes != nullptr)) {
    step(block, cute::false_type{}, cute::false_type{});
  } else {
    step(block, cute::false_type{}, cute::true_type{});
  }
}

// The ScoreMods of a step of step_with_options.
template <typename NoAlibi>
__device__ __forceinline__ ScoreMods step_score_mods(FwdParams const& p, Sequence const& seq, int head, NoAlibi) {
  ScoreMods mods = ScoreMods::make(p, seq, head);
  if constexpr (NoAlibi::value) mods.alibi = 0.f;
  return mods;
}

// s: scores in (rows, cols) view; coord: the matching (row, col) positions inside the tile.
// row0/col0: the tile's first query row and key column. Scores of keys a row does not see become -inf
// (keys past seqlen_k included); a row's first key is tested only where the policy bounds the left side.
template <bool kWindow, typename STensor, typename CoordTensor>
__device__ __forceinline__ void apply_mask(STensor& s, CoordTensor const& coord, int row0, int col0,
                                           MaskPolicy<kWindow> const& mask) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    const int row = row0 + get<0>(coord(mi, 0));
    const int begin = mask.key_begin(row), end = mask.key_end(row);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) {
      const int key = col0 + get<1>(coord(mi, ni));
      if ((mask.left_bounded() && key < begin) || key >= end) s(mi, ni) = -INFINITY;
    }
  }
}

// dS (a (rows, cols) view) of scores that went through a softcap, whose factor is softcap (1 - tanh^2)
// (params.h): times 1 - tanh^2, the softcap being in the caller's scale of dS already (grad_scale).
template <typename DSTensor, typename DTanh>
__device__ __forceinline__ void apply_softcap_grad(DSTensor& ds, DTanh const& dtanh) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(ds); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(ds); ++ni) ds(mi, ni) *= dtanh(mi, ni);
  }
}

}  // namespace cuteflash

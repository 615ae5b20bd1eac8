// Host side of the sm75 backward: up to head dim 128 the sm80 family's kernels (bwd_kernel.cuh there) with Turing's
// traits, their query blocks staged through registers; above, where no tile of those kernels fits a T4's 64 KB, the
// sm70 family's backward (sm75/tiles.h). Included by the generated src/kernels/bwd_sm75_<dtype>_hd<D>.cu files only.
#pragma once

#include <type_traits>

#include "cuteflash/sm70/bwd_launch.cuh"
#include "cuteflash/sm75/traits.h"
#include "cuteflash/sm80/bwd_launch.cuh"

namespace cuteflash::sm75 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, half_t>, "Turing's tensor cores take fp16");
  if constexpr (kHeadDim > kSm75BwdMaxHeadDim) {
    sm70::run_bwd<Element, kHeadDim>(p, stream);
  } else {
    using Traits = typename BwdTraitsSelect<kHeadDim>::type;
    launch_bwd_preprocess<Element, kHeadDim>(p, stream);
    require_smem(Traits::kSmemBytes, "backward", kHeadDim);
    sm80::launch_bwd_kernels<Traits, DqTraits<kHeadDim>>(p, stream,
                                                         {"sm75 backward", "sm75 dQ conversion", "sm75 backward dQ"});
  }
}

}  // namespace cuteflash::sm75

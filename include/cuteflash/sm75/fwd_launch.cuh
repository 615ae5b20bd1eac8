// Host side of the sm75 forward: the sm80 family's forward kernel (fwd_kernel.cuh there) with Turing's traits.
// Included by the generated src/kernels/fwd_sm75_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/sm75/traits.h"
#include "cuteflash/sm80/fwd_kernel.cuh"

namespace cuteflash::sm75 {

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, half_t>, "Turing's tensor cores take fp16");
  using Traits = typename FwdTraitsSelect<kHeadDim>::type;
  require_smem(Traits::kSmemBytes, "forward", kHeadDim);
  const dim3 grid = fwd_grid(p, Traits::kBlockM);
  for_variant(p, [&](auto variant) {  // decltype(...)::value: CUDA 11.8 cannot use variant() in the inner lambda
    for_paging<decltype(variant)::value>(p, [&](auto paged) {
      launch(&sm80::fwd_kernel<Traits, decltype(variant)::value, decltype(paged)::value>, grid, Traits::kNThreads,
             Traits::kSmemBytes, stream, p, "sm75 forward");
    });
  });
  if (p.num_splits > 1) merge_splits<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash::sm75

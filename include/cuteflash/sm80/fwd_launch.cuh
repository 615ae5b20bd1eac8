// Host side of the sm80 forward: picks the tile variant that fits the device's shared memory and
// launches. Included by the generated src/kernels/fwd_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/sm80/fwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    const dim3 grid = fwd_grid(p, Traits::kBlockM);
    for_variant(p, [&](auto variant) {  // decltype(...)::value: CUDA 11.8 cannot use variant() in the inner lambda
      for_paging<decltype(variant)::value>(p, [&](auto paged) {
        launch(&fwd_kernel<Traits, decltype(variant)::value, decltype(paged)::value>, grid, Traits::kNThreads,
               Traits::kSmemBytes, stream, p, "sm80 forward");
      });
    });
  };
  // The large- and small-shared-memory tiles are the same type below head dim 224; the causal tile
  // differs from the other only up to head dim 64.
  auto launch_for_mask = [&](auto causal) {
    constexpr bool kCausal = decltype(causal)::value;
    launch_fitting<typename FwdTraitsSelect<Element, kHeadDim, false, kCausal>::type,
                   typename FwdTraitsSelect<Element, kHeadDim, true, kCausal>::type>(launch_one, "forward", kHeadDim);
  };
  if (p.causal) {
    launch_for_mask(cute::true_type{});
  } else {
    launch_for_mask(cute::false_type{});
  }
  if (p.num_splits > 1) merge_splits<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash::sm80

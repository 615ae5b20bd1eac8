// Host side of the sm70 forward: the first tile of the table (sm70/tiles.h) that fits the device's shared
// memory (V100: 96 KB, T4: 64 KB). Included by the generated src/kernels/fwd_sm70_fp16_hd<D>.cu files only.
#pragma once

#include <type_traits>

#include "cuteflash/sm70/launch.h"
#include "cuteflash/sm70/fwd_kernel.cuh"
#include "cuteflash/host/launch_common.cuh"

namespace cuteflash::sm70 {

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, cutlass::half_t>, "the sm70 family computes in fp16");
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    const dim3 grid = fwd_grid(p, Traits::kBlockM);
    for_variant(p, [&](auto variant) {  // decltype(...)::value: CUDA 11.8 cannot use variant() in the inner lambda
      for_paging<decltype(variant)::value>(p, [&](auto paged) {
        launch(&fwd_kernel<Traits, decltype(variant)::value, decltype(paged)::value>, grid, Traits::kNThreads,
               Traits::kSmemBytes, stream, p, "sm70 forward");
      });
    });
  };
  launch_tile_choices<FwdTraitsChoice, kHeadDim>(launch_one, "sm70 forward");
  if (p.num_splits > 1) merge_splits<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash::sm70

// Host side of the sm80 forward: picks the tile variant that fits the device's shared memory and
// launches. Included by the generated src/kernels/fwd_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/launch.h"
#include "cuteflash/sm80/fwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  using Large = typename FwdTraitsSelect<Element, kHeadDim, false>::type;
  using Small = typename FwdTraitsSelect<Element, kHeadDim, true>::type;
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
    launch(&fwd_kernel<Traits>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm80 forward");
  };
  launch_fitting<Large, Small>(launch_one, "forward", kHeadDim);  // the same type below head dim 224
}

}  // namespace cuteflash::sm80

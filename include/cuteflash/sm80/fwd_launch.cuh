// Host side of the sm80 forward: picks the tile variant that fits the device's shared memory and
// launches. Included by the generated src/kernels/fwd_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/launch.h"
#include "cuteflash/sm80/fwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Traits>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  launch(&fwd_kernel<Traits>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm80 forward");
}

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  using Large = typename FwdTraitsSelect<Element, kHeadDim, false>::type;
  using Small = typename FwdTraitsSelect<Element, kHeadDim, true>::type;
  if (Large::kSmemBytes <= max_smem_per_block()) {
    launch_fwd<Large>(p, stream);
  } else {
    require_smem(Small::kSmemBytes, "forward", kHeadDim);
    launch_fwd<Small>(p, stream);
  }
}

}  // namespace cuteflash::sm80

// Host side of the sm70 forward: 64 keys per step where shared memory allows (V100: 96 KB), else 32
// (T4: 64 KB). Included by the generated src/kernels/fwd_sm70_fp16_hd<D>.cu files only.
#pragma once

#include <type_traits>

#include "cuteflash/launch.h"
#include "cuteflash/sm70/fwd_kernel.cuh"

namespace cuteflash::sm70 {

template <typename Traits>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  launch(&fwd_kernel<Traits>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm70 forward");
}

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, cutlass::half_t>, "the sm70 family computes in fp16");
  using Large = FwdTraits<kHeadDim, 64>;
  using Small = FwdTraits<kHeadDim, 32>;
  if (Large::kSmemBytes <= max_smem_per_block()) {
    launch_fwd<Large>(p, stream);
  } else {
    require_smem(Small::kSmemBytes, "sm70 forward", kHeadDim);
    launch_fwd<Small>(p, stream);
  }
}

}  // namespace cuteflash::sm70

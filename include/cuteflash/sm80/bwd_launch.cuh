// Host side of the sm80 backward: D = rowsum(dO * O), the dK/dV(/dQ) kernel, and the dQ kernel when
// asked for a deterministic pass. Included by the generated src/kernels/bwd_sm80_<dtype>_hd<D>.cu only.
#pragma once

#include "cuteflash/bwd_preprocess.cuh"
#include "cuteflash/launch.h"
#include "cuteflash/sm80/bwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  launch_bwd_preprocess<Element>(p, stream);

  using Large = typename BwdTraitsSelect<Element, kHeadDim, false>::type;
  using Small = typename BwdTraitsSelect<Element, kHeadDim, true>::type;
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
    launch(&bwd_kernel<Traits>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm80 backward");
  };
  launch_fitting<Large, Small>(launch_one, "backward", kHeadDim);  // the same type unless d is 96 or 128

  if (p.deterministic) {
    using DqT = DqTraits<Element, kHeadDim>;
    constexpr int smem = int(sizeof(DqSharedStorage<DqT>));
    require_smem(smem, "backward dQ", kHeadDim);
    dim3 grid_dq(ceil_div(p.seqlen_q, DqT::kBlockM), p.nheads, p.batch);
    launch(&bwd_dq_kernel<DqT>, grid_dq, DqT::kNThreads, smem, stream, p, "sm80 backward dQ");
  }
}

}  // namespace cuteflash::sm80

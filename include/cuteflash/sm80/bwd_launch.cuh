// Host side of the sm80 backward: D = rowsum(dO * O), the dK/dV(/dQ) kernel, and the dQ kernel when
// asked for a deterministic pass. Included by the generated src/kernels/bwd_sm80_<dtype>_hd<D>.cu only.
#pragma once

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/host/launch.h"
#include "cuteflash/sm80/bwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  launch_bwd_preprocess<Element, kHeadDim>(p, stream);

  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    for_variant(p, [&](auto variant) {
      dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
      launch(&bwd_kernel<Traits, variant()>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm80 backward");
    });
    if (!p.deterministic) {
      for_batch_kind(p, [&](auto batch_kind) {
        dim3 grid_dq(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
        constexpr int smem = Traits::kBlockM * Traits::kHeadDim * int(sizeof(typename Traits::Element));
        launch(&convert_dq_kernel<Traits, batch_kind()>, grid_dq, Traits::kNThreads, smem, stream, p,
               "sm80 dQ conversion");
      });
    }
  };
  // H100/H200, A100, then sm86/89/120; neighbours are often the same type.
  launch_fitting<typename BwdTraitsSelect<Element, kHeadDim, kSmemSm90Bytes>::type,
                 typename BwdTraitsSelect<Element, kHeadDim, kSmemSm80Bytes>::type,
                 typename BwdTraitsSelect<Element, kHeadDim, kSmallSmemBytes>::type>(launch_one, "backward", kHeadDim);

  if (p.deterministic) {
    using DqT = DqTraits<Element, kHeadDim>;
    constexpr int smem = int(sizeof(DqSharedStorage<DqT>));
    require_smem(smem, "backward dQ", kHeadDim);
    dim3 grid_dq(ceil_div(p.seqlen_q, DqT::kBlockM), p.nheads, p.batch);
    for_variant(p, [&](auto variant) {
      launch(&bwd_dq_kernel<DqT, variant()>, grid_dq, DqT::kNThreads, smem, stream, p, "sm80 backward dQ");
    });
  }
}

}  // namespace cuteflash::sm80

// Host side of the sm80 backward: D = rowsum(dO * O), the dK/dV(/dQ) kernel, and the dQ kernel when
// asked for a deterministic pass. Included by the generated src/kernels/bwd_sm80_<dtype>_hd<D>.cu only (and by the
// sm75 family's launcher, which runs the same kernels with its own traits).
#pragma once

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/host/launch.h"
#include "cuteflash/sm80/bwd_kernel.cuh"

namespace cuteflash::sm80 {

// The names of a family's backward kernels, for errors.
struct BwdKernelNames {
  char const* main;     // "sm80 backward"
  char const* convert;  // "sm80 dQ conversion"
  char const* dq;       // "sm80 backward dQ"
};

// The backward's kernels after the preprocess, on the tile Traits: the dK/dV kernel with dQ's atomics and their
// conversion into dq or, for a deterministic pass, the dK/dV kernel and then the dQ kernel on DqT's tile.
template <typename Traits, typename DqT>
void launch_bwd_kernels(BwdParams const& p, cudaStream_t stream, BwdKernelNames const& names) {
  for_variant(p, [&](auto variant) {
    dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
    launch(&bwd_kernel<Traits, variant()>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, names.main);
  });
  if (!p.deterministic) {
    for_batch_kind(p, [&](auto batch_kind) {
      dim3 grid_dq(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
      constexpr int smem = Traits::kBlockM * Traits::kHeadDim * int(sizeof(typename Traits::Element));
      launch(&convert_dq_kernel<Traits, batch_kind()>, grid_dq, Traits::kNThreads, smem, stream, p, names.convert);
    });
    return;
  }
  constexpr int smem = int(sizeof(DqSharedStorage<DqT>));
  require_smem(smem, "backward dQ", DqT::kHeadDim);
  dim3 grid_dq(ceil_div(p.seqlen_q, DqT::kBlockM), p.nheads, p.batch);
  for_variant(p, [&](auto variant) {
    launch(&bwd_dq_kernel<DqT, variant()>, grid_dq, DqT::kNThreads, smem, stream, p, names.dq);
  });
}

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  launch_bwd_preprocess<Element, kHeadDim>(p, stream);
  auto launch_one = [&](auto traits) {
    launch_bwd_kernels<decltype(traits), DqTraits<Element, kHeadDim>>(
        p, stream, {"sm80 backward", "sm80 dQ conversion", "sm80 backward dQ"});
  };
  // H100/H200, A100, then sm86/89/120; neighbours are often the same type.
  launch_fitting<typename BwdTraitsSelect<Element, kHeadDim, kSmemSm90Bytes>::type,
                 typename BwdTraitsSelect<Element, kHeadDim, kSmemSm80Bytes>::type,
                 typename BwdTraitsSelect<Element, kHeadDim, kSmallSmemBytes>::type>(launch_one, "backward", kHeadDim);
}

}  // namespace cuteflash::sm80

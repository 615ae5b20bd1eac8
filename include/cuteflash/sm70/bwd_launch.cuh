// Host side of the sm70 backward: D = rowsum(dO * O), the dK/dV kernel (with dQ atomics into dq_accum,
// which the last thread block of each head converts into dq) and, when a deterministic pass is asked
// for, the dQ kernel instead of the atomics; on the first tile of the table (sm70/tiles.h) that fits the device.
// Included by the generated src/kernels/bwd_sm70_fp16_hd<D>.cu files only.
#pragma once

#include <type_traits>

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/sm70/bwd_kernel.cuh"
#include "cuteflash/sm70/launch.h"

namespace cuteflash::sm70 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, cutlass::half_t>, "the sm70 family computes in fp16");
  launch_bwd_preprocess<Element, kHeadDim>(p, stream);
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    for_variant(p, [&](auto variant) {
      dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
      launch(&bwd_kernel<Traits, variant()>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm70 backward");
      if (p.deterministic) {
        dim3 grid_dq(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
        launch(&bwd_dq_kernel<Traits, variant()>, grid_dq, Traits::kNThreads, Traits::kSmemBytes, stream, p,
               "sm70 backward dQ");
      }
    });
  };
  launch_tile_choices<BwdTraitsChoice, kHeadDim>(launch_one, "sm70 backward");
}

}  // namespace cuteflash::sm70

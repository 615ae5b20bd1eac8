// Host side of the sm70 forward: the largest tile that fits the device's shared memory (V100: 96 KB,
// T4: 64 KB). Included by the generated src/kernels/fwd_sm70_fp16_hd<D>.cu files only.
#pragma once

#include <type_traits>

#include "cuteflash/sm70/launch.h"
#include "cuteflash/sm70/fwd_kernel.cuh"

namespace cuteflash::sm70 {

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  static_assert(std::is_same_v<Element, cutlass::half_t>, "the sm70 family computes in fp16");
  auto launch_one = [&](auto traits) {
    using Traits = decltype(traits);
    dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
    launch(&fwd_kernel<Traits>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, p, "sm70 forward");
  };
  // The largest tile: up to head dim 128, 128 query rows (32 per warp: each K and V fragment serves two
  // 16-row tiles) x 32 keys per step, 48 KB at d=64 (two blocks per SM on a V100, one on a T4), 73 KB at
  // d=128 (V100); about 10 % faster without a mask than 16 query rows per warp x 64 keys. Above, 64 query
  // rows x 64 keys. Then 64 x 32; 32 x 32 (T4 at head dims 192-256).
  using Largest = std::conditional_t<kHeadDim <= 128, FwdTraits<kHeadDim, 32, 4, 2>, FwdTraits<kHeadDim, 64>>;
  launch_fitting_sm70<Largest, FwdTraits<kHeadDim, 32>, FwdTraits<kHeadDim, 32, 2>>(launch_one, "sm70 forward",
                                                                                    kHeadDim);
}

}  // namespace cuteflash::sm70

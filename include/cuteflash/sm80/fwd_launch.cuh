// Host side of the sm80 forward: picks the tile variant that fits the device's shared memory and
// launches. Included by the generated src/kernels/fwd_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include <string>

#include "cuteflash/sm80/fwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Traits>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  auto kernel = &fwd_kernel<Traits>;
  constexpr int smem = Traits::kSmemBytes;
  if (smem > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "setting the forward kernel's shared-memory size");
  }
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "launching the sm80 forward kernel");
}

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  using Large = typename FwdTraitsSelect<Element, kHeadDim, false>::type;
  using Small = typename FwdTraitsSelect<Element, kHeadDim, true>::type;
  int device = 0, max_smem = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "reading the shared-memory limit");
  if (Large::kSmemBytes <= max_smem) {
    launch_fwd<Large>(p, stream);
  } else if (Small::kSmemBytes <= max_smem) {
    launch_fwd<Small>(p, stream);
  } else {
    throw std::runtime_error("cuteflash: the forward kernel for head dim " + std::to_string(kHeadDim) + " needs " +
                             std::to_string(Small::kSmemBytes) + " bytes of shared memory per block; this GPU offers " +
                             std::to_string(max_smem));
  }
}

}  // namespace cuteflash::sm80

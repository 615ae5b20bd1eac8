// Host side of the sm80 backward: D = rowsum(dO * O), then the dK/dV/dQ kernel. Included by the
// generated src/kernels/bwd_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include <string>

#include "cuteflash/sm80/bwd_kernel.cuh"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  constexpr int kPreprocessWarps = 4;
  dim3 grid_pre(ceil_div(p.seqlen_q, kPreprocessWarps), p.nheads, p.batch);
  bwd_preprocess_kernel<Element><<<grid_pre, kPreprocessWarps * 32, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "launching the backward preprocess kernel");

  using Traits = typename BwdTraitsSelect<Element, kHeadDim>::type;
  auto kernel = &bwd_kernel<Traits>;
  constexpr int smem = Traits::kSmemBytes;
  int device = 0, max_smem = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "reading the shared-memory limit");
  if (smem > max_smem) {
    throw std::runtime_error("cuteflash: the backward kernel for head dim " + std::to_string(kHeadDim) + " needs " +
                             std::to_string(smem) + " bytes of shared memory per block; this GPU offers " +
                             std::to_string(max_smem));
  }
  if (smem > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "setting the backward kernel's shared-memory size");
  }
  dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads, p.batch);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), "launching the sm80 backward kernel");

  if (p.deterministic) {
    using DqT = DqTraits<Element, kHeadDim>;
    auto dq_kernel = &bwd_dq_kernel<DqT>;
    constexpr int dq_smem = 2 * (DqT::kBlockM + DqT::kBlockN) * kHeadDim * int(sizeof(Element));
    if (dq_smem > 48 * 1024) {
      check_cuda(cudaFuncSetAttribute(dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dq_smem),
                 "setting the dQ kernel's shared-memory size");
    }
    dim3 grid_dq(ceil_div(p.seqlen_q, DqT::kBlockM), p.nheads, p.batch);
    dq_kernel<<<grid_dq, DqT::kNThreads, dq_smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "launching the sm80 deterministic dQ kernel");
  }
}

}  // namespace cuteflash::sm80

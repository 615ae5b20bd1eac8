// Host helpers shared by the launchers of both families: the device's shared-memory limit and a launch
// that raises the kernel's dynamic shared-memory limit first when it needs more than 48 KB.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuteflash/utils.cuh"

namespace cuteflash {

inline int max_smem_per_block() {
  int device = 0, max_smem = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "reading the shared-memory limit");
  return max_smem;
}

inline void require_smem(int needed, char const* what, int head_dim) {
  int available = max_smem_per_block();
  if (needed > available) {
    throw std::runtime_error(std::string("cuteflash: the ") + what + " kernel for head dim " + std::to_string(head_dim) +
                             " needs " + std::to_string(needed) + " bytes of shared memory per block; this GPU offers " +
                             std::to_string(available));
  }
}

template <typename Params>
void launch(void (*kernel)(Params), dim3 grid, int threads, int smem, cudaStream_t stream, Params const& p,
            char const* what) {
  if (smem > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               (std::string("setting the shared-memory size of the ") + what + " kernel").c_str());
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), (std::string("launching the ") + what + " kernel").c_str());
}

}  // namespace cuteflash

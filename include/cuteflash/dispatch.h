// The host's view of the compiled kernels: which families are in the module, whether a family's code
// runs on the current device, and the launcher of each (family, direction, dtype, head dim).
// Implemented by the generated dispatch.cpp (see src/kernels/generate.py).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuteflash/params.h"

namespace cuteflash {

enum class Family : int { kSm70 = 70, kSm80 = 80 };

using FwdFn = void (*)(FwdParams const&, cudaStream_t);
using BwdFn = void (*)(BwdParams const&, cudaStream_t);
// Writes the dropout mask of p's call (dropout.cuh's dropout_mask_kernel): keep, rows, cols.
using DropoutMaskFn = void (*)(FwdParams const&, uint8_t*, int, int, cudaStream_t);

// Appends new keys and values to a KV cache (cache_append.cuh).
using AppendFn = void (*)(AppendParams const&, cudaStream_t);

// True when the module holds code of this family that the current device can run.
bool family_runs(Family family);

// The forward / backward launcher for a kernel head dim (one of kHeadDims), or nullptr if it was not compiled.
FwdFn find_fwd(Family family, DType dtype, int head_dim);
BwdFn find_bwd(Family family, DType dtype, int head_dim);
// The decoding kernel (decode.cuh), built with each forward kernel.
FwdFn find_decode(Family family, DType dtype, int head_dim);
AppendFn find_append(Family family);
DropoutMaskFn find_dropout_mask(Family family);

// One compiled launcher: its family, direction ("fwd" or "bwd"), dtype and kernel head dim.
struct KernelInfo {
  Family family;
  char const* direction;
  DType dtype;
  int head_dim;
};

std::vector<KernelInfo> compiled_kernels();

}  // namespace cuteflash

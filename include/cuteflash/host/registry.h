// The host's view of the kernel families compiled into the module. The registry, python/cuteflash/_families.py,
// names the families; src/kernels/generate.py writes this view's implementation (dispatch.cpp in the build folder)
// from it, with what each family's folder says of itself (its tiles.h's FamilyTraits) and the kernels compiled.
// Nothing else on the host names a family: a family is an index into compiled_families().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuteflash/common/params.h"
#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"

namespace cuteflash {

using FwdFn = void (*)(FwdParams const&, cudaStream_t);
using BwdFn = void (*)(BwdParams const&, cudaStream_t);
// Writes the dropout mask of p's call (common/dropout_mask.cuh): keep, rows, cols.
using DropoutMaskFn = void (*)(FwdParams const&, uint8_t*, int, int, cudaStream_t);
// Appends new keys and values to a KV cache (common/cache_append.cuh).
using AppendFn = void (*)(AppendParams const&, cudaStream_t);

// A compiled family: the registry's name, the targets this build compiled it for, what its folder's FamilyTraits
// say, and its kernels that do not depend on a head dim.
struct FamilyInfo {
  char const* name;                        // "sm80"
  char const* targets;                     // "8.0 9.0"
  DecodeConfig decode;                     // how its decoding kernel reads the keys, where its tensor cores take over
  int decode_family;                       // the family whose decoding kernel it launches (itself, or the registry's
                                           // decode_from; -1: that family is not compiled in)
  bool rowsum_in_dq;                       // the backward's D may live in dq's memory unless the pass is deterministic
  TileConfig (*split_tile)(int head_dim);  // the forward tile that plans the tiled kernels' key splits
  bool (*runs)();                          // whether the family's code in this module runs on the current device
  DropoutMaskFn dropout_mask;
  AppendFn append;
};

// The families compiled in, in the registry's order. A family index (`int family` below) points into it.
std::vector<FamilyInfo> const& compiled_families();

// The launcher of a family's forward, backward or decoding kernel for a kernel head dim (one of kHeadDims), or
// nullptr if it was not compiled.
FwdFn find_fwd(int family, DType dtype, int head_dim);
BwdFn find_bwd(int family, DType dtype, int head_dim);
FwdFn find_decode(int family, DType dtype, int head_dim);

// One compiled launcher: its family, direction ("fwd" or "bwd"), dtype and kernel head dim.
struct KernelInfo {
  int family;
  char const* direction;
  DType dtype;
  int head_dim;
};

std::vector<KernelInfo> compiled_kernels();

}  // namespace cuteflash

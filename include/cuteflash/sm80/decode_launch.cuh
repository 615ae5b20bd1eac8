// The sm80 family's decoding kernel: the shared one (decode/kernel.cuh), reading the keys with cp.async.
// Included by the generated decode_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/kernel.cuh"
#include "cuteflash/sm80/tiles.h"

namespace cuteflash::sm80 {

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, FamilyTraits::kDecodeCpAsync>(p, stream);
}

}  // namespace cuteflash::sm80

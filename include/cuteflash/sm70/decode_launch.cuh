// The sm70 family's decoding kernel: the shared one (decode/kernel.cuh), reading the keys into registers, its products
// on WMMA. Included by the generated decode_sm70_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/kernel.cuh"
#include "cuteflash/sm70/tiles.h"

namespace cuteflash::sm70 {

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, FamilyTraits::kDecodeCpAsync>(p, stream);
}

}  // namespace cuteflash::sm70

// The sm90 family's decoding kernel: the sm80 family's (sm80/decode_launch.cuh; tiles.h plans with its DecodeConfig),
// compiled for sm_90a beside the family's forward. Included by the generated decode_sm90_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/sm80/decode_launch.cuh"
#include "cuteflash/sm90/tiles.h"

namespace cuteflash::sm90 {

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  sm80::run_decode<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash::sm90

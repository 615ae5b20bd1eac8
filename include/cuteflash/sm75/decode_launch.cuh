// The sm75 family's decoding kernel: the shared one (decode/) with the sm70 family's pass of several query rows on
// WMMA (sm70/decode_pass.cuh), which Turing runs as well, keys read into registers. Included by the generated
// decode_sm75_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/launch.cuh"
#include "cuteflash/sm70/decode_pass.cuh"
#include "cuteflash/sm75/tiles.h"

namespace cuteflash::sm75 {

struct DecodeFamily {
  static constexpr DecodeConfig kConfig = FamilyTraits::kDecode;
  template <typename Traits>
  using TensorPass = sm70::DecodeWmmaPass<Traits>;
};

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, DecodeFamily>(p, stream);
}

}  // namespace cuteflash::sm75

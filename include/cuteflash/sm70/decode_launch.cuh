// The sm70 family's decoding kernel: the shared one (decode/), reading the keys into registers, its products for
// several query rows on WMMA (decode_pass.cuh). Included by the generated decode_sm70_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/launch.cuh"
#include "cuteflash/sm70/decode_pass.cuh"
#include "cuteflash/sm70/tiles.h"

namespace cuteflash::sm70 {

struct DecodeFamily {
  static constexpr DecodeConfig kConfig = FamilyTraits::kDecode;
  template <typename Traits>
  using TensorPass = DecodeWmmaPass<Traits>;
};

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, DecodeFamily>(p, stream);
}

}  // namespace cuteflash::sm70

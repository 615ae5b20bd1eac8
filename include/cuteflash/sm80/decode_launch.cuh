// The sm80 family's decoding kernel: the shared one (decode/), reading the keys with cp.async, its products for
// several query rows on mma.sync (decode_pass.cuh). Included by the generated decode_sm80_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/launch.cuh"
#include "cuteflash/sm80/decode_pass.cuh"
#include "cuteflash/sm80/tiles.h"

namespace cuteflash::sm80 {

struct DecodeFamily {
  static constexpr DecodeConfig kConfig = FamilyTraits::kDecode;
  template <typename Traits>
  using TensorPass = DecodeMmaPass<Traits>;
};

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, DecodeFamily>(p, stream);
}

}  // namespace cuteflash::sm80

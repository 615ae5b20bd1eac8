// The sm90 family's decoding kernel: the sm80 family's (decode/ with its pass on mma.sync, sm80/decode_pass.cuh),
// compiled for sm_90a beside the family's forward. Included by the generated decode_sm90_<dtype>_hd<D>.cu files only.
#pragma once

#include "cuteflash/decode/launch.cuh"
#include "cuteflash/sm80/decode_pass.cuh"
#include "cuteflash/sm90/tiles.h"

namespace cuteflash::sm90 {

struct DecodeFamily {
  static constexpr DecodeConfig kConfig = FamilyTraits::kDecode;
  template <typename Traits>
  using TensorPass = sm80::DecodeMmaPass<Traits>;
};

template <typename Element, int kHeadDim>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  cuteflash::run_decode<Element, kHeadDim, DecodeFamily>(p, stream);
}

}  // namespace cuteflash::sm90

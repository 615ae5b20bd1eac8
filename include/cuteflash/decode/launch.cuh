// The host side of the decoding kernel (kernel.cuh): which kernel a call takes, and the merge of its splits. A family's
// decode_launch.cuh calls run_decode with its Family type (DecodeTraits).
#pragma once

#include "cuteflash/decode/kernel.cuh"
#include "cuteflash/host/launch_common.cuh"

namespace cuteflash {

// The decoding kernel for p (seqlen_q x group <= decode_max_rows, a fixed-length batch), then the merge of its
// splits where the kernel's last split does not merge them.
template <typename Element, int kHeadDim, typename Family>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  auto run = [&](auto traits) {
    using Traits = decltype(traits);
    launch(&decode_kernel<Traits>, dim3(p.num_splits, p.nheads_k, p.batch), Traits::kThreads,
           decode_storage_bytes<Traits>(), stream, p, "decoding");
  };
  const int rows = decode_kernel_rows(p.seqlen_q * (p.nheads / p.nheads_k));
  if (rows == 1) {
    run(DecodeTraits<Element, kHeadDim, 1, Family>{});
  } else if (rows == kDecodeMaxRows) {
    run(DecodeTraits<Element, kHeadDim, kDecodeMaxRows, Family>{});
  } else if constexpr (decode_tensor_cores(kHeadDim, kDecodeMaxMmaRows, Family::kConfig)) {
    run(DecodeTraits<Element, kHeadDim, kDecodeMaxMmaRows, Family>{});  // (decode_fits allows 16 only here)
  }
  if (p.num_splits > 1 && p.split_counters == nullptr) merge_splits<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash

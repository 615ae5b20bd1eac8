// Host side of the sm90 backward: D = rowsum(dO * O) (and dq_accum zeroed unless the pass is deterministic), the TMA
// descriptors of the call's operands and the dK/dV/dQ kernel, then dq from dq_accum; or, for a deterministic pass, the
// dK/dV kernel and then the sm80 family's dQ kernel. Included by the generated src/kernels/bwd_sm90_<dtype>_hd<D>.cu
// files only.
#pragma once

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/host/launch.h"
#include "cuteflash/sm80/bwd_kernel.cuh"  // the deterministic pass's dQ kernel
#include "cuteflash/sm90/bwd_kernel.cuh"
#include "cuteflash/sm90/operands.h"

namespace cuteflash::sm90 {

template <typename Element, int kHeadDim>
void run_bwd(BwdParams const& p, cudaStream_t stream) {
  using Traits = typename BwdTraitsSelect<Element, kHeadDim>::type;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  require_smem(Traits::kSmemBytes, "sm90 backward", kHeadDim);
  launch_bwd_preprocess<Element, kHeadDim>(p, stream);
  const int d = p.head_dim;
  const GmemExtent e = GmemExtent::of(p, p.cu_seqlens_q != nullptr, false, false);  // (no caches: q's batch is k's)
  auto tma = [&](Operand const& t, int rows, int heads, auto smem_layout, auto tile, char const* name) {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<false, Element>(t, rows, d, heads, e.batch_q, name), smem_layout,
                         tile, _1{});
  };
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  BwdArgs<Traits> args{tma(p.q, e.rows_q, p.nheads, take<0, 2>(typename Traits::SmemLayoutQ{}), TileQ{}, "q"),
                       tma(p.dout, e.rows_q, p.nheads, take<0, 2>(typename Traits::SmemLayoutQ{}), TileQ{}, "dout"),
                       tma(p.k, e.rows_k, p.nheads_k, typename Traits::SmemLayoutK{}, TileK{}, "k"),
                       tma(p.v, e.rows_k, p.nheads_k, typename Traits::SmemLayoutV{}, TileK{}, "v"), p};
  const dim3 grid(ceil_div(p.seqlen_k, kBlockN), p.nheads, p.batch);
  // The kernel's variant (host/launch.h): windows and ALiBi (either kind of batch) in one, with the softcap, with
  // dropout, with both in others, else the batch's kind.
  if (!p.deterministic) {
    for_variant(p, [&](auto variant) {
      launch(&bwd_kernel<Traits, true, variant()>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, args,
             "sm90 backward");
    });
    for_batch_kind(p, [&](auto batch_kind) {
      launch(&convert_dq_kernel<Traits, batch_kind() == Variant::kVarlen>,
             dim3(ceil_div(p.seqlen_q, kBlockM), p.nheads, p.batch), Traits::kConsumerThreads, 0, stream, p,
             "sm90 dQ conversion");
    });
    return;
  }
  // A deterministic pass: dK and dV by the kernel without dQ, then dQ by the sm80 family's dQ kernel, a block per
  // query block summing its keys' contributions in order (no atomics).
  using DqT = sm80::DqTraits<Element, kHeadDim>;
  constexpr int dq_smem = int(sizeof(sm80::DqSharedStorage<DqT>));
  require_smem(dq_smem, "backward dQ", kHeadDim);
  for_variant(p, [&](auto variant) {
    launch(&bwd_kernel<Traits, false, variant()>, grid, Traits::kNThreads, Traits::kSmemBytes, stream, args,
           "sm90 backward dK/dV");
    launch(&sm80::bwd_dq_kernel<DqT, variant()>, dim3(ceil_div(p.seqlen_q, DqT::kBlockM), p.nheads, p.batch),
           DqT::kNThreads, dq_smem, stream, p, "sm80 backward dQ");
  });
}

}  // namespace cuteflash::sm90

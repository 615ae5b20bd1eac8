// sm90 backward kernel: dQ, dK, dV with TMA loads, wgmma products and a producer warpgroup.
//
// After D = rowsum(dO * O) (common/bwd_preprocess.cuh), a thread block owns kBlockN keys of one (sequence, head) and
// walks the query blocks that see them, recomputing P from Q, K and the forward's log-sum-exp. Warpgroup 0 is the
// producer: one thread issues the TMA loads of K and V once, then of Q and dO block by block into kStages buffers
// (full: loaded; empty: both consumer warpgroups are done with it). Consumer warpgroup w owns keys [64 w, 64 w + 64)
// and, per query block, computes with the scores transposed (keys in rows, the accumulators' M):
//   S^T = K Q^T, dP^T = V dO^T  ->  P^T = exp(scale S^T - lse), dS^T = scale P^T (dP^T - D)  ->
//   dV += P^T dO, dK += dS^T Q (P^T and dS^T from registers)  ->  dS^T to shared memory  ->
//   dQ = dS K over the block's keys (its half of the head dim), added to dq_accum with fp32 reductions
// dK and dV stay in registers until the end; a last kernel converts dq_accum into dq.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/device_kernel.h>  // CUTLASS_GRID_CONSTANT

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/common/utils.cuh"
#include "cuteflash/sm90/gmma.cuh"
#include "cuteflash/sm90/traits.h"

namespace cuteflash::sm90 {

// The kernel's argument: the TMA descriptors (which hold the operands' addresses) and the params.
template <typename Traits>
struct BwdArgs {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  BwdParams p;
};

// The named barrier (CUTLASS's user ids) at which both consumer warpgroups have written their rows of dS^T.
constexpr uint32_t kDsWrittenBarrier = 1;

// The producer's thread: K and V of key block n_block, then Q and dO of each query block in `queries`, in order.
template <typename Traits>
__device__ __forceinline__ void load_bwd(BwdArgs<Traits> const& args, typename Traits::SharedStorage& smem,
                                         Sequence const& seq, int head, int n_block, BlockRange const& queries) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  BwdParams const& p = args.p;
  const int head_k = head / (p.nheads / p.nheads_k);
  auto q_shape = make_shape(p.seqlen_q, p.head_dim, p.nheads, p.batch);
  auto k_shape = make_shape(p.seqlen_k, p.head_dim, p.nheads_k, p.batch);
  Tensor gQ = local_tile(args.tma_q.get_tma_tensor(q_shape)(_, _, head, seq.batch),
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));  // (kBlockM, kHeadDim, m_blocks)
  Tensor gdO = local_tile(args.tma_do.get_tma_tensor(q_shape)(_, _, head, seq.batch),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gK = local_tile(args.tma_k.get_tma_tensor(k_shape)(_, _, head_k, seq.k_batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
  Tensor gV = local_tile(args.tma_v.get_tma_tensor(k_shape)(_, _, head_k, seq.k_batch),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor sQ =
      make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim, kStages)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});  // (kBlockN, kHeadDim)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});

  auto tma_q = args.tma_q.get_slice(_0{});
  auto tma_do = args.tma_do.get_slice(_0{});
  auto tma_k = args.tma_k.get_slice(_0{});
  auto tma_v = args.tma_v.get_slice(_0{});
  Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(gQ));      // (TMA, m_blocks)
  Tensor tQsQ = group_modes<0, 3>(tma_q.partition_D(sQ));      // (TMA, kStages)
  Tensor tdOgdO = group_modes<0, 3>(tma_do.partition_S(gdO));  // (TMA, m_blocks)
  Tensor tdOsdO = group_modes<0, 3>(tma_do.partition_D(sdO));  // (TMA, kStages)

  ClusterTransactionBarrier::arrive_and_expect_tx(&smem.kv_full, 2 * Traits::kKVBytes);
  copy(args.tma_k.with(smem.kv_full), tma_k.partition_S(gK), tma_k.partition_D(sK));
  copy(args.tma_v.with(smem.kv_full), tma_v.partition_S(gV), tma_v.partition_D(sV));
  RingState<Traits::kStages> ring;
  for (int m_block = queries.begin; m_block < queries.end; ++m_block) {
    ClusterBarrier::wait(&smem.q_empty[ring.stage], ring.phase ^ 1);
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full[ring.stage], 2 * Traits::kQBytes);
    copy(args.tma_q.with(smem.q_full[ring.stage]), tQgQ(_, m_block), tQsQ(_, ring.stage));
    copy(args.tma_do.with(smem.q_full[ring.stage]), tdOgdO(_, m_block), tdOsdO(_, ring.stage));
    ring.advance();
  }
}

// dq_accum += acc_dq, the (kBlockM, kHeadDim) tile of query block m_block that tiled_mma's warpgroups computed, with
// 8-byte fp32 reductions (whole blocks: dq_accum's region has rows up to a multiple of 128 past seqlen_q).
template <typename Traits, typename AccDq>
__device__ __forceinline__ void add_dq(BwdParams const& p, Sequence const& seq, int head, int m_block,
                                       AccDq const& acc_dq, int tid) {
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  auto thr_mma = typename Traits::TiledMmadQ{}.get_thread_slice(tid);
  Tensor c = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  float* region = dq_accum_region<kHeadDim>(p, seq, head) + m_block * kBlockM * kHeadDim;
  static_assert(decltype(size<0, 0>(acc_dq))::value == 2);  // column pairs, side by side in registers
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 2) {
    global_red_add_v2(region + get<0>(c(i)) * kHeadDim + get<1>(c(i)), &acc_dq(i));
  }
}

// A consumer warpgroup's thread (tid: its index among the consumers): the query blocks, then dK and dV of its keys.
template <typename Traits>
__device__ __forceinline__ void compute_bwd(BwdParams const& p, typename Traits::SharedStorage& smem,
                                            Sequence const& seq, int head, int n_block, BlockRange const& queries,
                                            int tid) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  if (!queries.empty()) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutdS{});
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // (MMA, MMA_M, MMA_K): descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, kStages)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV);      // (MMA, MMA_M, MMA_K)
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);    // (MMA, MMA_N, MMA_K, kStages)
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N over the head dim, MMA_K over rows, kStages)
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K over keys, 2)
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);  // (MMA, MMA_N over this warpgroup's head dims, MMA_K)
    auto ds_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto ds_thr = ds_copy.get_thread_slice(tid);
    Tensor tdSsdS = ds_thr.partition_D(sdSt);  // (CPY, CPY_M, CPY_N, 2)

    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor cS_rc = make_tensor(cS.data(), acc_rowcol_gmma(cS.layout()));  // (keys, query rows) -> (key, row)
    constexpr int kCols = decltype(size<1>(cS_rc))::value;
    const int64_t row_stats = seq.stats(p, head);
    const bool is_signaling = tid % 128 == 0;  // one arrival per warpgroup releases a buffer

    ClusterTransactionBarrier::wait(&smem.kv_full, 0);
    RingState<Traits::kStages> ring;
    int ds_stage = 0;
    auto step = [&](int m_block, auto masked) __attribute__((always_inline)) {
      // lse * log2(e) and D of this thread's query rows (rows past seqlen_q: P = 0, dS = 0), loaded under S^T.
      float lse_log2[kCols], d[kCols];
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        const RowStats row(p, row_stats, m_block * kBlockM + get<1>(cS_rc(0, ni)), seq.seqlen_q);
        lse_log2[ni] = row.lse_log2();
        d[ni] = row.d;
      }
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      ClusterTransactionBarrier::wait(&smem.q_full[ring.stage], ring.phase);
      gmma<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, ring.stage), acc_s);
      gmma<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, ring.stage), acc_dp);
      warpgroup_wait<1>();  // S^T is done
      warpgroup_fence_operand(acc_s);
      Tensor s = make_tensor(acc_s.data(), acc_rowcol_gmma(acc_s.layout()));  // (keys, rows)
      if constexpr (decltype(masked)::value) {
        const auto mask = mask_policy<Variant::kFixed>(p, seq);
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          const int key_end = mask.key_end(m_block * kBlockM + get<1>(cS_rc(0, ni)));
          CUTE_UNROLL
          for (int mi = 0; mi < size<0>(s); ++mi) {
            if (n_block * kBlockN + get<0>(cS_rc(mi, ni)) >= key_end) s(mi, ni) = -INFINITY;
          }
        }
      }
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(s); ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) s(mi, ni) = exp2_approx(s(mi, ni) * p.softmax_scale_log2 - lse_log2[ni]);
      }
      warpgroup_wait<0>();  // dP^T is done
      warpgroup_fence_operand(acc_dp);
      Tensor dp = make_tensor(acc_dp.data(), acc_rowcol_gmma(acc_dp.layout()));
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(dp); ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < kCols; ++ni) dp(mi, ni) = s(mi, ni) * p.softmax_scale * (dp(mi, ni) - d[ni]);
      }
      Tensor rP = make_tensor<Element>(acc_s.layout());
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      convert_fragment_into(acc_s, rP);
      convert_fragment_into(acc_dp, rdS);
      gmma<false, -1>(mma_dkv, make_tensor(rP.data(), acc_as_a_operand_gmma(rP.layout())), tdVrdOt(_, _, _, ring.stage),
                      acc_dv);
      gmma<false, -1>(mma_dkv, make_tensor(rdS.data(), acc_as_a_operand_gmma(rdS.layout())),
                      tdKrQt(_, _, _, ring.stage), acc_dk);

      // dS^T to shared memory, for both warpgroups' dQ (its other buffer may still be read by the other warpgroup's
      // dQ of the step before: each passed this step's barrier only after its own dQ was done).
      copy(ds_copy, ds_thr.retile_S(rdS), tdSsdS(_, _, _, ds_stage));
      cutlass::arch::fence_view_async_shared();  // the stores are visible to wgmma
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsWrittenBarrier);
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      gmma<true, 0>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrKt, acc_dq);  // and dV, dK before it
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      if (is_signaling) ClusterBarrier::arrive(&smem.q_empty[ring.stage]);
      ring.advance();
      ds_stage ^= 1;
      add_dq<Traits>(p, seq, head, m_block, acc_dq, tid);
    };
    for (int m_block = queries.begin; m_block < queries.end; ++m_block) {
      if (queries.masked(m_block)) {
        step(m_block, cute::true_type{});
      } else {
        step(m_block, cute::false_type{});
      }
    }
  }

  // dK and dV of this warpgroup's keys (a key block no query sees gets zeros).
  const int keys_left = seq.seqlen_k - n_block * kBlockN;
  Element* dk = p.dk.at<Element>(seq.batch, head, seq.k_row0 + n_block * kBlockN);
  Element* dv = p.dv.at<Element>(seq.batch, head, seq.k_row0 + n_block * kBlockN);
  using Mma = typename Traits::TiledMmadKV;
  store_acc_direct<Mma, kBlockN, kHeadDim>(acc_dk, dk, p.dk.row_stride, keys_left, p.head_dim, tid);
  store_acc_direct<Mma, kBlockN, kHeadDim>(acc_dv, dv, p.dv.row_stride, keys_left, p.head_dim, tid);
}

// One thread block per key block of each (sequence, head): fixed-length batches without options (the registry sends
// the other calls to the sm80 family).
template <typename Traits>
static __global__ void __launch_bounds__(Traits::kNThreads, 1)
    bwd_kernel(CUTLASS_GRID_CONSTANT BwdArgs<Traits> const args) {
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  BwdParams const& p = args.p;
  const int warp = cutlass::canonical_warp_idx_sync();
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    ClusterTransactionBarrier::init(&smem.kv_full, 1);
    for (int s = 0; s < Traits::kStages; ++s) {
      ClusterTransactionBarrier::init(&smem.q_full[s], 1);
      ClusterBarrier::init(&smem.q_empty[s], Traits::kConsumerWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // the last barrier of the whole block: the producer's other warps leave below

  const int n_block = int(blockIdx.x), head = int(blockIdx.y);
  const Sequence seq = sequence<Variant::kFixed>(p, int(blockIdx.z));
  const BlockRange queries =
      mask_policy<Variant::kFixed>(p, seq).template query_blocks<Traits::kBlockM, Traits::kBlockN>(n_block);
  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync() && !queries.empty()) {
      load_bwd<Traits>(args, smem, seq, head, n_block, queries);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    compute_bwd<Traits>(p, smem, seq, head, n_block, queries, int(threadIdx.x) - 128);
  }
}

// dq = dq_accum (row-major regions), kBlockM rows of one (sequence, head) per thread block.
template <typename Element, int kHeadDim, int kRows>
static __global__ void __launch_bounds__(128) convert_dq_kernel(const BwdParams p) {
  const Sequence seq = sequence<Variant::kFixed>(p, int(blockIdx.z));
  const int row0 = int(blockIdx.x) * kRows;
  convert_dq_rowmajor<Element, kHeadDim, 128>(p, seq, int(blockIdx.y), row0, min(row0 + kRows, seq.seqlen_q));
}

}  // namespace cuteflash::sm90

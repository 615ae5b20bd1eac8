// sm90 backward kernel: dQ, dK, dV with TMA loads, wgmma products and a producer warpgroup.
//
// After D = rowsum(dO * O) (common/bwd_preprocess.cuh), a thread block owns kBlockN keys of one (sequence, head) and
// walks the query blocks that see them, recomputing P from Q, K and the forward's log-sum-exp. Warpgroup 0 is the
// producer: one thread (in a variable-length batch's kernel, a warp's leader lane: load_bwd) issues the TMA loads of K
// and V of its key block, then of Q and dO block by block into kStages buffers (full: loaded; empty: both consumer
// warpgroups are done with it). The two consumer warpgroups compute, per query
// block, with the scores transposed (keys in rows, the accumulators' M):
//   S^T = K Q^T, dP^T = V dO^T  ->  P^T = exp(scale S^T - lse), dS^T = scale P^T (dP^T - D)  ->
//   dV += P^T dO, dK += dS^T Q  ->  dQ = dS K over the block's keys, added to dq_accum
// Up to head dim 128 (compute_bwd) warpgroup w owns keys [64 w, 64 w + 64): P^T and dS^T stay in registers as the A
// operands of dV and dK (dS^T goes to shared memory too, for dQ), and each warpgroup's half of dQ (of the head dim, or
// of the rows in 128-row blocks) leaves through shared memory by one bulk fp32 reduction (cp.reduce.async.bulk),
// which runs while the next step computes; the next block's S^T runs on the tensor cores during the dQ store.
// Above (compute_bwd_split) a block owns 64 keys that both warpgroups share, warpgroup w computing S^T and dP^T of the
// rows' half w and dV, dK and dQ of the head dim's half w: P^T and dS^T go through shared memory, and each thread adds
// its dQ to dq_accum with 16-byte atomic reductions (no room is left for a block's dQ in fp32).
// The rows' lse and D come through shared memory (fetch_stat). dK and dV stay in registers until the end; a last
// kernel converts dq_accum into dq. A deterministic pass runs bwd_kernel<Traits, false>, without dQ, and then the
// sm80 family's dQ kernel.
#pragma once

#include <cstddef>
#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/device_kernel.h>  // CUTLASS_GRID_CONSTANT

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/dropout.cuh"
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

// The named barrier (CUTLASS's user ids) at which both consumer warpgroups have written their rows of dS^T (of P^T too
// where the head dim is split, read by the other warpgroup's dV and dK) and the next block's statistics (all it orders
// in a pass without dQ up to head dim 128).
constexpr uint32_t kDsWrittenBarrier = 1;
// The named barriers (2 + w) at which consumer warpgroup w's threads have written their dQ to shared memory.
constexpr uint32_t kDqWrittenBarrier = 2;

// The producer, for key block n_block: K and V (walks_tiles(V): once the consumers released the block's previous ones,
// kv_phase: the parity of the block's key blocks with queries before this one), then Q and dO of each query block in
// `queries`, in order (the ring continues from one key block to the next). One thread (leader), or, walks_tiles(V),
// the producer's warp, whose leader lane issues the loads: in a variable-length batch rows past the sequence are zeroed
// (load_zeroing_tail).
template <typename Traits, Variant V>
__device__ __forceinline__ void load_bwd(BwdArgs<Traits> const& args, typename Traits::SharedStorage& smem,
                                         Sequence const& seq, int head, int n_block, BlockRange const& queries,
                                         RingState<Traits::kStages>& ring, uint32_t kv_phase, uint32_t& landed_phase,
                                         bool leader) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  BwdParams const& p = args.p;
  const int head_k = head / (p.nheads / p.nheads_k);
  const bool varlen = reads_varlen<V>(p);
  const GmemExtent extent = GmemExtent::of(p, varlen, false, false);
  auto q_shape = make_shape(extent.rows_q, p.head_dim, p.nheads, extent.batch_q);
  auto k_shape = make_shape(extent.rows_k, p.head_dim, p.nheads_k, extent.batch_k);
  // The sequence's rows from its first, (rows, head dim).
  auto rows_of = [&](auto const& tma, auto shape, int h, int batch, int row0) {
    return domain_offset(make_coord(row0, _0{}), tma.get_tma_tensor(shape)(_, _, h, extent.batch_index(batch)));
  };
  Tensor gQ = local_tile(rows_of(args.tma_q, q_shape, head, seq.batch, seq.q_row0),
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));  // (kBlockM, kHeadDim, m_blocks)
  Tensor gdO = local_tile(rows_of(args.tma_do, q_shape, head, seq.batch, seq.q_row0),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gK = local_tile(rows_of(args.tma_k, k_shape, head_k, seq.k_batch, seq.k_row0),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));  // (kBlockN, kHeadDim)
  Tensor gV = local_tile(rows_of(args.tma_v, k_shape, head_k, seq.k_batch, seq.k_row0),
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

  auto issue_kv = [&](uint64_t& barrier) {
    copy(args.tma_k.with(barrier), tma_k.partition_S(gK), tma_k.partition_D(sK));
    copy(args.tma_v.with(barrier), tma_v.partition_S(gV), tma_v.partition_D(sV));
  };
  if constexpr (walks_tiles(V)) ClusterBarrier::wait(&smem.kv_empty, kv_phase ^ 1);
  const int keys = seq.seqlen_k - n_block * kBlockN;
  load_zeroing_tail(&smem.kv_full, &smem.landed, landed_phase, 2 * Traits::kKVBytes, varlen && keys < kBlockN, leader,
                    issue_kv, [&] {
                      zero_rows_from<kBlockN, kHeadDim>(keys, [&](int r, int c) { return &sK(r, c); });
                      zero_rows_from<kBlockN, kHeadDim>(keys, [&](int r, int c) { return &sV(r, c); });
                    });
  for (int m_block = queries.begin; m_block < queries.end; ++m_block) {
    ClusterBarrier::wait(&smem.q_empty[ring.stage], ring.phase ^ 1);
    const int stage = ring.stage;
    auto issue_q = [&](uint64_t& barrier) {
      copy(args.tma_q.with(barrier), tQgQ(_, m_block), tQsQ(_, stage));
      copy(args.tma_do.with(barrier), tdOgdO(_, m_block), tdOsdO(_, stage));
    };
    const int rows = seq.seqlen_q - m_block * kBlockM;
    load_zeroing_tail(&smem.q_full[stage], &smem.landed, landed_phase, 2 * Traits::kQBytes, varlen && rows < kBlockM,
                      leader, issue_q, [&] {
                        zero_rows_from<kBlockM, kHeadDim>(rows, [&](int r, int c) { return &sQ(r, c, stage); });
                        zero_rows_from<kBlockM, kHeadDim>(rows, [&](int r, int c) { return &sdO(r, c, stage); });
                      });
    ring.advance();
  }
}

// Where element i of a consumer thread's dQ accumulator lives in a query block's dQ (kBlockM x kHeadDim floats), in
// shared memory and in dq_accum alike: each warpgroup's half of the block is contiguous (one bulk reduction), and
// in it elements i..i+3 of thread t are at [i * 128 + 4 t] (16-byte stores a thread, conflict-free; the accumulator's
// own row-major order would put a warp's stores on eight rows of one bank group). convert_dq_kernel reads them back.
template <typename Traits>
__device__ __forceinline__ int dq_slot(int tid, int i) {
  return (tid / 128) * (Traits::kBlockM * Traits::kHeadDim / 2) + i * 128 + 4 * (tid % 128);
}

// The dq_accum block of query block m_block (whole blocks: the region has rows up to a multiple of 128 past
// seqlen_q).
template <typename Traits>
__device__ __forceinline__ float* dq_accum_block(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  return dq_accum_region<Traits::kHeadDim>(p, seq, head) + m_block * Traits::kBlockM * Traits::kHeadDim;
}

// dq_accum += this warpgroup's half of query block m_block's dQ: the accumulator to shared memory (dq_slot), then one
// bulk reduction, issued by the warpgroup's first thread (which waits for its reads of shared memory before the
// warpgroup's next write: cute::tma_store_wait).
template <typename Traits, typename AccDq>
__device__ __forceinline__ void add_dq(BwdParams const& p, typename Traits::SharedStorage& smem, Sequence const& seq,
                                       int head, int m_block, AccDq const& acc_dq, int tid) {
  constexpr int kHalf = Traits::kBlockM * Traits::kHeadDim / 2;
  float* sdq = smem.dq.data();
  static_assert(decltype(size(acc_dq))::value % 4 == 0);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    *reinterpret_cast<float4*>(sdq + dq_slot<Traits>(tid, i)) =
        make_float4(acc_dq(i), acc_dq(i + 1), acc_dq(i + 2), acc_dq(i + 3));
  }
  cutlass::arch::fence_view_async_shared();  // the stores are visible to the bulk reduction
  cutlass::arch::NamedBarrier::sync(128, kDqWrittenBarrier + tid / 128);
  if (tid % 128 == 0) {
    const int half = (tid / 128) * kHalf;
    bulk_reduce_add(dq_accum_block<Traits>(p, seq, head, m_block) + half, sdq + half, kHalf * int(sizeof(float)));
    cute::tma_store_arrive();
  }
}

// The rows' statistics of the query blocks in flight, in shared memory (SharedStorage::lse_log2 and d, a stage per
// block), a value a consumer thread: lse * log2(e) of row t (threads t < kBlockM) and D of row t - kBlockM (the next
// kBlockM; rows past seqlen_q: P = 0 and dS = 0). A step loads the next block's early and stores them into the
// other stage before its barrier at dS, past which every consumer reads them; the stage's readers of two blocks
// before passed the barrier of the step before.
template <typename Traits>
__device__ __forceinline__ float fetch_stat(BwdParams const& p, Sequence const& seq, int64_t row_stats, int m_block,
                                            int tid) {
  const RowStats row(p, row_stats, m_block * Traits::kBlockM + tid % Traits::kBlockM, seq.seqlen_q);
  return tid < Traits::kBlockM ? row.lse_log2() : row.d;
}

template <typename Traits>
__device__ __forceinline__ void store_stat(typename Traits::SharedStorage& smem, int stage, float x, int tid) {
  if (tid < 2 * Traits::kBlockM) (tid < Traits::kBlockM ? smem.lse_log2 : smem.d)[stage][tid % Traits::kBlockM] = x;
}

// The mask on this thread's scores of query block m_block and key block n_block, transposed: s (keys, query rows) and
// cS_rc, their (key, row) in the tile; a row's first key is tested only where the policy bounds the left side.
template <typename Traits, Variant V, typename Scores, typename Coords>
__device__ __forceinline__ void mask_transposed(BwdParams const& p, Sequence const& seq, int m_block, int n_block,
                                                Scores& s, Coords const& cS_rc) {
  const auto mask = mask_policy<V>(p, seq);
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(s); ++ni) {
    const int row = m_block * Traits::kBlockM + get<1>(cS_rc(0, ni));
    const int key_begin = mask.key_begin(row), key_end = mask.key_end(row);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
      const int key = n_block * Traits::kBlockN + get<0>(cS_rc(mi, ni));
      if ((mask.left_bounded() && key < key_begin) || key >= key_end) s(mi, ni) = -INFINITY;
    }
  }
}

// f(mi, ni, ALiBi's term) for each of this thread's scores (keys, query rows) of query block m_block and key block
// n_block, cS_rc their (key, row) in the tile: apply_score_mods's term (ScoreMods::bias), the other way round (a float
// per row, minus constants per key).
template <typename Traits, typename Coords, typename F>
__device__ __forceinline__ void for_alibi_transposed(ScoreMods const& mods, int m_block, int n_block,
                                                     Coords const& cS_rc, F&& f) {
  const int key_first = get<0>(cS_rc(0, 0));
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(cS_rc); ++ni) {
    const float dist0 =
        float(m_block * Traits::kBlockM + get<1>(cS_rc(0, ni)) + mods.shift - n_block * Traits::kBlockN - key_first);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(cS_rc); ++mi) f(mi, ni, mods.bias(dist0 - float(get<0>(cS_rc(mi, ni)) - key_first)));
  }
}

// The softcap's factor in dS^T (dP^T - D scaled, keys by rows) in place: p.softcap (1 - tanh^2), the softcap's value
// recovered from P^T (probs; lse_log2[ni]: row ni's) rather than kept from the forward's scores in registers:
// P = exp2((tanh + ALiBi's term) scale log2(e) - lse log2(e)), of P's magnitude (dropout negates the dropped ones:
// probs_and_grads). A P of 0 (masked, or too small for fp32) gives a factor of 0 (1 - tanh^2 is never below).
template <typename Traits, typename Grads, typename Probs, typename Coords>
__device__ __forceinline__ void apply_softcap_grad_transposed(BwdParams const& p, ScoreMods const& mods, int m_block,
                                                              int n_block, Grads& ds, Probs const& probs,
                                                              float const* lse_log2, Coords const& cS_rc) {
  const float inv_scale = 1.f / p.softmax_scale_log2;
  auto scale_by = [&](int mi, int ni, float bias) __attribute__((always_inline)) {
    const float t = fmaf(__log2f(fabsf(probs(mi, ni))) + lse_log2[ni], inv_scale, -bias);
    ds(mi, ni) *= p.softcap * fmaxf(1.f - t * t, 0.f);
  };
  if (mods.alibi != 0.f) {
    for_alibi_transposed<Traits>(mods, m_block, n_block, cS_rc, scale_by);
  } else {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(ds); ++ni) {
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(ds); ++mi) scale_by(mi, ni, 0.f);
    }
  }
}

// P^T = exp2(S^T scale log2(e) - lse log2(e)) in place of this thread's scores s (keys, rows); lse_log2[ni]: its
// row ni's.
template <typename Scores>
__device__ __forceinline__ void exp_scores(BwdParams const& p, Scores& s, float const* lse_log2) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(s); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(s); ++ni) s(mi, ni) = exp2_approx(s(mi, ni) * p.softmax_scale_log2 - lse_log2[ni]);
  }
}

// dS^T = scale P^T (dP^T - D) in place of dP^T (keys, rows); d_of(ni): D of row ni. kDropout: P^T's dropped
// probabilities are negated (mark_dropped), and dP^T is the gradient of the kept ones, scaled by 1 / (1 - p): dS^T =
// scale (max(P^T, 0) dP^T / (1 - p) - |P^T| D).
template <bool kDropout, typename Grads, typename Probs, typename DOf>
__device__ __forceinline__ void grad_scores(BwdParams const& p, Grads& dp, Probs const& s, DOf const& d_of) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(dp); ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dp); ++ni) {
      if constexpr (kDropout) {
        const float kept = fmaxf(s(mi, ni), 0.f) * (p.softmax_scale * p.dropout_scale);
        dp(mi, ni) = fmaf(kept, dp(mi, ni), -fabsf(s(mi, ni)) * (p.softmax_scale * d_of(ni)));
      } else {
        dp(mi, ni) = s(mi, ni) * p.softmax_scale * (dp(mi, ni) - d_of(ni));
      }
    }
  }
}

// Where a kernel of variant V draws dropout's mask (has_dropout(V)), kRows: the query rows a thread holds. With 16
// (64-row blocks), while S^T runs, its bits kept in registers (keep_transposed); with 32 (128-row blocks, whose
// registers are full: the bits would spill), after the exponentials, in place (mark_dropped without bits).
template <Variant V, int kRows>
constexpr bool draws_early() {
  return has_dropout(V) && kRows <= 16;
}

// draws_early: which of this thread's probabilities (keys, rows) of query block m_block and key block n_block dropout
// keeps, cS_rc their (key, row) in the tile (a bit each); else nullptr.
template <typename Traits, Variant V, typename Coords>
__device__ __forceinline__ auto keep_transposed(Dropout const& dropout, int m_block, int n_block, Coords const& cS_rc) {
  if constexpr (draws_early<V, decltype(size<1>(cS_rc))::value>()) {
    return keep_mask_transposed(dropout, cS_rc, n_block * Traits::kBlockN, m_block * Traits::kBlockM);
  } else {
    return nullptr;
  }
}

// P^T's probabilities that dropout drops negated, in place of this thread's P^T (keys, rows) of query block m_block and
// key block n_block (keep: keep_transposed's bits, or nullptr: drawn here): the sign carries the mask to dS^T
// (grad_scores) and to the P^T of dV's product (max(P^T, 0), the kept probabilities unscaled; dV is scaled by
// 1 / (1 - p) at the end).
template <typename Traits, typename Probs, typename Keep, typename Coords>
__device__ __forceinline__ void mark_dropped(Dropout const& dropout, int m_block, int n_block, Probs& s,
                                             Keep const& keep, Coords const& cS_rc) {
  auto mark = [&](int mi, int ni, bool kept) { s(mi, ni) = kept ? s(mi, ni) : -s(mi, ni); };
  if constexpr (std::is_same_v<Keep, std::nullptr_t>) {
    for_each_kept_transposed(dropout, cS_rc, n_block * Traits::kBlockN, m_block * Traits::kBlockM, mark);
  } else {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(s); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) mark(mi, ni, keep(mi, ni));
    }
  }
}

// dq_accum += this thread's dQ of query block m_block, 16 bytes an atomic reduction (at its dq_slot addresses).
template <typename Traits, typename AccDq>
__device__ __forceinline__ void add_dq_atomic(BwdParams const& p, Sequence const& seq, int head, int m_block,
                                              AccDq const& acc_dq, int tid) {
  float* block = dq_accum_block<Traits>(p, seq, head, m_block);
  static_assert(decltype(size(acc_dq))::value % 4 == 0);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(block + dq_slot<Traits>(tid, i)), "f"(acc_dq(i)),
                 "f"(acc_dq(i + 1)), "f"(acc_dq(i + 2)), "f"(acc_dq(i + 3))
                 : "memory");
  }
}

// dK and dV of this consumer thread's warpgroup's part of key block n_block (its keys, or its half of the head dim
// where that is split; a key block no query sees gets zeros). has_dropout(V): dV's products took the kept
// probabilities without 1 / (1 - p), scaled here.
template <typename Traits, Variant V, typename Acc>
__device__ __forceinline__ void store_dkdv(BwdParams const& p, Sequence const& seq, int head, int n_block,
                                           Acc const& acc_dk, Acc& acc_dv, int tid) {
  using Element = typename Traits::Element;
  using Mma = typename Traits::TiledMmadKV;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int keys_left = seq.seqlen_k - n_block * kBlockN;
  if constexpr (has_dropout(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) acc_dv(i) *= p.dropout_scale;
  }
  Element* dk = p.dk.at<Element>(seq.batch, head, seq.k_row0 + n_block * kBlockN);
  Element* dv = p.dv.at<Element>(seq.batch, head, seq.k_row0 + n_block * kBlockN);
  store_acc_direct<Mma, kBlockN, kHeadDim>(acc_dk, dk, p.dk.row_stride, keys_left, p.head_dim, tid);
  store_acc_direct<Mma, kBlockN, kHeadDim>(acc_dv, dv, p.dv.row_stride, keys_left, p.head_dim, tid);
}

// A step's scores, once its S^T (acc_s) is issued: lse and D of this thread's query rows (stage's; D read where it is
// used when a thread holds 32 rows, for the registers), this thread's share of the next block's statistics (returned,
// kHasNext) and its stage (next_stage), dP^T issued once S^T is done and run under the exponentials; has_options(V):
// the softcap (has_softcap(V)) and ALiBi's term (mods, where it has a slope) before the mask; has_dropout(V): the
// dropped probabilities marked (mark_dropped). On return acc_s holds P^T (the kept probabilities, unscaled, with
// dropout) and acc_dp dS^T.
template <typename Traits, Variant V, bool kMasked, bool kHasNext, typename TiledMma, typename TV, typename TdO,
          typename Acc, typename Coords>
__device__ __forceinline__ float probs_and_grads(BwdParams const& p, typename Traits::SharedStorage& smem,
                                                 Sequence const& seq, ScoreMods const& mods, Dropout const& dropout,
                                                 int64_t row_stats, int stage, int m_block, int n_block, int tid,
                                                 TiledMma& mma_sdp, TV const& tdPrV, TdO const& tdPrdO, Acc& acc_s,
                                                 Acc& acc_dp, Coords const& cS_rc, int& next_stage) {
  constexpr int kCols = decltype(size<1>(cS_rc))::value;  // query rows a thread holds
  constexpr bool kEarlyD = kCols <= 16;
  float lse_log2[kCols], d[kEarlyD ? kCols : 1];
  CUTE_UNROLL
  for (int ni = 0; ni < kCols; ++ni) {
    lse_log2[ni] = smem.lse_log2[stage][get<1>(cS_rc(0, ni))];
    if constexpr (kEarlyD) d[ni] = smem.d[stage][get<1>(cS_rc(0, ni))];
  }
  next_stage = stage + 1 == Traits::kStages ? 0 : stage + 1;
  float next_stat = 0.f;
  if constexpr (kHasNext) next_stat = fetch_stat<Traits>(p, seq, row_stats, m_block + 1, tid);
  const auto keep = keep_transposed<Traits, V>(dropout, m_block, n_block, cS_rc);  // (draws_early: while S^T runs)
  warpgroup_wait<0>();  // S^T (issued before this step) is done; dP^T runs under the exponentials
  gmma<true, -1>(mma_sdp, tdPrV, tdPrdO, acc_dp);
  warpgroup_fence_operand(acc_s);
  Tensor s = make_tensor(acc_s.data(), acc_rowcol_gmma(acc_s.layout()));  // (keys, rows)
  if constexpr (has_softcap(V)) {
    const Softcap cap{mods.softcap};
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = cap(s(i));
  }
  if constexpr (has_options(V)) {
    if (mods.alibi != 0.f) {
      for_alibi_transposed<Traits>(mods, m_block, n_block, cS_rc,
                                   [&](int mi, int ni, float bias) { s(mi, ni) += bias; });
    }
  }
  if constexpr (kMasked) mask_transposed<Traits, V>(p, seq, m_block, n_block, s, cS_rc);
  exp_scores(p, s, lse_log2);
  if constexpr (has_dropout(V)) mark_dropped<Traits>(dropout, m_block, n_block, s, keep, cS_rc);
  warpgroup_wait<0>();  // dP^T is done
  warpgroup_fence_operand(acc_dp);
  Tensor dp = make_tensor(acc_dp.data(), acc_rowcol_gmma(acc_dp.layout()));
  grad_scores<has_dropout(V)>(p, dp, s, [&](int ni) { return kEarlyD ? d[ni] : smem.d[stage][get<1>(cS_rc(0, ni))]; });
  if constexpr (has_softcap(V))
    apply_softcap_grad_transposed<Traits>(p, mods, m_block, n_block, dp, s, lse_log2, cS_rc);
  if constexpr (has_dropout(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = fmaxf(s(i), 0.f);
  }
  return next_stat;
}

// The views of a backward block's shared memory: Q and dO (their stages), their transposes, K, K^T, V, and the buffers
// of dS^T and of dS.
template <typename Traits>
__device__ __forceinline__ auto bwd_smem_views(typename Traits::SharedStorage& smem) {
  auto view = [](auto* data, auto layout) { return make_tensor(make_smem_ptr(data), layout); };
  return cute::make_tuple(
      view(smem.q.data(), typename Traits::SmemLayoutQ{}), view(smem.dout.data(), typename Traits::SmemLayoutQ{}),
      view(smem.q.data(), typename Traits::SmemLayoutQt{}), view(smem.dout.data(), typename Traits::SmemLayoutQt{}),
      view(smem.k.data(), typename Traits::SmemLayoutK{}), view(smem.k.data(), typename Traits::SmemLayoutKt{}),
      view(smem.v.data(), typename Traits::SmemLayoutV{}), view(smem.ds.data(), typename Traits::SmemLayoutdSt{}),
      view(smem.ds.data(), typename Traits::SmemLayoutdS{}));
}

// A consumer thread's walk over the query blocks: the first block's statistics, into the stage of its Q and dO
// (every consumer reads them past this barrier), and S^T (issue_s), then step(m_block, masked, has_next) for each. A
// step issues the next S^T, so one is in flight on every path into the loop's next iteration (ptxas keeps the wgmma
// pipelined only then): the last block is stepped outside the loop, with the mask (which leaves an unmasked block as it
// is).
template <typename Traits, typename IssueS, typename Step>
__device__ __forceinline__ void walk_query_blocks(BwdParams const& p, typename Traits::SharedStorage& smem,
                                                  Sequence const& seq, int64_t row_stats, BlockRange const& queries,
                                                  int stage, int tid, IssueS&& issue_s, Step&& step) {
  store_stat<Traits>(smem, stage, fetch_stat<Traits>(p, seq, row_stats, queries.begin, tid), tid);
  cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsWrittenBarrier);
  issue_s();
  int m_block = queries.begin;
  for (; m_block + 1 < queries.end; ++m_block) {
    if (queries.masked(m_block)) {
      step(m_block, cute::true_type{}, cute::true_type{});
    } else {
      step(m_block, cute::false_type{}, cute::true_type{});
    }
  }
  step(m_block, cute::true_type{}, cute::false_type{});
}

// What a consumer thread carries from one of its thread block's key blocks to the next (kSeveral: a variable-length
// batch's block may take several): the ring of Q and dO, the buffer of dS^T (and P^T) to write next, and the phase of
// K and V (of the block's key blocks with queries).
template <int kStages, bool kSeveral>
struct BwdConsumerState {
  static constexpr bool kSeveralKeyBlocks = kSeveral;
  RingState<kStages> ring;
  int buf = 0;
  uint32_t kv_phase = 0;
};

// The end of a key block's walk: every product that read K and V is done, so the producer may load the next block's.
template <typename SharedStorage, typename State>
__device__ __forceinline__ void release_kv(SharedStorage& smem, State& state, int tid) {
  if constexpr (State::kSeveralKeyBlocks) {
    if (tid % 128 == 0) ClusterBarrier::arrive(&smem.kv_empty);
    state.kv_phase ^= 1;
  }
}

// A consumer warpgroup's thread (tid: its index among the consumers): the query blocks, then dK and dV of its keys.
// kDq: false in a deterministic pass, whose dQ the sm80 family's dQ kernel computes after this one.
template <typename Traits, bool kDq, Variant V, typename State>
__device__ __forceinline__ void compute_bwd(BwdParams const& p, typename Traits::SharedStorage& smem,
                                            Sequence const& seq, int head, int n_block, BlockRange const& queries,
                                            int tid, State& state) {
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
    auto [sQ, sdO, sQt, sdOt, sK, sKt, sV, sdSt, sdS] = bwd_smem_views<Traits>(smem);
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
    const int64_t row_stats = seq.stats(p, head);
    const ScoreMods mods = has_options(V) ? ScoreMods::make(p, seq, head) : ScoreMods{};
    const Dropout dropout = has_dropout(V) ? Dropout::make(p, seq.batch, head) : Dropout{};
    const bool is_signaling = tid % 128 == 0;  // one arrival per warpgroup releases a buffer

    ClusterTransactionBarrier::wait(&smem.kv_full, state.kv_phase);
    RingState<Traits::kStages>& ring = state.ring;
    int& ds_stage = state.buf;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // outlives a step (below)
    auto issue_s = [&]() __attribute__((always_inline)) {
      ClusterTransactionBarrier::wait(&smem.q_full[ring.stage], ring.phase);
      gmma<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, ring.stage), acc_s);
    };
    // The next block's S^T, if any, then the wait for all but it.
    auto issue_next_s = [&](auto has_next) __attribute__((always_inline)) {
      if constexpr (decltype(has_next)::value) {
        issue_s();
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
    };
    auto step = [&](int m_block, auto masked, auto has_next) __attribute__((always_inline)) {
      int next_stage;
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      const float next_stat = probs_and_grads<Traits, V, decltype(masked)::value, decltype(has_next)::value>(
          p, smem, seq, mods, dropout, row_stats, ring.stage, m_block, n_block, tid, mma_sdp, tdPrV,
          tdPrdO(_, _, _, ring.stage), acc_s, acc_dp, cS_rc, next_stage);
      Tensor rP = make_tensor<Element>(acc_s.layout());
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      convert_fragment_into(acc_s, rP);
      convert_fragment_into(acc_dp, rdS);
      gmma<false, -1>(mma_dkv, make_tensor(rP.data(), acc_as_a_operand_gmma(rP.layout())), tdVrdOt(_, _, _, ring.stage),
                      acc_dv);
      // dS^T to shared memory, for both warpgroups' dQ (its other buffer may still be read by the other warpgroup's
      // dQ of the step before: each passed this step's barrier only after its own dQ was done); before dK's wgmma,
      // which takes dS^T's registers as its A operand (no other instruction may access them while it runs).
      if constexpr (kDq) copy(ds_copy, ds_thr.retile_S(rdS), tdSsdS(_, _, _, ds_stage));
      gmma<false, -1>(mma_dkv, make_tensor(rdS.data(), acc_as_a_operand_gmma(rdS.layout())),
                      tdKrQt(_, _, _, ring.stage), acc_dk);
      if constexpr (kDq) cutlass::arch::fence_view_async_shared();  // the stores are visible to wgmma
      if constexpr (decltype(has_next)::value) store_stat<Traits>(smem, next_stage, next_stat, tid);
      // Past this barrier the warpgroup writes its dQ buffer again: the step before's bulk reduction has read it.
      if (kDq && is_signaling) cute::tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsWrittenBarrier);
      if constexpr (!kDq) {
        const int stage = ring.stage;
        ring.advance();
        issue_next_s(has_next);  // dV and dK are done: P^T and dS^T in registers, Q and dO in shared memory are free
        warpgroup_fence_operands(rP, rdS, acc_dv, acc_dk);
        if (is_signaling) ClusterBarrier::arrive(&smem.q_empty[stage]);
      } else {
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        gmma<true, -1>(mma_dq, tdQrdS(_, _, _, ds_stage), tdQrKt, acc_dq);
        warpgroup_wait<1>();  // dV and dK are done: P^T and dS^T in registers, Q and dO in shared memory are free
        warpgroup_fence_operands(rP, rdS, acc_dv, acc_dk);
        if (is_signaling) ClusterBarrier::arrive(&smem.q_empty[ring.stage]);
        ring.advance();
        ds_stage ^= 1;
        issue_next_s(has_next);  // dQ is done
        warpgroup_fence_operand(acc_dq);
        add_dq<Traits>(p, smem, seq, head, m_block, acc_dq, tid);
      }
    };
    walk_query_blocks<Traits>(p, smem, seq, row_stats, queries, ring.stage, tid, issue_s, step);
    if (kDq && is_signaling) bulk_wait_all();  // dq_accum holds the sums before the block ends
    release_kv(smem, state, tid);
  }

  store_dkdv<Traits, V>(p, seq, head, n_block, acc_dk, acc_dv, tid);
}

// A consumer thread where the warpgroups split the head dim (Traits::kSplitsHeadDim, 64 keys a block): per query
// block, warpgroup w computes S^T and dP^T of the block's keys and the rows' half w, writes P^T and dS^T to shared
// memory, and past the barrier at which both halves are there, dV, dK and dQ of the head dim's half w, every operand
// from shared memory. Each thread adds its dQ to dq_accum itself (a block's dQ in fp32 would not fit beside the
// stages of Q and dO).
template <typename Traits, bool kDq, Variant V, typename State>
__device__ __forceinline__ void compute_bwd_split(BwdParams const& p, typename Traits::SharedStorage& smem,
                                                  Sequence const& seq, int head, int n_block, BlockRange const& queries,
                                                  int tid, State& state) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});  // its half of the head dim
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  if (!queries.empty()) {
    auto [sQ, sdO, sQt, sdOt, sK, sKt, sV, sdSt, sdS] = bwd_smem_views<Traits>(smem);
    Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutdSt{});
    Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // (MMA, MMA_M, MMA_K): descriptors
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N over its half of the rows, MMA_K, kStages)
    Tensor tdPrV = thr_sdp.partition_fragment_A(sV);      // (MMA, MMA_M, MMA_K)
    Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);    // (MMA, MMA_N, MMA_K, kStages)
    Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);    // (MMA, MMA_M, MMA_K over rows, 2)
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N over its half of the head dim, MMA_K, kStages)
    Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K over keys, 2)
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);  // (MMA, MMA_N over its half of the head dim, MMA_K)
    auto st_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto st_thr = st_copy.get_thread_slice(tid);
    Tensor tPsP = st_thr.partition_D(sPt);  // (CPY, CPY_M, CPY_N, 2)
    Tensor tdSsdS = st_thr.partition_D(sdSt);

    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    Tensor cS_rc = make_tensor(cS.data(), acc_rowcol_gmma(cS.layout()));  // (keys, query rows) -> (key, row)
    const int64_t row_stats = seq.stats(p, head);
    const ScoreMods mods = has_options(V) ? ScoreMods::make(p, seq, head) : ScoreMods{};
    const Dropout dropout = has_dropout(V) ? Dropout::make(p, seq.batch, head) : Dropout{};
    const bool is_signaling = tid % 128 == 0;  // one arrival per warpgroup releases a buffer

    ClusterTransactionBarrier::wait(&smem.kv_full, state.kv_phase);
    RingState<Traits::kStages>& ring = state.ring;
    int& buf = state.buf;                                                               // the buffer of P^T and dS^T
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // outlives a step
    auto issue_s = [&]() __attribute__((always_inline)) {
      ClusterTransactionBarrier::wait(&smem.q_full[ring.stage], ring.phase);
      gmma<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, ring.stage), acc_s);
    };
    auto step = [&](int m_block, auto masked, auto has_next) __attribute__((always_inline)) {
      int next_stage;
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      const float next_stat = probs_and_grads<Traits, V, decltype(masked)::value, decltype(has_next)::value>(
          p, smem, seq, mods, dropout, row_stats, ring.stage, m_block, n_block, tid, mma_sdp, tdPrV,
          tdPrdO(_, _, _, ring.stage), acc_s, acc_dp, cS_rc, next_stage);
      Tensor rP = make_tensor<Element>(acc_s.layout());
      Tensor rdS = make_tensor<Element>(acc_dp.layout());
      convert_fragment_into(acc_s, rP);
      convert_fragment_into(acc_dp, rdS);
      // P^T and dS^T to shared memory (the other buffer may still be read by the other warpgroup's products of the
      // step before: each passed this step's barrier only after its own were done).
      copy(st_copy, st_thr.retile_S(rP), tPsP(_, _, _, buf));
      copy(st_copy, st_thr.retile_S(rdS), tdSsdS(_, _, _, buf));
      cutlass::arch::fence_view_async_shared();  // the stores are visible to wgmma
      if constexpr (decltype(has_next)::value) store_stat<Traits>(smem, next_stage, next_stat, tid);
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, kDsWrittenBarrier);
      gmma<false, -1>(mma_dkv, tdVrPt(_, _, _, buf), tdVrdOt(_, _, _, ring.stage), acc_dv);
      gmma<false, -1>(mma_dkv, tdKrdSt(_, _, _, buf), tdKrQt(_, _, _, ring.stage), acc_dk);
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      if constexpr (kDq) {
        gmma<true, -1>(mma_dq, tdQrdS(_, _, _, buf), tdQrKt, acc_dq);
        warpgroup_wait<1>();  // dV and dK are done: Q and dO in shared memory are free
      } else {
        warpgroup_wait<0>();
      }
      warpgroup_fence_operands(acc_dv, acc_dk);
      if (is_signaling) ClusterBarrier::arrive(&smem.q_empty[ring.stage]);
      ring.advance();
      buf ^= 1;
      // dQ's reductions, then the next S^T (issued before them, its accumulator beside dQ's makes ptxas spill).
      if constexpr (kDq) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq);
        add_dq_atomic<Traits>(p, seq, head, m_block, acc_dq, tid);
      }
      if constexpr (decltype(has_next)::value) issue_s();
    };
    walk_query_blocks<Traits>(p, smem, seq, row_stats, queries, ring.stage, tid, issue_s, step);
    release_kv(smem, state, tid);
  }

  store_dkdv<Traits, V>(p, seq, head, n_block, acc_dk, acc_dv, tid);
}

// A thread block per key block of each (sequence, head) up to the params' bound, for a kernel of variant V
// (fwd_kernel's: fixed-length batches, variable-length ones, either kind with windows and ALiBi, kSoftcap with the
// softcap too, and those two with dropout). walks_tiles(V): a block takes its key
// block and every gridDim.x-th after it while within its sequence (which may be longer than the bound, max_seqlen_k).
template <typename Traits, bool kDq, Variant V>
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
    if constexpr (walks_tiles(V)) {
      ClusterBarrier::init(&smem.kv_empty, Traits::kConsumerWarpgroups);
      ClusterTransactionBarrier::init(&smem.landed, 1);
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      ClusterTransactionBarrier::init(&smem.q_full[s], 1);
      ClusterBarrier::init(&smem.q_empty[s], Traits::kConsumerWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // the last barrier of the whole block: the producer's other warps leave below

  const int n_block = int(blockIdx.x), head = int(blockIdx.y);
  const Sequence seq = sequence<V>(p, int(blockIdx.z));
  const BlockRange queries = mask_policy<V>(p, seq).template query_blocks<Traits::kBlockM, Traits::kBlockN>(n_block);
  // body(seq, n_block, queries) for this block's key block, and, walks_tiles(V), every gridDim.x-th after it in its
  // sequence.
  auto walk_key_blocks = [&](auto&& body) __attribute__((always_inline)) {
    if constexpr (walks_tiles(V)) {
      for (int n = n_block;; n += int(gridDim.x)) {
        const Sequence seq_n = sequence<V>(p, int(blockIdx.z));
        if (n * Traits::kBlockN >= seq_n.seqlen_k) break;
        body(seq_n, n, mask_policy<V>(p, seq_n).template query_blocks<Traits::kBlockM, Traits::kBlockN>(n));
      }
    } else {
      body(seq, n_block, queries);
    }
  };
  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // (walks_tiles: the warp, load_bwd)
    if (warp == 0 && (walks_tiles(V) || (cute::elect_one_sync() && !queries.empty()))) {
      const bool leader = !walks_tiles(V) || cute::elect_one_sync();
      RingState<Traits::kStages> ring;
      uint32_t kv_phase = 0, landed_phase = 0;
      walk_key_blocks([&](Sequence const& seq, int n_block, BlockRange const& queries) __attribute__((always_inline)) {
        if (queries.empty()) return;  // the consumers store zeros and read nothing
        load_bwd<Traits, V>(args, smem, seq, head, n_block, queries, ring, kv_phase, landed_phase, leader);
        kv_phase ^= 1;
      });
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    BwdConsumerState<Traits::kStages, walks_tiles(V)> state;
    walk_key_blocks([&](Sequence const& seq, int n_block, BlockRange const& queries) __attribute__((always_inline)) {
      if constexpr (Traits::kSplitsHeadDim) {
        compute_bwd_split<Traits, kDq, V>(p, smem, seq, head, n_block, queries, int(threadIdx.x) - 128, state);
      } else {
        compute_bwd<Traits, kDq, V>(p, smem, seq, head, n_block, queries, int(threadIdx.x) - 128, state);
      }
    });
  }
}

// dq = dq_accum of one query block of one (sequence, head) per thread block, a thread per consumer thread of the main
// kernel: its slots (dq_slot; 16-byte loads from L2, which the other blocks' reductions wrote) to the rows and
// columns its dQ accumulator held, column pairs as 4-byte stores.
// kVarlen: a block takes its query block and every gridDim.x-th after it in its sequence (as bwd_kernel its key
// blocks).
template <typename Traits, bool kVarlen>
static __global__ void __launch_bounds__(Traits::kConsumerThreads) convert_dq_kernel(const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int head = int(blockIdx.y), tid = int(threadIdx.x);
  for (int m_block = int(blockIdx.x);; m_block += int(gridDim.x)) {
    const Sequence seq = sequence<kVarlen ? Variant::kVarlen : Variant::kFixed>(p, int(blockIdx.z));
    if (kVarlen && m_block * kBlockM >= seq.seqlen_q) break;
    Tensor acc_dq = partition_fragment_C(typename Traits::TiledMmadQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    float const* block = dq_accum_block<Traits>(p, seq, head, m_block);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 4) {
      const float4 x = __ldcg(reinterpret_cast<float4 const*>(block + dq_slot<Traits>(tid, i)));
      acc_dq(i) = x.x;
      acc_dq(i + 1) = x.y;
      acc_dq(i + 2) = x.z;
      acc_dq(i + 3) = x.w;
    }
    Element* dq = p.dq.at<Element>(seq.batch, head, seq.q_row0 + m_block * kBlockM);
    store_acc_direct<typename Traits::TiledMmadQ, kBlockM, kHeadDim>(acc_dq, dq, p.dq.row_stride,
                                                                     seq.seqlen_q - m_block * kBlockM, p.head_dim, tid);
    if constexpr (!kVarlen) break;  // the grid has a block per query block
  }
}

}  // namespace cuteflash::sm90

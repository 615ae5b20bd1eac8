// sm90 forward kernel: FlashAttention with TMA loads, wgmma products and warp specialisation.
//
// A thread block computes tiles of kBlockM query rows of one (sequence, head): one tile (causal calls: the grid lists
// them, heaviest first) or, persistent, a share of all of them (TileScheduler). Warpgroup 0 is the producer: one
// thread issues the TMA loads of each tile's Q, then of its K and V block by block (from the last visible block down,
// as the sm80 family walks them) into kStages buffers each, guarded by mbarriers (full: loaded; empty: every consumer
// warpgroup is done with it). The other warpgroups are consumers, 64 query rows each:
//   S = Q K^T (wgmma, both from shared memory)  ->  mask  ->  online softmax (common/softmax.cuh)  ->
//   O += P V (wgmma, P from registers)
// and at the end O to global memory (through Q's buffer for a block's one tile, from registers in persistent blocks),
// and the rows' log-sum-exp. Q's buffer is released once the tile's last Q K^T is done, so that a persistent block's
// producer loads the next tile's Q under the tile's last P V and its stores.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/device_kernel.h>  // CUTLASS_GRID_CONSTANT

#include "cuteflash/common/dropout.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/common/softmax.cuh"
#include "cuteflash/common/tile_scheduler.cuh"
#include "cuteflash/common/utils.cuh"
#include "cuteflash/sm90/gmma.cuh"
#include "cuteflash/sm90/traits.h"

namespace cuteflash::sm90 {

// The kernel's argument: the TMA descriptors (which hold the operands' addresses) and the params.
template <typename Traits>
struct FwdArgs {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaVt tma_v;
  FwdParams p;
};

// Named barriers (CUTLASS's user ids, 0-7), one of each per consumer warpgroup: its epilogue's, and its turn to issue
// products (Turns).
constexpr uint32_t kEpilogueBarrier = 0;
constexpr uint32_t kTurnBarrier = 3;

// The consumer warpgroups take turns to issue their products, so that one's softmax runs while another's products
// do (rather than all contending for the tensor cores at once, then all waiting on the exponentials): warpgroup w
// waits for its turn before it issues, and passes the turn on to w + 1 after. The first warpgroup's first turn is
// given at the start (begin); the last pass, back to it, is taken at the end (end), so that no barrier is left
// half-arrived.
template <int kWarpgroups>
struct Turns {
  int warpgroup;
  __device__ __forceinline__ void begin() const {
    if (warpgroup == 0) cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier);
  }
  __device__ __forceinline__ void wait() const { cutlass::arch::NamedBarrier::sync(256, kTurnBarrier + warpgroup); }
  __device__ __forceinline__ void pass() const {
    cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier + (warpgroup + 1) % kWarpgroups);
  }
  __device__ __forceinline__ void end() const {
    if (warpgroup == 0) wait();
  }
};

// The producer, for one tile: Q, then K and V of each visible key block, from the last down (nothing for a query
// block that sees no key). A buffer is refilled once every consumer warpgroup has released it (its empty barrier's
// phase; the first round waits for nothing); the rings continue from tile to tile. One thread (leader), or, in a kernel
// that walks tiles (walks_tiles), the producer's warp, whose leader lane issues the loads: in a variable-length batch
// V's rows past the sequence are zeroed (load_zeroing_tail; K's scores there are masked, and Q's rows past it are not
// stored).
template <typename Traits, Variant V>
__device__ __forceinline__ void load_tiles(FwdArgs<Traits> const& args, typename Traits::SharedStorage& smem,
                                           Sequence const& seq, int head, int m_block, BlockRange const& keys,
                                           RingState<1>& ring_q, RingState<Traits::kStages>& ring,
                                           uint32_t& landed_phase, bool leader) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  FwdParams const& p = args.p;
  const int head_k = head / (p.nheads / p.nheads_k);
  const bool varlen = reads_varlen<V>(p);
  const GmemExtent extent = GmemExtent::of(p, varlen);
  Tensor mQ = args.tma_q.get_tma_tensor(make_shape(extent.rows_q, p.head_dim, p.nheads, extent.batch));
  Tensor mK = args.tma_k.get_tma_tensor(make_shape(extent.rows_k, p.head_dim, p.nheads_k, extent.batch));
  Tensor mVt = args.tma_v.get_tma_tensor(make_shape(p.head_dim, extent.rows_k, p.nheads_k, extent.batch));
  // The sequence's rows from its first: (rows, head dim) of q and k, (head dim, rows) of V^T.
  Tensor mQs = domain_offset(make_coord(seq.q_row0, _0{}), mQ(_, _, head, extent.batch_index(seq.batch)));
  Tensor mKs = domain_offset(make_coord(seq.k_row0, _0{}), mK(_, _, head_k, extent.batch_index(seq.k_batch)));
  Tensor mVts = domain_offset(make_coord(_0{}, seq.k_row0), mVt(_, _, head_k, extent.batch_index(seq.k_batch)));
  Tensor gQ = local_tile(mQs, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mKs, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gVt = local_tile(mVts, Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(0, _));
  // gQ: (kBlockM, kHeadDim); gK: (kBlockN, kHeadDim, blocks); gVt: (kHeadDim, kBlockN, blocks)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

  auto tma_q = args.tma_q.get_slice(_0{});
  auto tma_k = args.tma_k.get_slice(_0{});
  auto tma_v = args.tma_v.get_slice(_0{});
  Tensor tQgQ = group_modes<0, 3>(tma_q.partition_S(gQ));    // (TMA)
  Tensor tQsQ = group_modes<0, 3>(tma_q.partition_D(sQ));    // (TMA)
  Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(gK));    // (TMA, blocks)
  Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(sK));    // (TMA, stages)
  Tensor tVgVt = group_modes<0, 3>(tma_v.partition_S(gVt));  // (TMA, blocks)
  Tensor tVsVt = group_modes<0, 3>(tma_v.partition_D(sVt));  // (TMA, stages)

  if (keys.empty()) return;  // the consumers write O = 0 and read nothing
  ClusterBarrier::wait(&smem.q_empty, ring_q.phase ^ 1);
  if (leader) {
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full, Traits::kQBytes);
    copy(args.tma_q.with(smem.q_full), tQgQ, tQsQ);
  }
  ring_q.advance();
  for (int n_block = keys.end - 1; n_block >= keys.begin; --n_block) {
    ClusterBarrier::wait(&smem.k_empty[ring.stage], ring.phase ^ 1);
    if (leader) {
      ClusterTransactionBarrier::arrive_and_expect_tx(&smem.k_full[ring.stage], Traits::kKVBytes);
      copy(args.tma_k.with(smem.k_full[ring.stage]), tKgK(_, n_block), tKsK(_, ring.stage));
    }
    ClusterBarrier::wait(&smem.v_empty[ring.stage], ring.phase ^ 1);
    const int stage = ring.stage;
    auto issue_v = [&](uint64_t& barrier) { copy(args.tma_v.with(barrier), tVgVt(_, n_block), tVsVt(_, stage)); };
    const int rows = seq.seqlen_k - n_block * kBlockN;
    load_zeroing_tail(
        &smem.v_full[stage], &smem.landed, landed_phase, Traits::kKVBytes, varlen && rows < kBlockN, leader, issue_v,
        [&] { zero_rows_from<kBlockN, kHeadDim>(rows, [&](int r, int c) { return &sVt(c, r, stage); }); });
    ring.advance();
  }
}

// A consumer warpgroup's rows of O (rows < rows_left, columns < head_dim) to global memory through its rows of sQ,
// which its products no longer read: 16-byte stores. kReleaseQ: then the warpgroup releases Q's buffer, into which
// the producer loads the block's next tile's Q (a variable-length batch's block may take several tiles); else the
// block takes one tile.
template <typename Traits, bool kReleaseQ, typename AccO>
__device__ __forceinline__ void write_o_staged(FwdParams const& p, typename Traits::Element* o, int rows_left,
                                               AccO const& acc_o, typename Traits::SharedStorage& smem, int tid) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int warpgroup = tid / 128;
  const uint32_t barrier = kEpilogueBarrier + uint32_t(warpgroup);
  Tensor sO = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
  cutlass::arch::NamedBarrier::sync(128, barrier);  // every thread of the warpgroup is past its last Q K^T
  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_fragment_into(acc_o, rO);
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename Traits::TiledMmaPV{});
  auto smem_thr = smem_copy.get_thread_slice(tid);
  copy(smem_copy, smem_thr.retile_S(rO), smem_thr.partition_D(sO));
  cutlass::arch::NamedBarrier::sync(128, barrier);

  Tensor gO =
      local_tile(make_tensor(make_gmem_ptr(o),
                             make_layout(Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.o.row_stride, _1{}))),
                 Shape<_64, Int<kHeadDim>>{}, make_coord(warpgroup, 0));  // (64, kHeadDim): the warpgroup's rows
  Tensor sO_rows = local_tile(sO, Shape<_64, Int<kHeadDim>>{}, make_coord(warpgroup, 0));
  typename Traits::GmemTiledCopyO gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid % 128);
  Tensor cO_rows = gmem_thr.partition_S(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
  copy_tile_bounded<false>(gmem_copy, gmem_thr.partition_S(sO_rows), gmem_thr.partition_D(gO), cO_rows,
                           rows_left - warpgroup * 64, p.head_dim);
  if constexpr (kReleaseQ) {
    cutlass::arch::fence_view_async_shared();  // the accesses to sQ come before the producer's next TMA load into it
    cutlass::arch::NamedBarrier::sync(128, barrier);
    if (tid % 128 == 0) ClusterBarrier::arrive(&smem.q_empty);
  }
}

// The same from registers, no shared memory held (store_acc_direct). Slower per tile than write_o_staged (more and
// narrower stores), but a persistent block loads its next tile's Q meanwhile.
template <typename Traits, typename AccO>
__device__ __forceinline__ void write_o_direct(FwdParams const& p, typename Traits::Element* o, int rows_left,
                                               AccO const& acc_o, int tid) {
  store_acc_direct<typename Traits::TiledMmaPV, Traits::kBlockM, Traits::kHeadDim>(acc_o, o, p.o.row_stride, rows_left,
                                                                                   p.head_dim, tid);
}

// The end of a consumer warpgroup's rows: O /= l (and, has_dropout(V), O /= 1 - p) and lse = m scale + log(l), then
// O to global memory (kStaged: write_o_staged, but, kSeveral (a block that may take several tiles), in a tile that saw
// no key, whose Q's buffer the producer may be filling with the next tile's; else write_o_direct).
template <typename Traits, bool kStaged, bool kSeveral, Variant V, typename Softmax, typename AccO>
__device__ __forceinline__ void store_output(FwdParams const& p, Sequence const& seq, int head, int m_block,
                                             bool saw_keys, Softmax& softmax, AccO& acc_o,
                                             typename Traits::SharedStorage& smem, int tid) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  auto thr_mma = typename Traits::TiledMmaPV{}.get_thread_slice(tid);
  if constexpr (has_dropout(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= p.dropout_scale;
  }
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol_gmma(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  float row_lse[kRows];
  softmax.finalize(acc_o_rc, p.softmax_scale, row_lse);

  const int rows_left = seq.seqlen_q - m_block * kBlockM;
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), acc_rowcol_gmma(cO.layout()));
  float* lse = p.lse + seq.stats(p, head) + m_block * kBlockM;
  if (get<1>(cO_rc(0, 0)) == 0) {  // the first thread of each quad writes the quad's rows
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int row = get<0>(cO_rc(mi, 0));
      if (row < rows_left) lse[row] = row_lse[mi];
    }
  }
  Element* o = p.o.at<Element>(seq.batch, head, seq.q_row0 + m_block * kBlockM);
  if (kStaged && (!kSeveral || saw_keys)) {
    write_o_staged<Traits, kSeveral>(p, o, rows_left, acc_o, smem, tid);
  } else {
    write_o_direct<Traits>(p, o, rows_left, acc_o, tid);
  }
}

// has_dropout(V): the probabilities of P (rP, 16 bits, of the tile whose first row and key are row0 and col0) that
// dropout drops zeroed, after the row sums, which count them all (store_output scales O by 1 / (1 - p)). The consumers
// drop under the Q K^T they issued before, when the registers of S are free for the draws.
template <Variant V, typename Probs, typename Coords>
__device__ __forceinline__ void drop_probs(Dropout const& dropout, Probs& rP, Coords const& cS_rc, int row0, int col0) {
  if constexpr (has_dropout(V)) apply_dropout_words(acc_words_gmma(rP), dropout, cS_rc, row0, col0);
}

// A consumer warpgroup's thread (tid: its index among the consumers), for one tile: the key loop over the blocks the
// producer loads, from the last down: the masked ones at the diagonal first, the unmasked ones, then (a sliding window,
// has_options(V)) the masked ones at the window's left edge. The product P V of a block runs while the softmax of the
// next block's scores does: each step waits for the P V before it, converts the block before's P to 16 bits, issues
// S = Q K^T of its block, rescales O, issues O += P V, and takes the softmax of S once Q K^T is done. has_options(V):
// the scores get the softcap (has_softcap(V)) and the call's ALiBi term (in the masked steps, and in the others of a
// call with slopes) before the mask, and dropout (has_dropout(V)) zeroes P's dropped probabilities.
template <typename Traits, bool kPersistent, bool kSkipAboveDiagonal, Variant V>
__device__ __forceinline__ void compute_tile(FwdParams const& p, typename Traits::SharedStorage& smem,
                                             Sequence const& seq, int head, int m_block, BlockRange const& keys,
                                             int tid, RingState<1>& ring_q, RingState<Traits::kStages>& ring_k,
                                             RingState<Traits::kStages>& ring_v) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K): descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, kStages)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N over the head dim, MMA_K over keys, kStages)
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol_gmma(acc_o.layout()));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol_gmma(cS.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  OnlineSoftmax<kRows> softmax;

  if (!keys.empty()) {
    const bool is_signaling = tid % 128 == 0;  // one arrival per warpgroup releases a buffer
    Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor s = make_tensor(acc_s.data(), acc_rowcol_gmma(acc_s.layout()));  // (rows, cols)
    Tensor rP = make_tensor<Element>(acc_s.layout());
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand_gmma(rP.layout()));  // (MMA, MMA_M, MMA_K)
    // The softcap and ALiBi (has_options(V)), read once a tile; mask_scores's no_alibi: a step without ALiBi's work
    // (of a call without slopes; the masked steps take it where there are).
    const ScoreMods mods = has_options(V) ? ScoreMods::make(p, seq, head) : ScoreMods{};
    const Dropout dropout = has_dropout(V) ? Dropout::make(p, seq.batch, head) : Dropout{};
    auto mask_scores = [&](int n_block, auto masked, auto no_alibi) __attribute__((always_inline)) {
      if constexpr (has_options(V) && (!decltype(no_alibi)::value || has_softcap(V))) {
        ScoreMods step_mods = mods;
        if constexpr (decltype(no_alibi)::value) step_mods.alibi = 0.f;
        apply_score_mods<V>(s, cS_rc, m_block * kBlockM, n_block * kBlockN, step_mods, nullptr);
      }
      if constexpr (decltype(masked)::value) {
        apply_mask(s, cS_rc, m_block * kBlockM, n_block * kBlockN, mask_policy<V>(p, seq));
      }
    };
    auto release = [&](uint64_t* empty, RingState<Traits::kStages>& ring) {
      if (is_signaling) ClusterBarrier::arrive(&empty[ring.stage]);
      ring.advance();
    };

    const Turns<Traits::kConsumerWarpgroups> turns{tid / 128};
    turns.begin();
    ClusterTransactionBarrier::wait(&smem.q_full, ring_q.phase);
    int n_block = keys.end - 1;
    // kSkipAboveDiagonal (causal): the tile's last key blocks may lie wholly above the diagonal for this warpgroup's
    // 64 rows, and rows past the sequence's end need none: the warpgroup releases those blocks unread, but the first of
    // the tile's blocks, so that every warpgroup computes one (rows that see no key get P = 0 from its mask; rows past
    // the end are not stored). Every warpgroup takes one turn per block of the tile, used or not, so that the turns go
    // round in step.
    if constexpr (kSkipAboveDiagonal) {
      const int first_row = m_block * kBlockM + 64 * (tid / 128);
      const int own_end = std::max(
          keys.begin + 1,
          first_row >= seq.seqlen_q
              ? keys.begin
              : std::min(keys.end, mask_policy<V>(p, seq).template key_blocks<64, kBlockN>(first_row / 64).end));
#pragma unroll 1
      for (; n_block >= own_end; --n_block) {
        turns.wait();  // the turn first: the next warpgroup's products wait for nothing of these
        turns.pass();
        ClusterTransactionBarrier::wait(&smem.k_full[ring_k.stage], ring_k.phase);
        release(smem.k_empty, ring_k);
        ClusterTransactionBarrier::wait(&smem.v_full[ring_v.stage], ring_v.phase);
        release(smem.v_empty, ring_v);
      }
      ClusterTransactionBarrier::wait(&smem.k_full[ring_k.stage], ring_k.phase);
      turns.wait();
      gmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, ring_k.stage), acc_s);
      turns.pass();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
    } else {
      ClusterTransactionBarrier::wait(&smem.k_full[ring_k.stage], ring_k.phase);
      gmma<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, ring_k.stage), acc_s);
    }
    release(smem.k_empty, ring_k);
    if (has_options(V) ? keys.masked(n_block) : n_block >= keys.unmasked_end) {
      mask_scores(n_block, cute::true_type{}, cute::false_type{});
    } else if constexpr (has_options(V)) {
      mask_scores(n_block, cute::false_type{}, cute::false_type{});
    }
    // The factors by which O's rows are rescaled before the next P V adds to it (the first block's multiply zeros).
    float alpha[kRows];
    softmax.update_scores(s, p.softmax_scale_log2, alpha);

    // The wait for P V opens the next step rather than ending this one: ptxas hoists a wait within a basic block to
    // the start of the softmax (which then no longer ran under P V; seen in the SASS), not across the loop's branch.
    bool pv_in_flight = false;
    auto finish_pv = [&]() __attribute__((always_inline)) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      if (pv_in_flight) release(smem.v_empty, ring_v);
    };
    auto step = [&](int n_block, auto masked, auto no_alibi) __attribute__((always_inline)) {
      finish_pv();
      pv_in_flight = true;
      ClusterTransactionBarrier::wait(&smem.k_full[ring_k.stage], ring_k.phase);
      convert_fragment_into(acc_s, rP);
      turns.wait();
      gmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, ring_k.stage), acc_s);
      softmax.rescale(acc_o_rc, alpha);  // under Q K^T, which writes S only
      drop_probs<V>(dropout, rP, cS_rc, m_block * kBlockM, (n_block + 1) * kBlockN);  // rP: the block before's
      ClusterTransactionBarrier::wait(&smem.v_full[ring_v.stage], ring_v.phase);
      gmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, ring_v.stage), acc_o);
      turns.pass();
      warpgroup_wait<1>();  // S is done
      warpgroup_fence_operand(acc_s);
      release(smem.k_empty, ring_k);
      mask_scores(n_block, masked, no_alibi);
      softmax.update_scores(s, p.softmax_scale_log2, alpha);
    };
    for (--n_block; n_block >= keys.unmasked_end; --n_block) step(n_block, cute::true_type{}, cute::false_type{});
    if constexpr (has_options(V)) {
      // The unmasked blocks: a copy of the step without ALiBi's work for a call without slopes (nvcc would issue it
      // predicated off in every step); then the window's left edge.
      if (p.alibi_slopes != nullptr) {
        for (; n_block >= keys.unmasked_begin; --n_block) step(n_block, cute::false_type{}, cute::false_type{});
      } else {
        for (; n_block >= keys.unmasked_begin; --n_block) step(n_block, cute::false_type{}, cute::true_type{});
      }
      for (; n_block >= keys.begin; --n_block) step(n_block, cute::true_type{}, cute::false_type{});
    } else {
      for (; n_block >= keys.begin; --n_block) step(n_block, cute::false_type{}, cute::true_type{});
    }
    // Every Q K^T is done: a persistent block's producer loads the next tile's Q under the last P V and the stores
    // (a block that walks tiles, which stores O through Q's buffer, releases it after: write_o_staged).
    if (!walks_tiles(V) && is_signaling) ClusterBarrier::arrive(&smem.q_empty);
    ring_q.advance();
    finish_pv();
    convert_fragment_into(acc_s, rP);
    softmax.rescale(acc_o_rc, alpha);
    drop_probs<V>(dropout, rP, cS_rc, m_block * kBlockM, (n_block + 1) * kBlockN);  // keys.begin
    ClusterTransactionBarrier::wait(&smem.v_full[ring_v.stage], ring_v.phase);
    gmma<false, 0>(mma_pv, tOrP, tOrV(_, _, _, ring_v.stage), acc_o);
    release(smem.v_empty, ring_v);
    turns.end();
  }
  store_output<Traits, !kPersistent, walks_tiles(V), V>(p, seq, head, m_block, !keys.empty(), softmax, acc_o, smem,
                                                        tid);
}

// A kernel of variant V: kFixed, fixed-length batches with at most a causal mask; kVarlen, variable-length ones;
// kGeneral, either kind with sliding windows and ALiBi; kSoftcap, with the softcap too; kDropout and kSoftcapDropout,
// those two with dropout. The tiles of TileScheduler (persistent for kFixed only); kSkipAboveDiagonal: compute_tile.
template <typename Traits, bool kPersistent, bool kSkipAboveDiagonal, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(CUTLASS_GRID_CONSTANT FwdArgs<Traits> const args) {
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  FwdParams const& p = args.p;
  const int warp = cutlass::canonical_warp_idx_sync();
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    ClusterTransactionBarrier::init(&smem.q_full, 1);
    ClusterBarrier::init(&smem.q_empty, Traits::kConsumerWarpgroups);
    if constexpr (walks_tiles(V)) ClusterTransactionBarrier::init(&smem.landed, 1);
    for (int s = 0; s < Traits::kStages; ++s) {
      ClusterTransactionBarrier::init(&smem.k_full[s], 1);
      ClusterTransactionBarrier::init(&smem.v_full[s], 1);
      ClusterBarrier::init(&smem.k_empty[s], Traits::kConsumerWarpgroups);
      ClusterBarrier::init(&smem.v_empty[s], Traits::kConsumerWarpgroups);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();  // the last barrier of the whole block: the producer's other warps leave below

  const int m_blocks = ceil_div(p.seqlen_q, Traits::kBlockM);
  const TileScheduler<kPersistent, walks_tiles(V)> scheduler{m_blocks, p.nheads,
                                                             kPersistent ? m_blocks * p.nheads * p.batch : 1};
  auto walk_tiles = [&](auto&& body) __attribute__((always_inline)) {
    for (int t = scheduler.first(); scheduler.valid(t); t = scheduler.next(t)) {
      const FwdTile tile = scheduler.tile(t);
      const Sequence seq = sequence<V>(p, tile.batch);
      if (walks_tiles(V) && tile.m_block * Traits::kBlockM >= seq.seqlen_q) break;  // past its sequence's end
      const BlockRange keys =
          mask_policy<V>(p, seq).template key_blocks<Traits::kBlockM, Traits::kBlockN>(tile.m_block);
      body(tile, seq, keys);
    }
  };
  RingState<1> ring_q;
  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 0 && (walks_tiles(V) || cute::elect_one_sync())) {  // (walks_tiles: the warp, load_tiles)
      const bool leader = !walks_tiles(V) || cute::elect_one_sync();
      RingState<Traits::kStages> ring;
      uint32_t landed_phase = 0;
      walk_tiles([&](FwdTile const& tile, Sequence const& seq, BlockRange const& keys) __attribute__((always_inline)) {
        load_tiles<Traits, V>(args, smem, seq, tile.head, tile.m_block, keys, ring_q, ring, landed_phase, leader);
      });
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    RingState<Traits::kStages> ring_k, ring_v;
    walk_tiles([&](FwdTile const& tile, Sequence const& seq, BlockRange const& keys) __attribute__((always_inline)) {
      compute_tile<Traits, kPersistent, kSkipAboveDiagonal, V>(p, smem, seq, tile.head, tile.m_block, keys,
                                                               int(threadIdx.x) - 128, ring_q, ring_k, ring_v);
    });
  }
}

}  // namespace cuteflash::sm90

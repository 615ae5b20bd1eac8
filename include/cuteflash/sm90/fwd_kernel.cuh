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
// producer loads the next tile's Q under the tile's last P V and its stores. Kernels of their own read a KV cache
// (KvCache: contiguous, or paged through load_paged_keys) and may split its keys (O and lse in fp32, merged after).
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
// C (KvCache): a paged cache's K and V come kPageRows rows at a time (load_paged_keys), and, kPagedBlocks, a block at
// a time where the block lies on one page (tma_k_block, tma_v_block).
template <typename Traits, KvCache C>
struct FwdArgs {
  typename Traits::TmaQ tma_q;
  std::conditional_t<is_paged(C), typename Traits::TmaKPaged, typename Traits::TmaK> tma_k;
  std::conditional_t<is_paged(C), typename Traits::TmaVtPaged, typename Traits::TmaVt> tma_v;
  FwdParams p;
};

template <typename Traits>
struct FwdArgs<Traits, KvCache::kPagedBlocks> {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKPaged tma_k;
  typename Traits::TmaVtPaged tma_v;
  FwdParams p;
  typename Traits::TmaK tma_k_block{};  // (set by launch_fwd)
  typename Traits::TmaVt tma_v_block{};
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

// Lane g's slice of a paged cache's key block [key0, key0 + kBlockN) of sequence seq: rows [16 g, 16 g + 16) of the
// block, loaded by TMA (by_tma) where they are keys of one page (page: its block-table entry; a page outside the cache
// reads as TMA's zeros), else copied by the warp (load_paged_keys). Looked up once for K and V. page_shift:
// log2_page_size(p).
struct PagedSlice {
  int page, in_page;
  bool by_tma;
};

template <typename Traits>
__device__ __forceinline__ PagedSlice paged_slice(FwdParams const& p, Sequence const& seq, int key0, int page_shift) {
  constexpr int kRows = Traits::kPageRows;
  const int lane = int(threadIdx.x % 32);
  const int key = key0 + kRows * lane;
  const PagePlace place = page_place(p, seq, key, page_shift);
  const bool by_tma =
      lane < Traits::kBlockN / kRows && key + kRows <= seq.seqlen_k && place.in_page + kRows <= p.page_size;
  return {load_offset_if(place.entry, by_tma, -1), place.in_page, by_tma};
}

// A paged cache's key block [key0, key0 + kBlockN) of operand t (k or v) and key-value head head_k into a stage's
// buffer, by the producer's warp: kBlocks, a block on one page by one TMA load (issue_block(page, row on the page));
// else each lane's slice (paged_slice) by TMA (issue(g, page, row on the page)), or the warp copies the slice itself (a
// slice across two pages, after cache_leftpad, or past the sequence's keys), 16 bytes a lane, with zeros for the rows
// past the keys, the columns past the head dim and the pages outside the cache. The buffer's barrier (full, one
// arrival) completes with the loads' bytes and the leader's arrival after the copies. at(r, c): the buffer's address
// of row r, column c.
template <typename Traits, bool kBlocks, typename IssueBlock, typename Issue, typename At>
__device__ __forceinline__ void load_paged_keys(FwdParams const& p, Sequence const& seq, Operand const& t, int head_k,
                                                int key0, int page_shift, PagedSlice const& slice, uint64_t* full,
                                                IssueBlock const& issue_block, Issue const& issue, At const& at) {
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kPageRows, kSlices = Traits::kBlockN / kRows, kChunks = Traits::kHeadDim / 8;
  const int lane = int(threadIdx.x % 32);
  if constexpr (kBlocks) {
    // The block on one page (lane 0's). (Not kept from paged_slice: the producer's few registers hold the slices.)
    if (key0 + Traits::kBlockN <= seq.seqlen_k &&
        page_place(p, seq, key0, page_shift).in_page + Traits::kBlockN <= p.page_size) {
      if (lane == 0) {
        ClusterTransactionBarrier::arrive_and_expect_tx(full, Traits::kKVBytes);
        issue_block(slice.page, slice.in_page);
      }
      return;
    }
  }
  const uint32_t tma_slices = __ballot_sync(0xffffffffu, slice.by_tma);
  if (lane == 0) ClusterTransactionBarrier::expect_transaction(full, __popc(tma_slices) * Traits::kPageRowsBytes);
  __syncwarp();
  if (slice.by_tma) issue(lane, slice.page, slice.in_page);
  const uint32_t copied = ~tma_slices & ((1u << kSlices) - 1);
  if (copied != 0) {
    for (uint32_t left = copied; left != 0; left &= left - 1) {
      const int first = kRows * (__ffs(left) - 1);  // the slice's first row
      for (int c = lane; c < kRows * kChunks; c += 32) {
        const int r = first + c / kChunks, col = c % kChunks * 8, key = key0 + r;
        // (null past the keys and for a page outside the cache)
        Element const* src = paged_key<Element>(p, seq, t, head_k, key, key_page(p, seq, key, page_shift), page_shift);
        uint4 value = make_uint4(0, 0, 0, 0);
        if (src != nullptr && col < p.head_dim) value = *reinterpret_cast<uint4 const*>(src + col);
        *reinterpret_cast<uint4*>(at(r, col)) = value;
      }
    }
    cutlass::arch::fence_view_async_shared();  // the copies are visible to the products (wgmma) that read the buffer
  }
  __syncwarp();
  if (lane == 0) ClusterBarrier::arrive(full);
}

// The producer, for one tile: Q, then K and V of each visible key block, from the last down (nothing for a query
// block that sees no key). A buffer is refilled once every consumer warpgroup has released it (its empty barrier's
// phase; the first round waits for nothing); the rings continue from tile to tile. One thread (leader), or, in a kernel
// that walks tiles (walks_tiles), the producer's warp, whose leader lane issues the loads: in a variable-length batch
// or a KV cache V's rows past the sequence's keys are zeroed (load_zeroing_tail; K's scores there are masked, and Q's
// rows past the sequence are not stored). A paged cache (C): K and V by the warp (load_paged_keys).
template <typename Traits, Variant V, KvCache C>
__device__ __forceinline__ void load_tiles(FwdArgs<Traits, C> const& args, typename Traits::SharedStorage& smem,
                                           Sequence const& seq, int head, int m_block, BlockRange const& keys,
                                           RingState<1>& ring_q, RingState<Traits::kStages>& ring,
                                           uint32_t& landed_phase, bool leader) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  FwdParams const& p = args.p;
  const int head_k = head / (p.nheads / p.nheads_k);
  const GmemExtent extent = GmemExtent::of(p, reads_varlen<V>(p), C != KvCache::kNone, is_paged(C));
  Tensor mQ = args.tma_q.get_tma_tensor(make_shape(extent.rows_q, p.head_dim, p.nheads, extent.batch_q));
  Tensor mK = args.tma_k.get_tma_tensor(make_shape(extent.rows_k, p.head_dim, p.nheads_k, extent.batch_k));
  Tensor mVt = args.tma_v.get_tma_tensor(make_shape(p.head_dim, extent.rows_k, p.nheads_k, extent.batch_k));
  // The sequence's rows from its first: (rows, head dim) of q.
  Tensor mQs = domain_offset(make_coord(seq.q_row0, _0{}), mQ(_, _, head, extent.batch_index(seq.batch)));
  Tensor gQ = local_tile(mQs, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (kBlockM, kHeadDim)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
  auto tma_q = args.tma_q.get_slice(_0{});
  auto tma_k = args.tma_k.get_slice(_0{});
  auto tma_v = args.tma_v.get_slice(_0{});

  if (keys.empty()) return;  // the consumers write O = 0 and read nothing
  ClusterBarrier::wait(&smem.q_empty, ring_q.phase ^ 1);
  if (leader) {
    ClusterTransactionBarrier::arrive_and_expect_tx(&smem.q_full, Traits::kQBytes);
    copy(args.tma_q.with(smem.q_full), group_modes<0, 3>(tma_q.partition_S(gQ)),
         group_modes<0, 3>(tma_q.partition_D(sQ)));
  }
  ring_q.advance();
  if constexpr (is_paged(C)) {
    constexpr bool kBlocks = C == KvCache::kPagedBlocks;
    using Rows = Int<Traits::kPageRows>;
    using BlockShapeK = Shape<Int<kBlockN>, Int<kHeadDim>>;
    using BlockShapeVt = Shape<Int<kHeadDim>, Int<kBlockN>>;
    // (The block loads' coordinates are those of mK and mVt: their descriptors span the same tensors.)
    const int page_shift = log2_page_size(p);
    // Each block's pages are looked up a block ahead, so that the reads of the block table run under the waits.
    PagedSlice next = paged_slice<Traits>(p, seq, (keys.end - 1) * kBlockN, page_shift);
    for (int n_block = keys.end - 1; n_block >= keys.begin; --n_block) {
      const int stage = ring.stage;
      const PagedSlice slice = next;
      if (n_block > keys.begin) next = paged_slice<Traits>(p, seq, (n_block - 1) * kBlockN, page_shift);
      ClusterBarrier::wait(&smem.k_empty[stage], ring.phase ^ 1);
      load_paged_keys<Traits, kBlocks>(
          p, seq, p.k, head_k, n_block * kBlockN, page_shift, slice, &smem.k_full[stage],
          [&](int page, int row) {
            if constexpr (kBlocks) {  // (whose args alone have tma_k_block)
              Tensor src = local_tile(domain_offset(make_coord(row, _0{}), mK(_, _, head_k, page)), BlockShapeK{},
                                      make_coord(0, 0));
              auto tma = args.tma_k_block.get_slice(_0{});
              copy(args.tma_k_block.with(smem.k_full[stage]), group_modes<0, 3>(tma.partition_S(src)),
                   group_modes<0, 3>(tma.partition_D(sK(_, _, stage))));
            }
          },
          [&](int g, int page, int row) {
            Tensor src = local_tile(domain_offset(make_coord(row, _0{}), mK(_, _, head_k, page)),
                                    Shape<Rows, Int<kHeadDim>>{}, make_coord(0, 0));
            Tensor dst = local_tile(sK(_, _, stage), Shape<Rows, Int<kHeadDim>>{}, make_coord(g, 0));
            copy(args.tma_k.with(smem.k_full[stage]), group_modes<0, 3>(tma_k.partition_S(src)),
                 group_modes<0, 3>(tma_k.partition_D(dst)));
          },
          [&](int r, int c) { return &sK(r, c, stage); });
      ClusterBarrier::wait(&smem.v_empty[stage], ring.phase ^ 1);
      load_paged_keys<Traits, kBlocks>(
          p, seq, p.v, head_k, n_block * kBlockN, page_shift, slice, &smem.v_full[stage],
          [&](int page, int row) {
            if constexpr (kBlocks) {
              Tensor src = local_tile(domain_offset(make_coord(_0{}, row), mVt(_, _, head_k, page)), BlockShapeVt{},
                                      make_coord(0, 0));
              auto tma = args.tma_v_block.get_slice(_0{});
              copy(args.tma_v_block.with(smem.v_full[stage]), group_modes<0, 3>(tma.partition_S(src)),
                   group_modes<0, 3>(tma.partition_D(sVt(_, _, stage))));
            }
          },
          [&](int g, int page, int row) {
            Tensor src = local_tile(domain_offset(make_coord(_0{}, row), mVt(_, _, head_k, page)),
                                    Shape<Int<kHeadDim>, Rows>{}, make_coord(0, 0));
            Tensor dst = local_tile(sVt(_, _, stage), Shape<Int<kHeadDim>, Rows>{}, make_coord(0, g));
            copy(args.tma_v.with(smem.v_full[stage]), group_modes<0, 3>(tma_v.partition_S(src)),
                 group_modes<0, 3>(tma_v.partition_D(dst)));
          },
          [&](int r, int c) { return &sVt(c, r, stage); });
      ring.advance();
    }
  } else {
    // The sequence's keys from its first: (rows, head dim) of k, (head dim, rows) of V^T.
    Tensor mKs = domain_offset(make_coord(seq.k_row0, _0{}), mK(_, _, head_k, extent.k_batch_index(seq)));
    Tensor mVts = domain_offset(make_coord(_0{}, seq.k_row0), mVt(_, _, head_k, extent.k_batch_index(seq)));
    Tensor gK = local_tile(mKs, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (kBlockN, kHeadDim, blocks)
    Tensor gVt = local_tile(mVts, Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(0, _));  // (kHeadDim, kBlockN, ..)
    Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(gK));                                 // (TMA, blocks)
    Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(sK));                                 // (TMA, stages)
    Tensor tVgVt = group_modes<0, 3>(tma_v.partition_S(gVt));                               // (TMA, blocks)
    Tensor tVsVt = group_modes<0, 3>(tma_v.partition_D(sVt));                               // (TMA, stages)
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
      load_zeroing_tail(&smem.v_full[stage], &smem.landed, landed_phase, Traits::kKVBytes,
                        extent.rows_past_keys() && rows < kBlockN, leader, issue_v, [&] {
                          zero_rows_from<kBlockN, kHeadDim>(rows, [&](int r, int c) { return &sVt(c, r, stage); });
                        });
      ring.advance();
    }
  }
}

// A consumer warpgroup releases Q's buffer once each of its threads is done with it.
template <typename Traits>
__device__ __forceinline__ void release_q(typename Traits::SharedStorage& smem, int tid) {
  cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + uint32_t(tid / 128));
  if (tid % 128 == 0) ClusterBarrier::arrive(&smem.q_empty);
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
    release_q<Traits>(smem, tid);
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
// no key, whose Q's buffer the producer may be filling with the next tile's; else write_o_direct), or, where the keys
// are split (a kernel that reads cache C: splits_cache_keys), the split's O and lse to o_accum and lse_accum.
template <typename Traits, bool kStaged, bool kSeveral, Variant V, KvCache C, typename Softmax, typename AccO>
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
  if (splits_cache_keys<C>(p)) {  // the split's O and lse in fp32, merged by a kernel after (split_merge.cuh)
    store_partial<false, kBlockM, Traits::kHeadDim, 0>(p, seq, head, m_block * kBlockM, acc_o_rc, cO_rc, row_lse,
                                                       rows_left, nullptr, tid);
    if (kSeveral && saw_keys) release_q<Traits>(smem, tid);
    return;
  }
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
template <typename Traits, bool kPersistent, bool kSkipAboveDiagonal, Variant V, KvCache C>
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
  store_output<Traits, !kPersistent, walks_tiles(V), V, C>(p, seq, head, m_block, !keys.empty(), softmax, acc_o, smem,
                                                           tid);
}

// A kernel of variant V: kFixed, fixed-length batches with at most a causal mask; kVarlen, variable-length ones;
// kGeneral, either kind with sliding windows and ALiBi; kSoftcap, with the softcap too; kDropout and kSoftcapDropout,
// those two with dropout. The tiles of TileScheduler (persistent for kFixed only); kSkipAboveDiagonal: compute_tile.
// C: the KV cache it reads (kGeneral and kSoftcap: fwd_launch.cuh's for_kv_cache), whose keys it may split.
template <typename Traits, bool kPersistent, bool kSkipAboveDiagonal, Variant V, KvCache C>
static __global__ void __launch_bounds__(Traits::kNThreads, 1)
    fwd_kernel(CUTLASS_GRID_CONSTANT FwdArgs<Traits, C> const args) {
  static_assert(C == KvCache::kNone || (serves_caches(V) && walks_tiles(V)));  // (the producer's warp loads pages)
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
      FwdTile tile = scheduler.tile(t);
      if (splits_cache_keys<C>(p))
        tile.m_block /= p.num_splits;  // blocks num_splits apart take one tile (sequence.cuh)
      const Sequence seq = sequence<V>(p, tile.batch);
      if (walks_tiles(V) && tile.m_block * Traits::kBlockM >= seq.seqlen_q) break;  // past its sequence's end
      BlockRange keys = mask_policy<V>(p, seq).template key_blocks<Traits::kBlockM, Traits::kBlockN>(tile.m_block);
      if (splits_cache_keys<C>(p)) {
        // A split keeps the call's unmasked blocks (BlockRange::split); compute_tile's runs of steps need them within
        // it.
        keys = keys.split(key_split(p), p.num_splits);
        keys.unmasked_end = std::min(std::max(keys.unmasked_end, keys.begin), keys.end);
        keys.unmasked_begin = std::min(std::max(keys.unmasked_begin, keys.begin), keys.unmasked_end);
      }
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
        load_tiles<Traits, V, C>(args, smem, seq, tile.head, tile.m_block, keys, ring_q, ring, landed_phase, leader);
      });
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    RingState<Traits::kStages> ring_k, ring_v;
    walk_tiles([&](FwdTile const& tile, Sequence const& seq, BlockRange const& keys) __attribute__((always_inline)) {
      compute_tile<Traits, kPersistent, kSkipAboveDiagonal, V, C>(p, smem, seq, tile.head, tile.m_block, keys,
                                                                  int(threadIdx.x) - 128, ring_q, ring_k, ring_v);
    });
  }
}

}  // namespace cuteflash::sm90

// sm80 forward kernel: FlashAttention-2 with ldmatrix + mma.sync.m16n8k16 + cp.async.
//
// One thread block owns kBlockM query rows of one (sequence, head). It walks the visible key blocks from
// the last to the first (so the masked blocks come first and the rest run without a mask), keeping
// the running softmax statistics and O in registers:
//   S = Q K^T  ->  mask  ->  P = exp(scale (S - m)), rescale O and l  ->  O += P V
// K of the next block loads while the softmax and P V of this one run; V loads while S is computed. With
// dropout (kDropout), P's dropped entries are zeroed after the row sums and O is scaled by 1 / (1 - p) at the end.
#pragma once

#include "cuteflash/dropout.cuh"
#include "cuteflash/mask.cuh"
#include "cuteflash/params.h"
#include "cuteflash/softmax.cuh"
#include "cuteflash/sm80/traits.h"
#include "cuteflash/utils.cuh"

namespace cuteflash::sm80 {

// acc += A B^T with both operands in shared memory. The fragments of k-slice i+1 are loaded while the
// MMAs of slice i run.
template <typename Acc, typename RegA, typename RegB, typename SmemA, typename SmemB, typename TiledMma, typename CopyA,
          typename ThrCopyA, typename CopyB, typename ThrCopyB>
__device__ __forceinline__ void gemm_ss(Acc& acc, RegA& tCrA, RegB& tCrB, SmemA const& tCsA, SmemB const& tCsB,
                                        TiledMma const& tiled_mma, CopyA const& copy_a, ThrCopyA const& thr_copy_a,
                                        CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, 0), tCrA_view(_, _, 0));
  copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i + 1 < size<2>(tCrA)) {
      copy(copy_a, tCsA(_, _, i + 1), tCrA_view(_, _, i + 1));
      copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    }
    gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// acc += A B^T with A already in registers (P) and B in shared memory (V^T).
template <typename Acc, typename RegA, typename RegB, typename SmemB, typename TiledMma, typename CopyB,
          typename ThrCopyB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RegA const& tCrA, RegB& tCrB, SmemB const& tCsB,
                                        TiledMma const& tiled_mma, CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, 0), tCrB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i + 1 < size<2>(tCrA)) copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// Writes a (kRows, kHeadDim) tile from shared memory to global memory (rows < rows_left, columns <
// head_dim), 16 bytes per thread (tid: the thread's index in its block). Traits: a FwdTraits with the block's
// thread count, for its copy.
template <typename Traits, typename SmemTile, typename GmemTile>
__device__ __forceinline__ void store_smem_tile(SmemTile const& s, GmemTile&& g, int rows_left, int head_dim,
                                                unsigned tid) {
  typename Traits::GmemTiledCopyO gmem_copy;
  auto thr = gmem_copy.get_thread_slice(tid);
  Tensor coord = make_identity_tensor(make_shape(size<0>(s), size<1>(s)));  // (row, col) of each element
  copy_tile_bounded<false>(gmem_copy, thr.partition_S(s), thr.partition_D(g), thr.partition_S(coord), rows_left,
                           head_dim);
}

// Writes an fp32 accumulator tile of (kRows, kHeadDim), partitioned by tiled_mma, to the global tile g in
// the element type (rows < rows_left, columns < head_dim): through shared memory (kRows x kHeadDim
// elements at smem, free when called), so that each thread stores 16 bytes at a time. Traits: a FwdTraits
// with as many threads as tiled_mma, for its swizzled smem atom and copies. Ends with smem still in use.
template <typename Traits, int kRows, typename Acc, typename TiledMma, typename Element, typename GmemTile>
__device__ __forceinline__ void store_acc_tile(Acc const& acc, TiledMma const& tiled_mma, Element* smem, GmemTile&& g,
                                               int rows_left, int head_dim, unsigned tid) {
  using SmemLayout =
      decltype(tile_to_shape(typename Traits::SmemLayoutAtom{}, Shape<Int<kRows>, Int<Traits::kHeadDim>>{}));
  Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
  auto smem_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr = smem_copy.get_thread_slice(tid);
  Tensor r = convert_fragment<Element>(acc);
  copy(smem_copy, smem_thr.retile_S(r), smem_thr.partition_D(s));
  __syncthreads();
  store_smem_tile<Traits>(s, g, rows_left, head_dim, tid);
}

// Writes zeros to a (kRows, kHeadDim) global tile through the free shared tile s (the output of a query
// block that sees no key).
template <typename Traits, typename SmemTile, typename GmemTile>
__device__ __forceinline__ void store_zero_tile(SmemTile& s, GmemTile&& g, int rows_left, int head_dim, unsigned tid) {
  typename Traits::GmemTiledCopyO gmem_copy;
  clear(gmem_copy.get_thread_slice(tid).partition_S(s));  // the same elements store_smem_tile reads
  store_smem_tile<Traits>(s, g, rows_left, head_dim, tid);
}

// A query block that sees no key (causal with seqlen_q > seqlen_k, or seqlen_k = 0): O = 0 and lse = +inf.
template <typename Traits, typename SmemO, typename GmemO>
__device__ void store_empty_block(SmemO& sO, GmemO& gO, float* lse, FwdParams const& p, int rows_left, unsigned tid) {
  store_zero_tile<Traits>(sO, gO, rows_left, p.head_dim, tid);
  for (int row = int(tid); row < min(rows_left, Traits::kBlockM); row += Traits::kNThreads) lse[row] = INFINITY;
}

// Query block m_block of one (sequence, head).
template <typename Traits, Variant V>
__device__ __forceinline__ void fwd_block(FwdParams const& p, Sequence const& seq, int head, int m_block) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  // The thread's index, read where it is used (utils.cuh's kFresh where the kernel walks several tiles).
  auto thread = [] { return V != Variant::kFixed ? unsigned(thread_index<Traits::kNThreads, true>()) : threadIdx.x; };
  const int tid = thread();
  const int rows_left = seq.seqlen_q - m_block * kBlockM;

  Tensor gQ = head_rows<kBlockM, kHeadDim, Element const>(p.q, seq.batch, head, seq.q_row0).block(m_block);
  Tensor gO = head_rows<kBlockM, kHeadDim, Element>(p.o, seq.batch, head, seq.q_row0).block(m_block);
  const auto gK = head_rows<kBlockN, kHeadDim, Element const>(p.k, seq.k_batch, head_k, seq.k_row0);
  const auto gV = head_rows<kBlockN, kHeadDim, Element const>(p.v, seq.k_batch, head_k, seq.k_row0);
  // gQ, gO: (kBlockM, kHeadDim); block(i) of gK, gV: (kBlockN, kHeadDim)
  float* lse = p.lse + seq.stats(p, head) + m_block * kBlockM;

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});    // (kBlockM, kHeadDim)
  Tensor sO = make_tensor(make_smem_ptr(smem.o.data()), typename Traits::SmemLayoutO{});    // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});   // (kBlockN, kHeadDim)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});   // (kBlockN, kHeadDim)
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});  // (kHeadDim, kBlockN)

  // The key blocks to visit, downwards: first those from keys.unmasked_end on, which hold keys past seqlen_k or
  // past some row's last key, with a mask; then those without; then, where a window bounds the rows on the
  // left (has_options), those below keys.unmasked_begin with a mask again.
  const BlockRange keys = mask_policy<V>(p, seq).template key_blocks<kBlockM, kBlockN>(m_block);
  if (keys.empty()) {
    store_empty_block<Traits>(sO, gO, lse, p, rows_left, thread());
    return;
  }

  // ---- Load Q and the last K block (cp.async, zero-filled past seqlen and head_dim).
  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);  // (CPY, CPY_M, CPY_K)
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // Every key block but the last is full, so it loads without bounds checks when the head dim fills
  // the tile (5 % faster on H200).
  auto load_kv = [&](auto const& rows, auto& tDst, int n_block) {
    Tensor tSrc = gmem_thr.partition_S(rows.block(n_block));  // (CPY, CPY_N, CPY_K)
    if (n_block < keys.end - 1 && p.head_dim == kHeadDim) {
      copy(gmem_copy, tSrc, tDst);
    } else {
      copy_tile_bounded<true>(gmem_copy, tSrc, tDst, tKVcKV, seq.seqlen_k - n_block * kBlockN, p.head_dim);
    }
    cp_async_commit();
  };

  int n_block = keys.end - 1;
  copy_tile_bounded<true>(gmem_copy, tQgQ, tQsQ, tQcQ, rows_left, p.head_dim);
  load_kv(gK, tKsK, n_block);

  // ---- MMA operands and the shared-memory -> register copies that feed them.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);  // (MMA, MMA_K over head dim, MMA_N over keys)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_N)
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);

  // (row, col) of each score this thread holds, in the (rows, cols) view of the accumulator.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  OnlineSoftmax<kRows> softmax;

  // always_inline: a step the compiler does not inline (it is instantiated up to three times) keeps the fragments
  // it captures in local memory.
  auto step = [&](int n_block, auto masked, auto no_alibi) __attribute__((always_inline)) {
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[n_block] is in sK, and no warp still reads sV
    load_kv(gV, tVsV, n_block);

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_thr_q, smem_copy_k, smem_thr_k);
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
    // Without a mask or ALiBi, the softcap is the softmax's (OnlineSoftmax::update).
    constexpr bool kSoftcapInSoftmax = V == Variant::kSoftcap && !decltype(masked)::value && decltype(no_alibi)::value;
    if constexpr (has_options(V) && !kSoftcapInSoftmax) {
      apply_score_mods<V>(s, tScS_rc, m_block * kBlockM, n_block * kBlockN, step_score_mods(p, seq, head, no_alibi),
                          nullptr);
    }
    if constexpr (decltype(masked)::value) {
      apply_mask(s, tScS_rc, m_block * kBlockM, n_block * kBlockN, mask_policy<V>(p, seq));
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n_block] is in sV, and no warp still reads sK
    if (n_block > keys.begin) load_kv(gK, tKsK, n_block - 1);

    if constexpr (kSoftcapInSoftmax) {
      softmax.update(s, acc_o_rc, p.softmax_scale_log2, Softcap{p.softcap});
    } else {
      softmax.update(s, acc_o_rc, p.softmax_scale_log2);
    }
    Tensor rP = convert_fragment<Element>(acc_s);
    if constexpr (V == Variant::kDropout) {  // after the row sums, which are of every probability
      apply_dropout_packed(rP, Dropout::make(p, seq.batch, head), tScS_rc, m_block * kBlockM, n_block * kBlockN);
    }
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));  // (MMA, MMA_M, MMA_K over keys)
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
  };
  if constexpr (has_options(V)) {
    // A window's masked blocks are at both ends of the range: one loop, which picks the step's copy per block.
    for (; n_block >= keys.begin; --n_block) step_with_options<V>(p, keys, n_block, step);
  } else {  // keys.begin == keys.unmasked_begin
    for (; n_block >= keys.unmasked_end; --n_block) step(n_block, cute::true_type{}, cute::true_type{});
    for (; n_block >= keys.begin; --n_block) step(n_block, cute::false_type{}, cute::true_type{});
  }

  // ---- Epilogue: O /= l, lse = m * scale + log(l); O goes through shared memory for 16-byte stores.
  float row_lse[kRows];
  softmax.finalize(acc_o_rc, p.softmax_scale, row_lse);
  if constexpr (V == Variant::kDropout) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= p.dropout_scale;
  }
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  if (get<1>(tOcO_rc(0, 0)) == 0) {  // the first thread of each quad writes the quad's rows
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      int row = get<0>(tOcO_rc(mi, 0));
      if (row < rows_left) lse[row] = row_lse[mi];
    }
  }
  __syncthreads();  // sO aliases sQ
  store_acc_tile<Traits, kBlockM>(acc_o, tiled_mma, smem.o.data(), gO, rows_left, p.head_dim, thread());
}

// One thread block per query block of each (sequence, head) (sequence.cuh): the heaviest causal blocks (most
// keys) are scheduled first, so that the grid's tail is light.
template <typename Traits, Variant V>
__global__ void __launch_bounds__(Traits::kNThreads) fwd_kernel(const FwdParams p) {
  for_each_tile<V>(
      p, gridDim.x - 1 - blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { fwd_block<Traits, V>(p, seq, blockIdx.y, m_block); });
}

}  // namespace cuteflash::sm80

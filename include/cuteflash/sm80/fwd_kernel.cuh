// sm80 forward kernel: FlashAttention-2 with ldmatrix + mma.sync.m16n8k16 + cp.async.
//
// One thread block owns kBlockM query rows of one (sequence, head). It walks the visible key blocks from
// the last to the first (so the masked blocks come first and the rest run without a mask), keeping
// the running softmax statistics and O in registers:
//   S = Q K^T  ->  mask  ->  P = exp(scale (S - m)), rescale O and l  ->  O += P V
// K of the next block loads while the softmax and P V of this one run; V loads while S is computed. With
// dropout (has_dropout), P's dropped entries are zeroed after the row sums and O is scaled by 1 / (1 - p) at the end.
#pragma once

#include "cuteflash/common/dropout.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/common/softmax.cuh"
#include "cuteflash/common/split_merge.cuh"
#include "cuteflash/sm80/traits.h"
#include "cuteflash/common/utils.cuh"

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
  // One copy per k-slice of each operand: the copy atoms' K is the MMA's (traits' SmemCopyAtomA, SmemCopyAtomB).
  CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(tCrA_view) && size<2>(tCsA) == size<2>(tCrA_view));
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view) && size<2>(tCsB) == size<2>(tCrB_view));
  CUTE_STATIC_ASSERT_V(size<2>(tCrA) == size<2>(tCrA_view) && size<2>(tCrB) == size<2>(tCrB_view));
  CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(acc) && size<1>(tCrB) == size<2>(acc));  // M and N
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
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view) && size<2>(tCsB) == size<2>(tCrB_view));
  CUTE_STATIC_ASSERT_V(size<2>(tCrA) == size<2>(tCrB) && size<2>(tCrB) == size<2>(tCrB_view));  // K
  CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(acc) && size<1>(tCrB) == size<2>(acc));         // M and N
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

// A paged cache's key tiles, in the kernels that read one (kPaged): each thread copies kRowsPerThread
// consecutive rows of a tile, which span at most two consecutive entries of the block table (a page holds 16
// rows or more). With GmemTiledCopyQKV's rows, kNThreads / kGmemThreadsPerRow apart, a thread would look up and
// keep a page for each of its rows, which spills in the loop at head dim 128.
template <typename Traits>
struct PagedTiles {
  static constexpr int kThreadsPerRow = Traits::kGmemThreadsPerRow;
  static constexpr int kRowsPerThread = Traits::kBlockN * kThreadsPerRow / Traits::kNThreads;
  static_assert(kRowsPerThread >= 1 && kRowsPerThread <= 16, "a thread's rows must lie on at most two pages");

  // The calling thread's pages in one tile: where its first row is, and where the rows run on past that page's
  // end (-1 where not read). Looked up a step before the copies that use them, so that these wait for no load.
  struct Pages {
    int a = -1;
    int b = -1;
  };

  // The first key of the thread's rows in the tile of keys from key0 on.
  __device__ static int first_key(int key0, int tid) { return key0 + tid / kThreadsPerRow * kRowsPerThread; }

  __device__ static Pages lookup(FwdParams const& p, Sequence const& seq, int key0, int tid) {
    const int key = first_key(key0, tid);
    const int rows = min(kRowsPerThread, seq.seqlen_k - key);  // the rows to read (none if <= 0)
    const PagePlace at = page_place(p, seq, key, log2_page_size(p));
    Pages pages;
    if (rows > 0) pages.a = load_offset(at.entry);
    if (at.in_page + rows > p.page_size) pages.b = load_offset(at.entry + 1);
    return pages;
  }

  // 16 bytes from global memory src to shared memory dst, with cp.async where the traits have it (kCpAsync), else
  // through a register; with ok, zeros where !ok.
  template <typename Element>
  __device__ static void copy_chunk(Element const* src, Element* dst) {
    if constexpr (Traits::kCpAsync) {
      SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(*reinterpret_cast<uint128_t const*>(src),
                                                 *reinterpret_cast<uint128_t*>(dst));
    } else {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
    }
  }
  template <typename Element>
  __device__ static void copy_chunk(Element const* src, Element* dst, bool ok) {
    if constexpr (Traits::kCpAsync) {
      SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<uint128_t const*>(src),
                                                       *reinterpret_cast<uint128_t*>(dst), ok);
    } else {
      *reinterpret_cast<uint4*>(dst) = ok ? *reinterpret_cast<uint4 const*>(src) : make_uint4(0, 0, 0, 0);
    }
  }

  // Keys [key0, key0 + kBlockN) of head head_k of operand t (k or v) into the shared tile s (kBlockN,
  // kHeadDim) with cp.async (kCpAsync); zeros past seq.seqlen_k and head_dim and on pages outside the cache.
  template <typename Element, typename SmemTile>
  __device__ static void copy(FwdParams const& p, Sequence const& seq, Operand const& t, int head_k, int key0,
                              Pages const& pages, SmemTile& s, int tid) {
    constexpr int kElems = Traits::kGmemElemsPerCopy;
    const int key = first_key(key0, tid);
    const int row0 = key - key0;
    const int in_page = page_place(p, seq, key, log2_page_size(p)).in_page;  // the first row's place
    // The thread writes the same 16-byte chunk of each of its rows in shared memory, at offset u of the
    // unswizzled layout, and so copies into it the column that the swizzle puts there: u's column plus
    // swizzle(u) - u. Writing a fixed column instead, the destinations of consecutive rows would differ by a
    // swizzle (an XOR), computed anew for each row and, at head dim 128, spilled. The swizzle is linear over XOR,
    // and the thread's first row is a multiple of kRowsPerThread (a divisor of the atom's 8 rows), so row m's
    // offset u0 + m r is u0 ^ (m r) and its column is the first row's XOR a constant: one instruction per row.
    auto const swizzle = s.layout().layout_a();
    auto const plain = s.layout().layout_b();  // rows are plain(1, 0) apart, column blocks kCols
    constexpr int kCols = kThreadsPerRow * kElems;
    constexpr int kRowStep = decltype(plain(Int<1>{}, Int<0>{}))::value;
    static_assert(8 % kRowsPerThread == 0);
    const int u0 = plain(row0, tid % kThreadsPerRow * kElems);
    const int col_first = tid % kThreadsPerRow * kElems + int(swizzle(u0)) - u0;
    auto col_of = [&](auto m) {  // row m's column (the same in each column block)
      constexpr int kOffset = decltype(m)::value * kRowStep;
      constexpr int kFlip = int(std::decay_t<decltype(swizzle)>::apply(kOffset)) - kOffset;
      return col_first ^ kFlip;
    };
    Element* smem = raw_pointer_cast(s.data());
    Element const* row_a = t.at<Element const>(pages.a, head_k, in_page);
    // The usual case, with no check per row: every row read (all tiles but the last), on page a (no leftpad across
    // pages), whose entry is valid, and the whole head dim.
    if (key + kRowsPerThread <= seq.seqlen_k && in_page + kRowsPerThread <= p.page_size &&
        unsigned(pages.a) < unsigned(p.num_pages) && p.head_dim == Traits::kHeadDim) {
      cute::for_each(cute::make_seq<kRowsPerThread>{}, [&](auto m) {
        Element const* src = row_a + (m * int(t.row_stride) + col_of(m));  // below 2^24 (api.cpp)
        CUTE_UNROLL
        for (int k = 0; k < Traits::kHeadDim / kCols; ++k) {
          copy_chunk(src + k * kCols, smem + u0 + m * kRowStep + plain(0, k * kCols));
        }
      });
      return;
    }
    // Row m is at row_a + m r on page a, at row_b + m r past its end (r: the row stride).
    Element const* row_b = t.at<Element const>(pages.b, head_k, in_page - p.page_size);
    cute::for_each(cute::make_seq<kRowsPerThread>{}, [&](auto m) {
      const bool on_a = in_page + m < p.page_size;
      const int page = on_a ? pages.a : pages.b;
      const bool ok = key + m < seq.seqlen_k && unsigned(page) < unsigned(p.num_pages);
      const int col0 = col_of(m);
      // A row not read points into the cache's first row, whose head dim elements exist (its copies read nothing).
      Element const* src = ok ? (on_a ? row_a : row_b) + m * int(t.row_stride) + col0  // below 2^24 (api.cpp)
                              : static_cast<Element const*>(t.ptr);
      CUTE_UNROLL
      for (int k = 0; k < Traits::kHeadDim / kCols; ++k) {
        copy_chunk(src + k * kCols, smem + u0 + m * kRowStep + plain(0, k * kCols),
                   ok && col0 + k * kCols < p.head_dim);
      }
    });
  }
};

// A query block whose keys (this split's) are none: O = 0 and lse = +inf, or, where the keys are split, lse_accum
// -inf, which tells the merge to read no O of this split. tid: the thread's index; thread() reads it anew (fwd_block).
template <typename Traits, Variant V, typename SmemO, typename GmemO, typename Thread>
__device__ __forceinline__ void fwd_no_keys(FwdParams const& p, Sequence const& seq, int head, int m_block, SmemO& sO,
                                            GmemO& gO, float* lse, int rows_left, int tid, Thread const& thread) {
  if (!splits_keys<V>(p)) {
    store_empty_block<Traits>(sO, gO, lse, p, rows_left, thread());
  } else {
    for (int row = tid; row < min(rows_left, Traits::kBlockM); row += Traits::kNThreads) {
      p.lse_accum[split_row(p, key_split(p), seq.batch, head, m_block * Traits::kBlockM + row)] = -INFINITY;
    }
  }
}

// The end of a query block: O /= l and lse = m * scale + log(l), then O through shared memory for 16-byte stores, or,
// where the keys are split, the split's part of O and its lse to o_accum and lse_accum (store_partial).
// acc_o: (MMA, MMA_M, MMA_N) over (kBlockM, kHeadDim); acc_o_rc its (rows, cols) view.
template <typename Traits, Variant V, bool kPaged, typename Softmax, typename AccO, typename AccORowCol,
          typename ThrMma, typename TiledMma, typename GmemO, typename Thread>
__device__ __forceinline__ void fwd_epilogue(FwdParams const& p, Sequence const& seq, int head, int m_block,
                                             Softmax& softmax, AccO& acc_o, AccORowCol& acc_o_rc, ThrMma const& thr_mma,
                                             TiledMma const& tiled_mma, typename Traits::SharedStorage& smem, GmemO& gO,
                                             float* lse, int rows_left, Thread const& thread) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  float row_lse[kRows];
  softmax.finalize(acc_o_rc, p.softmax_scale, row_lse);
  if constexpr (has_dropout(V)) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= p.dropout_scale;
  }
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  if (splits_keys<V>(p)) {
    static_assert(sizeof(typename Traits::SharedStorage) >= kBlockM * kHeadDim * sizeof(float));
    __syncthreads();  // the whole of the shared memory is free
    // Staged but in the paged kernels: at head dim 128 (ptxas, sm_90), the other way round grows the spill loads
    // by a third in the general kernel, which stores straight then, and by three quarters in the paged one.
    store_partial<!kPaged, kBlockM, kHeadDim, Traits::kNThreads>(p, seq, head, m_block * kBlockM, acc_o_rc, tOcO_rc,
                                                                 row_lse, rows_left, reinterpret_cast<float*>(&smem),
                                                                 thread());
    return;
  }
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

// The copies of fwd_block's K and V blocks into shared memory, with the thread's slice `thr` of gmem_copy. Every key
// block but the last is full, so it loads without bounds checks when the head dim fills the tile (5 % faster on
// H200). kPaged: k and v are a paged cache, read through the block table: the caller's `pages` are this thread's
// pages of the block, looked up a block ahead while the products run. The copies take the thread's index read anew
// (thread()), so that the offsets they derive from it are recomputed at each copy rather than held through the loop,
// which spills them. Without cp.async (kCpAsync false) and unpaged (kThroughRegisters), the blocks come a step ahead
// through registers: stage() stores the block fetched before to shared memory and fetches the next one in its place,
// so that the loads' latency hides behind the products (a block is 8 to 16 registers a thread in the sm75 family's
// tiles up to head dim 128, 20 to 32 above).
template <typename Traits, bool kPaged, typename ThrCopy, typename Coord, typename Thread, typename Regs>
struct KVLoads {
  using Paged = PagedTiles<Traits>;
  static constexpr bool kThroughRegisters = !Traits::kCpAsync && !kPaged;
  FwdParams const& p;
  Sequence const& seq;
  BlockRange const& keys;
  int head_k;
  typename Traits::GmemTiledCopyQKV const& gmem_copy;
  ThrCopy const& thr;
  Coord const& tKVcKV;  // (CPY, CPY_N, CPY_K): the coordinates of the thread's chunks of a block
  Thread const& thread;
  Regs staged;  // kThroughRegisters: the block on its way to shared memory, (CPY, CPY_N, CPY_K)

  // Block n_block of rows (of operand t) to tDst (sDst when kPaged), or to the registers `staged`.
  template <typename Rows, typename SmemTile, typename Dst>
  __device__ __forceinline__ void load(Rows const& rows, Operand const& t, SmemTile& sDst, Dst& tDst, int n_block,
                                       typename Paged::Pages const& block_pages) {
    using Element = typename Traits::Element;
    Tensor tSrc = thr.partition_S(rows.block(n_block));  // (CPY, CPY_N, CPY_K)
    if constexpr (kPaged) {
      Paged::template copy<Element>(p, seq, t, head_k, n_block * Traits::kBlockN, block_pages, sDst, thread());
    } else if (n_block < keys.end - 1 && p.head_dim == Traits::kHeadDim) {
      copy(gmem_copy, tSrc, tDst);
    } else {
      copy_tile_bounded<true>(gmem_copy, tSrc, tDst, tKVcKV, seq.seqlen_k - n_block * Traits::kBlockN, p.head_dim);
    }
    cp_async_commit();
  }

  // kThroughRegisters: the fetched block to tDst, then block `next` of rows into the registers (none below keys.begin).
  template <typename Dst, typename Rows>
  __device__ __forceinline__ void stage(Dst& tDst, Rows const& rows, Operand const& t, int next) {
    static_assert(kThroughRegisters);
    copy(gmem_copy, staged, tDst);
    if (next >= keys.begin) load(rows, t, tDst, staged, next, typename Paged::Pages{});
  }
};

// Query block m_block of one (sequence, head); where the keys are split (splits_keys), split key_split(p) of them.
template <typename Traits, Variant V, bool kPaged>
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
  // left (has_options), those below keys.unmasked_begin with a mask again. Split keys: this split's part of them.
  BlockRange keys = mask_policy<V>(p, seq).template key_blocks<kBlockM, kBlockN>(m_block);
  if (splits_keys<V>(p)) keys = keys.split(key_split(p), p.num_splits);
  if (keys.empty()) return fwd_no_keys<Traits, V>(p, seq, head, m_block, sO, gO, lse, rows_left, tid, thread);

  // ---- Load Q and the last K block (cp.async, zero-filled past seqlen and head_dim).
  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);  // (CPY, CPY_M, CPY_K)
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using Paged = PagedTiles<Traits>;
  typename Paged::Pages pages, next_pages;
  KVLoads<Traits, kPaged, decltype(gmem_thr), decltype(tKVcKV), decltype(thread), decltype(make_fragment_like(tKsK))>
      kv{p, seq, keys, head_k, gmem_copy, gmem_thr, tKVcKV, thread};
  constexpr bool kThroughRegisters = decltype(kv)::kThroughRegisters;

  int n_block = keys.end - 1;
  copy_tile_bounded<true>(gmem_copy, tQgQ, tQsQ, tQcQ, rows_left, p.head_dim);
  if constexpr (kPaged) pages = Paged::lookup(p, seq, n_block * kBlockN, tid);
  if constexpr (kThroughRegisters) {
    kv.load(gK, p.k, sK, kv.staged, n_block, pages);
    kv.stage(tKsK, gV, p.v, n_block);  // K to sK; V of the same block fetched
  } else {
    kv.load(gK, p.k, sK, tKsK, n_block, pages);
  }

  // ---- MMA operands and the shared-memory -> register copies that feed them.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);  // (MMA, MMA_K over head dim, MMA_N over keys)
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, MMA_M, MMA_N)
  clear(acc_o);

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtomA{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtomB{}, tiled_mma);
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
    if constexpr (kThroughRegisters) {
      kv.stage(tVsV, gK, p.k, n_block - 1);  // V[n_block] to sV; K[n_block - 1] fetched
    } else {
      kv.load(gV, p.v, sV, tVsV, n_block, pages);
    }
    if constexpr (kPaged) {
      if (n_block > keys.begin) next_pages = Paged::lookup(p, seq, (n_block - 1) * kBlockN, tid);
    }

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_thr_q, smem_copy_k, smem_thr_k);
    Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
    // Without a mask or ALiBi, the softcap is the softmax's (OnlineSoftmax::update); dropout comes after it.
    constexpr bool kSoftcapInSoftmax = has_softcap(V) && !decltype(masked)::value && decltype(no_alibi)::value;
    if constexpr (has_options(V) && !kSoftcapInSoftmax) {
      apply_score_mods<V>(s, tScS_rc, m_block * kBlockM, n_block * kBlockN, step_score_mods(p, seq, head, no_alibi),
                          nullptr);
    }
    if constexpr (decltype(masked)::value) {
      apply_mask(s, tScS_rc, m_block * kBlockM, n_block * kBlockN, mask_policy<V>(p, seq));
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n_block] is in sV, and no warp still reads sK
    if (n_block > keys.begin) {
      if constexpr (kThroughRegisters) {
        kv.stage(tKsK, gV, p.v, n_block - 1);  // K[n_block - 1] to sK; V[n_block - 1] fetched
      } else {
        kv.load(gK, p.k, sK, tKsK, n_block - 1, next_pages);
      }
    }
    if constexpr (kPaged) pages = next_pages;

    if constexpr (kSoftcapInSoftmax) {
      softmax.update(s, acc_o_rc, p.softmax_scale_log2, Softcap{p.softcap});
    } else {
      softmax.update(s, acc_o_rc, p.softmax_scale_log2);
    }
    Tensor rP = convert_fragment<Element>(acc_s);
    if constexpr (has_dropout(V)) {  // after the row sums, which are of every probability
      apply_dropout_packed(rP, Dropout::make(p, seq.batch, head), tScS_rc, m_block * kBlockM, n_block * kBlockN);
    }
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand<Traits::kMmaK>(rP.layout()));  // (MMA, MMA_M, MMA_K)
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
  };
  if constexpr (has_options(V)) {
    // A window's masked blocks are at both ends of the range: one loop, which picks the step's copy per block.
    for (; n_block >= keys.begin; --n_block) step_with_options<V>(p, keys, n_block, step);
  } else {  // keys.begin == keys.unmasked_begin
    for (; n_block >= keys.unmasked_end; --n_block) step(n_block, cute::true_type{}, cute::true_type{});
    for (; n_block >= keys.begin; --n_block) step(n_block, cute::false_type{}, cute::true_type{});
  }

  fwd_epilogue<Traits, V, kPaged>(p, seq, head, m_block, softmax, acc_o, acc_o_rc, thr_mma, tiled_mma, smem, gO, lse,
                                  rows_left, thread);
}

// One thread block per query block of each (sequence, head) and split of the keys (sequence.cuh's
// for_each_fwd_tile, the heaviest causal blocks first).
template <typename Traits, Variant V, bool kPaged>
static __global__ void __launch_bounds__(Traits::kNThreads) fwd_kernel(const FwdParams p) {
  for_each_fwd_tile<V>(
      p, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { fwd_block<Traits, V, kPaged>(p, seq, blockIdx.y, m_block); });
}

}  // namespace cuteflash::sm80

// The sm90 family's forward traits: wgmma products, TMA loads and the shared-memory layouts both take.
//
// Hopper's instructions exist only in code compiled for sm_90a: wgmma, setmaxnreg (empty in plain sm_90 code, where
// the kernels would trap or run out of registers).
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "cuteflash/common/params.h"
#include "cuteflash/common/sequence.cuh"
#include "cuteflash/common/utils.cuh"
#include "cuteflash/sm90/tiles.h"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the sm90 family's kernels are compiled for sm_90a only"
#endif

namespace cuteflash::sm90 {

// The widest swizzle of a 16-bit operand tile whose contiguous mode (K for kMajor K, else M or N) has kContig
// elements: 128-byte rows where it is a multiple of 64, else 64 or 32 bytes.
template <GMMA::Major kMajor, typename Element, int kContig>
constexpr auto smem_atom() {
  static_assert(sizeof(Element) == 2 && kContig % 16 == 0);
  if constexpr (kMajor == GMMA::Major::K) {
    if constexpr (kContig % 64 == 0) {
      return GMMA::Layout_K_SW128_Atom<Element>{};
    } else if constexpr (kContig % 32 == 0) {
      return GMMA::Layout_K_SW64_Atom<Element>{};
    } else {
      return GMMA::Layout_K_SW32_Atom<Element>{};
    }
  } else {
    if constexpr (kContig % 64 == 0) {
      return GMMA::Layout_MN_SW128_Atom<Element>{};
    } else if constexpr (kContig % 32 == 0) {
      return GMMA::Layout_MN_SW64_Atom<Element>{};
    } else {
      return GMMA::Layout_MN_SW32_Atom<Element>{};
    }
  }
}

// The global tensors the TMA descriptors span, (rows, head dim, heads, batch): a fixed-length batch's operands as they
// are; a variable-length batch's as one batch of all its rows (total_q, total_k), each sequence's tiles offset by its
// first row (Sequence::q_row0, k_row0); a KV cache's keys and values as the cache (kv_rows rows of kv_batch batches),
// each sequence's from its first key (k_row0, leftpad) of its cache batch (k_batch), or, paged, as the pages (page_size
// rows of num_pages pages: load_paged_keys). TMA brings the rows of a tile past its sequence's end from the next
// sequence, or the cache's rows past the sequence's keys (or, past the operand's end, zeros); the producer zeroes those
// that a product would read (load_zeroing_tail).
struct GmemExtent {
  bool varlen;  // q (and k and v, but for a cache) of a variable-length batch
  bool cache;   // k and v of a KV cache (params.h)
  int rows_q, rows_k, batch_q, batch_k;

  // varlen: p.cu_seqlens_q != nullptr (reads_varlen, in a kernel), cache: p.seqused_k != nullptr, paged:
  // p.block_table != nullptr too (KvCache).
  CUTE_HOST_DEVICE static GmemExtent of(FwdParams const& p, bool varlen, bool cache, bool paged) {
    return {varlen,
            cache,
            varlen ? p.total_q : p.seqlen_q,
            paged    ? p.page_size
            : cache  ? p.kv_rows
            : varlen ? p.total_k
                     : p.seqlen_k,
            varlen ? 1 : p.batch,
            paged    ? p.num_pages
            : cache  ? p.kv_batch
            : varlen ? 1
                     : p.batch};
  }
  // The batch index of the descriptors' tensors that holds batch b's rows of q (and of k and v, but for a cache); of k
  // and v, those of sequence seq.
  CUTE_HOST_DEVICE int batch_index(int b) const { return varlen ? 0 : b; }
  CUTE_HOST_DEVICE int k_batch_index(Sequence const& seq) const { return varlen && !cache ? 0 : seq.k_batch; }
  // Whether the rows of a key block past its sequence's keys may hold values other than zeros (load_zeroing_tail).
  CUTE_HOST_DEVICE bool rows_past_keys() const { return varlen || cache; }
};

// Whether a kernel of variant V reads a variable-length batch: kVarlen always, kFixed never, a kernel with options
// (either kind of batch) where the params have cu_seqlens.
template <Variant V>
CUTE_HOST_DEVICE bool reads_varlen(FwdParams const& p) {
  return V == Variant::kVarlen || (has_options(V) && p.cu_seqlens_q != nullptr);
}

// The KV cache a forward kernel reads (params.h): none, or, in kernels of their own, a contiguous or a paged one
// (fwd_launch.cuh's for_kv_cache: the variants that serve caches, sequence.cuh). Those kernels also split the keys
// (splits_cache_keys), so that the kernels without a cache carry none of that code. Paged: kPagedBlocks where a page
// holds a key block or more, whose blocks that lie on one page come in one load, else kPaged (load_paged_keys).
enum class KvCache { kNone, kContiguous, kPaged, kPagedBlocks };

constexpr bool is_paged(KvCache c) { return c == KvCache::kPaged || c == KvCache::kPagedBlocks; }

// Whether a kernel that reads cache C splits the keys of p (params.h's num_splits).
template <KvCache C>
CUTE_HOST_DEVICE bool splits_cache_keys(FwdParams const& p) {
  return C != KvCache::kNone && p.num_splits > 1;
}

// Whether a block of a kernel of variant V may take several tiles (or key blocks), walking them within its sequence
// (TileScheduler): every variant but kFixed, whose grid has a block per tile.
constexpr bool walks_tiles(Variant v) { return v != Variant::kFixed; }

// One forward kernel's shapes: kBlockM query rows (64 per consumer warpgroup), kBlockN keys per step, kStages
// buffers of K and of V.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;  // warpgroup 0 loads
  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups <= 3);
  // setmaxnreg's registers a thread (multiples of 8): the producer gives up what the consumers take, within 64 K a
  // block (2 consumer warpgroups: 128 x 24 + 256 x 240).
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 240 : 160;

  // S = Q K^T: (kBlockM, kBlockN) over kHeadDim, both operands from shared memory. O += P V: (kBlockM, kHeadDim) over
  // kBlockN, P from registers, V from shared memory as an MN-major B operand (head dim contiguous, as V lies in
  // memory: wgmma transposes 16-bit B operands itself). Warpgroup w computes rows [64 w, 64 w + 64) of both.
  using WarpgroupLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
      WarpgroupLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpgroupLayout{}));

  using SmemLayoutQ = decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kHeadDim>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (kBlockM, kHeadDim), also O
  using SmemLayoutK = decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kHeadDim>(),
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T: (kHeadDim, kBlockN, kStages), the head dim contiguous.
  using SmemLayoutVt = decltype(tile_to_shape(smem_atom<GMMA::Major::MN, Element, kHeadDim>(),
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // The TMA copies, over global tensors (rows, head dim, heads, batch) of q and k with the head dim contiguous, and
  // V^T (head dim, rows, heads, batch) over v's memory.
  using GmemShape = Shape<int, int, int, int>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemStrideVt = Stride<_1, int64_t, int64_t, int64_t>;
  template <typename Stride_>
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, Stride_{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<GmemStride>{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<GmemStride>{}, take<0, 2>(SmemLayoutK{}),
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaVt = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<GmemStrideVt>{}, take<0, 2>(SmemLayoutVt{}),
                                       Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));
  // A paged cache's keys and values: loads of kPageRows rows (a page holds a multiple of 16), over the tensors (page
  // rows, head dim, heads, pages) of K and (head dim, page rows, heads, pages) of V^T, into a kPageRows-row slice of
  // a buffer (whose swizzle repeats within it).
  static constexpr int kPageRows = 16;
  static_assert(kBlockN % kPageRows == 0 && kBlockN / kPageRows <= 32);  // a lane of the producer's warp per slice
  using SmemLayoutKPage =
      decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kHeadDim>(), Shape<Int<kPageRows>, Int<kHeadDim>>{}));
  using SmemLayoutVtPage = decltype(tile_to_shape(smem_atom<GMMA::Major::MN, Element, kHeadDim>(),
                                                  Shape<Int<kHeadDim>, Int<kPageRows>>{}, Step<_2, _1>{}));
  using TmaKPaged = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<GmemStride>{}, SmemLayoutKPage{},
                                           Shape<Int<kPageRows>, Int<kHeadDim>>{}, _1{}));
  using TmaVtPaged = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<GmemStrideVt>{}, SmemLayoutVtPage{},
                                            Shape<Int<kHeadDim>, Int<kPageRows>>{}, _1{}));
  // The bytes each load brings (a TMA load counts the zeros it fills past the tensor's end too).
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kPageRowsBytes = kPageRows * kHeadDim * sizeof(Element);

  // O from shared memory to global memory, 16 bytes a thread, by one warpgroup: rows of 64 or 32 columns.
  static constexpr int kGmemThreadsPerRow = (kHeadDim % 64 == 0 ? 64 : 32) / 8;
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{},
      Layout<Shape<Int<128 / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));

  struct SharedStorage {
    // 1 KB aligned: the 128-byte swizzle repeats every 1024 bytes, and TMA and wgmma address it from there.
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>> v;
    // mbarriers: Q loaded, and released by every consumer warpgroup (a persistent block loads the next tile's Q
    // then); stage s of K (of V) loaded, and released.
    uint64_t q_full;
    uint64_t q_empty;
    uint64_t k_full[kStages];
    uint64_t k_empty[kStages];
    uint64_t v_full[kStages];
    uint64_t v_empty[kStages];
    uint64_t landed;  // the producer's own, for loads whose rows past the sequence it zeroes (load_zeroing_tail)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// One backward kernel's shapes: kBlockN keys per thread block, kBlockM query rows per step, kStages buffers of Q and
// of dO. Two consumer warpgroups share a block's keys one of two ways:
// - kBlockN = 128 (head dims up to 128): warpgroup w owns keys [64 w, 64 w + 64), their dK and dV in its registers;
// - kBlockN = 64 (above: kSplitsHeadDim): both warpgroups own the 64 keys, warpgroup w columns [w d/2, w d/2 + d/2)
//   of their dK and dV (d = kHeadDim), so that a thread holds half as many.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kNThreads = 128 + kConsumerThreads;  // warpgroup 0 loads
  static constexpr bool kSplitsHeadDim = Sm90BwdTile{kBlockM, kBlockN, kStages}.splits_head_dim();
  // dQ's columns (64 rows) or rows (128) are split between the two consumer warpgroups (below).
  static_assert((kBlockN == 128 || (kBlockN == 64 && kBlockM == 64)) && (kBlockM == 64 || kBlockM == 128) &&
                kHeadDim % 16 == 0);
  // A step waits for the next block's Q and dO (its S^T) before it releases its own buffers.
  static_assert(kStages >= 2);
  static constexpr bool kDqSplitsRows = kBlockM == 128;
  static constexpr int kDqRows = kDqSplitsRows ? kBlockM / 2 : kBlockM;  // dQ's rows and columns a warpgroup computes
  static constexpr int kDqCols = kDqSplitsRows ? kHeadDim : kHeadDim / 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // Per step, both operands from shared memory:
  //   S^T = K Q^T and dP^T = V dO^T, (kBlockN, kBlockM) over the head dim, warpgroup w computing its 64 keys' rows
  //   (kBlockN = 128) or the query rows' half w (kBlockN = 64);
  // then dV += P^T dO and dK += dS^T Q, (kBlockN, kHeadDim) over the step's query rows, Q and dO as MN-major B
  // operands, with P^T and dS^T from registers (kBlockN = 128: the accumulators' layout is the A operand's) or from
  // shared memory (kBlockN = 64: each warpgroup needs the other's half, and computes the head dim's half w);
  // and, dS^T through shared memory, dQ = dS K, (kBlockM, kHeadDim) over the block's keys, warpgroup w computing
  // the head dim's half w (64 rows) or the rows' half w (128 rows).
  using WarpgroupRows = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  using WarpgroupCols = Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<64>, Int<kSplitsHeadDim ? kBlockM / 2 : kBlockM>, Int<kHeadDim>>>(),
      std::conditional_t<kSplitsHeadDim, WarpgroupCols, WarpgroupRows>{}));
  using TiledMmadKV = std::conditional_t<
      kSplitsHeadDim,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, float, Shape<Int<64>, Int<kHeadDim / 2>, Int<kBlockM>>, GMMA::Major::K,
                               GMMA::Major::MN>(),
          WarpgroupCols{})),
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<Int<64>, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              WarpgroupRows{}))>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kDqRows>, Int<kDqCols>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      std::conditional_t<kDqSplitsRows, WarpgroupRows, WarpgroupCols>{}));

  // A tile and its transpose are two views of one buffer: K-major atoms stacked along the rows first and MN-major
  // atoms stacked along the columns first place every element alike. The swizzle of K (and of Q and dO where the
  // head dim is split) follows the columns a warpgroup takes of it, so that each warpgroup's half starts at an atom.
  static constexpr int kQAtomCols = kSplitsHeadDim ? kHeadDim / 2 : kHeadDim;
  using SmemLayoutQ = decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kQAtomCols>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // also dO
  using SmemLayoutQt = decltype(tile_to_shape(smem_atom<GMMA::Major::MN, Element, kQAtomCols>(),
                                              Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kDqCols>(), Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(tile_to_shape(smem_atom<GMMA::Major::MN, Element, kDqCols>(),
                                              Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kHeadDim>(), Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // dS^T (and P^T where the head dim is split), (kBlockN, kBlockM), two buffers (a step writes one while the other may
  // still be read by the step before's products in the other warpgroup); as dS, (kBlockM, kBlockN), the MN-major A
  // operand of dQ.
  using SmemLayoutdSt =
      decltype(tile_to_shape(smem_atom<GMMA::Major::K, Element, kBlockM>(), Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));
  using SmemLayoutdS = decltype(tile_to_shape(smem_atom<GMMA::Major::MN, Element, kBlockM>(),
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}, Step<_2, _1, _3>{}));

  using GmemShape = Shape<int, int, int, int>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor =
      decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));  // also dO
  using TmaK =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV =
      decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdSt>> ds;
    // The step's dQ, for the bulk reductions (kBlockN = 128; at 64 each thread adds its own to dq_accum).
    alignas(128) cute::array_aligned<float, kSplitsHeadDim ? 4 : kBlockM * kHeadDim> dq;
    float lse_log2[kStages][kBlockM];  // the rows' lse * log2(e) and D, a stage per query block in flight
    float d[kStages][kBlockM];
    // mbarriers: K and V loaded; stage s of Q and dO loaded (one barrier for both), and released by every consumer
    // warpgroup; K and V released by every consumer warpgroup (a block that may take several key blocks).
    uint64_t kv_full;
    uint64_t q_full[kStages];
    uint64_t q_empty[kStages];
    uint64_t kv_empty;
    uint64_t landed;  // the producer's own, for loads whose rows past the sequence it zeroes (load_zeroing_tail)
    // P^T (kBlockN = 64), laid out as dS^T.
    alignas(kSplitsHeadDim ? 1024 : 16) cute::array_aligned<Element, kSplitsHeadDim ? cosize_v<SmemLayoutdSt> : 8> p;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// The traits of head dim kHeadDim's kernel, causal or not (tiles.h).
template <typename Element, int kHeadDim, bool kCausal>
struct FwdTraitsSelect {
  static constexpr Sm90FwdTile kTile = sm90_fwd_tile(kHeadDim, kCausal);
  using type = FwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.stages>;
};

// The traits of head dim kHeadDim's kernels with options, and of those that read a paged cache (tiles.h).
template <typename Element, int kHeadDim, bool kPaged = false>
struct FwdOptionsTraitsSelect {
  static constexpr Sm90FwdTile kTile = kPaged ? sm90_fwd_paged_tile(kHeadDim) : sm90_fwd_options_tile(kHeadDim);
  using type = FwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.stages>;
};

// The backward traits of head dim kHeadDim (tiles.h).
template <typename Element, int kHeadDim>
struct BwdTraitsSelect {
  static constexpr Sm90BwdTile kTile = sm90_bwd_tile(kHeadDim);
  using type = BwdTraits<Element, kHeadDim, kTile.block_m, kTile.block_n, kTile.stages>;
};

}  // namespace cuteflash::sm90

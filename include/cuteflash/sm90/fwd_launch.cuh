// Host side of the sm90 forward: the TMA descriptors of the call's operands, then the launch. Included by the
// generated src/kernels/fwd_sm90_<dtype>_hd<D>.cu files only.
//
// A descriptor holds its tensor's address, so it is built at every call (prepared launches re-address their params,
// and a CUDA graph captures the kernel's argument by value): nothing keeps one from a call to the next.
#pragma once

#include "cuteflash/host/launch.h"
#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/sm90/fwd_kernel.cuh"
#include "cuteflash/sm90/operands.h"

namespace cuteflash::sm90 {

// kPersistent: a block per multiprocessor, each through its share of the tiles (TileScheduler); else a block per query
// block of each (sequence, head). V: the kernel's variant (fwd_kernel; kFixed only is persistent). C: the KV cache it
// reads; a paged one's descriptors span the pages and bring kPageRows rows at a time (load_paged_keys), and, with
// pages of a block or more, a block.
template <typename Traits, bool kPersistent, bool kSkipAboveDiagonal, Variant V, KvCache C = KvCache::kNone>
void launch_fwd(FwdParams const& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  constexpr bool kPaged = is_paged(C);
  constexpr int kRowsKV = kPaged ? Traits::kPageRows : Traits::kBlockN;  // the rows of k and v a load brings
  using SmemLayoutK = std::conditional_t<kPaged, typename Traits::SmemLayoutKPage,
                                         decltype(take<0, 2>(typename Traits::SmemLayoutK{}))>;
  using SmemLayoutVt = std::conditional_t<kPaged, typename Traits::SmemLayoutVtPage,
                                          decltype(take<0, 2>(typename Traits::SmemLayoutVt{}))>;
  require_smem(Traits::kSmemBytes, "sm90 forward", kHeadDim);
  const int d = p.head_dim;
  const GmemExtent e = GmemExtent::of(p, p.cu_seqlens_q != nullptr, C != KvCache::kNone, kPaged);
  // The TMA loads of k and of V^T into `layout`, rows a load (an Int).
  auto tma_k = [&](auto layout, auto rows) {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<false, Element>(p.k, e.rows_k, d, p.nheads_k, e.batch_k, "k"),
                         layout, Shape<decltype(rows), Int<kHeadDim>>{}, _1{});
  };
  auto tma_vt = [&](auto layout, auto rows) {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<true, Element>(p.v, e.rows_k, d, p.nheads_k, e.batch_k, "v"),
                         layout, Shape<Int<kHeadDim>, decltype(rows)>{}, _1{});
  };
  FwdArgs<Traits, C> args{
      make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<false, Element>(p.q, e.rows_q, d, p.nheads, e.batch_q, "q"),
                    typename Traits::SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}),
      tma_k(SmemLayoutK{}, Int<kRowsKV>{}), tma_vt(SmemLayoutVt{}, Int<kRowsKV>{}), p};
  if constexpr (C == KvCache::kPagedBlocks) {  // a block on one page in one load (load_paged_keys)
    args.tma_k_block = tma_k(take<0, 2>(typename Traits::SmemLayoutK{}), Int<Traits::kBlockN>{});
    args.tma_v_block = tma_vt(take<0, 2>(typename Traits::SmemLayoutVt{}), Int<Traits::kBlockN>{});
  }
  dim3 grid = fwd_grid(p, kBlockM);
  if constexpr (kPersistent) {
    const int64_t tiles = int64_t(grid.x) * grid.y * grid.z;
    grid = dim3(unsigned(std::max<int64_t>(1, std::min<int64_t>(tiles, device_limits().sms))));
  }
  launch(&fwd_kernel<Traits, kPersistent, kSkipAboveDiagonal, V, C>, grid, Traits::kNThreads, Traits::kSmemBytes,
         stream, args, "sm90 forward");
  if (p.num_splits > 1) merge_splits<Element, kHeadDim>(p, stream);
}

// Calls launch_for(std::integral_constant<KvCache, C>{}) with the KV cache C that a kernel of variant V reads for p:
// kernels of their own for a contiguous and a paged cache (the variants that serve caches: sequence.cuh), the latter
// two: pages of kBlockN rows (the kernel's keys a block) or more, and smaller ones.
template <Variant V, int kBlockN, typename LaunchFor>
void for_kv_cache(FwdParams const& p, LaunchFor const& launch_for) {
  if constexpr (serves_caches(V)) {
    if (p.block_table != nullptr) {
      if (p.page_size >= kBlockN) {
        launch_for(std::integral_constant<KvCache, KvCache::kPagedBlocks>{});
      } else {
        launch_for(std::integral_constant<KvCache, KvCache::kPaged>{});
      }
      return;
    }
    if (p.seqused_k != nullptr) {
      launch_for(std::integral_constant<KvCache, KvCache::kContiguous>{});
      return;
    }
  }
  launch_for(std::integral_constant<KvCache, KvCache::kNone>{});
}

template <typename Element, int kHeadDim>
void run_fwd(FwdParams const& p, cudaStream_t stream) {
  // Persistent blocks only for full attention up to head dim 64, the short tiles whose start and end are a large part
  // of their time (fixed-length batches: a variable-length one's tiles are listed by sequence, TileScheduler). Causal
  // tiles differ in their work: the grid's order (heaviest first) and the hardware's placement of blocks as others
  // finish balance them better than a static share would. At larger head dims the persistent blocks' register-to-global
  // stores of O cost what the overlap gains (measured on an H200, head dim 128).
  // Causal tiles of three warpgroups (192 rows) let a warpgroup skip the key blocks above its own rows' diagonal; two
  // warpgroups (128 rows) would skip little (none but past the sequence's end at head dim 128, at most a block a tile
  // at 256), and the registers it takes spill at head dim 256.
  // Windows and ALiBi (either kind of batch): one kernel, on the causal tile (at head dim 128 its 128 keys a step
  // rather than 176: fewer keys masked for nothing at a window's edges; up to head dim 64 of two consumer warpgroups:
  // tiles.h), whose blocks visit the keys the window spans and mask those at its edges.
  // The softcap's tanh, and dropout, in kernels of their own (host/launch.h's for_variant), so that the others carry no
  // trace of them; so do KV caches, contiguous and paged, with the key splits (for_kv_cache).
  for_variant(p, [&](auto variant) {
    constexpr Variant V = variant();
    if constexpr (has_options(V)) {
      using PagedTraits = typename FwdOptionsTraitsSelect<Element, kHeadDim, true>::type;
      for_kv_cache<V, PagedTraits::kBlockN>(p, [&](auto cache) {
        using Traits = typename FwdOptionsTraitsSelect<Element, kHeadDim, is_paged(cache())>::type;
        launch_fwd<Traits, false, false, V, cache()>(p, stream);
      });
    } else if (p.causal) {
      using Traits = typename FwdTraitsSelect<Element, kHeadDim, true>::type;
      launch_fwd<Traits, false, (Traits::kConsumerWarpgroups == 3), V>(p, stream);
    } else {
      launch_fwd<typename FwdTraitsSelect<Element, kHeadDim, false>::type, (kHeadDim <= 64 && V == Variant::kFixed),
                 false, V>(p, stream);
    }
  });
}

}  // namespace cuteflash::sm90

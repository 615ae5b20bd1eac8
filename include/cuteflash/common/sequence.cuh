// One sequence of a batch as a thread block sees it: its lengths and where its rows start in the operands
// and in the row statistics. In a fixed-length batch every sequence has the params' lengths and the batch
// strides place it; in a variable-length one (params.h) cu_seqlens_q and cu_seqlens_k do.
//
// The kernels are compiled per Variant (below). The grids have a block per tile of the params' lengths; in a
// variable-length batch those are the caller's bounds, and block x takes tiles x, x + gridDim.x, ... of its
// sequence (for_each_tile), so that a sequence longer than the bound is still computed whole.
#pragma once

#include "cuteflash/common/params.h"
#include "cuteflash/common/tile_scheduler.cuh"

namespace cuteflash {

// What a kernel is compiled for; the launchers pick one per call (launch.h's for_variant):
//   kFixed    a fixed-length batch with at most a causal mask: the common case's code and nothing more;
//   kVarlen   a variable-length batch (cu_seqlens), the same masks;
//   kGeneral  either kind of batch (told apart at run time) with the params' other options: sliding windows
//             and ALiBi, each applied only where the params set it;
//   kSoftcap  kGeneral with softcapping as well. Apart because nvcc predicates an option's work per score
//             rather than branching around it, so that a kernel with the softcap's tanh pays for it always;
//   kDropout  kGeneral with dropout (dropout.cuh); without the softcap, for the reason above;
//   kSoftcapDropout  kGeneral with the softcap and dropout (no paged caches: those calls set no dropout).
enum class Variant { kFixed, kVarlen, kGeneral, kSoftcap, kDropout, kSoftcapDropout };

// Whether kernels of variant v apply the params' options (windows, ALiBi; the softcap and dropout as below).
constexpr bool has_options(Variant v) { return v != Variant::kFixed && v != Variant::kVarlen; }

// Whether kernels of variant v apply the params' softcap, and dropout. The kernels ask these rather than name a
// variant, so that kSoftcapDropout runs each option's code where that option's own variant does.
constexpr bool has_softcap(Variant v) { return v == Variant::kSoftcap || v == Variant::kSoftcapDropout; }
constexpr bool has_dropout(Variant v) { return v == Variant::kDropout || v == Variant::kSoftcapDropout; }

// Whether forward kernels of variant v serve KV-cache calls (flash_attn_with_kvcache): read paged caches and
// split the keys (params.h). Those calls set no dropout.
constexpr bool serves_caches(Variant v) { return v == Variant::kGeneral || v == Variant::kSoftcap; }

struct Sequence {
  int batch;
  int seqlen_q;
  int seqlen_k;
  int q_row0;   // its first row in q, o, dout and dq (0 in a fixed-length batch)
  int k_row0;   // in k, v, dk and dv
  int k_batch;  // the batch of k and v it reads (a KV cache's kv_batch_idx; else batch)

  // lse and D of row r of this sequence and head `head` are at stats(p, head) + r.
  __device__ __forceinline__ int64_t stats(FwdParams const& p, int head) const {
    return batch * p.stats_batch_stride + head * p.stats_head_stride + q_row0;
  }
};

// An int of a variable-length batch's offsets, loaded anew at each call: a kernel that walks several tiles
// rereads its sequence per tile rather than keeping it in registers through the tile's loops.
__device__ __forceinline__ int load_offset(int const* ptr) {
  int x;
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(x) : "l"(ptr));
  return x;
}

// load_offset(ptr) where pred holds, else `otherwise` (a predicated load): a walk that reads a table ahead issues
// these back to back and uses them later.
__device__ __forceinline__ int load_offset_if(int const* ptr, bool pred, int otherwise) {
  int x = otherwise;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.s32 %0, [%1];\n}"
               : "+r"(x)
               : "l"(ptr), "r"(int(pred)));
  return x;
}

// Rows [row0, row0 + length) of a variable-length batch's sequence `batch`, from its offsets cu, clamped to the
// operand's `total` rows (and each end to its start), so that malformed offsets cannot make a kernel reach
// outside them.
__device__ __forceinline__ void varlen_rows(int const* cu, int batch, int total, int& row0, int& length) {
  const int begin = min(max(load_offset(cu + batch), 0), total);
  const int end = min(max(load_offset(cu + batch + 1), begin), total);
  row0 = begin;
  length = end - begin;
}

// The keys of sequence `batch` in a KV cache (params.h), clamped to the cache.
__device__ __forceinline__ void cache_rows(FwdParams const& p, int batch, Sequence& seq) {
  const int begin = p.leftpad_k != nullptr ? min(max(load_offset(p.leftpad_k + batch), 0), p.kv_rows) : 0;
  const int end = min(max(load_offset(p.seqused_k + batch) + p.seqlen_new, begin), p.kv_rows);
  seq.k_row0 = begin;
  seq.seqlen_k = end - begin;
  if (p.kv_batch_idx != nullptr) seq.k_batch = min(max(load_offset(p.kv_batch_idx + batch), 0), p.kv_batch - 1);
}

// log2(p.page_size) where that is a power of two, else -1 (key_row then divides).
__device__ __forceinline__ int log2_page_size(FwdParams const& p) {
  return (p.page_size & (p.page_size - 1)) == 0 ? __ffs(p.page_size) - 1 : -1;
}

// Where key `key` of sequence seq lies in a paged cache: its block-table entry (not read here) and its row on that
// page. page_shift: log2_page_size(p).
struct PagePlace {
  int const* entry;
  int in_page;
};

__device__ __forceinline__ PagePlace page_place(FwdParams const& p, Sequence const& seq, int key, int page_shift) {
  const int row = seq.k_row0 + key;
  const int index = page_shift >= 0 ? row >> page_shift : row / p.page_size;
  return {p.block_table + seq.batch * p.block_table_stride + index,
          page_shift >= 0 ? row & (p.page_size - 1) : row - index * p.page_size};
}

// Where key `key` of sequence seq lies in k and v: the batch (or page) and row, and whether the key is below key_hi
// (a key at or past it is not read, nor is a page outside the cache: key_readable). page_shift: log2_page_size(p).
// The block table is read only for keys below key_hi, within the table's row, and its entry is not used here:
// a walk that looks its rows up ahead does not wait for the table until it reads the keys.
struct KeyRow {
  int batch;
  int row;
  bool in_range;
};

__device__ __forceinline__ KeyRow key_row(FwdParams const& p, Sequence const& seq, int key, int key_hi,
                                          int page_shift) {
  const bool in_range = key < key_hi;
  if (p.block_table == nullptr) return {seq.k_batch, seq.k_row0 + key, in_range};
  const PagePlace at = page_place(p, seq, key, page_shift);
  return {load_offset_if(at.entry, in_range, -1), at.in_page, in_range};
}

// Whether the key of r is read: below key_hi, and in a paged cache on a page of the cache.
__device__ __forceinline__ bool key_readable(FwdParams const& p, KeyRow const& r) {
  return p.block_table == nullptr ? r.in_range : unsigned(r.batch) < unsigned(p.num_pages);
}

// The page of key `key` of sequence seq in a paged cache, from the block table (page_shift: log2_page_size);
// -1, without reading the table, for a key at or past seq.seqlen_k.
__device__ __forceinline__ int key_page(FwdParams const& p, Sequence const& seq, int key, int page_shift) {
  return key_row(p, seq, key, seq.seqlen_k, page_shift).batch;
}

// Key `key` of head `head` of operand t (k or v) of a paged cache, on page `page` (key_page); null where that is
// outside the cache (also for -1).
template <typename Element>
__device__ __forceinline__ Element const* paged_key(FwdParams const& p, Sequence const& seq, Operand const& t, int head,
                                                    int key, int page, int page_shift) {
  const int in_page = page_place(p, seq, key, page_shift).in_page;
  return unsigned(page) < unsigned(p.num_pages) ? t.at<Element const>(page, head, in_page) : nullptr;
}

// The sequence of batch index `batch` for a kernel of variant V.
template <Variant V>
__device__ __forceinline__ Sequence sequence(FwdParams const& p, int batch) {
  Sequence seq{batch, p.seqlen_q, p.seqlen_k, 0, 0, batch};
  if constexpr (V == Variant::kVarlen) {
    varlen_rows(p.cu_seqlens_q, batch, p.total_q, seq.q_row0, seq.seqlen_q);
    varlen_rows(p.cu_seqlens_k, batch, p.total_k, seq.k_row0, seq.seqlen_k);
  } else if constexpr (has_options(V)) {  // either kind of batch, and KV caches
    if (p.cu_seqlens_q != nullptr) varlen_rows(p.cu_seqlens_q, batch, p.total_q, seq.q_row0, seq.seqlen_q);
    if (p.seqused_k != nullptr) {
      cache_rows(p, batch, seq);
    } else if (p.cu_seqlens_k != nullptr) {
      varlen_rows(p.cu_seqlens_k, batch, p.total_k, seq.k_row0, seq.seqlen_k);
    }
  }
  return seq;
}

// Calls body(seq, tile) for the tiles of its sequence seq (of batch index blockIdx.z) that the calling thread
// block takes: `first` (< gridDim.x), then, but in a kFixed kernel, first + gridDim.x, ... below
// tiles(seq), with a barrier between two. Nothing but the tile index stays live from one tile to the next.
template <Variant V, typename Tiles, typename Body>
__device__ __forceinline__ void for_each_tile(FwdParams const& p, int first, Tiles const& tiles, Body const& body) {
  if constexpr (V == Variant::kFixed) {
    body(sequence<V>(p, blockIdx.z), first);  // the grid has a block per tile
  } else {
    for (int tile = first;; tile += gridDim.x) {
      const Sequence seq = sequence<V>(p, blockIdx.z);
      if (tile >= tiles(seq)) break;
      if (tile >= int(gridDim.x)) __syncthreads();  // the previous tile's shared memory is free
      body(seq, tile);
    }
  }
}

// Whether a forward kernel of variant V splits the keys of p (params.h): its grid then has p.num_splits blocks per
// query tile (a fixed-length batch), and block x computes split x % num_splits (key_split) of tile x / num_splits.
template <Variant V>
__device__ __forceinline__ bool splits_keys(FwdParams const& p) {
  return serves_caches(V) && p.num_splits > 1;
}

// The split of the keys that the calling block computes, where splits_keys: recomputed where used, rather than held
// in a register through the key loop.
__device__ __forceinline__ int key_split(FwdParams const& p) { return int(blockIdx.x) % p.num_splits; }

// for_each_tile for a forward kernel (splits_keys: blocks num_splits apart take one tile), taking the tiles from the
// last, the heaviest causal ones, so that the grid's tail is light.
template <Variant V, typename Tiles, typename Body>
__device__ __forceinline__ void for_each_fwd_tile(FwdParams const& p, Tiles const& tiles, Body const& body) {
  const int per_tile = splits_keys<V>(p) ? p.num_splits : 1;  // > 1: a fixed-length batch, body called once
  for_each_tile<V>(p, heaviest_first_block() / per_tile, tiles, body);
}

}  // namespace cuteflash

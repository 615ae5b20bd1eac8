// Appending flash_attn_with_kvcache's new keys and values to a KV cache (params.h's AppendParams), before the
// attention kernel reads the cache on the same stream. Rows are moved as bytes, kVectorBytes at a time, so one
// kernel serves every dtype; a row whose place in the cache does not exist (past its rows, a page or cache batch
// out of range) is left out rather than written out of bounds.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuteflash/common/params.h"

namespace cuteflash {

static __global__ void __launch_bounds__(256) append_kv_kernel(const AppendParams a) {
  const int chunks = a.row_chunks();
  const int64_t total = a.chunks();
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % chunks), head = int(idx / chunks % a.nheads_k);
    const int t = int(idx / chunks / a.nheads_k % a.seqlen_new), b = int(idx / chunks / a.nheads_k / a.seqlen_new);
    const int pos = a.cache_seqlens[b] + t;
    if (pos < 0 || pos >= a.kv_rows) continue;
    int cache_batch = b, row = pos;
    if (a.block_table != nullptr) {
      cache_batch = a.block_table[b * a.block_table_stride + pos / a.page_size];
      row = pos % a.page_size;
      if (cache_batch < 0 || cache_batch >= a.num_pages) continue;
    } else if (a.kv_batch_idx != nullptr) {
      cache_batch = a.kv_batch_idx[b];
      if (cache_batch < 0 || cache_batch >= a.kv_batch) continue;
    }
    static_assert(sizeof(uint4) == kVectorBytes);
    const int at = c * kVectorBytes;
    *reinterpret_cast<uint4*>(a.k_cache.bytes_at(a.element_bytes, cache_batch, head, row) + at) =
        *reinterpret_cast<uint4 const*>(a.k_new.bytes_at(a.element_bytes, b, head, t) + at);
    *reinterpret_cast<uint4*>(a.v_cache.bytes_at(a.element_bytes, cache_batch, head, row) + at) =
        *reinterpret_cast<uint4 const*>(a.v_new.bytes_at(a.element_bytes, b, head, t) + at);
  }
}

}  // namespace cuteflash

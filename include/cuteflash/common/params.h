// Plain structs shared by the host and the kernels. Filled in src/api.cpp from values that Python
// passes (pointers, sizes, strides); no torch types anywhere below this line.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CUTEFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CUTEFLASH_HOST_DEVICE inline
#endif

namespace cuteflash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// The bytes of an element of each dtype, and the bytes the kernels move at a time (cp.async, ldmatrix's rows, the
// epilogues' stores, the cache append): operands' addresses are aligned to kVectorBytes, and their strides and head
// dims are multiples of vector_elements(dtype).
constexpr int kVectorBytes = 16;
constexpr int element_bytes(DType) { return 2; }  // fp16 and bf16
constexpr int vector_elements(DType dtype) { return kVectorBytes / element_bytes(dtype); }

// A (batch, seqlen, heads, head_dim) tensor in flash-attn's layout: its first element and the strides, in
// elements, of its first three dimensions (the last dimension is contiguous).
struct Operand {
  void* ptr;
  int64_t batch_stride;
  int64_t row_stride;
  int64_t head_stride;

  // Row `row` of (batch, head), as Element (const for the inputs).
  template <typename Element>
  CUTEFLASH_HOST_DEVICE Element* at(int batch, int head, int64_t row = 0) const {
    return static_cast<Element*>(ptr) + batch * batch_stride + head * head_stride + row * row_stride;
  }

  // The same row's first byte, for elements of element_bytes bytes.
  CUTEFLASH_HOST_DEVICE char* bytes_at(int element_bytes, int batch, int head, int64_t row = 0) const {
    return static_cast<char*>(ptr) + (batch * batch_stride + head * head_stride + row * row_stride) * element_bytes;
  }
};

// One attention problem in flash-attn's layout: q (batch, seqlen_q, nheads, head_dim),
// k and v (batch, seqlen_k, nheads_k, head_dim), o like q, lse (batch, nheads, seqlen_q) in fp32.
// A variable-length batch (cu_seqlens_q set) packs its sequences' rows one after another instead:
// q and o (total_q, nheads, head_dim), k and v (total_k, nheads_k, head_dim), with batch strides of 0,
// and lse (nheads, total_q). Kernels see one sequence at a time (sequence.cuh).
struct FwdParams {
  Operand q, k, v;  // read only
  Operand o;
  float* lse;
  // lse (and the backward's D) of row r of (batch, head) sits at
  // batch * stats_batch_stride + head * stats_head_stride + the sequence's first row in q + r.
  int64_t stats_batch_stride;
  int64_t stats_head_stride;

  int batch;
  int nheads;
  int nheads_k;  // nheads is a multiple of it (MQA/GQA)
  // Each sequence's lengths; in a variable-length batch the caller's bound on them (max_seqlen_q/k),
  // which sizes the grids only: a longer sequence is still computed whole.
  int seqlen_q;
  int seqlen_k;
  int head_dim;  // the real head dim, <= the kernel's kHeadDim and a multiple of vector_elements

  // Variable-length batches: the (batch + 1) int32 prefix sums of the sequences' lengths, on the GPU;
  // sequence b has rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q. Null in a fixed-length batch.
  int const* cu_seqlens_q;
  int const* cu_seqlens_k;
  int total_q;  // rows of q and k (variable-length batches): the kernels clamp the offsets to them
  int total_k;

  float softmax_scale;       // applied to QK^T, 1/sqrt(head_dim) by default (softcap: see there)
  float softmax_scale_log2;  // softmax_scale * log2(e): the kernels use exp2
  bool causal;               // bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q (mask.h)

  // Options that only the general kernels (sequence.cuh's Variant) apply; launch.h picks those when one is set.
  int window_left;   // flash-attn's window_size (mask.h): keys before / after the diagonal a row sees,
  int window_right;  // -1 for an unbounded side
  // Softcapping (softcap > 0): the scores S become tanh(S * softcap) and softmax_scale is flash-attn's softcap,
  // so that the softmax sees its softcap * tanh(S * scale / softcap); the gradient of S then carries
  // softmax_scale * softcap (the caller's scale) and 1 - tanh^2.
  float softcap;
  // ALiBi: fp32 slopes at alibi_slopes[batch * alibi_batch_stride + head] (a stride of 0: per head); the
  // scores of row i, key j get -slope |i + seqlen_k - seqlen_q - j| added after the softmax's scale. Null: none.
  float const* alibi_slopes;
  int alibi_batch_stride;
  // Dropout (dropout.cuh), where rng_state is set: on the device, this forward call's 64-bit Philox counter base
  // (its backward reads the same); a probability is kept where its byte of the draw is below dropout_threshold =
  // (1 - p) 256 rounded, and the kept ones are scaled by dropout_scale = 1 / (1 - p).
  uint64_t const* rng_state;
  uint32_t dropout_threshold;
  float dropout_scale;
  bool fp16_correction;  // sm70: P (and dS) as hi + 2^-11 lo in their products (error-corrected fp16)

  // A KV cache (flash_attn_with_kvcache), read by the general kernels and the decoding kernel (decode/); null
  // pointers: none. Sequence b reads keys [leftpad_k[b], seqused_k[b] + seqlen_new) of batch kv_batch_idx[b] of k
  // and v, clamped to the kv_rows rows of a batch and to the kv_batch batches, so that no value reaches outside
  // the caches; kv_rows is the cache's seqlen (in a paged cache, block_table's columns times page_size).
  int const* seqused_k;
  int seqlen_new;
  int const* leftpad_k;
  int const* kv_batch_idx;
  int kv_batch;
  int kv_rows;
  // A paged cache (the decoding kernel, and the forward kernels launch.h's for_paging picks): k and v are
  // (num_pages, page_size, nheads_k, head_dim), their operands' batch stride that of a page; key row r of sequence
  // b is row r % page_size of page block_table[b * block_table_stride + r / page_size] (pages outside
  // [0, num_pages) read as zeros). No dropout with it.
  int const* block_table;
  int64_t block_table_stride;
  int page_size;
  int num_pages;

  // A split of the keys (flash-decoding; the decoding kernel, and the tiled kernels of KV-cache calls: a
  // fixed-length batch): with num_splits > 1 each split writes its O, divided by its own row sums, to o_accum
  // (num_splits, batch, nheads, seqlen_q, kernel head dim) and its log-sum-exp to lse_accum (num_splits, batch,
  // nheads, seqlen_q), fp32; a second kernel merges them into o and lse (split_merge.cuh). With split_counters
  // (the decoding kernel only: batch x nheads_k ints, zero), the last split of each (sequence, key-value head)
  // merges them instead, and leaves its counter zero again.
  int num_splits;
  float* o_accum;
  float* lse_accum;
  int* split_counters;
};

// Appending new keys and values to a KV cache (flash_attn_with_kvcache's k and v): row t of sequence b goes to
// row cache_seqlens[b] + t of cache batch kv_batch_idx[b] (or of the pages of block_table), where that row exists.
struct AppendParams {
  Operand k_new, v_new;      // (batch, seqlen_new, nheads_k, head_dim), read only
  Operand k_cache, v_cache;  // like FwdParams' k and v with a cache
  int element_bytes;         // of the dtype's elements (element_bytes)
  int batch;
  int seqlen_new;
  int nheads_k;
  int head_dim;  // a multiple of vector_elements
  int const* cache_seqlens;
  int const* kv_batch_idx;
  int kv_batch;
  int kv_rows;
  int const* block_table;
  int64_t block_table_stride;
  int page_size;
  int num_pages;

  // The kernel moves rows kVectorBytes at a time: the chunks of a row, and of every new row of every head.
  CUTEFLASH_HOST_DEVICE int row_chunks() const { return head_dim * element_bytes / kVectorBytes; }
  CUTEFLASH_HOST_DEVICE int64_t chunks() const { return int64_t(batch) * seqlen_new * nheads_k * row_chunks(); }
};

// The backward pass's fp32 workspace dq_accum, which sums dQ = dS K with atomics (none for a deterministic
// pass): per head, a region of dq_accum_rows(seqlen_q) rows of the kernel's head dim for each sequence,
// then one int per (batch, head). Whole 128-row blocks, so that the kernels add whole tiles without
// bounds checks (zeros into the padding). A head's regions follow one another: sequence b starts at row
// b * dq_accum_rows(seqlen_q) of its head, or in a variable-length batch at cu_seqlens_q[b] + 128 b
// (room for each sequence's padding). The preprocess kernel zeroes it all; each family lays out its
// regions as suits its atomics and converts them into dq itself; the ints count a head's finished
// dK/dV thread blocks (dq_blocks_done: the sm70 family converts a head's dQ in its last block).
CUTEFLASH_HOST_DEVICE int dq_accum_rows(int seqlen_q) { return (seqlen_q + 127) / 128 * 128; }

struct DqAccumLayout {
  int64_t head_rows;  // rows from one head's regions to the next
  int batch_rows;     // rows from one sequence's region to the next, besides cu_seqlens_q
  int64_t floats;     // the whole workspace, counts included (0 for a deterministic pass)
};

// total_q: the rows of q of a variable-length batch, < 0 for a fixed-length one.
inline DqAccumLayout dq_accum_layout(int batch, int nheads, int seqlen_q, int64_t total_q, int kernel_head_dim,
                                     bool deterministic) {
  const bool varlen = total_q >= 0;
  DqAccumLayout l{};
  l.batch_rows = varlen ? 128 : dq_accum_rows(seqlen_q);
  l.head_rows = varlen ? total_q + 128 * int64_t(batch) : int64_t(batch) * l.batch_rows;
  l.floats = deterministic ? 0 : nheads * (l.head_rows * kernel_head_dim) + int64_t(batch) * nheads;
  return l;
}

// The backward pass: the forward's problem plus dO, the gradients and two fp32 work buffers.
// dk/dv have a head per query head (nheads); for MQA/GQA Python sums each group.
struct BwdParams : FwdParams {
  Operand dout;    // like q, read only
  Operand dk, dv;  // (batch, seqlen_k, nheads, head_dim)
  Operand dq;      // like q
  float* dq_accum;
  int64_t dq_accum_head_rows;  // DqAccumLayout
  int dq_accum_batch_rows;
  int* dq_blocks_done;  // after the regions: batch * nheads counts
  float* d_rowsum;      // D = rowsum(dO * O) in fp32, laid out as lse, written by the preprocess kernel
  // dQ by a second kernel that walks the keys of each query block (bitwise reproducible), instead of
  // fp32 atomics from the dK/dV kernel (whose order varies between runs).
  bool deterministic;
};

}  // namespace cuteflash

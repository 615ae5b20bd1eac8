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
};

// One attention problem in flash-attn's layout: q (batch, seqlen_q, nheads, head_dim),
// k and v (batch, seqlen_k, nheads_k, head_dim), o like q, lse (batch, nheads, seqlen_q) in fp32.
struct FwdParams {
  Operand q, k, v;  // read only
  Operand o;
  float* lse;

  int batch;
  int nheads;
  int nheads_k;  // nheads is a multiple of it (MQA/GQA)
  int seqlen_q;
  int seqlen_k;
  int head_dim;  // the real head dim, <= the kernel's kHeadDim and a multiple of 8

  float softmax_scale;       // applied to QK^T, 1/sqrt(head_dim) by default
  float softmax_scale_log2;  // softmax_scale * log2(e): the kernels use exp2
  bool causal;               // bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q (mask.h)
  bool fp16_correction;      // sm70: P (and dS) as hi + 2^-11 lo in their products (error-corrected fp16)
};

// The backward pass's fp32 workspace dq_accum, which sums dQ = dS K with atomics (none for a deterministic
// pass): a region of dq_accum_rows(seqlen_q) rows of the kernel's head dim per (batch, head), one after
// another, then one int per (batch, head). Whole 128-row blocks, so that the kernels add whole tiles
// without bounds checks (zeros into the padding). The preprocess kernel zeroes it all; each family lays
// out its regions as suits its atomics and converts them into dq itself; the ints count a head's finished
// dK/dV blocks (dq_blocks_done: the sm70 family converts a head's dQ in its last block).
CUTEFLASH_HOST_DEVICE int dq_accum_rows(int seqlen_q) { return (seqlen_q + 127) / 128 * 128; }

inline int64_t dq_accum_floats(int batch, int nheads, int seqlen_q, int kernel_head_dim, bool deterministic) {
  if (deterministic) return 0;
  return int64_t(batch) * nheads * (int64_t(dq_accum_rows(seqlen_q)) * kernel_head_dim + 1);
}

// The backward pass: the forward's problem plus dO, the gradients and two fp32 work buffers.
// dk/dv have a head per query head (nheads); for MQA/GQA Python sums each group.
struct BwdParams : FwdParams {
  Operand dout;    // like q, read only
  Operand dk, dv;  // (batch, seqlen_k, nheads, head_dim)
  Operand dq;      // like q
  float* dq_accum;
  int dq_accum_rows;
  float* d_rowsum;  // D = rowsum(dO * O), (batch, nheads, seqlen_q) fp32, written by the preprocess kernel
  // dQ by a second kernel that walks the keys of each query block (bitwise reproducible), instead of
  // fp32 atomics from the dK/dV kernel (whose order varies between runs).
  bool deterministic;
};

}  // namespace cuteflash

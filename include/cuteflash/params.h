// Plain structs shared by the host and the kernels. Filled in src/api.cpp from values that Python
// passes (pointers, sizes, strides); no torch types anywhere below this line.
#pragma once

#include <cstdint>

namespace cuteflash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// One attention problem in flash-attn's layout: q (batch, seqlen_q, nheads, head_dim),
// k and v (batch, seqlen_k, nheads_k, head_dim), o like q, lse (batch, nheads, seqlen_q) in fp32.
// Strides are in elements; the last dimension of every tensor is contiguous.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;

  int batch;
  int nheads;
  int nheads_k;  // nheads is a multiple of it (MQA/GQA)
  int seqlen_q;
  int seqlen_k;
  int head_dim;  // the real head dim, <= the kernel's kHeadDim and a multiple of 8

  float softmax_scale;       // applied to QK^T, 1/sqrt(head_dim) by default
  float softmax_scale_log2;  // softmax_scale * log2(e): the kernels use exp2
  bool causal;               // bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
  bool fp16_correction;      // sm70: P (and dS) as hi + 2^-11 lo in their products (error-corrected fp16)
};

// The backward pass: the forward's problem plus dO, the gradients and two fp32 work buffers.
// dk/dv have a head per query head (nheads); for MQA/GQA Python sums each group.
struct BwdParams : FwdParams {
  const void* dout;  // like q
  void* dk;          // (batch, seqlen_k, nheads, head_dim)
  void* dv;
  // fp32 scratch (zeroed by the preprocess kernel) that sums dQ = dS K with atomics (unless deterministic): a region of
  // dq_accum_rows = round_up(seqlen_q, 128) rows of the kernel's head dim per (batch, head), one after
  // another (dq_accum_region). Whole 128-row blocks, so that the kernels add whole tiles without bounds
  // checks (zeros into the padding). Each family lays out its region as suits its atomics and converts
  // it into dq itself. After the regions, one int per (batch, head), zeroed too (dq_blocks_done: the sm70
  // family converts a head's dQ in the dK/dV kernel, by the last of its thread blocks to finish).
  float* dq_accum;
  int dq_accum_rows;
  void* dq;         // like q
  float* d_rowsum;  // D = rowsum(dO * O), (batch, nheads, seqlen_q) fp32, written by the preprocess kernel

  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  // dQ by a second kernel that walks the keys of each query block (bitwise reproducible), instead of
  // fp32 atomics from the dK/dV kernel (whose order varies between runs).
  bool deterministic;
};

}  // namespace cuteflash

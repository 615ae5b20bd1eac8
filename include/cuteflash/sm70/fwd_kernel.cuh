// sm70 forward kernel (Volta, Turing): WMMA fp16 tensor cores with error-corrected P V.
//
// FlashAttention-2's single pass with an online softmax. WMMA keeps its accumulators' element-to-thread
// mapping unspecified, so the kernel learns it at run time: it loads a 16x16 tile whose entries are
// their own row numbers into an accumulator fragment, which tells each thread the row of each of its
// elements (every accumulator fragment of the type shares that mapping). Each warp owns 16 or 32 query
// rows (kRowTiles 16-row tiles: with two, each K and V fragment serves both). Per key block, each warp:
//   S = Q K^T -> shared scratch, where lane r owns row r (32 rows) or lanes r and r + 16 do (16 rows)
//   -> new row max m, alpha = exp(m_old - m), P = exp(scale (S - m)) split into hi and lo (wmma.cuh:
//      stored as hi' = 2^11 hi and lo) in S's place, row sum l
//   -> O *= alpha (per element, by its row; skipped when no row max of the warp moved), then
//      O += hi' V + lo V in one fp32 accumulator
// and O = O / l at the end.
#pragma once

#include "cuteflash/common/dropout.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/common/softmax.cuh"
#include "cuteflash/common/split_merge.cuh"
#include "cuteflash/sm70/traits.h"

namespace cuteflash::sm70 {

using namespace cute;

// kPaged: the pages of the thread's rows of key block n_block, looked up a block ahead, so that the loads wait for no
// read of the block table.
template <typename Traits>
__device__ __forceinline__ void look_up_pages(FwdParams const& p, Sequence const& seq, int n_block,
                                              int (&pages)[Traits::CopyKV::kRowsPerThread], int tid) {
  using CopyKV = typename Traits::CopyKV;
  CUTE_UNROLL
  for (int m = 0; m < CopyKV::kRowsPerThread; ++m) {
    const int key = n_block * Traits::kBlockN + CopyKV::row(tid, m);
    pages[m] = tid < CopyKV::kThreads ? key_page(p, seq, key, log2_page_size(p)) : -1;
  }
}

// Key block n_block of K or V (rows: its head's blocks, t: its operand) into the registers kv_regs (Volta has no
// cp.async), zeros past seqlen_k and head_dim; kPaged: from the paged cache, on the pages look_up_pages found.
template <typename Traits, bool kPaged, typename Rows, typename Regs>
__device__ __forceinline__ void load_kv(FwdParams const& p, Sequence const& seq, Rows const& rows, Operand const& t,
                                        int head_k, int n_block, int const (&pages)[Traits::CopyKV::kRowsPerThread],
                                        Regs& kv_regs, int tid) {
  using Element = typename Traits::Element;
  using CopyKV = typename Traits::CopyKV;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  if constexpr (kPaged) {
    // Whether every row of mine is read (keys past seqlen_k and threads past the copy have page -1), on a page
    // of the cache, over the whole head dim: then the copy checks nothing (all tiles but a sequence's last).
    bool whole = p.head_dim == kHeadDim;
    CUTE_UNROLL
    for (int m = 0; m < CopyKV::kRowsPerThread; ++m) whole = whole && unsigned(pages[m]) < unsigned(p.num_pages);
    if (whole) {
      auto row_at = [&](int m, int r) {
        return t.at<Element const>(pages[m], head_k,
                                   page_place(p, seq, n_block * kBlockN + r, log2_page_size(p)).in_page);
      };
      CopyKV::template load_rows<false>(row_at, kv_regs, p.head_dim, tid);
    } else {
      auto row_at = [&](int m, int r) {
        return paged_key<Element>(p, seq, t, head_k, n_block * kBlockN + r, pages[m], log2_page_size(p));
      };
      CopyKV::template load_rows<true>(row_at, kv_regs, p.head_dim, tid);
    }
  } else {
    CopyKV::load(rows.block(n_block), kv_regs, seq.seqlen_k - n_block * kBlockN, p.head_dim, tid);
  }
}

// Where a lane's scores live in its warp's scratch: with 32 rows a warp, lane r owns all of row r; with 16, lanes 0-15
// the first half of rows 0-15 and lanes 16-31 the second. Rows r with bit 2 of r differing from bit 3 visit their
// quads of columns rotated by one, so that the 16-byte reads of S (8 lanes at a time, rows 8 banks apart) and the
// 8-byte writes of P (16 at a time, rows 20 banks apart) hit distinct banks; without the rotation both would be bank
// conflicts.
template <typename Traits>
struct LanePart {
  static constexpr int kLanesPerRow = 32 / Traits::kWarpRows;
  static constexpr int kCols = Traits::kBlockN / kLanesPerRow;
  static constexpr int kQuads = kCols / 4;  // a lane reads S 4 floats and writes P 4 halves at a time
  int row;                                  // in the warp's rows
  int half;                                 // 0 with 32 rows
  int col0;                                 // my part's first column in the block
  int rotation;                             // quad i of my visit is quad (i + rotation) % kQuads of my part

  __device__ __forceinline__ explicit LanePart(int lane)
      : row(lane % Traits::kWarpRows),
        half(lane / Traits::kWarpRows),
        col0(half * kCols),
        rotation(((row / 4) ^ (row / 8)) % 2) {}
};

// The row (within its 16x16 tile) of each element of an accumulator fragment, learned from a tile of row numbers
// stored in the warp's scratch.
__device__ __forceinline__ void learn_fragment_rows(float* scratch, int ld, int lane,
                                                    int (&row_of)[FragAcc{}.num_elements]) {
  CUTE_UNROLL
  for (int c = 0; c < 8; ++c) scratch[(lane % 16) * ld + (lane / 16) * 8 + c] = float(lane % 16);
  __syncwarp();
  FragAcc rows;
  nvcuda::wmma::load_matrix_sync(rows, scratch, ld, nvcuda::wmma::mem_row_major);
  CUTE_UNROLL
  for (int i = 0; i < FragAcc{}.num_elements; ++i) row_of[i] = int(rows.x[i]);
  __syncwarp();
}

// S = Q K^T of the warp's rows and the key block in sK, into the warp's scratch (fp32, kLdS apart).
template <typename Traits>
__device__ __forceinline__ void scores_to_scratch(typename Traits::SharedStorage const& smem, int warp,
                                                  float* scratch) {
  using namespace nvcuda;
  constexpr int kRowTiles = Traits::kRowTiles, kBlockN = Traits::kBlockN, kLd = Traits::kLdQKV;
  FragAcc acc[kRowTiles][kBlockN / 16];
  CUTE_UNROLL
  for (int t = 0; t < kRowTiles; ++t) {
    CUTE_UNROLL
    for (int j = 0; j < kBlockN / 16; ++j) wmma::fill_fragment(acc[t][j], 0.f);
  }
  auto const* sq = reinterpret_cast<__half const*>(smem.q.data()) + warp * Traits::kWarpRows * kLd;
  CUTE_UNROLL
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    FragA a[kRowTiles];
    CUTE_UNROLL
    for (int t = 0; t < kRowTiles; ++t) wmma::load_matrix_sync(a[t], sq + t * 16 * kLd + kk * 16, kLd);
    CUTE_UNROLL
    for (int j = 0; j < kBlockN / 16; ++j) {
      FragBCol b;  // K^T: element (k, n) is K[n][k]
      wmma::load_matrix_sync(b, reinterpret_cast<__half const*>(smem.k.data()) + j * 16 * kLd + kk * 16, kLd);
      CUTE_UNROLL
      for (int t = 0; t < kRowTiles; ++t) wmma::mma_sync(acc[t][j], a[t], b, acc[t][j]);
    }
  }
  CUTE_UNROLL
  for (int t = 0; t < kRowTiles; ++t) {
    CUTE_UNROLL
    for (int j = 0; j < kBlockN / 16; ++j) {
      wmma::store_matrix_sync(scratch + t * 16 * Traits::kLdS + j * 16, acc[t][j], Traits::kLdS, wmma::mem_row_major);
    }
  }
}

// The online softmax of my part of my row's scores of key block n_block (in the scratch): the score modifiers and the
// mask, the new running max m, P = 2^p_shift exp(scale (S - m)) written in S's place as hi' and lo (wmma.cuh), the
// running sum l, and the row's rescale factor alpha into alpha_row. Whether any row of the warp needs O rescaled.
template <typename Traits, Variant V>
__device__ __forceinline__ bool softmax_to_p(FwdParams const& p, Sequence const& seq, int head, BlockRange const& keys,
                                             int n_block, LanePart<Traits> const& part, int q_row, int key_first,
                                             int key_limit, float const* scratch, __half* p_hi, __half* p_lo,
                                             float p_shift, float& m, float& l, float* alpha_row) {
  constexpr int kCols = LanePart<Traits>::kCols, kQuads = LanePart<Traits>::kQuads;
  float const* my = scratch + part.row * Traits::kLdS + part.col0;
  const int col0 = n_block * Traits::kBlockN + part.col0;
  float s[kCols];  // s[4 i + e]: column 4 ((i + rotation) % kQuads) + e of my part
  CUTE_UNROLL
  for (int i = 0; i < kQuads; ++i) {
    float4 v = *reinterpret_cast<float4 const*>(my + 4 * ((i + part.rotation) % kQuads));
    s[4 * i] = v.x;
    s[4 * i + 1] = v.y;
    s[4 * i + 2] = v.z;
    s[4 * i + 3] = v.w;
  }
  __syncwarp();  // every lane holds its S: P takes its place
  if constexpr (has_options(V)) {
    const ScoreMods mods = ScoreMods::make(p, seq, head);
    if constexpr (has_softcap(V)) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        float unused;
        s[c] = mods.cap(s[c], unused);
      }
    }
    if (mods.alibi != 0.f) {
      const float dist0 = float(q_row + mods.shift - col0);  // minus the column's offset in my part
      CUTE_UNROLL
      for (int i = 0; i < kQuads; ++i) {
        // Quad (i + rotation) % kQuads, at 4 i + 4 rotation but where the last one wraps to 0.
        const float quad = i == kQuads - 1 && part.rotation ? 0.f : 4.f * (i + part.rotation);
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) s[4 * i + e] += mods.bias(dist0 - quad - float(e));
      }
    }
  }
  constexpr bool kWindow = has_options(V);  // else keys.begin == keys.unmasked_begin, key_first == 0
  if (kWindow ? keys.masked(n_block) : n_block >= keys.unmasked_end) {  // keys past the end or a row's keys
    CUTE_UNROLL
    for (int i = 0; i < kQuads; ++i) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int key = col0 + 4 * ((i + part.rotation) % kQuads) + e;
        if (key >= key_limit || (kWindow && key < key_first)) s[4 * i + e] = -INFINITY;
      }
    }
  }
  float block_max = -INFINITY;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) block_max = fmaxf(block_max, s[c]);
  if constexpr (LanePart<Traits>::kLanesPerRow == 2) {
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, 16));
  }
  const float m_new = fmaxf(m, block_max);
  const RowStep step = online_step(m, m_new, p.softmax_scale_log2);
  // Exactly 1 where the max stays (so is O's rescale, and the warp skips it).
  const float alpha = m_new == step.m_old ? 1.f : step.alpha();
  const bool rescale = __any_sync(0xffffffff, m_new != step.m_old);
  // has_dropout: the keep bits of my part of the row (in order, not rotated).
  const auto keep = [&] {
    if constexpr (has_dropout(V)) {
      return RowKeep<kCols, true>(Dropout::make(p, seq.batch, head), q_row, col0);
    } else {
      return nullptr;
    }
  }();
  float sum = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < kQuads; ++i) {
    float prob[4];  // 2^p_shift P
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) {
      prob[e] = exp2_approx(s[4 * i + e] * p.softmax_scale_log2 - (step.offset - p_shift));  // masked: 0
      sum += prob[e];
    }
    if constexpr (has_dropout(V)) {  // after the row sum, which is of every probability
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {  // column e of quad (i + rotation) % kQuads
        const uint32_t bits = part.rotation ? keep.bits(4 * ((i + 1) % kQuads) + e) : keep.bits(4 * i + e);
        prob[e] = keep.kept(bits, p.dropout_threshold) ? prob[e] : 0.f;
      }
    }
    const int at = part.row * Traits::kLdP + part.col0 + 4 * ((i + part.rotation) % kQuads);
    store_split<4>(prob, 1.f, p_hi + at, p_lo + at);
  }
  l = l * alpha + sum;
  if (part.half == 0) *alpha_row = alpha;
  return rescale;
}

// O *= alpha by rows (alpha_rows: the warp's rows'), then O += hi' V + lo V (lo V only with fp16_correction) with the
// warp's P from its scratch and the key block's V from sV.
template <typename Traits, int kFragElems>
__device__ __forceinline__ void rescale_o(FragAcc (&acc_o)[Traits::kRowTiles][Traits::kHeadDim / 16],
                                          float const* alpha_rows, int const (&row_of)[kFragElems]) {
  CUTE_UNROLL
  for (int t = 0; t < Traits::kRowTiles; ++t) {
    float alpha_of[kFragElems];
    CUTE_UNROLL
    for (int i = 0; i < kFragElems; ++i) alpha_of[i] = alpha_rows[t * 16 + row_of[i]];
    CUTE_UNROLL
    for (int j = 0; j < Traits::kHeadDim / 16; ++j) {
      CUTE_UNROLL
      for (int i = 0; i < kFragElems; ++i) acc_o[t][j].x[i] *= alpha_of[i];
    }
  }
}

template <typename Traits>
__device__ __forceinline__ void accumulate_pv(FragAcc (&acc_o)[Traits::kRowTiles][Traits::kHeadDim / 16],
                                              __half const* p_hi, __half const* p_lo, __half const* sv,
                                              bool fp16_correction) {
  using namespace nvcuda;
  constexpr int kRowTiles = Traits::kRowTiles, kLd = Traits::kLdQKV;
  CUTE_UNROLL
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    FragA a_hi[kRowTiles], a_lo[kRowTiles];
    CUTE_UNROLL
    for (int t = 0; t < kRowTiles; ++t) {
      wmma::load_matrix_sync(a_hi[t], p_hi + t * 16 * Traits::kLdP + kk * 16, Traits::kLdP);
      if (fp16_correction) wmma::load_matrix_sync(a_lo[t], p_lo + t * 16 * Traits::kLdP + kk * 16, Traits::kLdP);
    }
    CUTE_UNROLL
    for (int j = 0; j < Traits::kHeadDim / 16; ++j) {
      FragBRow b;  // V: element (k, n) is V[k][n]
      wmma::load_matrix_sync(b, sv + kk * 16 * kLd + j * 16, kLd);
      CUTE_UNROLL
      for (int t = 0; t < kRowTiles; ++t) {
        wmma::mma_sync(acc_o[t][j], a_hi[t], b, acc_o[t][j]);
        if (fp16_correction) wmma::mma_sync(acc_o[t][j], a_lo[t], b, acc_o[t][j]);
      }
    }
  }
}

// The epilogue: O = O / l by rows (both in units of 2^p_shift P), stored through the scratch; lse = m scale +
// log(l 2^-p_shift). Split keys: in fp32 to o_accum and lse_accum (split_merge.cuh). l is my row's whole sum.
template <typename Traits, Variant V, int kFragElems>
__device__ __forceinline__ void store_output(FwdParams const& p, Sequence const& seq, int head, int m_block,
                                             FragAcc (&acc_o)[Traits::kRowTiles][Traits::kHeadDim / 16],
                                             int const (&row_of)[kFragElems], float* alpha_rows, float* scratch,
                                             LanePart<Traits> const& part, int warp, int rows_left, int row_in_block,
                                             int q_row, float m, float l, float p_shift) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const bool empty = l == 0.f;  // no visible key: O = 0, lse = +inf (as the sm80 kernel; -inf for a split)
  if (part.half == 0) alpha_rows[part.row] = empty ? 0.f : (has_dropout(V) ? p.dropout_scale : 1.f) / l;
  __syncwarp();
  auto store_o = [&](auto* out, int64_t row_stride) {  // out: the block's first row
    CUTE_UNROLL
    for (int t = 0; t < Traits::kRowTiles; ++t) {
      float inv_of[kFragElems];
      CUTE_UNROLL
      for (int i = 0; i < kFragElems; ++i) inv_of[i] = alpha_rows[t * 16 + row_of[i]];
      const int row0 = warp * Traits::kWarpRows + t * 16;  // the tile's first row in the block
      CUTE_UNROLL
      for (int j = 0; j < kHeadDim / 16; ++j) {
        CUTE_UNROLL
        for (int i = 0; i < kFragElems; ++i) acc_o[t][j].x[i] *= inv_of[i];
        store_tile(acc_o[t][j], 1.f, scratch, out + row0 * row_stride + j * 16, row_stride, rows_left - row0,
                   p.head_dim - j * 16);
      }
    }
  };
  const float lse = m * p.softmax_scale + logf(l) - p_shift * 0.6931471805599453f;
  if (splits_keys<V>(p)) {
    const int64_t at = split_row(p, key_split(p), seq.batch, head, m_block * kBlockM);  // the block's first row
    store_o(p.o_accum + at * kHeadDim, kHeadDim);
    if (part.half == 0 && q_row < seq.seqlen_q) p.lse_accum[at + row_in_block] = empty ? -INFINITY : lse;
  } else {
    store_o(p.o.at<Element>(seq.batch, head, seq.q_row0 + m_block * kBlockM), p.o.row_stride);
    if (part.half == 0 && q_row < seq.seqlen_q) p.lse[seq.stats(p, head) + q_row] = empty ? INFINITY : lse;
  }
}

// Query block m_block of one (sequence, head); where the keys are split (splits_keys), split key_split(p) of them.
template <typename Traits, Variant V, bool kPaged>
__device__ __forceinline__ void fwd_block(FwdParams const& p, Sequence const& seq, int head, int m_block) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kRowTiles = Traits::kRowTiles;
  constexpr int kWarpRows = Traits::kWarpRows;

  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = thread_index<Traits::kNThreads>();
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int rows_left = seq.seqlen_q - m_block * kBlockM;
  const LanePart<Traits> part(lane);
  const int row_in_block = warp * kWarpRows + part.row;
  const int q_row = m_block * kBlockM + row_in_block;

  const auto gQ = head_rows<kBlockM, kHeadDim, Element const>(p.q, seq.batch, head, seq.q_row0);
  const auto gK = head_rows<kBlockN, kHeadDim, Element const>(p.k, seq.k_batch, head_k, seq.k_row0);
  const auto gV = head_rows<kBlockN, kHeadDim, Element const>(p.v, seq.k_batch, head_k, seq.k_row0);
  // block(i) of gQ: (kBlockM, kHeadDim); of gK, gV: (kBlockN, kHeadDim)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (kBlockM, kHeadDim)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});  // (kBlockN, kHeadDim)
  char* warp_scratch = smem.scratch.data() + warp * Traits::kScratchBytes;
  float* scratch = reinterpret_cast<float*>(warp_scratch);  // S: (kWarpRows, kBlockN) fp32
  __half* p_hi = reinterpret_cast<__half*>(warp_scratch);   // then P: (kWarpRows, kBlockN) hi' and lo
  __half* p_lo = p_hi + Traits::kPLoOffset;

  Traits::CopyQ::copy(gQ.block(m_block), sQ, rows_left, p.head_dim, tid);

  // Key blocks [keys.begin, keys.end), masked from keys.unmasked_end on and, where a window bounds the rows on
  // the left (has_options), below keys.unmasked_begin; split keys: this split's part of them. My row sees keys
  // [key_first, key_limit).
  BlockRange keys = mask_policy<V>(p, seq).template key_blocks<kBlockM, kBlockN>(m_block);
  if (splits_keys<V>(p)) keys = keys.split(key_split(p), p.num_splits);
  const int key_limit = mask_policy<V>(p, seq).key_end(q_row);
  const int key_first = mask_policy<V>(p, seq).key_begin(q_row);  // 0 but with has_options(V)

  constexpr int kFragElems = FragAcc{}.num_elements;
  int row_of[kFragElems];
  learn_fragment_rows(scratch, Traits::kLdS, lane, row_of);

  FragAcc acc_o[kRowTiles][kHeadDim / 16];
  CUTE_UNROLL
  for (int t = 0; t < kRowTiles; ++t) {
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 16; ++j) nvcuda::wmma::fill_fragment(acc_o[t][j], 0.f);
  }
  float* alpha_rows = smem.alpha.data() + warp * kWarpRows;
  float m = -INFINITY;  // running row max, and the lane's part of the running row sum
  // P is computed as 2^11 P when corrected (as P when not), the v of the split (wmma.cuh): hi' V + lo V
  // accumulates in O's one fp32 accumulator, and the factor cancels in O / l.
  const float p_shift = p.fp16_correction ? kLoScaleLog2 : 0.f;
  float l = 0.f;

  // K and V of the next block are loaded into registers while this block is computed (Volta has no
  // cp.async): K(n + 1) during the softmax, V(n + 1) during P V(n). Each is stored to shared memory
  // after the barrier that frees its buffer, so the loop keeps two barriers per block.
  // kPaged: k and v are a paged cache. `pages` holds the pages of the thread's rows of the next block (key_page),
  // looked up a block ahead, so that the loads wait for no read of the block table.
  using CopyKV = typename Traits::CopyKV;
  auto kv_regs = CopyKV::make_regs();
  int pages[CopyKV::kRowsPerThread];
  auto load = [&](auto const& rows, Operand const& t, int n_block) {
    load_kv<Traits, kPaged>(p, seq, rows, t, head_k, n_block, pages, kv_regs, tid);
  };
  if (!keys.empty()) {
    if constexpr (kPaged) look_up_pages<Traits>(p, seq, keys.begin, pages, tid);
    load(gK, p.k, keys.begin);
    CopyKV::store(kv_regs, sK, tid);
    load(gV, p.v, keys.begin);
  }

  for (int n_block = keys.begin; n_block < keys.end; ++n_block) {
    const bool has_next = n_block + 1 < keys.end;
    if constexpr (kPaged) {
      if (has_next) look_up_pages<Traits>(p, seq, n_block + 1, pages, tid);
    }
    __syncthreads();  // K(n) is in sK; no warp still reads sV
    CopyKV::store(kv_regs, sV, tid);
    scores_to_scratch<Traits>(smem, warp, scratch);
    // K(n + 1) into the registers that held V(n): loaded after S's products, which give the stores of
    // V(n) the time to read them (loads issued right after those stores would wait for them).
    if (has_next) load(gK, p.k, n_block + 1);
    __syncwarp();
    const bool rescale = softmax_to_p<Traits, V>(p, seq, head, keys, n_block, part, q_row, key_first, key_limit,
                                                 scratch, p_hi, p_lo, p_shift, m, l, alpha_rows + part.row);
    __syncthreads();  // V(n) is in sV; no warp still reads sK
    if (has_next) CopyKV::store(kv_regs, sK, tid);
    if (rescale) rescale_o<Traits>(acc_o, alpha_rows, row_of);
    // V(n + 1), after O's rescale (the stores of K(n + 1) read the registers meanwhile).
    if (has_next) load(gV, p.v, n_block + 1);
    accumulate_pv<Traits>(acc_o, p_hi, p_lo, reinterpret_cast<__half const*>(smem.v.data()), p.fp16_correction);
    __syncwarp();  // the scratch, P and alpha are rewritten by the next block
  }
  if constexpr (LanePart<Traits>::kLanesPerRow == 2) l += __shfl_xor_sync(0xffffffff, l, 16);
  store_output<Traits, V>(p, seq, head, m_block, acc_o, row_of, alpha_rows, scratch, part, warp, rows_left,
                          row_in_block, q_row, m, l, p_shift);
}

// One thread block per query block of each (sequence, head) and split of the keys (sequence.cuh's
// for_each_fwd_tile, the heaviest causal blocks first).
template <typename Traits, Variant V, bool kPaged>
static __global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks) fwd_kernel(const FwdParams p) {
  for_each_fwd_tile<V>(
      p, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { fwd_block<Traits, V, kPaged>(p, seq, blockIdx.y, m_block); });
}

}  // namespace cuteflash::sm70

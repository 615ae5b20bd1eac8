// sm70 backward kernels (Volta, Turing): WMMA fp16 tensor cores with error-corrected P and dS.
//
// The structure of FlashAttention-2's backward. After D = rowsum(dO * O) (bwd_preprocess.cuh), each
// thread block of bwd_kernel owns kBlockN keys and walks the query blocks that see them:
//   S = Q K^T   -> P = exp(scale S - lse)      (S and dP pass through a shared fp32 scratch: WMMA's
//   dP = dO V^T -> dS = P (dP - D)              accumulator layout is unspecified, rows are not known)
//   dV += P^T dO,  dK += dS^T Q,  dQ += dS K (fp32 atomics, or bwd_dq_kernel when deterministic)
// The last of a head's blocks to finish converts the head's summed dQ into dq.
// P and dS are fp32 and feed fp16 tensor-core products, so each is stored split in hi' and lo (see
// wmma.cuh) and both halves are multiplied, accumulating in fp32. Scaling keeps small values out of
// fp16's subnormal range (below 2^-14, where precision drops, and 2^-24, where values flush to 0):
// P <= 1 is split as v = 2^15 P, and dS as v = s dS with a power of two s that keeps the step's largest
// |v| in [2^(15 - kDsSlack), 2^15) -- small gradients (small dO, long rows) would otherwise underflow.
// s changes only when a step's largest |dS| leaves that range, so that dK and the deterministic dQ
// accumulate in place in units of s, rescaled by the ratio of the powers of two when s moves. dV
// accumulates in units of 2^15 P; both are unscaled at the end, the atomic dQ per step. Without
// p.fp16_correction (for comparison) P and dS are rounded to fp16 once, unscaled: what a plain fp16
// kernel computes.
#pragma once

#include "cuteflash/common/bwd_preprocess.cuh"
#include "cuteflash/common/dropout.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/params.h"
#include "cuteflash/sm70/traits.h"

namespace cuteflash::sm70 {

constexpr float kPScale = 32768.f;  // 2^15: P <= 1, so P's fp16 hi' stays below fp16's 65504

__device__ __forceinline__ float p_scale(BwdParams const& p) { return p.fp16_correction ? kPScale : 1.f; }

// Bits of fp16 range below 2^15 that a step's largest |dS| s may fall short by before s is raised.
constexpr int kDsSlack = 4;
// A raise of s stops where the largest |sum| kept in units of s would pass 2^kSumExpCap: far from fp32's
// 2^128 (a step adds at most 2^(15 + 16 + log2 kBlockM) per element), for dO whose magnitude collapses
// from one query block to the next.
constexpr int kSumExpCap = 100;

// 2^e for -126 <= e <= 127, exactly.
__device__ __forceinline__ float exp2f_int(int e) { return __int_as_float((e + 127) << 23); }

// A block-wide max in two halves around a barrier: post_warp_max puts the largest x of the calling
// thread's warp (warp) in its slot of warp_max (which no thread may still be reading); after a
// __syncthreads, read_block_max gives the largest of the block's, in every thread.
__device__ __forceinline__ void post_warp_max(float x, float* warp_max, int warp) {
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  if (threadIdx.x % 32 == 0) warp_max[warp] = x;
}

template <int kNWarps>
__device__ __forceinline__ float read_block_max(float const* warp_max) {
  float x = warp_max[0];
  CUTE_UNROLL
  for (int w = 1; w < kNWarps; ++w) x = fmaxf(x, warp_max[w]);
  return x;
}

// S = Q K^T and dP = dO V^T of a step (probs_and_grads) into the two halves of the scratch, fp32. A warp computes
// kScoreGroup tiles of one row of either product: independent chains that share their A fragments (one barrier for
// both products instead of one each).
template <typename Traits>
__device__ __forceinline__ void score_products(typename Traits::SharedStorage& smem,
                                               typename Traits::Buffers const& buf) {
  constexpr int kLd = Traits::kLdQKV;
  const int warp = thread_index<Traits::kNThreads>() / 32;
  float* scratch = buf.scratch;
  constexpr int kTilesN = Traits::kBlockN / 16;
  constexpr int kGroup = Traits::kScoreGroup;
  constexpr int kUnits = Traits::kScoreTiles / kGroup;  // per product
  for (int u = warp; u < 2 * kUnits; u += Traits::kNWarps) {
    const bool dp = u >= kUnits;  // warp-uniform: dP = dO V^T, else S = Q K^T
    const int t = (u % kUnits) * kGroup;
    const int mt = t / kTilesN, nt = t % kTilesN;
    auto const* a = reinterpret_cast<__half const*>(dp ? buf.dout : buf.q) + mt * 16 * kLd;
    auto const* b = reinterpret_cast<__half const*>(dp ? smem.v.data() : smem.k.data()) + nt * 16 * kLd;
    FragAcc acc[kGroup];
    CUTE_UNROLL
    for (int g = 0; g < kGroup; ++g) nvcuda::wmma::fill_fragment(acc[g], 0.f);
    CUTE_UNROLL
    for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
      FragA fa;
      nvcuda::wmma::load_matrix_sync(fa, a + kk * 16, kLd);
      CUTE_UNROLL
      for (int g = 0; g < kGroup; ++g) {
        FragBCol fb;  // K^T (V^T): element (k, n) is K[n][k]
        nvcuda::wmma::load_matrix_sync(fb, b + g * 16 * kLd + kk * 16, kLd);
        nvcuda::wmma::mma_sync(acc[g], fa, fb, acc[g]);
      }
    }
    float* out = scratch + (dp ? Traits::kBlockM * Traits::kLdS : 0) + mt * 16 * Traits::kLdS + nt * 16;
    CUTE_UNROLL
    for (int g = 0; g < kGroup; ++g) {
      nvcuda::wmma::store_matrix_sync(out + g * 16, acc[g], Traits::kLdS, nvcuda::wmma::mem_row_major);
    }
  }
}

// One step of either kernel: query block m_block against key block n_block, with Q and dO of the block in
// `buf` and K and V in shared memory. Writes P p_scale(p) and dS s split in hi' / lo to shared memory;
// s = 2^ds_exp, the same in every thread (ds_exp = 0 before the first step), updated when this step's dS
// needs another. When a thread returns, every thread is done with buf.scratch (which may take the next Q).
// Returns the factor (new s / old s, or 1) by which sums kept in units of s must be rescaled before this
// step's dS is added; sum_abs_max() gives the largest |element| of the calling thread's share of them.
// `row` holds the statistics of the calling thread's row of the element-wise phase (tid / kThreadsPerRow).
template <typename Traits, Variant V, typename SumAbsMax>
__device__ float probs_and_grads(typename Traits::SharedStorage& smem, typename Traits::Buffers const& buf,
                                 BwdParams const& p, Sequence const& seq, int m_block, int n_block, RowStats const& row,
                                 int& ds_exp, SumAbsMax const& sum_abs_max) {
  constexpr int kCols = Traits::kCols;
  const int tid = thread_index<Traits::kNThreads>();
  const int warp = tid / 32;
  float* scratch = buf.scratch;

  score_products<Traits>(smem, buf);
  __syncthreads();

  // Each thread reads kCols floats of a row of S and dP and writes kCols halves of P and dS with vector
  // accesses (8 threads cover a row of 64, so the 16-byte writes of a quarter-warp hit distinct banks);
  // the upper half of a row's threads reads its two 16-byte halves in swapped order, which makes the
  // reads conflict-free too (scalar 2-byte stores would be 4-way conflicts).
  const int r = tid / Traits::kThreadsPerRow;
  const int c0 = (tid % Traits::kThreadsPerRow) * kCols;
  const bool swap = (tid % Traits::kThreadsPerRow) >= 4;
  const int q_row = m_block * Traits::kBlockM + r;
  const int key0 = n_block * Traits::kBlockN + c0;
  const int key_limit = mask_policy<V>(p, seq).key_end(q_row);    // my row sees keys [key_first, key_limit)
  const int key_first = mask_policy<V>(p, seq).key_begin(q_row);  // 0 but with has_options(V)
  const int mine = r * Traits::kLdS + c0;
  const int mine_p = r * Traits::kLdP + c0;
  auto* p_hi = reinterpret_cast<__half*>(smem.p_hi.data()) + mine_p;
  auto* p_lo = reinterpret_cast<__half*>(smem.p_lo.data()) + mine_p;
  auto* ds_hi = reinterpret_cast<__half*>(smem.ds_hi.data()) + mine_p;
  auto* ds_lo = reinterpret_cast<__half*>(smem.ds_lo.data()) + mine_p;

  // P and dS of the thread's kCols elements, from S and dP in the scratch (again, on a rare path).
  const int block_key_limit = mask_policy<V>(p, seq).key_end(m_block * Traits::kBlockM);  // the block's first row's
  float prob[kCols], ds[kCols];
  auto probs_and_grads_of_thread = [&] {
    load_floats(prob, scratch + mine, swap);
    load_floats(ds, scratch + Traits::kBlockM * Traits::kLdS + mine, swap);
    float dtanh[kCols];  // has_softcap: the softcap's 1 - tanh^2
    if constexpr (has_options(V)) {
      const ScoreMods mods = ScoreMods::make(p, seq, blockIdx.y);
      if constexpr (has_softcap(V)) {
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) prob[c] = mods.cap(prob[c], dtanh[c]);
      }
      if (mods.alibi != 0.f) {
        const float dist0 = float(q_row + mods.shift - key0);
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) prob[c] += mods.bias(dist0 - float(c));
      }
    }
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) prob[c] = exp2_approx(prob[c] * p.softmax_scale_log2 - row.lse_log2());
    // A row that sees one key has P = 1 there, exactly as the softmax of one score. From the lse it comes out as
    // 1 +- 2^-23 (the forward's and this exponent's roundings of the scaled score differ), which the hi / lo split
    // keeps, so that dV = P^T dO could round an exact tie of its fp16 conversion the other way.
    if (key_limit - key_first == 1 && q_row < seq.seqlen_q) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) prob[c] = key0 + c == key_first && prob[c] == prob[c] ? 1.f : prob[c];
    }
    // Keys past the end or outside the row's keys (rows past seqlen_q have lse = +inf: P = 0 already).
    if constexpr (has_options(V)) {
      if (mask_policy<V>(p, seq).template block_masked<Traits::kBlockM, Traits::kBlockN>(m_block, n_block)) {
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) prob[c] = key0 + c < key_limit && key0 + c >= key_first ? prob[c] : 0.f;
      }
    } else if ((n_block + 1) * Traits::kBlockN > block_key_limit) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) prob[c] = key0 + c < key_limit ? prob[c] : 0.f;
    }
    if constexpr (has_dropout(V)) {  // dS of the kept probabilities; dV's products take those (unscaled)
      const RowKeep<kCols, false> row_keep(Dropout::make(p, seq.batch, blockIdx.y), q_row, key0);
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const bool keep = row_keep.keeps(c, p.dropout_threshold);
        ds[c] = prob[c] * ((keep ? ds[c] * p.dropout_scale : 0.f) - row.d);
        prob[c] = keep ? prob[c] : 0.f;
      }
    } else {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) ds[c] = prob[c] * (ds[c] - row.d);
    }
    if constexpr (has_softcap(V)) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) ds[c] *= p.softcap * dtanh[c];
    }
  };
  probs_and_grads_of_thread();
  float ds_max = 0.f;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) ds_max = fmaxf(ds_max, fabsf(ds[c]));
  store_split(prob, p_scale(p), p_hi, p_lo);
  // Traits::kSchedule.eager_ds: dS is stored with the current s before the block's largest |dS| is known (one
  // barrier for both); a step that needs another s (rare: dS's magnitude moved by more than kDsSlack
  // binades) stores it again.
  if constexpr (Traits::kSchedule.eager_ds) store_split(ds, exp2f_int(ds_exp), ds_hi, ds_lo);
  post_warp_max(ds_max, buf.warp_max, warp);
  __syncthreads();  // P is complete, and dS where stored eagerly
  ds_max = read_block_max<Traits::kNWarps>(buf.warp_max);
  // The ideal s = 2^(15 - e) for max |dS| = f 2^e, f in [0.5, 1), puts the largest element in
  // [2^14, 2^15); s stays while it is at most that and at least 2^-kDsSlack of it.
  int e = 0;
  frexpf(ds_max, &e);
  float rescale = 1.f;
  if (ds_max > 0.f && p.fp16_correction) {
    const int ideal_exp = min(15 - e, 126);  // |dS| <= FLT_MAX < 2^128: at least 2^-113, a normal float
    const int old_exp = ds_exp;
    if (ds_exp > ideal_exp) {  // must come down: s dS would pass fp16's range
      rescale = ldexpf(1.f, ideal_exp - ds_exp);
      ds_exp = ideal_exp;
    } else if (ds_exp < ideal_exp - kDsSlack) {  // raised as far as the sums allow
      __syncthreads();                           // every thread has read warp_max
      post_warp_max(sum_abs_max(), buf.warp_max, warp);
      __syncthreads();
      const float m = read_block_max<Traits::kNWarps>(buf.warp_max);
      int sum_exp = 0;  // m < 2^sum_exp
      frexpf(m, &sum_exp);
      const int raise = m > 0.f ? min(ideal_exp - ds_exp, kSumExpCap - sum_exp) : ideal_exp - ds_exp;
      if (raise > 0) {
        if (m > 0.f) rescale = exp2f_int(raise);  // sums of 0 stay 0 in any units
        ds_exp += raise;
      }
    }
    if (Traits::kSchedule.eager_ds && ds_exp != old_exp) {  // the same in every thread: dS again, with the new s
      probs_and_grads_of_thread();  // recomputed rather than held in registers through the barriers
      store_split(ds, exp2f_int(ds_exp), ds_hi, ds_lo);
      __syncthreads();
    }
  }
  if constexpr (!Traits::kSchedule.eager_ds) {
    store_split(ds, exp2f_int(ds_exp), ds_hi, ds_lo);
    __syncthreads();  // dS is complete
  }
  return rescale;
}

// The largest |element| of a thread's share of a warp's accumulator tiles.
template <int kTiles>
__device__ __forceinline__ float abs_max_of_tiles(FragAcc const (&acc)[kTiles]) {
  float m = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < kTiles; ++i) {
    CUTE_UNROLL
    for (int j = 0; j < acc[i].num_elements; ++j) m = fmaxf(m, fabsf(acc[i].x[j]));
  }
  return m;
}

// acc *= factor for each of a warp's accumulator tiles (a block-uniform factor of 1: nothing).
template <int kTiles>
__device__ __forceinline__ void rescale_tiles(FragAcc (&acc)[kTiles], float factor) {
  if (factor == 1.f) return;
  CUTE_UNROLL
  for (int i = 0; i < kTiles; ++i) {
    CUTE_UNROLL
    for (int j = 0; j < acc[i].num_elements; ++j) acc[i].x[j] *= factor;
  }
}

// Adds acc * scale (a 16x16 fp32 tile) into out (row-major fp32 in global memory) with atomic
// reductions, rows below rows_valid, columns below cols_valid, through the warp's staging tile (leading
// dimension kLd floats). Each instruction covers two rows of 16, row(i) and row(i) + kPair, 16 banks apart:
// kLd = 16, rows 0 and 1, 2 and 3, ...; kLd = 24, rows 0 and 2, 1 and 3, 4 and 6, ... (where a half-warp of
// the accumulator's stores, 4 rows of 32 bytes as WMMA lowers on sm80+, hits distinct banks, rows 24 banks
// apart; at kLd = 16, 2-way conflicts). The lane reads its 8 values first, so that it waits for shared
// memory once, not before every atomic.
template <int kLd>
__device__ __forceinline__ void red_add_tile(FragAcc const& acc, float scale, float* stage, float* out,
                                             int64_t row_stride, int rows_valid, int cols_valid) {
  static_assert(kLd % 32 == 16 || kLd % 32 == 24);
  constexpr int kPair = kLd % 32 == 16 ? 1 : 2;
  const int lane = threadIdx.x % 32;
  nvcuda::wmma::store_matrix_sync(stage, acc, kLd, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const int r0 = (lane / 16) * kPair, c = lane % 16;
  auto row = [](int i) { return (i / kPair) * 2 * kPair + i % kPair; };
  float x[8];
  CUTE_UNROLL
  for (int i = 0; i < 8; ++i) x[i] = stage[(row(i) + r0) * kLd + c] * scale;
  __syncwarp();  // the staging tile is free
  out += r0 * row_stride + c;
  if (rows_valid >= 16 && cols_valid >= 16) {
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) global_red_add(out + row(i) * row_stride, x[i]);
  } else if (c < cols_valid) {
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      if (row(i) + r0 < rows_valid) global_red_add(out + row(i) * row_stride, x[i]);
    }
  }
}

// The loads of the dK/dV kernel's steps: Q and dO of query block m_block, from global memory into registers
// (load) and from there into a step's region (store), or straight into it (copy), or into L2 (prefetch).
// The kernel's loop stages them as Traits::kStaging says (sm70/tiles.h).
template <typename Traits>
struct QdoLoads {
  static constexpr int kBlockM = Traits::kBlockM;
  using Rows = HeadRows<kBlockM, Traits::kHeadDim, half_t const>;  // block(i): (kBlockM, kHeadDim)
  using Regs = decltype(Traits::CopyQ::make_regs());

  BwdParams const& p;
  Rows q, dout;
  int seqlen_q;
  int tid;

  __device__ QdoLoads(BwdParams const& p_, Sequence const& seq, int head, int tid_)
      : p(p_),
        q(head_rows<kBlockM, Traits::kHeadDim, half_t const>(p_.q, seq.batch, head, seq.q_row0)),
        dout(head_rows<kBlockM, Traits::kHeadDim, half_t const>(p_.dout, seq.batch, head, seq.q_row0)),
        seqlen_q(seq.seqlen_q),
        tid(tid_) {}

  __device__ int rows_left(int m_block) const { return seqlen_q - m_block * kBlockM; }
  __device__ void load(int m_block, Regs& q_dst, Regs& do_dst) const {
    Traits::CopyQ::load(q.block(m_block), q_dst, rows_left(m_block), p.head_dim, tid);
    Traits::CopyQ::load(dout.block(m_block), do_dst, rows_left(m_block), p.head_dim, tid);
  }
  __device__ void store(typename Traits::Buffers const& buf, Regs const& q_src, Regs const& do_src) const {
    Tensor sQ = make_tensor(make_smem_ptr(buf.q), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(buf.dout), typename Traits::SmemLayoutQ{});
    Traits::CopyQ::store(q_src, sQ, tid);
    Traits::CopyQ::store(do_src, sdO, tid);
  }
};

// The dV accumulators of the dK/dV kernel: its own (dv), or with split_key_products those of dK (a warp has
// the tiles of one of the two).
template <bool kSplit, int kCount, int kOwn>
__device__ __forceinline__ FragAcc (&dv_tiles(FragAcc (&dk)[kCount], FragAcc (&dv)[kOwn])) [kCount] {
  if constexpr (kSplit) return dk;
  else return dv;
}

// dV += P^T dO (in units of p_scale) and dK += dS^T Q (in units of s), into the warp's key tiles: A read
// transposed from P and dS, K = the step's queries. The warp's band of P^T / dS^T is its key tile row's 16
// columns of P / dS.
template <typename Traits, typename KeyTiles>
__device__ __forceinline__
    void key_products(FragAcc (&acc_dk)[KeyTiles::kCount], FragAcc (&acc_dv)[KeyTiles::kCount],
                      KeyTiles const& key_tiles, bool has_dk, bool has_dv, typename Traits::SharedStorage const& smem,
                      __half const* s_q, __half const* s_do, bool correction) {
  constexpr int kLd = Traits::kLdQKV;
  constexpr int kLdP = Traits::kLdP;
  const int band = key_tiles.row * 16;
  if (has_dv) {
    mma_row_tiles_split<Traits::kBlockM, true>(
        acc_dv, key_tiles, reinterpret_cast<__half const*>(smem.p_hi.data()) + band,
        reinterpret_cast<__half const*>(smem.p_lo.data()) + band, kLdP, s_do, kLd, correction);
  }
  if (has_dk) {
    mma_row_tiles_split<Traits::kBlockM, true>(
        acc_dk, key_tiles, reinterpret_cast<__half const*>(smem.ds_hi.data()) + band,
        reinterpret_cast<__half const*>(smem.ds_lo.data()) + band, kLdP, s_q, kLd, correction);
  }
}

// dQ += scale dS K / s for query block m_block, in the warp's query tiles, added to the fp32 dq_accum tile
// by tile through the warp's staging tile.
template <typename Traits, typename QueryTiles>
__device__ __forceinline__ void query_product_atomic(QueryTiles const& query_tiles,
                                                     typename Traits::SharedStorage const& smem, BwdParams const& p,
                                                     int seqlen_q, int m_block, float ds_unscale, float* stage,
                                                     float* dq_accum) {
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLdP = Traits::kLdP;
  FragAcc acc[QueryTiles::kCount];
  CUTE_UNROLL
  for (int i = 0; i < QueryTiles::kCount; ++i) nvcuda::wmma::fill_fragment(acc[i], 0.f);
  const int band = query_tiles.row * 16 * kLdP;
  mma_row_tiles_split<Traits::kBlockN, false>(
      acc, query_tiles, reinterpret_cast<__half const*>(smem.ds_hi.data()) + band,
      reinterpret_cast<__half const*>(smem.ds_lo.data()) + band, kLdP, reinterpret_cast<__half const*>(smem.k.data()),
      Traits::kLdQKV, p.fp16_correction);
  const int row0 = m_block * Traits::kBlockM + query_tiles.row * 16;
  query_tiles.for_each([&](int i, int col0) {
    red_add_tile<Traits::kStageLd>(acc[i], p.softmax_scale * ds_unscale, stage,
                                   dq_accum + int64_t(row0) * kHeadDim + col0, kHeadDim, seqlen_q - row0,
                                   p.head_dim - col0);
  });
}

// Key block n_block of one (sequence, head) in the dK/dV kernel, walking the query blocks that see it. A
// step's phases: loads (Q and dO, staged as Traits::kStaging says), the softmax gradient (probs_and_grads),
// the products (key_products, query_product_atomic, ordered by Traits::kSchedule); then the epilogue (dK, dV).
template <typename Traits, Variant V>
__device__ __forceinline__ void bwd_block(BwdParams const& p, Sequence const& seq, int head, int n_block) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr bool kRegisters = Traits::kStaging == Sm70QStaging::kRegisters;
  constexpr bool kPrefetch = Traits::kStaging == Sm70QStaging::kPrefetch;
  constexpr bool kPingPong = Traits::kStaging == Sm70QStaging::kPingPong;
  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = thread_index<Traits::kNThreads>();
  const int warp = tid / 32;
  const int keys_left = seq.seqlen_k - n_block * kBlockN;
  // The query blocks with a row that sees a key of this block (probs_and_grads masks per element). The first
  // is derived here from the first key's rows rather than taken from query_blocks: the same value, but in this
  // form the kernel compiles to the code of its causal-only arithmetic (from query_blocks its schedule moved,
  // 3-4 % slower at head dim 256).
  const auto mask = mask_policy<V>(p, seq);
  const int m_block_begin = mask.right_bounded() ? mask.row_begin(n_block * kBlockN) / kBlockM : 0;
  const int m_block_end = mask.template query_blocks<kBlockM, kBlockN>(n_block).end;

  const QdoLoads<Traits> loads(p, seq, head, tid);
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Traits::CopyKV::copy(head_rows<kBlockN, kHeadDim, half_t const>(p.k, seq.batch, head_k, seq.k_row0).block(n_block),
                       sK, keys_left, p.head_dim, tid);
  Traits::CopyKV::copy(head_rows<kBlockN, kHeadDim, half_t const>(p.v, seq.batch, head_k, seq.k_row0).block(n_block),
                       sV, keys_left, p.head_dim, tid);

  using KeyTiles = typename Traits::KeyTiles;
  constexpr bool kSplit = Traits::kSchedule.split_key_products;
  const KeyTiles key_tiles(kSplit ? warp % (Traits::kNWarps / 2) : warp);
  // The warp's tiles of dK and dV; with split_key_products those of one of them (has_dk, has_dv), in acc_dk
  // either way.
  const bool has_dk = !kSplit || warp >= Traits::kNWarps / 2;
  const bool has_dv = !kSplit || warp < Traits::kNWarps / 2;
  FragAcc acc_dk[KeyTiles::kCount], acc_dv_own[kSplit ? 1 : KeyTiles::kCount];
  auto& acc_dv = dv_tiles<kSplit>(acc_dk, acc_dv_own);
  int ds_exp = 0;  // dS, and so dK, are kept in units of 2^ds_exp (probs_and_grads)
  CUTE_UNROLL
  for (int i = 0; i < KeyTiles::kCount; ++i) {
    nvcuda::wmma::fill_fragment(acc_dk[i], 0.f);
    if constexpr (!kSplit) nvcuda::wmma::fill_fragment(acc_dv[i], 0.f);
  }
  float* stage = Traits::stage(smem, warp);
  const int64_t row_stats = seq.stats(p, head);
  float* dq_accum = dq_accum_region<kHeadDim>(p, seq, head);  // row-major

  // Loads: kRegisters keeps a step's Q and dO in registers from the top of the step before, kPingPong puts
  // the first step's in region 0.
  using Regs = typename QdoLoads<Traits>::Regs;
  Regs q_regs, do_regs;
  if ((kRegisters || kPingPong) && m_block_begin < m_block_end) {
    loads.load(m_block_begin, q_regs, do_regs);
    if constexpr (kPingPong) loads.store(Traits::buffers(smem, 0), q_regs, do_regs);
  }

  // Products.
  const typename Traits::QueryTiles query_tiles(warp);
  auto dv_dk = [&](__half const* s_q, __half const* s_do) {
    key_products<Traits>(acc_dk, acc_dv, key_tiles, has_dk, has_dv, smem, s_q, s_do, p.fp16_correction);
  };
  auto dq = [&](int m_block, float ds_unscale) {
    if (!p.deterministic) {
      query_product_atomic<Traits>(query_tiles, smem, p, seq.seqlen_q, m_block, ds_unscale, stage, dq_accum);
    }
  };

  int which = 0;  // the region holding the step's Q and dO (always 0 without kPingPong)
  const int row_in_block = tid / Traits::kThreadsPerRow;  // the calling thread's in probs_and_grads
  RowStats row_ahead(p, row_stats, m_block_begin * kBlockM + row_in_block, seq.seqlen_q);  // kRegisters: the next
  for (int m_block = m_block_begin; m_block < m_block_end; ++m_block) {
    // No warp still reads the previous Q, dO, P, dS or its staging tile; with kPingPong, this step's Q
    // and dO are in place.
    __syncthreads();
    const auto buf = Traits::buffers(smem, which);
    const bool has_next = m_block + 1 < m_block_end;
    const int m_next = m_block + 1;  // if has_next
    // Loads: this step's Q and dO into buf (kPingPong: there already).
    if constexpr (kRegisters) {
      loads.store(buf, q_regs, do_regs);
      if (has_next) loads.load(m_next, q_regs, do_regs);
    } else if constexpr (kPrefetch) {
      Tensor sQ = make_tensor(make_smem_ptr(buf.q), typename Traits::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(buf.dout), typename Traits::SmemLayoutQ{});
      Traits::CopyQ::copy(loads.q.block(m_block), sQ, loads.rows_left(m_block), p.head_dim, tid);
      Traits::CopyQ::copy(loads.dout.block(m_block), sdO, loads.rows_left(m_block), p.head_dim, tid);
    }
    // The row statistics, first used after S and dP. kRegisters loads them a step ahead like Q and dO:
    // at d=64 the products of S and dP are too short to hide the loads' latency. Else loaded here (held
    // through a step, they would be spilled at d=128).
    const RowStats row =
        kRegisters ? row_ahead : RowStats(p, row_stats, m_block * kBlockM + row_in_block, seq.seqlen_q);
    if (kRegisters && has_next) row_ahead = RowStats(p, row_stats, m_next * kBlockM + row_in_block, seq.seqlen_q);
    if constexpr (!kPingPong) __syncthreads();

    // Softmax gradient: P and dS into shared memory.
    const float dk_rescale = probs_and_grads<Traits, V>(smem, buf, p, seq, m_block, n_block, row, ds_exp,
                                                        [&] { return has_dk ? abs_max_of_tiles(acc_dk) : 0.f; });
    if (has_dk) rescale_tiles(acc_dk, dk_rescale);
    // Products, in the schedule's order. Between the first and the others, loads: kPingPong loads the next
    // Q and dO, to be stored into the region of S and dP (spent by then) after the last, so that registers
    // hold them through the last products only (held any longer, they make ptxas spill at d=128);
    // kPrefetch prefetches them, to be copied at the top of the next step.
    Regs next_q, next_do;
    auto first_product_done = [&] {
      if constexpr (kPingPong) {
        if (has_next) loads.load(m_next, next_q, next_do);
      } else if constexpr (kPrefetch) {
        if (has_next) {
          Traits::CopyQ::prefetch(loads.q.block(m_next), loads.rows_left(m_next), tid);
          Traits::CopyQ::prefetch(loads.dout.block(m_next), loads.rows_left(m_next), tid);
        }
      }
    };
    auto const* s_q = reinterpret_cast<__half const*>(buf.q);
    auto const* s_do = reinterpret_cast<__half const*>(buf.dout);
    if constexpr (Traits::kSchedule.dq_first) {
      dq(m_block, exp2f_int(-ds_exp));
      first_product_done();
      dv_dk(s_q, s_do);
    } else {
      dv_dk(s_q, s_do);
      first_product_done();
      dq(m_block, exp2f_int(-ds_exp));
    }
    if constexpr (kPingPong) {
      if (has_next) loads.store(Traits::buffers(smem, which ^ 1), next_q, next_do);
      which ^= 1;
    }
  }
  // The staging tiles may alias the scratch: no warp still reads it (also with no step).
  __syncthreads();

  // Epilogue: dK = scale dS^T Q and dV, in the input dtype; a key block that no query sees gets zeros.
  auto* dk = p.dk.at<half_t>(seq.batch, head, seq.k_row0);
  auto* dv = p.dv.at<half_t>(seq.batch, head, seq.k_row0);
  const int row0 = n_block * kBlockN + key_tiles.row * 16;
  key_tiles.for_each([&](int i, int col0) {
    if (has_dk) {
      store_tile(acc_dk[i], p.softmax_scale * exp2f_int(-ds_exp), stage, dk + int64_t(row0) * p.dk.row_stride + col0,
                 p.dk.row_stride, seq.seqlen_k - row0, p.head_dim - col0);
    }
    if (has_dv) {
      store_tile(acc_dv[i], (has_dropout(V) ? p.dropout_scale : 1.f) / p_scale(p), stage,
                 dv + int64_t(row0) * p.dv.row_stride + col0, p.dv.row_stride, seq.seqlen_k - row0, p.head_dim - col0);
    }
  });
}

// The dK/dV kernel: one thread block per key block of each (sequence, head) (sequence.cuh). The head's dQ,
// summed by atomics, is converted by the last of its thread blocks to finish (a sequence without keys:
// zeros).
template <typename Traits, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks) bwd_kernel(const BwdParams p) {
  const int head = blockIdx.y;
  // A sequence without keys has no tile: its blocks only count themselves, and the last converts zeros.
  for_each_tile<V>(
      p, blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_k, Traits::kBlockN); },
      [&](Sequence const& seq, int n_block) { bwd_block<Traits, V>(p, seq, head, n_block); });
  if (p.deterministic) return;
  // Every warp has issued its dQ atomics: count the block done (release: its atomics before the count). The
  // last to count converts (acquire: the other blocks' atomics after the count).
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(dq_blocks_done(p, blockIdx.z, head), 1) == int(gridDim.x) - 1;
    if (last) __threadfence();
  }
  if (__syncthreads_or(last)) {
    const Sequence seq = sequence<V>(p, blockIdx.z);
    convert_dq_rowmajor<half_t, Traits::kHeadDim, Traits::kNThreads>(p, seq, head, 0, seq.seqlen_q);
  }
}

// Deterministic dQ: one thread block per query block walks the key blocks it sees in a fixed order,
// recomputing P and dS, and keeps dQ += dS K / s in registers.
template <typename Traits, Variant V>
__device__ __forceinline__ void bwd_dq_block(BwdParams const& p, Sequence const& seq, int head, int m_block) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLd = Traits::kLdQKV;
  constexpr int kLdP = Traits::kLdP;
  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = thread_index<Traits::kNThreads>();
  const int warp = tid / 32;
  const int rows_left = seq.seqlen_q - m_block * kBlockM;

  const auto gK = head_rows<kBlockN, kHeadDim, half_t const>(p.k, seq.batch, head_k, seq.k_row0);
  const auto gV = head_rows<kBlockN, kHeadDim, half_t const>(p.v, seq.batch, head_k, seq.k_row0);
  // block(i) of gK, gV: (kBlockN, kHeadDim)
  const auto buf = Traits::buffers(smem, 0);
  Tensor sQ = make_tensor(make_smem_ptr(buf.q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(buf.dout), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Traits::CopyQ::copy(head_rows<kBlockM, kHeadDim, half_t const>(p.q, seq.batch, head, seq.q_row0).block(m_block), sQ,
                      rows_left, p.head_dim, tid);
  Traits::CopyQ::copy(head_rows<kBlockM, kHeadDim, half_t const>(p.dout, seq.batch, head, seq.q_row0).block(m_block),
                      sdO, rows_left, p.head_dim, tid);
  const RowStats row(p, seq.stats(p, head), m_block * kBlockM + tid / Traits::kThreadsPerRow, seq.seqlen_q);

  using QueryTiles = typename Traits::QueryTiles;
  const QueryTiles query_tiles(warp);
  FragAcc acc_dq[QueryTiles::kCount];
  int ds_exp = 0;  // dQ is kept in units of 2^ds_exp (probs_and_grads)
  CUTE_UNROLL
  for (int i = 0; i < QueryTiles::kCount; ++i) nvcuda::wmma::fill_fragment(acc_dq[i], 0.f);
  auto const* ds_hi = reinterpret_cast<__half const*>(smem.ds_hi.data());
  auto const* ds_lo = reinterpret_cast<__half const*>(smem.ds_lo.data());
  auto const* s_k = reinterpret_cast<__half const*>(smem.k.data());

  const BlockRange keys = mask_policy<V>(p, seq).template key_blocks<kBlockM, kBlockN>(m_block);
  for (int n_block = keys.begin; n_block < keys.end; ++n_block) {
    __syncthreads();  // no warp still reads the previous K, V or dS
    const int keys_left = seq.seqlen_k - n_block * kBlockN;
    Traits::CopyKV::copy(gK.block(n_block), sK, keys_left, p.head_dim, tid);
    Traits::CopyKV::copy(gV.block(n_block), sV, keys_left, p.head_dim, tid);
    __syncthreads();
    rescale_tiles(acc_dq, probs_and_grads<Traits, V>(smem, buf, p, seq, m_block, n_block, row, ds_exp,
                                                     [&] { return abs_max_of_tiles(acc_dq); }));
    const int band = query_tiles.row * 16 * kLdP;
    mma_row_tiles_split<kBlockN, false>(acc_dq, query_tiles, ds_hi + band, ds_lo + band, kLdP, s_k, kLd,
                                        p.fp16_correction);
  }
  __syncthreads();  // the staging tiles alias the scratch

  float* stage = Traits::stage(smem, warp);
  auto* dq = p.dq.at<half_t>(seq.batch, head, seq.q_row0);
  const int row0 = m_block * kBlockM + query_tiles.row * 16;
  query_tiles.for_each([&](int i, int col0) {
    store_tile(acc_dq[i], p.softmax_scale * exp2f_int(-ds_exp), stage, dq + int64_t(row0) * p.dq.row_stride + col0,
               p.dq.row_stride, seq.seqlen_q - row0, p.head_dim - col0);
  });
}

// One thread block per query block of each (sequence, head) (sequence.cuh).
template <typename Traits, Variant V>
static __global__ void __launch_bounds__(Traits::kNThreads) bwd_dq_kernel(const BwdParams p) {
  for_each_tile<V>(
      p, blockIdx.x, [](Sequence const& seq) { return ceil_div(seq.seqlen_q, Traits::kBlockM); },
      [&](Sequence const& seq, int m_block) { bwd_dq_block<Traits, V>(p, seq, blockIdx.y, m_block); });
}

}  // namespace cuteflash::sm70

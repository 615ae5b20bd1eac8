// sm70 backward kernels (Volta, Turing): WMMA fp16 tensor cores with error-corrected P and dS.
//
// The structure of FlashAttention-2's backward. After D = rowsum(dO * O) (bwd_preprocess.cuh), each
// thread block of bwd_kernel owns kBlockN keys and walks the query blocks that see them:
//   S = Q K^T   -> P = exp(scale S - lse)      (S and dP pass through a shared fp32 scratch: WMMA's
//   dP = dO V^T -> dS = P (dP - D)              accumulator layout is unspecified, rows are not known)
//   dV += P^T dO,  dK += dS^T Q,  dQ += dS K (fp32 atomics, or bwd_dq_kernel when deterministic)
// P and dS are fp32 and feed fp16 tensor-core products, so each is stored split in hi' and lo (see
// wmma.cuh) and both halves are multiplied, accumulating in fp32. Scaling keeps small values out of
// fp16's subnormal range (below 2^-14, where precision drops, and 2^-24, where values flush to 0):
// P <= 1 is split as v = 2^15 P, and dS as v = s dS with a power of two s per step that puts the step's
// largest |v| in [2^14, 2^15) -- small gradients (small dO, long rows) would otherwise underflow. dV
// accumulates in units of 2^15 P and is unscaled at the end; the dK and dQ products of a step are
// unscaled by 1 / s as they are added. Without p.fp16_correction (for comparison) P and dS are
// rounded to fp16 once, unscaled: what a plain fp16 kernel computes.
#pragma once

#include "cuteflash/block_info.cuh"
#include "cuteflash/bwd_preprocess.cuh"
#include "cuteflash/params.h"
#include "cuteflash/sm70/wmma.cuh"

namespace cuteflash::sm70 {

constexpr float kPScale = 32768.f;  // 2^15: P <= 1, so P's fp16 hi' stays below fp16's 65504

__device__ __forceinline__ float p_scale(BwdParams const& p) { return p.fp16_correction ? kPScale : 1.f; }

template <int kHeadDim_, int kBlockM_, int kBlockN_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per step (of a dK/dV thread block: all of its keys)
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  // Blocks per SM that the registers must allow (__launch_bounds__; 0: the compiler's choice). On the
  // sm70 family's own GPUs one block fills the shared memory (64-96 KB per SM), but where the family
  // is compiled for a larger GPU (to test it there) two fit: capping head dims <= 128 at 128 registers
  // lets them run. H200, forced sm70, d=128: 165 -> 128 registers (36 bytes of spills), backward
  // 86 -> 104 TFLOP/s at S=8192. (An explicit 1 is not the same as none: ptxas then takes up to 255.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static constexpr int kMinBlocks = kHeadDim <= 128 ? 2 : 0;
#else
  static constexpr int kMinBlocks = 0;
#endif
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0);

  // Row-major shared tiles padded by 16 bytes per row against bank conflicts (WMMA loads take a
  // pointer and a leading dimension: no swizzle).
  static constexpr int kLdQKV = kHeadDim + 8;  // halves
  // floats: S and dP, (kBlockM, kBlockN) each. Rows 8 banks apart: the accumulator stores of 16 lanes
  // (4 rows of 8-byte pairs, as WMMA lowers on sm80+) hit distinct banks; the element-wise reads take one
  // row per quarter-warp and do not care.
  static constexpr int kLdS = kBlockN + 8;
  static constexpr int kLdP = kBlockN + 8;     // halves: P and dS hi / lo, (kBlockM, kBlockN)

  // The element-wise phase: each thread owns kCols consecutive columns of one row of S and dP.
  static constexpr int kCols = kBlockM * kBlockN / kNThreads;
  static constexpr int kThreadsPerRow = kBlockN / kCols;
  static_assert(kCols >= 1 && kThreadsPerRow * kCols == kBlockN && 32 % kThreadsPerRow == 0);

  // 16x16 output tiles of each product, dealt to the warps round-robin.
  static constexpr int kScoreTiles = (kBlockM / 16) * (kBlockN / 16);  // S, dP
  // Tiles of a row of S or dP per warp (sharing A): 2 where the block has twice as many tiles as warps.
  static constexpr int kScoreGroup = 2 * kScoreTiles >= 2 * kNWarps && (kBlockN / 16) % 2 == 0 ? 2 : 1;
  static constexpr int kKeyTiles = (kBlockN / 16) * (kHeadDim / 16);   // dK, dV
  static constexpr int kQueryTiles = (kBlockM / 16) * (kHeadDim / 16); // dQ
  static constexpr int kKeyTilesPerWarp = ceil_div(kKeyTiles, kNWarps);
  static constexpr int kQueryTilesPerWarp = ceil_div(kQueryTiles, kNWarps);

  // The scratch holds S and dP side by side; between steps, each warp's 16x16 fp32 tile on its way out.
  static constexpr int kScratchFloats =
      2 * kBlockM * kLdS > kNWarps * 16 * 16 ? 2 * kBlockM * kLdS : kNWarps * 16 * 16;

  using SmemLayoutQ = Layout<Shape<Int<kBlockM>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;
  using SmemLayoutKV = Layout<Shape<Int<kBlockN>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;
  using CopyQ = GmemTileCopy<kBlockM, kHeadDim, kNThreads>;
  using CopyKV = GmemTileCopy<kBlockN, kHeadDim, kNThreads>;

  struct SharedStorage {  // 32-byte alignment: WMMA loads and stores need 256-bit aligned pointers
    array_aligned<half_t, cosize_v<SmemLayoutQ>, 32> q, dout;
    array_aligned<half_t, cosize_v<SmemLayoutKV>, 32> k, v;
    array_aligned<float, kScratchFloats, 32> scratch;
    array_aligned<half_t, kBlockM * kLdP, 32> p_hi, p_lo, ds_hi, ds_lo;
    float warp_max[kNWarps];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// Calls f(i, tile_row, tile_col) for each of this warp's 16x16 output tiles of a product with kTiles
// tiles, kTileCols to a row, dealt to the warps round-robin (i: the warp's i-th tile).
template <int kTiles, int kTileCols, int kNWarps, typename F>
__device__ __forceinline__ void for_warp_tiles(int warp, F&& f) {
  CUTE_UNROLL
  for (int i = 0; i < ceil_div(kTiles, kNWarps); ++i) {
    int t = warp + i * kNWarps;
    if (kTiles % kNWarps == 0 || t < kTiles) f(i, t / kTileCols, t % kTileCols);
  }
}

// for_warp_tiles over the output tiles of a product with a row-major (kK, *) B in shared memory at b,
// passing each tile's B slice (FragBSlice) as f(i, tile_row, tile_col, slice): loaded once per warp where
// its tiles share their columns (kNWarps a multiple of kTileCols: head dims 32, 64, 128), else per tile.
template <int kTiles, int kTileCols, int kNWarps, int kK, typename F>
__device__ __forceinline__ void for_warp_tiles_of_b(int warp, __half const* b, int ldb, F&& f) {
  if constexpr (kNWarps % kTileCols == 0) {
    const FragBSlice<kK> slice(b + warp % kTileCols * 16, ldb);
    for_warp_tiles<kTiles, kTileCols, kNWarps>(warp, [&](int i, int row, int col) { f(i, row, col, slice); });
  } else {
    for_warp_tiles<kTiles, kTileCols, kNWarps>(
        warp, [&](int i, int row, int col) { f(i, row, col, FragBSlice<kK>(b + col * 16, ldb)); });
  }
}

// One step of either kernel: query block m_block against key block n_block, with Q, dO, K and V of the
// blocks in shared memory. Writes P p_scale(p) and dS s (s chosen per step) split in hi' / lo to shared
// memory, and returns 1 / s; `row` is the calling thread's row of the element-wise phase
// (tid / kThreadsPerRow).
template <typename Traits>
__device__ float probs_and_grads(typename Traits::SharedStorage& smem, BwdParams const& p, int m_block, int n_block,
                                 RowStats const& row) {
  constexpr int kLd = Traits::kLdQKV;
  constexpr int kCols = Traits::kCols;
  constexpr int kTilesN = Traits::kBlockN / 16;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  float* scratch = smem.scratch.data();

  // S = Q K^T and dP = dO V^T into the two halves of the scratch, fp32. A warp computes kScoreGroup tiles
  // of one row of either product: independent chains that share their A fragments (one barrier for
  // both products instead of one each).
  constexpr int kGroup = Traits::kScoreGroup;
  constexpr int kUnits = Traits::kScoreTiles / kGroup;  // per product
  for (int u = warp; u < 2 * kUnits; u += Traits::kNWarps) {
    const bool dp = u >= kUnits;  // warp-uniform: dP = dO V^T, else S = Q K^T
    const int t = (u % kUnits) * kGroup;
    const int mt = t / kTilesN, nt = t % kTilesN;
    auto const* a = reinterpret_cast<__half const*>(dp ? smem.dout.data() : smem.q.data()) + mt * 16 * kLd;
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
  __syncthreads();

  // Each thread reads kCols floats of a row of S and dP and writes kCols halves of P and dS with vector
  // accesses (8 threads cover a row of 64, so the 16-byte writes of a quarter-warp hit distinct banks);
  // the upper half of a row's threads reads its two 16-byte halves in swapped order, which makes the
  // reads conflict-free too. (Scalar 2-byte stores were 4-way conflicts: ncu, H200, d=64, 253 M in 979 M
  // shared wavefronts.)
  const int r = tid / Traits::kThreadsPerRow;
  const int c0 = (tid % Traits::kThreadsPerRow) * kCols;
  const bool swap = (tid % Traits::kThreadsPerRow) >= 4;
  const int q_row = m_block * Traits::kBlockM + r;
  const int key0 = n_block * Traits::kBlockN + c0;
  const int key_limit = p.causal ? min(p.seqlen_k, q_row + p.seqlen_k - p.seqlen_q + 1) : p.seqlen_k;
  const int mine = r * Traits::kLdS + c0;
  const int mine_p = r * Traits::kLdP + c0;
  auto* p_hi = reinterpret_cast<__half*>(smem.p_hi.data()) + mine_p;
  auto* p_lo = reinterpret_cast<__half*>(smem.p_lo.data()) + mine_p;
  auto* ds_hi = reinterpret_cast<__half*>(smem.ds_hi.data()) + mine_p;
  auto* ds_lo = reinterpret_cast<__half*>(smem.ds_lo.data()) + mine_p;

  float prob[kCols], ds[kCols];
  load_floats(prob, scratch + mine, swap);
  load_floats(ds, scratch + Traits::kBlockM * Traits::kLdS + mine, swap);
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) prob[c] = exp2_approx(prob[c] * p.softmax_scale_log2 - row.lse_log2());
  // Keys past the end or past a causal limit (rows past seqlen_q have lse = +inf: P = 0 already).
  const int block_key_limit = p.causal ? min(p.seqlen_k, m_block * Traits::kBlockM + p.seqlen_k - p.seqlen_q + 1)
                                       : p.seqlen_k;
  if ((n_block + 1) * Traits::kBlockN > block_key_limit) {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) prob[c] = key0 + c < key_limit ? prob[c] : 0.f;
  }
  float ds_max = 0.f;
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    ds[c] = prob[c] * (ds[c] - row.d);
    ds_max = fmaxf(ds_max, fabsf(ds[c]));
  }
  store_split(prob, p_scale(p), p_hi, p_lo);
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) ds_max = fmaxf(ds_max, __shfl_xor_sync(0xffffffff, ds_max, offset));
  if (tid % 32 == 0) smem.warp_max[warp] = ds_max;
  __syncthreads();
  CUTE_UNROLL
  for (int w = 0; w < Traits::kNWarps; ++w) ds_max = fmaxf(ds_max, smem.warp_max[w]);
  // s = 2^(15 - e) for max |dS| = f 2^e, f in [0.5, 1): the largest element lands in [2^14, 2^15).
  int e = 0;
  frexpf(ds_max, &e);
  const float ds_scale = ds_max > 0.f && p.fp16_correction ? ldexpf(1.f, min(15 - e, 126)) : 1.f;
  store_split(ds, ds_scale, ds_hi, ds_lo);
  __syncthreads();  // P and dS are complete; the scratch is free
  return 1.f / ds_scale;
}

// Adds acc * scale (a 16x16 fp32 tile) into out (row-major fp32 in global memory) with atomic
// reductions, rows below rows_valid, columns below cols_valid. Each instruction covers two rows of 16.
// The lane reads its 8 values first, so that it waits for shared memory once, not before every atomic.
__device__ __forceinline__ void red_add_tile(FragAcc const& acc, float scale, float* stage, float* out,
                                             int64_t row_stride, int rows_valid, int cols_valid) {
  const int lane = threadIdx.x % 32;
  nvcuda::wmma::store_matrix_sync(stage, acc, 16, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const int r0 = lane / 16, c = lane % 16;
  float x[8];
  CUTE_UNROLL
  for (int i = 0; i < 8; ++i) x[i] = stage[(2 * i + r0) * 16 + c] * scale;
  __syncwarp();  // the staging tile is free
  out += r0 * row_stride + c;
  if (rows_valid >= 16 && cols_valid >= 16) {
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) global_red_add(out + 2 * i * row_stride, x[i]);
  } else if (c < cols_valid) {
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      if (2 * i + r0 < rows_valid) global_red_add(out + 2 * i * row_stride, x[i]);
    }
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks) bwd_kernel(const BwdParams p) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLd = Traits::kLdQKV;
  constexpr int kLdP = Traits::kLdP;
  constexpr int kTilesD = kHeadDim / 16;
  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int n_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int keys_left = p.seqlen_k - n_block * kBlockN;
  // Query blocks with a row that sees a key of this block (causal: query i sees keys j <= i + shift).
  const int m_block_max = ceil_div(p.seqlen_q, kBlockM);
  const int m_block_min = p.causal ? max(0, n_block * kBlockN - (p.seqlen_k - p.seqlen_q)) / kBlockM : 0;

  const auto gQ = head_rows<kBlockM, kHeadDim>(static_cast<half_t const*>(p.q), batch * p.q_batch_stride,
                                               head * p.q_head_stride, p.q_row_stride);
  const auto gdO = head_rows<kBlockM, kHeadDim>(static_cast<half_t const*>(p.dout), batch * p.do_batch_stride,
                                                head * p.do_head_stride, p.do_row_stride);
  // block(i) of gQ, gdO: (kBlockM, kHeadDim)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Traits::CopyKV::copy(head_rows<kBlockN, kHeadDim>(static_cast<half_t const*>(p.k), batch * p.k_batch_stride,
                                                    head_k * p.k_head_stride, p.k_row_stride).block(n_block),
                       sK, keys_left, p.head_dim, tid);
  Traits::CopyKV::copy(head_rows<kBlockN, kHeadDim>(static_cast<half_t const*>(p.v), batch * p.v_batch_stride,
                                                    head_k * p.v_head_stride, p.v_row_stride).block(n_block),
                       sV, keys_left, p.head_dim, tid);

  FragAcc acc_dk[Traits::kKeyTilesPerWarp], acc_dv[Traits::kKeyTilesPerWarp];
  CUTE_UNROLL
  for (int i = 0; i < Traits::kKeyTilesPerWarp; ++i) {
    nvcuda::wmma::fill_fragment(acc_dk[i], 0.f);
    nvcuda::wmma::fill_fragment(acc_dv[i], 0.f);
  }
  auto const* p_hi = reinterpret_cast<__half const*>(smem.p_hi.data());
  auto const* p_lo = reinterpret_cast<__half const*>(smem.p_lo.data());
  auto const* ds_hi = reinterpret_cast<__half const*>(smem.ds_hi.data());
  auto const* ds_lo = reinterpret_cast<__half const*>(smem.ds_lo.data());
  auto const* s_q = reinterpret_cast<__half const*>(smem.q.data());
  auto const* s_do = reinterpret_cast<__half const*>(smem.dout.data());
  auto const* s_k = reinterpret_cast<__half const*>(smem.k.data());
  float* stage = smem.scratch.data() + warp * 16 * 16;
  const int64_t row_stats = (int64_t(batch) * p.nheads + head) * p.seqlen_q;
  float* dq_accum = dq_accum_region<kHeadDim>(p, batch, head);  // row-major

  // Q and dO of the next query block are loaded into registers while this block's products run (Volta
  // has no cp.async), and stored to shared memory at the top of the next step.
  auto q_regs = Traits::CopyQ::make_regs();
  auto do_regs = Traits::CopyQ::make_regs();
  auto load_step = [&](int m_block) {
    const int rows_left = p.seqlen_q - m_block * kBlockM;
    Traits::CopyQ::load(gQ.block(m_block), q_regs, rows_left, p.head_dim, tid);
    Traits::CopyQ::load(gdO.block(m_block), do_regs, rows_left, p.head_dim, tid);
  };
  if (m_block_min < m_block_max) load_step(m_block_min);

  for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
    __syncthreads();  // no warp still reads the previous Q, dO, P, dS or its staging tile
    Traits::CopyQ::store(q_regs, sQ, tid);
    Traits::CopyQ::store(do_regs, sdO, tid);
    if (m_block + 1 < m_block_max) load_step(m_block + 1);
    // The row statistics are loaded here and first used after S and dP: their products hide the
    // latency (loaded a step ahead, they were spilled, which waits for the load at once).
    const RowStats row(p, row_stats, m_block * kBlockM + tid / Traits::kThreadsPerRow);
    __syncthreads();
    const float ds_unscale = probs_and_grads<Traits>(smem, p, m_block, n_block, row);

    // dV += P^T dO (in units of p_scale) and dK += dS^T Q / s: A read transposed from P / dS, K = the
    // step's queries.
    for_warp_tiles_of_b<Traits::kKeyTiles, kTilesD, Traits::kNWarps, kBlockM>(
        warp, s_do, kLd, [&](int i, int nt, int, FragBSlice<kBlockM> const& b) {
          mma_tile_split<kBlockM, true>(acc_dv[i], p_hi + nt * 16, p_lo + nt * 16, kLdP, b, p.fp16_correction);
        });
    for_warp_tiles_of_b<Traits::kKeyTiles, kTilesD, Traits::kNWarps, kBlockM>(
        warp, s_q, kLd, [&](int i, int nt, int, FragBSlice<kBlockM> const& b) {
          mma_tile_split_scaled<kBlockM, true>(acc_dk[i], ds_hi + nt * 16, ds_lo + nt * 16, kLdP, b, ds_unscale,
                                               p.fp16_correction);
        });
    if (!p.deterministic) {  // dQ += scale dS K / s, added to the fp32 buffer tile by tile
      for_warp_tiles_of_b<Traits::kQueryTiles, kTilesD, Traits::kNWarps, kBlockN>(
          warp, s_k, kLd, [&](int, int mt, int dt, FragBSlice<kBlockN> const& b) {
            FragAcc acc;
            nvcuda::wmma::fill_fragment(acc, 0.f);
            mma_tile_split<kBlockN, false>(acc, ds_hi + mt * 16 * kLdP, ds_lo + mt * 16 * kLdP, kLdP, b,
                                           p.fp16_correction);
            const int row0 = m_block * kBlockM + mt * 16;
            red_add_tile(acc, p.softmax_scale * ds_unscale, stage, dq_accum + int64_t(row0) * kHeadDim + dt * 16,
                         kHeadDim, p.seqlen_q - row0, p.head_dim - dt * 16);
          });
    }
  }
  __syncthreads();  // the staging tiles alias the scratch: no warp still reads it (also with no step)

  // dK = scale dS^T Q and dV, in the input dtype; a key block that no query sees gets zeros.
  auto* dk = static_cast<half_t*>(p.dk) + batch * p.dk_batch_stride + head * p.dk_head_stride;
  auto* dv = static_cast<half_t*>(p.dv) + batch * p.dv_batch_stride + head * p.dv_head_stride;
  for_warp_tiles<Traits::kKeyTiles, kTilesD, Traits::kNWarps>(warp, [&](int i, int nt, int dt) {
    int row0 = n_block * kBlockN + nt * 16;
    store_tile_fp16(acc_dk[i], p.softmax_scale, stage, dk + int64_t(row0) * p.dk_row_stride + dt * 16,
                    p.dk_row_stride, p.seqlen_k - row0, p.head_dim - dt * 16);
    store_tile_fp16(acc_dv[i], 1.f / p_scale(p), stage, dv + int64_t(row0) * p.dv_row_stride + dt * 16, p.dv_row_stride,
                    p.seqlen_k - row0, p.head_dim - dt * 16);
  });
}

// Deterministic dQ: one thread block per query block walks the key blocks it sees in a fixed order,
// recomputing P and dS, and keeps dQ += dS K / s in registers.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads) bwd_dq_kernel(const BwdParams p) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLd = Traits::kLdQKV;
  constexpr int kLdP = Traits::kLdP;
  constexpr int kTilesD = kHeadDim / 16;
  extern __shared__ __align__(128) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int head_k = head / (p.nheads / p.nheads_k);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int rows_left = p.seqlen_q - m_block * kBlockM;

  const auto gK = head_rows<kBlockN, kHeadDim>(static_cast<half_t const*>(p.k), batch * p.k_batch_stride,
                                               head_k * p.k_head_stride, p.k_row_stride);
  const auto gV = head_rows<kBlockN, kHeadDim>(static_cast<half_t const*>(p.v), batch * p.v_batch_stride,
                                               head_k * p.v_head_stride, p.v_row_stride);
  // block(i) of gK, gV: (kBlockN, kHeadDim)
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
  Traits::CopyQ::copy(head_rows<kBlockM, kHeadDim>(static_cast<half_t const*>(p.q), batch * p.q_batch_stride,
                                                   head * p.q_head_stride, p.q_row_stride).block(m_block),
                      sQ, rows_left, p.head_dim, tid);
  Traits::CopyQ::copy(head_rows<kBlockM, kHeadDim>(static_cast<half_t const*>(p.dout), batch * p.do_batch_stride,
                                                   head * p.do_head_stride, p.do_row_stride).block(m_block),
                      sdO, rows_left, p.head_dim, tid);
  const RowStats row(p, (int64_t(batch) * p.nheads + head) * p.seqlen_q,
                     m_block * kBlockM + tid / Traits::kThreadsPerRow);

  FragAcc acc_dq[Traits::kQueryTilesPerWarp];
  CUTE_UNROLL
  for (int i = 0; i < Traits::kQueryTilesPerWarp; ++i) nvcuda::wmma::fill_fragment(acc_dq[i], 0.f);
  auto const* ds_hi = reinterpret_cast<__half const*>(smem.ds_hi.data());
  auto const* ds_lo = reinterpret_cast<__half const*>(smem.ds_lo.data());
  auto const* s_k = reinterpret_cast<__half const*>(smem.k.data());

  const KeyRange<kBlockM, kBlockN> keys(p, m_block);
  for (int n_block = 0; n_block < keys.n_block_max; ++n_block) {
    __syncthreads();  // no warp still reads the previous K, V or dS
    const int keys_left = p.seqlen_k - n_block * kBlockN;
    Traits::CopyKV::copy(gK.block(n_block), sK, keys_left, p.head_dim, tid);
    Traits::CopyKV::copy(gV.block(n_block), sV, keys_left, p.head_dim, tid);
    __syncthreads();
    const float ds_unscale = probs_and_grads<Traits>(smem, p, m_block, n_block, row);
    for_warp_tiles_of_b<Traits::kQueryTiles, kTilesD, Traits::kNWarps, kBlockN>(
        warp, s_k, kLd, [&](int i, int mt, int, FragBSlice<kBlockN> const& b) {
          mma_tile_split_scaled<kBlockN, false>(acc_dq[i], ds_hi + mt * 16 * kLdP, ds_lo + mt * 16 * kLdP, kLdP, b,
                                                ds_unscale, p.fp16_correction);
        });
  }
  __syncthreads();  // the staging tiles alias the scratch

  float* stage = smem.scratch.data() + warp * 16 * 16;
  auto* dq = static_cast<half_t*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
  for_warp_tiles<Traits::kQueryTiles, kTilesD, Traits::kNWarps>(warp, [&](int i, int mt, int dt) {
    int row0 = m_block * kBlockM + mt * 16;
    store_tile_fp16(acc_dq[i], p.softmax_scale, stage, dq + int64_t(row0) * p.dq_row_stride + dt * 16,
                    p.dq_row_stride, p.seqlen_q - row0, p.head_dim - dt * 16);
  });
}

}  // namespace cuteflash::sm70

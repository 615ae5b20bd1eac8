// Building blocks of the sm70 kernels: WMMA 16x16x16 fp16 products with fp32 accumulation on row-major
// shared-memory tiles, their error-corrected form, global -> shared copies without cp.async, and stores
// of accumulator tiles.
#pragma once

#include <mma.h>

#include <type_traits>

#include "cuteflash/utils.cuh"

namespace cuteflash::sm70 {

using namespace cute;

using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major>;
using FragBRow = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::row_major>;
using FragBCol = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major>;
using FragAcc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;

// Error-corrected fp16 splits x into hi = fp16(x) and lo = fp16((x - hi) 2^11), and a product with an fp16
// B is hi B + 2^-11 lo B, accumulated in fp32. The kernels store hi' = 2^11 hi instead: they split
// v = 2^11 x (the factor folded into a scale they apply anyway) as hi' = fp16(v) and lo = fp16(v - hi'),
// the same pair with hi exact times 2^11 (away from fp16's subnormals, where hi' is the more precise).
// Then hi' B + lo B = 2^11 (hi B + 2^-11 lo B) goes into one fp32 accumulator: no second accumulator,
// and no 2^-11 to apply per product.
constexpr float kLoScaleLog2 = 11.f;

// kCols consecutive floats of shared memory at src (aligned to their size, up to 16 bytes) into dst, with
// vector loads. With two 16-byte halves, `swap` reads the second first (a bank rotation; dst is in
// order either way).
template <int kCols>
__device__ __forceinline__ void load_floats(float (&dst)[kCols], float const* src, bool swap) {
  static_assert(kCols == 2 || kCols == 4 || kCols == 8);
  if constexpr (kCols == 2) {
    float2 v = *reinterpret_cast<float2 const*>(src);
    dst[0] = v.x;
    dst[1] = v.y;
  } else {
    float4 v[kCols / 4];
    CUTE_UNROLL
    for (int j = 0; j < kCols / 4; ++j) v[j] = reinterpret_cast<float4 const*>(src)[j ^ int(kCols == 8 && swap)];
    if constexpr (kCols == 8) {
      float4 first = swap ? v[1] : v[0], second = swap ? v[0] : v[1];
      v[0] = first;
      v[1] = second;
    }
    CUTE_UNROLL
    for (int j = 0; j < kCols / 4; ++j) {
      dst[4 * j] = v[j].x;
      dst[4 * j + 1] = v[j].y;
      dst[4 * j + 2] = v[j].z;
      dst[4 * j + 3] = v[j].w;
    }
  }
}

// v = x[0..kCols) scale split into hi' = fp16(v) and lo = fp16(v - hi') (see kLoScaleLog2), each stored
// to shared memory with one vector store (hi and lo aligned to kCols halves, at most 16 bytes).
template <int kCols>
__device__ __forceinline__ void store_split(float const (&x)[kCols], float scale, __half* hi, __half* lo) {
  static_assert(kCols == 2 || kCols == 4 || kCols == 8);
  using Vec = std::conditional_t<kCols == 8, uint4, std::conditional_t<kCols == 4, uint2, uint32_t>>;
  __align__(16) __half2 h[kCols / 2], l[kCols / 2];
  CUTE_UNROLL
  for (int c = 0; c < kCols / 2; ++c) {
    const float v0 = x[2 * c] * scale, v1 = x[2 * c + 1] * scale;
    h[c] = __floats2half2_rn(v0, v1);
    const float2 back = __half22float2(h[c]);
    l[c] = __floats2half2_rn(v0 - back.x, v1 - back.y);
  }
  *reinterpret_cast<Vec*>(hi) = *reinterpret_cast<Vec const*>(h);
  *reinterpret_cast<Vec*>(lo) = *reinterpret_cast<Vec const*>(l);
}

// A operand of a 16 x K slice: row-major A (a[i lda + k]), or, with kTransposed, A^T stored row-major
// (a[k lda + i], e.g. P^T read from P).
template <bool kTransposed>
using FragAOf = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half,
                                       std::conditional_t<kTransposed, nvcuda::wmma::col_major, nvcuda::wmma::row_major>>;

// Address of the k-th 16-wide step along K of an operand tile.
template <bool kAlongRows>
__device__ __forceinline__ __half const* k_step(__half const* base, int ld, int k) {
  return kAlongRows ? base + k * 16 * ld : base + k * 16;
}

// The B operand of a 16-column slice of a row-major (kK, *) fp16 tile, all kK / 16 steps along K: loaded
// once, it can serve several output tiles of the same columns.
template <int kK>
struct FragBSlice {
  FragBRow step[kK / 16];

  __device__ FragBSlice(__half const* b, int ldb) {
    CUTE_UNROLL
    for (int k = 0; k < kK / 16; ++k) nvcuda::wmma::load_matrix_sync(step[k], b + k * 16 * ldb, ldb);
  }
};

// acc += hi' B + lo B: the error-corrected product of a split fp32 A (a_hi, a_lo of the same layout, see
// kLoScaleLog2) with an fp16 B, in units of A's 2^11 x. Without `correction` the lo product is skipped
// (plain fp16 A, for comparison).
template <int kK, bool kATransposed>
__device__ __forceinline__ void mma_tile_split(FragAcc& acc, __half const* a_hi, __half const* a_lo, int lda,
                                               FragBSlice<kK> const& b, bool correction) {
  CUTE_UNROLL
  for (int k = 0; k < kK / 16; ++k) {
    FragAOf<kATransposed> fa;
    nvcuda::wmma::load_matrix_sync(fa, k_step<kATransposed>(a_hi, lda, k), lda);
    nvcuda::wmma::mma_sync(acc, fa, b.step[k], acc);
    if (correction) {
      nvcuda::wmma::load_matrix_sync(fa, k_step<kATransposed>(a_lo, lda, k), lda);
      nvcuda::wmma::mma_sync(acc, fa, b.step[k], acc);
    }
  }
}

// The A operand of a 16-row slice of a split fp32 A (a_hi, a_lo, see kLoScaleLog2), all kK / 16 steps
// along K, stored row-major or (kATransposed) as its transpose: loaded once, it can serve several output
// tiles of the same rows. Without `correction` the lo half is not loaded.
template <int kK, bool kATransposed>
struct FragASplitSlice {
  FragAOf<kATransposed> hi[kK / 16], lo[kK / 16];

  __device__ FragASplitSlice(__half const* a_hi, __half const* a_lo, int lda, bool correction) {
    CUTE_UNROLL
    for (int k = 0; k < kK / 16; ++k) {
      nvcuda::wmma::load_matrix_sync(hi[k], k_step<kATransposed>(a_hi, lda, k), lda);
      if (correction) nvcuda::wmma::load_matrix_sync(lo[k], k_step<kATransposed>(a_lo, lda, k), lda);
    }
  }
};

// acc += hi' B + lo B with A's slice in registers and a row-major B (kK x 16) read from shared memory.
template <int kK, bool kATransposed>
__device__ __forceinline__ void mma_tile_split(FragAcc& acc, FragASplitSlice<kK, kATransposed> const& a,
                                               __half const* b, int ldb, bool correction) {
  CUTE_UNROLL
  for (int k = 0; k < kK / 16; ++k) {
    FragBRow fb;
    nvcuda::wmma::load_matrix_sync(fb, b + k * 16 * ldb, ldb);
    nvcuda::wmma::mma_sync(acc, a.hi[k], fb, acc);
    if (correction) nvcuda::wmma::mma_sync(acc, a.lo[k], fb, acc);
  }
}

// Writes acc * scale (a 16x16 fp32 tile) as fp16 to out, a row-major global matrix, through the warp's
// shared staging tile: rows below rows_valid, columns below cols_valid (a multiple of 8).
__device__ __forceinline__ void store_tile_fp16(FragAcc const& acc, float scale, float* stage, half_t* out,
                                                int64_t row_stride, int rows_valid, int cols_valid) {
  const int lane = threadIdx.x % 32;
  nvcuda::wmma::store_matrix_sync(stage, acc, 16, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const int r = lane / 2, c0 = (lane % 2) * 8;
  if (r < rows_valid && c0 < cols_valid) {
    cutlass::Array<half_t, 8> packed;
    CUTE_UNROLL
    for (int c = 0; c < 8; ++c) packed[c] = half_t(stage[r * 16 + c0 + c] * scale);
    *reinterpret_cast<cutlass::Array<half_t, 8>*>(out + r * row_stride + c0) = packed;
  }
  __syncwarp();  // the staging tile is free
}

// Global -> shared copies of (kRows, kHeadDim) fp16 tiles through registers, 16 bytes per thread
// (Volta has no cp.async): kThreadsPerRow threads per row, as many threads of the block as the tile
// can use (the rest skip the copy). copy() does both halves at once; load() and store() split them, so
// that the next tile's loads are in flight while the block computes on the current one.
template <int kRows, int kHeadDim, int kNThreads>
struct GmemTileCopy {
  static constexpr int kThreadsPerRow = kHeadDim % 64 == 0 ? 8 : 4;
  static constexpr int kThreads = kRows * kThreadsPerRow < kNThreads ? kRows * kThreadsPerRow : kNThreads;
  static_assert(kRows % (kThreads / kThreadsPerRow) == 0);
  using TiledCopy = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, half_t>{},
      Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));

  // A thread's share of a tile in registers, for load() and store().
  __device__ static auto make_regs() {
    auto coord = TiledCopy{}.get_slice(0).partition_S(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
    return make_tensor<half_t>(shape(coord));
  }

  // gmem: (kRows, kHeadDim) view of global memory; smem: the same shape in shared memory. Rows from
  // rows_left and columns from head_dim on are zero-filled.
  template <typename GTensor, typename STensor>
  __device__ static void copy(GTensor const& gmem, STensor& smem, int rows_left, int head_dim, int tid) {
    auto regs = make_regs();
    load(gmem, regs, rows_left, head_dim, tid);
    store(regs, smem, tid);
  }

  template <typename GTensor, typename Regs>
  __device__ static void load(GTensor const& gmem, Regs& regs, int rows_left, int head_dim, int tid) {
    if (tid >= kThreads) return;
    TiledCopy tiled_copy;
    auto thr = tiled_copy.get_thread_slice(tid);
    Tensor coord = thr.partition_S(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
    copy_tile_bounded<true>(tiled_copy, thr.partition_S(gmem), regs, coord, rows_left, head_dim);
  }

  template <typename Regs, typename STensor>
  __device__ static void store(Regs const& regs, STensor& smem, int tid) {
    if (tid >= kThreads) return;
    TiledCopy tiled_copy;
    cute::copy(tiled_copy, regs, tiled_copy.get_thread_slice(tid).partition_D(smem));
  }
};

}  // namespace cuteflash::sm70

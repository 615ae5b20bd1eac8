// Building blocks of the sm70 kernels: WMMA 16x16x16 fp16 products with fp32 accumulation on row-major
// shared-memory tiles, their error-corrected form, global -> shared copies without cp.async, and stores
// of accumulator tiles.
#pragma once

#include <mma.h>

#include <type_traits>

#include "cuteflash/common/utils.cuh"

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
using FragAOf =
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half,
                           std::conditional_t<kTransposed, nvcuda::wmma::col_major, nvcuda::wmma::row_major>>;

// A warp's 16x16 output tiles of a product with kTileRows x kTileCols tiles, dealt so that they share
// their rows: warp w owns tile row w % kTileRows and the tile columns col(i) = w / kTileRows + i kColStep,
// i < kCount, those below kTileCols (valid(i)). Sharing rows, a warp loads the split A operand of a step
// along K once for all of its tiles.
template <int kTileRows, int kTileCols, int kNWarps>
struct WarpRowTiles {
  static_assert(kNWarps % kTileRows == 0);
  static constexpr int kColStep = kNWarps / kTileRows;
  static constexpr int kCount = (kTileCols + kColStep - 1) / kColStep;
  int row, col0;

  __device__ explicit WarpRowTiles(int warp) : row(warp % kTileRows), col0(warp / kTileRows) {}
  __device__ int col(int i) const { return col0 + i * kColStep; }
  __device__ bool valid(int i) const { return kTileCols % kColStep == 0 || col(i) < kTileCols; }
  // f(i, the tile's first column) for each valid tile i.
  template <typename F>
  __device__ __forceinline__ void for_each(F const& f) const {
    CUTE_UNROLL
    for (int i = 0; i < kCount; ++i) {
      if (valid(i)) f(i, col(i) * 16);
    }
  }
};

// acc[i] += hi' B_i + lo B_i, the error-corrected product (see kLoScaleLog2) of a split fp32 A with an
// fp16 B, in units of A's 2^11 x, for a warp's tiles (WarpRowTiles): A is the 16-row band of the tiles'
// row, a_hi / a_lo (kK along K, same layout: row-major, or with kATransposed its transpose stored
// row-major, e.g. P^T read from P); B_i is the 16-column slice col(i) of the row-major (kK, *) b. K is
// the outer loop: a step loads A's two fragments once and one B fragment per tile. Without `correction`
// the lo half is skipped (plain fp16 A, for comparison).
template <int kK, bool kATransposed, typename Tiles>
__device__ __forceinline__ void mma_row_tiles_split(FragAcc (&acc)[Tiles::kCount], Tiles const& tiles,
                                                    __half const* a_hi, __half const* a_lo, int lda, __half const* b,
                                                    int ldb, bool correction) {
  CUTE_UNROLL
  for (int k = 0; k < kK / 16; ++k) {
    const int a_step = kATransposed ? k * 16 * lda : k * 16;
    FragAOf<kATransposed> hi, lo;
    nvcuda::wmma::load_matrix_sync(hi, a_hi + a_step, lda);
    if (correction) nvcuda::wmma::load_matrix_sync(lo, a_lo + a_step, lda);
    tiles.for_each([&](int i, int col0) {
      FragBRow fb;
      nvcuda::wmma::load_matrix_sync(fb, b + k * 16 * ldb + col0, ldb);
      nvcuda::wmma::mma_sync(acc[i], hi, fb, acc[i]);
      if (correction) nvcuda::wmma::mma_sync(acc[i], lo, fb, acc[i]);
    });
  }
}

// Writes acc * scale (a 16x16 fp32 tile) as Out (half_t, or float) to out, a row-major global matrix, through the
// warp's shared staging tile: rows below rows_valid, columns below cols_valid (a multiple of 8).
template <typename Out>
__device__ __forceinline__ void store_tile(FragAcc const& acc, float scale, float* stage, Out* out, int64_t row_stride,
                                           int rows_valid, int cols_valid) {
  const int lane = threadIdx.x % 32;
  nvcuda::wmma::store_matrix_sync(stage, acc, 16, nvcuda::wmma::mem_row_major);
  __syncwarp();
  const int r = lane / 2, c0 = (lane % 2) * 8;
  if (r < rows_valid && c0 < cols_valid) {
    using Packed = cutlass::AlignedArray<Out, 8, 16>;
    Packed packed;
    CUTE_UNROLL
    for (int c = 0; c < 8; ++c) packed[c] = Out(stage[r * 16 + c0 + c] * scale);
    *reinterpret_cast<Packed*>(out + r * row_stride + c0) = packed;
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

  // The rows of a tile that thread tid (< kThreads) loads: row(tid, m), m < kRowsPerThread.
  static constexpr int kRowsPerThread = kRows / (kThreads / kThreadsPerRow);
  __device__ static int row(int tid, int m) { return tid / kThreadsPerRow + m * (kThreads / kThreadsPerRow); }

  // load() of a tile whose row r, the thread's m-th, is row_at(m, r), or zeros where that is null
  // (copy_rows_bounded): a paged cache. kChecked false: every row is read, over the whole head dim.
  template <bool kChecked, typename RowAt, typename Regs>
  __device__ static void load_rows(RowAt const& row_at, Regs& regs, int head_dim, int tid) {
    if (tid >= kThreads) return;
    TiledCopy tiled_copy;
    auto thr = tiled_copy.get_thread_slice(tid);
    Tensor coord = thr.partition_S(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
    copy_rows_bounded<true, kChecked, kRows, kHeadDim>(tiled_copy, thr, row_at, regs, coord, head_dim);
  }

  // Asks for the 128-byte lines of gmem's rows below rows_left ahead of a copy() of the same tile,
  // holding no registers (the threads that copy a line's first 16 bytes ask for it), with
  // prefetch.global.L1. The gain is in code generation more than in caching: the later copy still mostly
  // misses L1, but without the prefetch ptxas spills in the backward at d=128, which is then 1.7 % slower.
  template <typename GTensor>
  __device__ static void prefetch(GTensor const& gmem, int rows_left, int tid) {
    if (tid >= kThreads) return;
    TiledCopy tiled_copy;
    auto thr = tiled_copy.get_thread_slice(tid);
    Tensor src = thr.partition_S(gmem);
    Tensor coord = thr.partition_S(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (get<1>(coord(0, m, k)) % 64 == 0 && get<0>(coord(0, m, k)) < rows_left) {
          asm volatile("prefetch.global.L1 [%0];" ::"l"(&src(0, m, k)));
        }
      }
    }
  }

  template <typename Regs, typename STensor>
  __device__ static void store(Regs const& regs, STensor& smem, int tid) {
    if (tid >= kThreads) return;
    TiledCopy tiled_copy;
    cute::copy(tiled_copy, regs, tiled_copy.get_thread_slice(tid).partition_D(smem));
  }
};

}  // namespace cuteflash::sm70

// Small device helpers shared by the kernel families: layout views of MMA accumulators, type
// conversion of register fragments, predicated tile copies.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "cuteflash/common/params.h"

namespace cuteflash {

using namespace cute;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// threadIdx.x of a block of kNThreads threads, with that range stated: otherwise nvcc may not know that
// the index is non-negative and divides it by powers of two as a signed number (the range saves 23 % of
// the instructions of the sm70 backward's step at d=64).
// kFresh: read anew at each call, for a kernel that walks several tiles (sequence.cuh's for_each_tile): what
// the compiler derives from the index (copy and shared-memory offsets) would otherwise be computed once before
// the walk and held through each tile's main loop, which at the register limit (the sm80 forward at head dim
// 128) turns into spills and register moves in that loop.
template <int kNThreads, bool kFresh = false>
__device__ __forceinline__ int thread_index() {
  int tid;
  if constexpr (kFresh) {
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  } else {
    tid = threadIdx.x;
  }
  __builtin_assume(tid >= 0 && tid < kNThreads);
  return tid;
}

// 2^x on the special function unit; ex2.approx(-inf) is +0, which masked entries rely on.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// *ptr += x in global memory, without a return value. atomicAdd on a generic float* may compile to a
// shared-or-global test with a compare-and-swap loop, which also pushes the backward kernel's fragments
// into local memory at d=256.
__device__ __forceinline__ void global_red_add(float* ptr, float x) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(ptr), "f"(x) : "memory");
}

// ptr[0..3] += x[0..3], ptr 16-byte aligned: one vector reduction (sm90, PTX ISA 8.1: CUDA 12.1 or newer).
__device__ __forceinline__ void global_red_add_v4(float* ptr, float const* x) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
}

// The four threads of a quad (lanes 4i..4i+3) hold one accumulator row between them.
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return op(x, __shfl_xor_sync(0xffffffff, x, 1));
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// An m16n8 accumulator fragment ((2, 2), MMA_M, MMA_N) viewed as (rows, cols) =
// ((2, MMA_M), (2, MMA_N)): value mode 0 is (column pair, row half).
template <typename Layout>
__host__ __device__ constexpr auto acc_rowcol(Layout acc) {
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(size<0>(acc))::value == 4);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The same accumulator read as the A operand of the next m16n8k16 product (P in P.V):
// two neighbouring n8 blocks form one k16 slice, ((4, 2), MMA_M, MMA_N / 2). For m16n8k8 (kMmaK 8), whose A
// fragment holds the values of an m16n8 accumulator in the same order, each n8 block is one k8 slice: unchanged.
template <int kMmaK = 16, typename Layout>
__host__ __device__ constexpr auto acc_as_a_operand(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4);
  static_assert(kMmaK == 8 || kMmaK == 16);
  if constexpr (kMmaK == 8) {
    return acc;
  } else {
    static_assert(decltype(size<2>(acc))::value % 2 == 0);
    auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N / 2))
    return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
  }
}

// Element-wise conversion of a register fragment into dst, a fragment of src's layout: register for register (a copy
// between fragments whose layouts differ would repack the 16-bit halves).
template <typename SrcEngine, typename DstEngine, typename Layout>
__device__ __forceinline__ void convert_fragment_into(Tensor<SrcEngine, Layout> const& src,
                                                      Tensor<DstEngine, Layout>& dst) {
  using From = typename SrcEngine::value_type;
  using To = typename DstEngine::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
}

// The same into a new fragment of src's layout.
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  Tensor dst = make_tensor<To>(src.layout());
  convert_fragment_into(src, dst);
  return dst;
}

// The rows of one (batch, head) of a (batch, seqlen, nheads, head_dim) tensor, kRows at a time: block(i)
// is the (kRows, kHeadDim) tile of rows [i * kRows, (i + 1) * kRows). Offsets inside a tile are 32-bit
// (api.cpp keeps row strides below 2^24), so a thread's copy addresses all derive from one 64-bit pointer
// (64-bit tile strides add 84 bytes of spills to the sm80 forward loop at head dim 128).
template <int kRows, int kHeadDim, typename Element>
struct HeadRows {
  static_assert(kRows <= 128);  // with row strides below 2^24, block offsets stay below 2^31
  Element* head;
  int64_t row_stride;

  __device__ auto block(int i) const {
    return make_tensor(make_gmem_ptr(head + int64_t(i) * kRows * row_stride),
                       make_layout(Shape<Int<kRows>, Int<kHeadDim>>{}, make_stride(int(row_stride), _1{})));
  }
};

// The rows of (batch, head) of operand t from row row0 on (a sequence's first row: Sequence), read (or
// written) as Element.
template <int kRows, int kHeadDim, typename Element>
__device__ __forceinline__ HeadRows<kRows, kHeadDim, Element> head_rows(Operand const& t, int batch, int head,
                                                                        int row0) {
  return {t.at<Element>(batch, head, row0), t.row_stride};
}

// Copy a partitioned tile (CPY, CPY_ROWS, CPY_COLS) whose rows or columns may run past the tensor:
// `coord` is the identity tensor partitioned the same way, giving each chunk's (row, col) in the tile.
// Chunks outside [0, max_rows) x [0, max_cols) are skipped, or zero-filled in `dst` when `kZeroFill`.
template <bool kZeroFill, typename TiledCopy, typename SrcTensor, typename DstTensor, typename CoordTensor>
__device__ __forceinline__ void copy_tile_bounded(TiledCopy const& tiled_copy, SrcTensor const& src, DstTensor&& dst,
                                                  CoordTensor const& coord, int max_rows, int max_cols) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    bool row_ok = get<0>(coord(0, m, 0)) < max_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (row_ok && get<1>(coord(0, m, k)) < max_cols) {
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
      } else if constexpr (kZeroFill) {
        clear(dst(_, m, k));
      }
    }
  }
}

// copy_tile_bounded for a tile whose rows lie anywhere in memory (a paged cache): row_at(m, r) points to the first
// element of the tile's row r, the thread's m-th, or is null for a row that is not read. Chunks of those rows,
// and from column max_cols on, are skipped, or zero-filled in `dst` when `kZeroFill`; without kChecked, the caller
// knows every row is read over every column, and nothing is checked. thr: tiled_copy's slice of this thread.
template <bool kZeroFill, bool kChecked, int kRows, int kCols, typename TiledCopy, typename ThrCopy, typename RowAt,
          typename DstTensor, typename CoordTensor>
__device__ __forceinline__ void copy_rows_bounded(TiledCopy const& tiled_copy, ThrCopy const& thr, RowAt const& row_at,
                                                  DstTensor&& dst, CoordTensor const& coord, int max_cols) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    auto const* row = row_at(m, get<0>(coord(0, m, 0)));
    // The thread's chunks of a tile all of whose rows are this one.
    Tensor src = thr.partition_S(
        make_tensor(make_gmem_ptr(row), make_layout(Shape<Int<kRows>, Int<kCols>>{}, make_stride(_0{}, _1{}))));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      if (!kChecked || (row != nullptr && get<1>(coord(0, m, k)) < max_cols)) {
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
      } else if constexpr (kZeroFill) {
        clear(dst(_, m, k));
      }
    }
  }
}

// cp.async of 16 bytes from global memory (zeros where !ok) that the kernel reads once, as the decoding kernel reads
// a KV cache: L2 keeps them at the lowest priority (evict-first) and fetches the 256 bytes around them at once. A
// single query row over 8k cached keys is 3 % faster this way than with CuTe's cp.async (128-byte prefetch) on an H100.
__device__ __forceinline__ void cp_async_read_once(void* smem_dst, void const* gmem_src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src), "r"(ok ? 16 : 0), "l"(policy));
#endif  // (below sm_80, the sm70 family's, the decoding kernel loads into registers)
}

__device__ __forceinline__ void cp_async_commit() { cute::cp_async_fence(); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

}  // namespace cuteflash

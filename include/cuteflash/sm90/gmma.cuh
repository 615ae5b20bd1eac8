// The sm90 family's parts that its kernels share: the mbarriers' types, views of wgmma's accumulators, a batch of
// wgmma, a ring of buffers' state, and an accumulator tile's store from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuteflash/common/utils.cuh"

namespace cuteflash::sm90 {

using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

// An accumulator fragment of wgmma, ((2, 2, N / 8), MMA_M, MMA_N) (a thread holds column pairs of two rows 8 apart),
// viewed as (rows, cols) = ((2, MMA_M), (2, N / 8, MMA_N)).
template <typename Layout>
__host__ __device__ constexpr auto acc_rowcol_gmma(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3 && decltype(size<0, 0>(acc))::value == 2);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same accumulator, converted to 16 bits, as the register A operand of the next wgmma (P in P V): its k16 slices
// are pairs of n8 column blocks, ((2, 2, 2), MMA_M, (N / 16, MMA_N)); the values stay where they are.
template <typename Layout>
__host__ __device__ constexpr auto acc_as_a_operand_gmma(Layout acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto pairs = logical_divide(get<0, 2>(acc), Tile<_2>{});  // (2, N / 16)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(pairs)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(pairs), get<2>(acc))));
}

// A wgmma accumulator converted to 16 bits as words of column pairs, (row half, MMA_M, n8 tiles over MMA_N): the view
// that common/dropout.cuh's apply_dropout_words takes.
template <typename Fragment>
__device__ __forceinline__ auto acc_words_gmma(Fragment& fragment) {
  Tensor words = recast<uint32_t>(fragment);  // ((1, 2, N / 8), MMA_M, MMA_N)
  auto layout = words.layout();
  static_assert(decltype(size<0, 0>(layout))::value == 1 && decltype(size<0, 1>(layout))::value == 2);
  return make_tensor(words.data(),
                     make_layout(get<0, 1>(layout), get<1>(layout), make_layout(get<0, 2>(layout), get<2>(layout))));
}

// c (+)= a b over the k-slices of a and b, issued as one batch of wgmma; kWait: then waits until at most kWait
// batches are in flight (-1: returns at once, the caller waits with warpgroup_wait). kZeroInit: c = a b (the first
// slice's product overwrites c, so that no other instruction writes c between products).
template <bool kZeroInit, int kWait, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void gmma(TiledMma& tiled_mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegisterA = !std::is_base_of_v<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(tiled_mma, a(_, _, k), b(_, _, k), c);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// warpgroup_fence_operand on each of the fragments.
template <typename... Fragments>
__device__ __forceinline__ void warpgroup_fence_operands(Fragments&... fragments) {
  (warpgroup_fence_operand(fragments), ...);
}

// dst[0, bytes / 4) += src[0, bytes / 4) in fp32, from shared to global memory: one bulk reduction, in this thread's
// bulk async-group that cute::tma_store_arrive commits (cute::tma_store_wait: its reads of src are done). Both
// addresses 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add(float* dst, float const* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
               "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
}

// Waits until this thread's bulk async-groups are complete: their writes done, not only their reads.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// A ring of kStages buffers: the stage and the phase parity a thread's next use of it waits for.
template <int kStages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// A producer warp's TMA load into a buffer of which only rows [0, rows) are of the tile's sequence (rows < kRows: the
// last block of a variable-length batch's sequence). TMA brings whole blocks, the rows past the sequence from the next
// sequence or, past the operand, zeros; the masks leave those rows out with zeros, but a zero times an infinity or a
// NaN there would not be, so the warp sets them to zero before the consumers are told: the leader lane issues the
// copy (issue(barrier)) on `landed`, the producer's own barrier (landed_phase: the parity of its next phase), the warp
// waits for it, zeroes the rows (zero_rows), and the leader arrives on `full` (initialised for one arrival; no bytes
// expected). Where every row is the sequence's, the copy is issued on `full` itself.
template <typename Issue, typename ZeroRows>
__device__ __forceinline__ void load_zeroing_tail(uint64_t* full, uint64_t* landed, uint32_t& landed_phase,
                                                  uint32_t bytes, bool partial, bool leader, Issue const& issue,
                                                  ZeroRows const& zero_rows) {
  if (!partial) {
    if (leader) {
      ClusterTransactionBarrier::arrive_and_expect_tx(full, bytes);
      issue(*full);
    }
    return;
  }
  if (leader) {
    ClusterTransactionBarrier::arrive_and_expect_tx(landed, bytes);
    issue(*landed);
  }
  ClusterTransactionBarrier::wait(landed, landed_phase);
  landed_phase ^= 1;
  zero_rows();
  cutlass::arch::fence_view_async_shared();  // the zeros are visible to the products (wgmma) that read the buffer
  __syncwarp();
  if (leader) ClusterBarrier::arrive(full);
}

// Rows [rows, kRows) of a shared-memory tile zeroed by the 32 lanes of a warp, 16 bytes a store: at(r, c) is the
// address of the tile's row r, column c (kCols columns of 16-bit elements, 8 consecutive ones contiguous from a
// multiple of 8, as in every swizzled layout of the family).
template <int kRows, int kCols, typename At>
__device__ __forceinline__ void zero_rows_from(int rows, At const& at) {
  constexpr int kChunks = kCols / 8;
  for (int c = int(threadIdx.x % 32); c < (kRows - rows) * kChunks; c += 32) {
    *reinterpret_cast<uint4*>(at(rows + c / kChunks, c % kChunks * 8)) = make_uint4(0, 0, 0, 0);
  }
}

// A warpgroup's accumulator fragment acc of tiled_mma's (kRows, kCols) tile to global memory at `out` (row_stride
// elements from a row to the next), rows < rows_left and columns < cols: each thread writes its column pairs
// converted to Element (4 bytes, which the head dim's multiples of 8 and the 16-byte row strides keep aligned).
// row_stride and cols by reference, the params' own: read from the kernel's parameters where used (taken by value,
// ptxas kept them in registers throughout, and the persistent forward kernel's code changed).
template <typename TiledMma, int kRows, int kCols, typename Acc, typename Element>
__device__ __forceinline__ void store_acc_direct(Acc const& acc, Element* out, int64_t const& row_stride, int rows_left,
                                                 int const& cols, int tid) {
  auto thr_mma = TiledMma{}.get_thread_slice(tid);
  Tensor c = thr_mma.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
  Tensor c_rc = make_tensor(c.data(), acc_rowcol_gmma(c.layout()));  // (rows, cols) -> (row, col)
  Tensor r = make_tensor<Element>(acc.layout());
  convert_fragment_into(acc, r);
  Tensor r_rc = make_tensor(r.data(), acc_rowcol_gmma(r.layout()));
  static_assert(decltype(stride<1, 0>(r_rc))::value == 1 && decltype(size<1, 0>(r_rc))::value == 2);
  uint32_t const* words = reinterpret_cast<uint32_t const*>(r.data());  // column pairs
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(r_rc); ++mi) {
    const int row = get<0>(c_rc(mi, 0));
    if (row >= rows_left) continue;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(r_rc); ni += 2) {
      const int col = get<1>(c_rc(mi, ni));
      if (col < cols) *reinterpret_cast<uint32_t*>(out + row * row_stride + col) = words[r_rc.layout()(mi, ni) / 2];
    }
  }
}

}  // namespace cuteflash::sm90

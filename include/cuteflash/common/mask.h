// Which keys each query row may see, and what follows for the blocks of a tiled kernel: block ranges in
// both directions, the blocks that need a mask, and per-row limits, for causal masks, sliding windows and
// per-sequence lengths alike. Plain C++ with no CUDA types, so that the host uses and tests it too.
#pragma once

#include "cuteflash/common/params.h"  // CUTEFLASH_HOST_DEVICE

namespace cuteflash {

// Sequence lengths must be below this (api.cpp checks), so that the policy's arithmetic stays in int.
constexpr int kMaxSeqlen = 1 << 30;

// Block indices [begin, end) to visit, of which [unmasked_begin, unmasked_end) need no per-element mask.
// begin <= unmasked_begin <= unmasked_end <= end; an empty range has begin == end.
struct BlockRange {
  int begin;
  int end;
  int unmasked_begin;
  int unmasked_end;

  // == rather than >=: where begin is 0 at compile time, nvcc then tests end == 0, which spilled less in
  // the sm80 forward kernel than end <= 0.
  CUTEFLASH_HOST_DEVICE bool empty() const { return begin == end; }
  CUTEFLASH_HOST_DEVICE bool masked(int block) const { return block < unmasked_begin || block >= unmasked_end; }

  // Part `part` of `parts` runs of equal length (the last shorter, some past the end empty), with the same masks.
  CUTEFLASH_HOST_DEVICE BlockRange split(int part, int parts) const {
    const int per = (end - begin + parts - 1) / parts;
    BlockRange r = *this;
    r.begin = begin + part * per < end ? begin + part * per : end;
    r.end = r.begin + per < end ? r.begin + per : end;
    return r;
  }
};

// Query row i (0 <= i < seqlen_q) sees key j (0 <= j < seqlen_k) when
//     i + shift - left <= j <= i + shift + right,    shift = seqlen_k - seqlen_q,
// flash-attn's alignment of the mask to the bottom-right corner. causal is right = 0; a side without a
// bound is kUnbounded. A row that sees no key (causal with seqlen_q > seqlen_k, say) has key_end <= key_begin.
// The lengths are those of one sequence: a kernel builds the policy of the sequence it works on.
//
// kWindow: whether a window may bound a side (flash-attn's window_size). Without one the causal diagonal is
// the only bound besides the lengths: no row is bounded on the left, and every expression below reduces at
// compile time to that of the causal case alone (right = 0), with causal-or-not the one run-time choice.
// Kernels compiled for that case keep the registers and the code of causal-only masking.
template <bool kWindow>
struct MaskPolicy {
  // Larger than any length, small enough that row + shift + kUnbounded + 1 (at most seqlen_k + kUnbounded)
  // stays in int.
  static constexpr int kUnbounded = kMaxSeqlen;

  int seqlen_q;
  int seqlen_k;
  int left;   // keys before the diagonal a row sees (kUnbounded: all)
  int right;  // keys after the diagonal a row sees (0: causal; kUnbounded: all)

  // No window: the causal diagonal at most.
  CUTEFLASH_HOST_DEVICE static MaskPolicy make(int seqlen_q, int seqlen_k, bool causal) {
    return {seqlen_q, seqlen_k, kUnbounded, causal ? 0 : kUnbounded};
  }
  // window_left, window_right: flash-attn's window_size, -1 for an unbounded side; causal sets right to 0.
  CUTEFLASH_HOST_DEVICE static MaskPolicy make(int seqlen_q, int seqlen_k, bool causal, int window_left,
                                               int window_right) {
    static_assert(kWindow, "a policy without kWindow cannot bound a row on the left: use MaskPolicy<true>");
    int right = causal ? 0 : window_right < 0 ? kUnbounded : window_right;
    return {seqlen_q, seqlen_k, window_left < 0 ? kUnbounded : window_left, right};
  }

  CUTEFLASH_HOST_DEVICE int shift() const { return seqlen_k - seqlen_q; }
  CUTEFLASH_HOST_DEVICE bool left_bounded() const { return kWindow && left < kUnbounded; }
  CUTEFLASH_HOST_DEVICE bool right_bounded() const { return right < kUnbounded; }
  // The keys row i sees: [key_begin(i), key_end(i)); both are non-decreasing in i.
  CUTEFLASH_HOST_DEVICE int key_begin(int row) const { return left_bounded() ? max_(0, row + shift() - left) : 0; }
  CUTEFLASH_HOST_DEVICE int key_end(int row) const {
    return right_bounded() ? min_(seqlen_k, row + shift() + right_side() + 1) : seqlen_k;
  }
  // The rows that see key j: [row_begin(j), row_end(j)); both are non-decreasing in j.
  CUTEFLASH_HOST_DEVICE int row_begin(int key) const {
    return right_bounded() ? max_(0, key - shift() - right_side()) : 0;
  }
  CUTEFLASH_HOST_DEVICE int row_end(int key) const {
    return left_bounded() ? min_(seqlen_q, key - shift() + left + 1) : seqlen_q;
  }
  CUTEFLASH_HOST_DEVICE bool visible(int row, int key) const { return key >= key_begin(row) && key < key_end(row); }

  // The key blocks of kBlockN keys that query block m_block (rows [m_block * kBlockM, + kBlockM), the part
  // below seqlen_q; m_block < ceil(seqlen_q / kBlockM)) visits; a block is unmasked when every one of its keys
  // is visible to every such row. The block sees no key only when its last row's keys end before key 0.
  // Written without early returns, so that where a side is unbounded the compiler keeps no more live values
  // than the expressions of the other side need.
  template <int kBlockM, int kBlockN>
  CUTEFLASH_HOST_DEVICE BlockRange key_blocks(int m_block) const {
    const int first = m_block * kBlockM, last = min_(first + kBlockM, seqlen_q) - 1;
    const int end_key = key_end(last);
    const int begin = key_begin(first) / kBlockN;
    const int end = !right_bounded() || end_key > 0 ? div_up(end_key, kBlockN) : begin;
    // Unmasked: keys [n kBlockN, (n + 1) kBlockN) inside [key_begin(last), key_end(first)).
    const int unmasked_begin = clamp_(div_up(key_begin(last), kBlockN), begin, end);
    const int unmasked_end = clamp_(max_(key_end(first), 0) / kBlockN, unmasked_begin, end);
    return {begin, end, unmasked_begin, unmasked_end};
  }

  // Whether query block m_block and key block n_block need a per-element mask: not when every row of the
  // query block below seqlen_q sees every key of the key block, and the key block is whole.
  template <int kBlockM, int kBlockN>
  CUTEFLASH_HOST_DEVICE bool block_masked(int m_block, int n_block) const {
    const int first = m_block * kBlockM, last = min_(first + kBlockM, seqlen_q) - 1;
    const int key0 = n_block * kBlockN, key1 = key0 + kBlockN;
    return key1 > seqlen_k || key_begin(last) > key0 || key_end(first) < key1;
  }

  // The query blocks of kBlockM rows that key block n_block (keys [n_block * kBlockN, + kBlockN), the part
  // below seqlen_k; n_block < ceil(seqlen_k / kBlockN)) is seen by; a block is unmasked when each of its rows
  // below seqlen_q sees every key of the key block, and the key block is whole (rows past seqlen_q must not
  // count: kernels give them P = 0). No row sees the block only when the rows that see its last key end
  // before row 0, which takes a bounded left side.
  template <int kBlockM, int kBlockN>
  CUTEFLASH_HOST_DEVICE BlockRange query_blocks(int n_block) const {
    const int first = n_block * kBlockN, last = min_(first + kBlockN, seqlen_k) - 1;
    const int end_row = row_end(last);
    const int begin = row_begin(first) / kBlockM;
    const int end = !left_bounded() || end_row > 0 ? div_up(end_row, kBlockM) : begin;
    // Unmasked rows: [row_begin(last), row_end(first)); a block ending at seqlen_q counts as whole. A key block
    // with keys past seqlen_k is masked in every query block.
    const int rows_begin = row_begin(last), rows_end = row_end(first);
    const int unmasked_begin = clamp_(div_up(rows_begin, kBlockM), begin, end);
    const int unmasked_end = last - first + 1 < kBlockN ? unmasked_begin
                                                        : clamp_(rows_end >= seqlen_q ? div_up(seqlen_q, kBlockM)
                                                                                      : max_(rows_end, 0) / kBlockM,
                                                                 unmasked_begin, end);
    return {begin, end, unmasked_begin, unmasked_end};
  }

 private:
  // The right side's offset where it is bounded: 0 (causal) without kWindow, a constant the compiler folds.
  CUTEFLASH_HOST_DEVICE int right_side() const { return kWindow ? right : 0; }
  // On the device CUDA's min and max: nvcc keeps the conditional-expression form as a compare and a select,
  // which changes the register allocation of the kernels' main loops (a spill more in the sm80 forward).
  CUTEFLASH_HOST_DEVICE static int min_(int a, int b) {
#ifdef __CUDA_ARCH__
    return ::min(a, b);
#else
    return a < b ? a : b;
#endif
  }
  CUTEFLASH_HOST_DEVICE static int max_(int a, int b) {
#ifdef __CUDA_ARCH__
    return ::max(a, b);
#else
    return a > b ? a : b;
#endif
  }
  CUTEFLASH_HOST_DEVICE static int clamp_(int x, int lo, int hi) { return max_(lo, min_(x, hi)); }
  CUTEFLASH_HOST_DEVICE static int div_up(int a, int b) { return (a + b - 1) / b; }
};

}  // namespace cuteflash

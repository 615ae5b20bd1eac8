// Dropout on the attention probabilities, the same mask in every kernel that needs it.
//
// The mask is a function of the call's random state (params.h's rng_state: a 64-bit counter base, drawn by
// the caller from torch's CUDA generator) and of an element's place: batch index, head, and row and column
// inside its sequence. It is computed in units of eight elements, rows i and i + 8 (i % 16 < 8) by columns
// j, j + 1, j + 8 and j + 9 (j % 16 < 8, j even): what a thread holds of two neighbouring m16n8 accumulator
// tiles. A unit is one Philox-2x32-10 draw (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011) of two 32-bit words at the 64-bit counter base + unit number, under a fixed key (the randomness is
// all in the counter, and a constant key schedule costs no instructions): word w holds row i + 8 w, a byte per
// column in the order j, j + 1, j + 8, j + 9. An element is kept where its byte is below dropout_threshold,
// (1 - p) 256 rounded: as in flash-attn, the keep probability is a multiple of 1/256. Units are numbered
// row-pair-major over a (batch, head)'s rows and columns: rows and columns of the batch's sequences (fixed
// length) or of its whole operands (variable length, whose sequences may exceed the caller's bounds), so that
// no two elements of a call share a draw.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuteflash/common/params.h"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

constexpr uint32_t kPhiloxKey = 0x2545F491u;

// Philox-2x32 with 10 rounds on counter (lo, hi) and key `key`: a round is one IMAD.WIDE.U32 and one LOP3 with
// a constant key (the product's halves as __umulhi and a multiply: written as a 64-bit product, nvcc adds an
// instruction per round).
__device__ __forceinline__ uint2 philox2x32_10(uint32_t lo, uint32_t hi, uint32_t key) {
  constexpr uint32_t kMultiplier = 0xD256D193u;
  CUTE_UNROLL
  for (int round = 0; round < 10; ++round) {
    const uint32_t next_lo = __umulhi(kMultiplier, lo) ^ key ^ hi;
    hi = kMultiplier * lo;
    lo = next_lo;
    key += 0x9E3779B9u;
  }
  return {lo, hi};
}

// The byte of a unit's word that holds column col (any column: its place in the unit).
__host__ __device__ __forceinline__ constexpr int dropout_byte(int col) { return col % 2 + (col & 8) / 4; }

// Whether the element in byte `byte` of a draw's word is kept.
__device__ __forceinline__ bool dropout_keeps(uint32_t word, int byte, uint32_t threshold) {
  return ((word >> (8 * byte)) & 0xFFu) < threshold;
}

// dropout_keeps for two bytes of a word at once, bytes 0 and 1 (kHigh = false: columns j, j + 1) or 2 and 3
// (columns j + 8, j + 9): 0xFFFF in each 16-bit half that is kept, 0 in the others. One byte permutation makes
// the halves 0x5C00 | byte, fp16 numbers (256 + byte / 4) ordered as the bytes, and one f16x2 comparison with
// threshold2 (0x5C00 | threshold in both halves) decides both.
template <bool kHigh>
__device__ __forceinline__ uint32_t dropout_keep_halves(uint32_t word, uint32_t threshold2) {
  const uint32_t halves = __byte_perm(word, 0x5Cu, kHigh ? 0x4342u : 0x4140u);
  uint32_t mask;
  asm("set.lt.u32.f16x2 %0, %1, %2;" : "=r"(mask) : "r"(halves), "r"(threshold2));
  return mask;
}

__device__ __forceinline__ uint32_t dropout_threshold2(uint32_t threshold) { return (0x5C00u | threshold) * 0x10001u; }

struct Dropout {
  uint64_t head_counter;  // the counter of the (batch, head)'s unit 0
  uint32_t col_units;     // units per row pair
  uint32_t threshold;

  // The mask of batch index `batch` (its sequence in a variable-length batch) and head `head`.
  __device__ __forceinline__ static Dropout make(FwdParams const& p, int batch, int head) {
    const bool varlen = p.cu_seqlens_q != nullptr;
    const uint64_t row_units = uint64_t((varlen ? p.total_q : p.seqlen_q) + 15) / 16 * 8;
    const uint32_t col_units = uint32_t((varlen ? p.total_k : p.seqlen_k) + 15) / 16 * 4;
    return {*p.rng_state + (uint64_t(batch) * p.nheads + head) * row_units * col_units, col_units, p.dropout_threshold};
  }

  // The counter of the units of rows (row, row + 8) of the sequence (row % 16 < 8): add the column's unit.
  __device__ __forceinline__ uint64_t row_counter(int row) const {
    return head_counter + uint64_t(row / 16 * 8 + row % 8) * col_units;
  }

  // The draw of the unit that holds column col, of rows (row, row + 8), from row_counter(row).
  __device__ __forceinline__ uint2 draw(uint64_t row_counter, int col) const {
    const uint64_t counter = row_counter + uint32_t(col) / 16 * 4 + uint32_t(col) % 8 / 2;
    return philox2x32_10(uint32_t(counter), uint32_t(counter >> 32), kPhiloxKey);
  }
};

// The keep bits of columns col0 + c (c < kCols) of one row, as the words of their units: with kCols a multiple
// of 16 and col0 % 16 == 0, whole units (a word per unit, kCols / 4); with kCols <= 8 and col0 % kCols == 0,
// the columns lie in one half of a unit's columns (a word per column pair, half of whose bytes are read).
// kPaired (whole units): lane ^ 8 of the warp holds row ^ 8 with the same columns, so that each of the two draws
// half of the units and they trade the other row's words.
template <int kCols, bool kPaired>
struct RowKeep {
  static constexpr bool kWhole = kCols % 16 == 0;
  static_assert(kWhole || (kCols <= 8 && kCols % 2 == 0 && !kPaired));
  static constexpr int kWords = kWhole ? kCols / 4 : kCols / 2;
  uint32_t word[kWords];
  int shift;  // !kWhole: the bits of the columns' half (0, or 16 where col0 % 16 >= 8)

  __device__ __forceinline__ RowKeep(Dropout const& dropout, int row, int col0) : shift((col0 & 8) * 2) {
    const bool second = row & 8;  // the unit's second row
    const uint64_t counter = dropout.row_counter(row & ~8);
    // The first column of word k's unit.
    auto unit_col = [&](int k) { return kWhole ? col0 + k / 4 * 16 + k % 4 * 2 : col0 + 2 * k; };
    if constexpr (kPaired) {
      static_assert(kWords % 2 == 0);
      CUTE_UNROLL
      for (int k = 0; k < kWords; k += 2) {
        const uint2 draw = dropout.draw(counter, unit_col(k + int(second)));  // unit k + second
        const uint32_t mine = second ? draw.y : draw.x;
        const uint32_t got = __shfl_xor_sync(0xffffffffu, second ? draw.x : draw.y, 8);  // unit k + !second
        word[k] = second ? got : mine;
        word[k + 1] = second ? mine : got;
      }
    } else {
      CUTE_UNROLL
      for (int k = 0; k < kWords; ++k) {
        const uint2 draw = dropout.draw(counter, unit_col(k));
        word[k] = second ? draw.y : draw.x;
      }
    }
  }

  // Column c's byte in the low 8 bits (higher bits: other columns'); kept where it is below the threshold.
  __device__ __forceinline__ uint32_t bits(int c) const {
    if constexpr (kWhole) {
      return word[c / 16 * 4 + c % 8 / 2] >> (8 * dropout_byte(c));
    } else {
      return word[c / 2] >> (8 * (c % 2) + shift);
    }
  }
  __device__ __forceinline__ static bool kept(uint32_t bits, uint32_t threshold) {
    return dropout_keeps(bits, 0, threshold);
  }
  __device__ __forceinline__ bool keeps(int c, uint32_t threshold) const { return kept(bits(c), threshold); }
};

// Calls f(mi, ni, kept) for each element of a thread's (rows, cols) view of m16n8 accumulator tiles, kept:
// whether dropout keeps it. coord gives (row, col) in the tile whose first row and key are row0 and col0, as
// the accumulator's layout pairs them: rows 2 m and 2 m + 1 are 8 apart, columns 2 n and 2 n + 1 adjacent,
// and the tiled MMA must place a warp's n8 tiles in pairs 8 columns apart, the first at a column j with
// j % 16 < 8: columns 4 q, 4 q + 1, 4 q + 2 and 4 q + 3 are then those of one unit.
template <typename CoordTensor, typename F>
__device__ __forceinline__ void for_each_kept(Dropout const& dropout, CoordTensor const& coord, int row0, int col0,
                                              F const& f) {
  constexpr int kRows = decltype(size<0>(coord))::value, kCols = decltype(size<1>(coord))::value;
  static_assert(kRows % 2 == 0 && kCols % 4 == 0);
  CUTE_UNROLL
  for (int m = 0; m < kRows / 2; ++m) {
    const uint64_t counter = dropout.row_counter(row0 + get<0>(coord(2 * m, 0)));
    CUTE_UNROLL
    for (int q = 0; q < kCols / 4; ++q) {
      const uint2 draw = dropout.draw(counter, col0 + get<1>(coord(0, 4 * q)));
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        f(2 * m + e / 4, 4 * q + e % 4, dropout_keeps(e < 4 ? draw.x : draw.y, e % 4, dropout.threshold));
      }
    }
  }
}

// for_each_kept on transposed scores, keys in rows: coord gives (key, row) of a thread's (keys, rows) view of m16n8
// (or wgmma) accumulator tiles of S^T whose first key and row are key0 and row0. Its keys 2 a and 2 a + 1 are k and
// k + 8 (k % 16 < 8), its rows 4 b .. 4 b + 3 are r, r + 1, r + 8 and r + 9 (r % 16 < 8, r even): half of each of two
// units, rows (r, r + 8) and (r + 1, r + 9) by columns j, j + 1, j + 8, j + 9 (j = k rounded down to even), whose other
// halves lane ^ 4 holds (key k ^ 1, the same rows). Each of the two draws one of the units and they trade the halves
// the other needs, packed in a word: a draw and a shuffle per eight elements, as in the forward. Every lane of the warp
// must take part.
template <typename CoordTensor, typename F>
__device__ __forceinline__ void for_each_kept_transposed(Dropout const& dropout, CoordTensor const& coord, int key0,
                                                         int row0, F const& f) {
  constexpr int kKeys = decltype(size<0>(coord))::value, kRows = decltype(size<1>(coord))::value;
  static_assert(kKeys % 2 == 0 && kRows % 4 == 0);
  CUTE_UNROLL
  for (int a = 0; a < kKeys / 2; ++a) {
    const int key = key0 + get<0>(coord(2 * a, 0));
    const bool odd = key & 1;
    CUTE_UNROLL
    for (int b = 0; b < kRows / 4; ++b) {
      const int row = row0 + get<1>(coord(0, 4 * b));
      // This lane's unit: rows (row, row + 8) where its key is even, else (row + 1, row + 9).
      const uint2 draw = dropout.draw(dropout.row_counter(row + int(odd)), key - int(odd));
      // A word's bytes: (its upper row, key k), (upper row, k + 8), (lower row, k), (lower row, k + 8), of the even
      // keys' columns (j, j + 8: the draw's bytes 0 and 2) or the odd keys' (j + 1, j + 9: bytes 1 and 3).
      const uint32_t even_keys = __byte_perm(draw.x, draw.y, 0x6420), odd_keys = __byte_perm(draw.x, draw.y, 0x7531);
      const uint32_t own = odd ? odd_keys : even_keys;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? even_keys : odd_keys, 4);
      const uint32_t word[2] = {odd ? got : own, odd ? own : got};  // rows (row, row + 8), (row + 1, row + 9)
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        const int r = e % 2, c = e / 2;  // key 2 a + r, row 4 b + c
        f(2 * a + r, 4 * b + c, dropout_keeps(word[c % 2], c / 2 * 2 + r, dropout.threshold));
      }
    }
  }
}

// P with the elements that dropout drops zeroed, P's 16-bit values as words of column pairs: words (2, M, N), word
// (h, m, n) holding the two columns of m16n8 tile (m, n)'s row 8 h (as an accumulator fragment converted to a 16-bit
// type holds them), tiles n and n + 1 (n even) the halves of a unit's words. coord: the fp32 fragment's (rows, cols)
// coordinates, as for for_each_kept.
template <typename Words, typename CoordTensor>
__device__ __forceinline__ void apply_dropout_words(Words&& words, Dropout const& dropout, CoordTensor const& coord,
                                                    int row0, int col0) {
  static_assert(decltype(size<0>(words))::value == 2 && decltype(size<2>(words))::value % 2 == 0);
  const uint32_t threshold2 = dropout_threshold2(dropout.threshold);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(words); ++m) {
    const uint64_t counter = dropout.row_counter(row0 + get<0>(coord(2 * m, 0)));
    CUTE_UNROLL
    for (int n = 0; n < size<2>(words); n += 2) {
      const uint2 draw = dropout.draw(counter, col0 + get<1>(coord(0, 2 * n)));
      words(0, m, n) &= dropout_keep_halves<false>(draw.x, threshold2);
      words(0, m, n + 1) &= dropout_keep_halves<true>(draw.x, threshold2);
      words(1, m, n) &= dropout_keep_halves<false>(draw.y, threshold2);
      words(1, m, n + 1) &= dropout_keep_halves<true>(draw.y, threshold2);
    }
  }
}

// apply_dropout_words on an m16n8 accumulator fragment (MMA, MMA_M, MMA_N) converted to a 16-bit type, whose atoms'
// two registers hold their rows 0 and 8's two columns.
template <typename PTensor, typename CoordTensor>
__device__ __forceinline__ void apply_dropout_packed(PTensor& p, Dropout const& dropout, CoordTensor const& coord,
                                                     int row0, int col0) {
  apply_dropout_words(recast<uint32_t>(p), dropout, coord, row0, col0);  // (2, MMA_M, MMA_N)
}

// x(mi, ni) = kept ? x(mi, ni) * scale : 0 on a (rows, cols) view x with coordinates coord (for_each_kept).
template <typename Tensor, typename CoordTensor>
__device__ __forceinline__ void apply_dropout(Tensor& x, Dropout const& dropout, CoordTensor const& coord, int row0,
                                              int col0, float scale) {
  for_each_kept(dropout, coord, row0, col0,
                [&](int mi, int ni, bool kept) { x(mi, ni) = kept ? x(mi, ni) * scale : 0.f; });
}

// Which elements of a (rows, cols) view with coordinates coord dropout keeps (for_each_kept), a bit each, for
// kernels that use the mask twice.
template <int kRows, int kCols>
struct KeepMask {
  static constexpr int kWords = (kRows * kCols + 31) / 32;
  uint32_t bits[kWords];

  __device__ __forceinline__ KeepMask() {
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) bits[w] = 0;
  }
  template <typename CoordTensor>
  __device__ __forceinline__ KeepMask(Dropout const& dropout, CoordTensor const& coord, int row0, int col0)
      : KeepMask() {
    for_each_kept(dropout, coord, row0, col0, [&](int mi, int ni, bool kept) { set(mi, ni, kept); });
  }

  __device__ __forceinline__ void set(int mi, int ni, bool kept) {
    const int i = mi * kCols + ni;
    bits[i / 32] |= uint32_t(kept) << (i % 32);
  }

  __device__ __forceinline__ bool operator()(int mi, int ni) const {
    const int i = mi * kCols + ni;
    return (bits[i / 32] >> (i % 32)) & 1u;
  }
};

template <typename CoordTensor>
__device__ __forceinline__ auto keep_mask(Dropout const& dropout, CoordTensor const& coord, int row0, int col0) {
  return KeepMask<decltype(size<0>(coord))::value, decltype(size<1>(coord))::value>(dropout, coord, row0, col0);
}

// keep_mask of transposed scores (for_each_kept_transposed: coord's (key, row), the first key and row key0 and row0).
template <typename CoordTensor>
__device__ __forceinline__ auto keep_mask_transposed(Dropout const& dropout, CoordTensor const& coord, int key0,
                                                     int row0) {
  KeepMask<decltype(size<0>(coord))::value, decltype(size<1>(coord))::value> keep;
  for_each_kept_transposed(dropout, coord, key0, row0, [&](int mi, int ni, bool kept) { keep.set(mi, ni, kept); });
  return keep;
}

// keep_mask's bits in a kernel with dropout (kDropout), nullptr in one without (whose code tests has_dropout first).
template <bool kDropout, typename CoordTensor>
__device__ __forceinline__ auto keep_mask_if(FwdParams const& p, int batch, int head, CoordTensor const& coord,
                                             int row0, int col0) {
  if constexpr (kDropout) {
    return keep_mask(Dropout::make(p, batch, head), coord, row0, col0);
  } else {
    return nullptr;
  }
}

// x(mi, ni) = keep(mi, ni) ? x(mi, ni) * scale : 0 on a (rows, cols) view.
template <typename Tensor, int kRows, int kCols>
__device__ __forceinline__ void apply_keep(Tensor& x, KeepMask<kRows, kCols> const& keep, float scale) {
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) x(mi, ni) = keep(mi, ni) ? x(mi, ni) * scale : 0.f;
  }
}

// A kernel without dropout has no bits (keep_mask_if<false>): nothing to apply. Its calls sit in discarded
// `if constexpr (has_dropout(V))` branches, which CUDA 11.8 still resolves inside a generic lambda.
template <typename Tensor>
__device__ __forceinline__ void apply_keep(Tensor&, std::nullptr_t, float) {}

}  // namespace cuteflash

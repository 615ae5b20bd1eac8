// The sm80 family's pass of the decoding kernel (decode/) for several query rows: each warp computes its keys' two
// products on tensor cores from the cp.async stages, the rows as mma's m = 16 (S = Q K^T and O = P V with
// mma.m16n8k16, 8 of the rows padding in a kernel for 8, its keys of a chunk 16 at a time, the head dim in steps of
// 16; P in registers, as in the tiled kernels), and keeps its rows' own running max and sum. On CUDA cores the
// lanes' reductions would cost more than reading the cache.
#pragma once

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <type_traits>

#include "cuteflash/decode/block.cuh"

namespace cuteflash::sm80 {

template <typename Traits>
struct DecodeMmaPass : DecodePassBase {
  using Element = typename Traits::Element;
  static constexpr int kRows = Traits::kRows;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kLanesPerKey = Traits::kLanesPerKey;
  static constexpr int kKeysPerStep = Traits::kKeysPerStep;
  static_assert(Traits::kTensorCores && Traits::kAsync);
  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;

  // A lane's place in the mma fragments: rows quad_row and quad_row + 8 of A and C (query rows), columns 2 quad_col
  // and 2 quad_col + 1 of C (keys, or head dims), k 2 quad_col, 2 quad_col + 1 (+ 8) of A and B. Its held rows:
  // quad_row + 8 held, whose scores it holds.
  static constexpr int kRowsHeld = 2;
  __device__ __forceinline__ static int held_row(int held, int lane) { return lane / 4 + 8 * held; }
  static constexpr bool kWarpReadsStage = true;  // (ldmatrix)
  // The 16-byte pieces of a key row are permuted by the key, so that ldmatrix's reads of one piece of 8 keys fall
  // in distinct banks.
  __device__ __forceinline__ static int stage_piece(int piece, int s, int key_slot) {
    return piece ^ (kLanesPerKey >= 8 ? (s * kKeysPerStep + key_slot) & 7 : (key_slot >> 1) & 3);
  }

  int quad_row, quad_col;
  // Q's A fragments, element j: query row quad_row + 8 (j % 2), head dims 16 kb + 8 (j / 2) + 2 quad_col + {0, 1}.
  uint32_t q_frag[kHeadDim / 16][4];
  // O's C fragments over my warp's keys, head dims 8 n + 2 quad_col + {0, 1}, rows quad_row (+ 8 for e >= 2).
  float o_frag[kHeadDim / 8][4];
  // Rows quad_row + 8 j over my warp's keys, in log2 units (the sums over my quad's columns only, until the end).
  float m_own[2], l_own[2];

  template <typename Block>
  __device__ __forceinline__ void init(Block& b) {
    quad_row = b.lane / 4;
    quad_col = b.lane % 4;
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int r = quad_row + 8 * (j % 2);
      Element const* q_row = b.p.q.template at<Element const>(b.seq.batch, b.head_of(r), b.seq.q_row0 + r / b.group);
      CUTE_UNROLL
      for (int kb = 0; kb < kHeadDim / 16; ++kb) {
        const int dim = kb * 16 + 8 * (j / 2) + 2 * quad_col;
        q_frag[kb][j] = b.live(r) && dim < b.p.head_dim ? *reinterpret_cast<uint32_t const*>(q_row + dim) : 0u;
      }
    }
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 8; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) o_frag[n][e] = 0.f;
    }
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      m_own[j] = -INFINITY;
      l_own[j] = 0.f;
    }
  }

  // My warp's part of a chunk: S = Q K^T for its keys, 16 at a time (two n tiles of 8), the running max and sum of
  // its rows, O rescaled, and O += P V with P in registers (the C fragments of two n tiles are the A fragment of one
  // k step).
  template <typename Block>
  __device__ void run(Block& b, int stage, int key0) {
    constexpr int kBlocks = Traits::kWarpKeys / 16;
    const int lane = b.lane;
    float x[kBlocks][2][4];  // scores: 16 keys mb, n tile t, element e (row quad_row + 8 (e / 2))
    CUTE_UNROLL
    for (int mb = 0; mb < kBlocks; ++mb) {
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) x[mb][t][e] = 0.f;
      }
      CUTE_UNROLL
      for (int kb = 0; kb < kHeadDim / 16; ++kb) {
        uint32_t k_frag[4];  // K^T's B fragments: keys 0-7 (k_frag[0], [1]) and 8-15 ([2], [3]) of the 16
        const int key = mb * 16 + (lane >> 4) * 8 + (lane & 7), piece = 2 * kb + (lane >> 3 & 1);
        cute::SM75_U32x4_LDSM_N::copy(reinterpret_cast<cute::uint128_t const&>(b.key_piece(stage, 0, key, piece)),
                                      k_frag[0], k_frag[1], k_frag[2], k_frag[3]);
        CUTE_UNROLL
        for (int t = 0; t < 2; ++t) {
          float (&c)[4] = x[mb][t];
          Mma::fma(c[0], c[1], c[2], c[3], q_frag[kb][0], q_frag[kb][1], q_frag[kb][2], q_frag[kb][3], k_frag[2 * t],
                   k_frag[2 * t + 1], c[0], c[1], c[2], c[3]);
        }
      }
    }
    float chunk_max[2] = {-INFINITY, -INFINITY};
    CUTE_UNROLL
    for (int mb = 0; mb < kBlocks; ++mb) {
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, key = key0 + mb * 16 + t * 8 + 2 * quad_col + e % 2;
          x[mb][t][e] = b.score(x[mb][t][e], key, quad_row + 8 * h, b.key_begin[h], b.key_end[h], b.slope[h]);
          chunk_max[h] = fmaxf(chunk_max[h], x[mb][t][e]);
        }
      }
    }
    float alpha[2], offset[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int o = 1; o <= 2; o *= 2) chunk_max[h] = fmaxf(chunk_max[h], __shfl_xor_sync(0xffffffff, chunk_max[h], o));
      const RowStep step = online_step(m_own[h], fmaxf(m_own[h], chunk_max[h]));
      offset[h] = step.offset;
      alpha[h] = step.alpha();
      l_own[h] *= alpha[h];
    }
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 8; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) o_frag[n][e] *= alpha[e / 2];
    }
    CUTE_UNROLL
    for (int mb = 0; mb < kBlocks; ++mb) add_pv(b, stage, mb, x[mb], offset);
  }

  // O += P V for my warp's keys 16 mb on: P's A fragment from the scores x of those keys.
  template <typename Block>
  __device__ __forceinline__ void add_pv(Block& b, int stage, int mb, float const (&x)[2][4],
                                         float const (&offset)[2]) {
    const int lane = b.lane;
    uint32_t a[4];  // P's A fragment: rows quad_row (a[0], a[2]) and + 8, keys 2 quad_col (+ 8 for a[2], a[3])
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int t = j / 2, h = j % 2;
      float prob[2];
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) {
        prob[e] = exp2_approx(x[t][2 * h + e] - offset[h]);
        l_own[h] += prob[e];
      }
      const auto pair = cutlass::NumericArrayConverter<Element, float, 2>{}(cutlass::Array<float, 2>{prob[0], prob[1]});
      a[j] = reinterpret_cast<uint32_t const&>(pair);
    }
    CUTE_UNROLL
    for (int db = 0; db < kHeadDim / 16; ++db) {
      uint32_t v_frag[4];  // V's B fragments: head dims 16 db + 0-7 (v_frag[0], [1]) and + 8-15 ([2], [3])
      const int key = mb * 16 + (lane >> 3 & 1) * 8 + (lane & 7), piece = 2 * db + (lane >> 4);
      cute::SM75_U16x8_LDSM_T::copy(reinterpret_cast<cute::uint128_t const&>(b.key_piece(stage, 1, key, piece)),
                                    v_frag[0], v_frag[1], v_frag[2], v_frag[3]);
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        float (&c)[4] = o_frag[2 * db + t];
        Mma::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], v_frag[2 * t], v_frag[2 * t + 1], c[0], c[1], c[2],
                 c[3]);
      }
    }
  }

  // A lane's row sums cover its columns: the quad's sum is the warp's.
  template <typename Block>
  __device__ __forceinline__ void reduce(Block&) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int o = 1; o <= 2; o *= 2) l_own[h] += __shfl_xor_sync(0xffffffff, l_own[h], o);
    }
  }

  // C element e: row quad_row (+ 8 for e >= 2), head dim 8 n + 2 quad_col + e % 2.
  template <typename Block>
  __device__ __forceinline__ void store(Block& b) {
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 8; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = quad_row + 8 * (e / 2);
        if (r < kRows) b.smem.o_part[b.warp][r][8 * n + 2 * quad_col + e % 2] = o_frag[n][e];
      }
    }
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = quad_row + 8 * h;
      if (quad_col == 0 && r < kRows) {
        b.smem.row_max[b.warp * kRows + r] = m_own[h];
        b.smem.row_sum[b.warp * kRows + r] = l_own[h];
      }
    }
  }
};

}  // namespace cuteflash::sm80

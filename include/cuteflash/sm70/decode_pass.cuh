// The sm70 family's pass of the decoding kernel (decode/) for more query rows than its CUDA cores take
// (kDecodeMaxRows): WMMA 16x16x16 products, the 16 rows as m, on shared tiles: Q's, and per warp its keys' K and V of
// a chunk (stored from the registers, so that the next chunk's loads are in flight during the products) and S, then
// P in its place as error-corrected fp16 (wmma.cuh). Each warp keeps its rows' own running max and sum.
#pragma once

#include "cuteflash/decode/block.cuh"
#include "cuteflash/sm70/wmma.cuh"

namespace cuteflash::sm70 {

template <typename Traits>
struct DecodeWmmaPass : DecodePassBase {
  using Element = typename Traits::Element;
  static constexpr int kRows = Traits::kRows;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarpKeys = Traits::kWarpKeys;
  static_assert(Traits::kTensorCores && !Traits::kAsync);
  static_assert(kRows == 16 && std::is_same_v<Element, cutlass::half_t>);

  // The tiles, row-major, rows padded by 16 bytes (WMMA's loads take a leading dimension, no swizzle): Q's 16 rows; a
  // warp's K and V rows of a chunk; its S (fp32, 16 x its keys), then P's hi' and lo (fp16) in its place; its rows'
  // rescale factors.
  static constexpr int kLdKV = kHeadDim + 8;  // elements
  static constexpr int kLdS = kWarpKeys + 8;  // floats of S, halves of P
  struct WarpTiles {
    Element k[kWarpKeys][kLdKV], v[kWarpKeys][kLdKV];
    float s[16][kLdS];
    float alpha[16];
  };
  struct Tiles {
    Element q[16][kLdKV];
    WarpTiles warps[Traits::kWarps];
  };
  // Row lane % 16, whose softmax lanes r and r + 16 share.
  __device__ __forceinline__ static int held_row(int held, int lane) { return lane % 16; }
  static constexpr bool kFetchesItself = true;  // once the chunk's registers are stored to the tiles

  // O's accumulator tiles over my warp's keys (head dims 16 n on), holding p_scale times O; the row in its tile of
  // each element of an accumulator fragment, learned from a tile of row numbers (WMMA does not specify the mapping;
  // every accumulator fragment of the type shares it).
  FragAcc o_acc[kHeadDim / 16];
  int row_of[FragAcc::num_elements];
  float p_scale;  // P as hi' and lo (wmma.cuh)
  // Row lane % 16 over my warp's keys, in log2 units (the sum over my half of them, until the end).
  float m_own, l_own;

  template <typename Block>
  __device__ __forceinline__ void init(Block& b) {
    p_scale = b.p.fp16_correction ? exp2f(kLoScaleLog2) : 1.f;
    auto& tiles = b.smem.tiles;
    for (int idx = threadIdx.x; idx < 16 * (kHeadDim / 8); idx += Traits::kThreads) {  // Q's rows, zeros past them
      const int r = idx / (kHeadDim / 8), c = idx % (kHeadDim / 8) * 8;
      *reinterpret_cast<uint4*>(&tiles.q[r][c]) = b.query_piece(r, c);
    }
    const int lane = b.lane;
    float (&s)[16][kLdS] = tiles.warps[b.warp].s;
    CUTE_UNROLL
    for (int c = 0; c < 8; ++c) s[lane % 16][lane / 16 * 8 + c] = float(lane % 16);
    __syncwarp();
    FragAcc row_numbers;
    nvcuda::wmma::load_matrix_sync(row_numbers, &s[0][0], kLdS, nvcuda::wmma::mem_row_major);
    CUTE_UNROLL
    for (int e = 0; e < FragAcc::num_elements; ++e) row_of[e] = int(row_numbers.x[e]);
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 16; ++n) nvcuda::wmma::fill_fragment(o_acc[n], 0.f);
    __syncthreads();  // Q's tile is whole (and my warp's scratch read)
    m_own = -INFINITY;
    l_own = 0.f;
  }

  // My warp's part of a chunk: its keys' K and V from my registers to its tiles, the next chunk's loads issued,
  // S = Q K^T into the scratch, each row's running max and sum (lanes r and r + 16 take half of row r's keys each),
  // P as hi' and lo in S's place, O rescaled by rows, then O += hi' V + lo V.
  template <typename Block>
  __device__ void run(Block& b, int stage, int key0) {
    auto& mine = b.smem.tiles.warps[b.warp];
    __syncwarp();  // my warp is done with its tiles' previous chunk
    if (b.col < kHeadDim) {
      CUTE_UNROLL
      for (int s = 0; s < Traits::kSteps; ++s) {
        *reinterpret_cast<uint4*>(&mine.k[s * Traits::kKeysPerStep + b.slot][b.col]) = b.stage_at(0, 0, s);
        *reinterpret_cast<uint4*>(&mine.v[s * Traits::kKeysPerStep + b.slot][b.col]) = b.stage_at(0, 1, s);
      }
    }
    b.fetch();  // the next chunk, into the registers just stored
    __syncwarp();
    scores(b.smem.tiles, mine);
    __syncwarp();
    const bool rescale = softmax(b, mine, key0);
    __syncwarp();
    if (rescale) {
      float alpha_of[FragAcc::num_elements];
      CUTE_UNROLL
      for (int e = 0; e < FragAcc::num_elements; ++e) alpha_of[e] = mine.alpha[row_of[e]];
      CUTE_UNROLL
      for (int n = 0; n < kHeadDim / 16; ++n) {
        CUTE_UNROLL
        for (int e = 0; e < FragAcc::num_elements; ++e) o_acc[n].x[e] *= alpha_of[e];
      }
    }
    add_pv(b, mine);
  }

  // S = Q K^T of my warp's keys, into its scratch.
  __device__ __forceinline__ void scores(Tiles const& tiles, WarpTiles& mine) {
    using namespace nvcuda;
    auto const* q_tile = reinterpret_cast<__half const*>(&tiles.q[0][0]);
    CUTE_UNROLL
    for (int kb = 0; kb < kWarpKeys / 16; ++kb) {
      FragAcc s_acc;
      wmma::fill_fragment(s_acc, 0.f);
      CUTE_UNROLL
      for (int d = 0; d < kHeadDim / 16; ++d) {
        FragA a;
        FragBCol k_frag;
        wmma::load_matrix_sync(a, q_tile + 16 * d, kLdKV);
        wmma::load_matrix_sync(k_frag, reinterpret_cast<__half const*>(&mine.k[16 * kb][16 * d]), kLdKV);
        wmma::mma_sync(s_acc, a, k_frag, s_acc);
      }
      wmma::store_matrix_sync(&mine.s[0][16 * kb], s_acc, kLdS, wmma::mem_row_major);
    }
  }

  // Row lane % 16's running max and sum over my half of the chunk's keys, P as hi' and lo in S's place, the row's
  // rescale factor in the tiles; whether any row of the warp needs rescaling.
  template <typename Block>
  __device__ __forceinline__ bool softmax(Block& b, WarpTiles& mine, int key0) {
    constexpr int kHalf = kWarpKeys / 2;
    const int r = b.lane % 16, half = b.lane / 16;
    float x[kHalf];
    float chunk_max = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kHalf; ++j) {
      const int key = half * kHalf + j;
      x[j] = b.score(mine.s[r][key], key0 + key, r, b.key_begin[0], b.key_end[0], b.slope[0]);
      chunk_max = fmaxf(chunk_max, x[j]);
    }
    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffff, chunk_max, 16));
    const float m_new = fmaxf(m_own, chunk_max);
    const RowStep step = online_step(m_own, m_new);
    const float alpha = step.alpha();
    const bool rescale = __any_sync(0xffffffff, m_new != step.m_old);
    l_own *= alpha;
    CUTE_UNROLL
    for (int j = 0; j < kHalf; ++j) {
      x[j] = exp2_approx(x[j] - step.offset);
      l_own += x[j];
    }
    __syncwarp();  // S is read: P takes its place
    __half* p_hi = reinterpret_cast<__half*>(&mine.s[0][0]);
    __half* p_lo = p_hi + 16 * kLdS;
    CUTE_UNROLL
    for (int j = 0; j < kHalf; j += 8) {
      float part[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) part[e] = x[j + e];
      const int at = r * kLdS + half * kHalf + j;
      store_split<8>(part, p_scale, p_hi + at, p_lo + at);
    }
    if (half == 0) mine.alpha[r] = alpha;
    return rescale;
  }

  // O += hi' V + lo V over my warp's keys.
  template <typename Block>
  __device__ __forceinline__ void add_pv(Block& b, WarpTiles const& mine) {
    using namespace nvcuda;
    auto const* p_hi = reinterpret_cast<__half const*>(&mine.s[0][0]);
    auto const* p_lo = p_hi + 16 * kLdS;
    CUTE_UNROLL
    for (int kb = 0; kb < kWarpKeys / 16; ++kb) {
      FragA hi, lo;
      wmma::load_matrix_sync(hi, p_hi + 16 * kb, kLdS);
      if (b.p.fp16_correction) wmma::load_matrix_sync(lo, p_lo + 16 * kb, kLdS);
      CUTE_UNROLL
      for (int n = 0; n < kHeadDim / 16; ++n) {
        FragBRow v_frag;
        wmma::load_matrix_sync(v_frag, reinterpret_cast<__half const*>(&mine.v[16 * kb][16 * n]), kLdKV);
        wmma::mma_sync(o_acc[n], hi, v_frag, o_acc[n]);
        if (b.p.fp16_correction) wmma::mma_sync(o_acc[n], lo, v_frag, o_acc[n]);
      }
    }
  }

  // Lanes r and r + 16 summed half of row r's keys each.
  template <typename Block>
  __device__ __forceinline__ void reduce(Block&) {
    l_own += __shfl_xor_sync(0xffffffff, l_own, 16);
  }

  template <typename Block>
  __device__ __forceinline__ void store(Block& b) {
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 16; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < FragAcc::num_elements; ++e) o_acc[n].x[e] /= p_scale;
      nvcuda::wmma::store_matrix_sync(&b.smem.o_part[b.warp][0][16 * n], o_acc[n], kHeadDim,
                                      nvcuda::wmma::mem_row_major);
    }
    if (b.lane < 16) {
      b.smem.row_max[b.warp * kRows + b.lane] = m_own;
      b.smem.row_sum[b.warp * kRows + b.lane] = l_own;
    }
  }
};

}  // namespace cuteflash::sm70

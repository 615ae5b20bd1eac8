// The decoding kernel: attention of the few query rows that share a key-value head (seqlen_q times the GQA group,
// at most kDecodeMaxRows, or kDecodeMaxMmaRows on tensor cores) against many keys, for either family. With so few
// rows, reading K and V is the whole cost, so the kernel is built for it: rather than tensor-core tiles of 64 or
// more rows, each lane loads 16 bytes of a key row at a time, a paged cache is read row by row, and the keys are
// split across thread blocks where batch x heads alone cannot fill the GPU (flash-decoding), each split's result
// merged by its log-sum-exp.
//
// A thread block (4 warps) takes one split of one (sequence, key-value head) and walks its keys in chunks, fetched
// kStages - 1 chunks ahead with cp.async in the sm80 family, at the top of each pass in the sm70 family. Per
// chunk, each warp reads its keys (kLanesPerKey lanes per key row, kKeysPerStep rows per load), reduces each row's
// dot products with the queries across those lanes and writes the scores to shared memory; the warp that owns a
// query row then updates the row's running max and sum and turns the chunk's scores into probabilities; every warp
// finally rescales its part of O and adds its keys' P V. At the end the warps' parts of O are summed. A single
// query row needs none of that exchange: the lanes of each key slot keep a running max and sum of their own keys,
// with no barrier in the walk, and the epilogue merges them (kOwnSoftmax). For several query rows in the sm80
// family (kMma), each warp computes its keys' two products on tensor cores from the shared-memory stages, the rows
// as mma's m = 16 (S = Q K^T, O = P V, P in registers as in the tiled kernels), and keeps its rows' own running
// max and sum as well; on CUDA cores the lanes' reductions cost more than the cache read.
#pragma once

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <type_traits>

#include "cuteflash/host/launch_common.cuh"
#include "cuteflash/common/mask.cuh"
#include "cuteflash/sm70/wmma.cuh"
#include "cuteflash/decode/config.h"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

// The splits whose parts a warp of the last split reads at once when it merges them (split_merge.cuh): 16, what batch
// 1 over 16 key-value heads gets on an H100 (fewer heads get more splits, merged in several rounds of loads). The
// single-row kernel keeps 128 registers per thread with it, so 4 blocks still fit an SM.
constexpr int kDecodeMergeInFlight = 16;

template <typename Element_, int kHeadDim_, int kRows_, bool kAsync_>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = kRows_;  // query rows held (a block serves up to this many)
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // decode/config.h: the lanes that read a key row, 8 elements (16 bytes) each; the loads of K and of V per lane and
  // chunk; with kAsync (cp.async, the sm80 family), the chunks in flight in shared memory, else one in registers.
  static constexpr int kLanesPerKey = decode_lanes_per_key(kHeadDim);
  static constexpr int kKeysPerStep = 32 / kLanesPerKey;
  static constexpr int kSteps = decode_steps(kHeadDim, kRows, kAsync_);
  static constexpr bool kAsync = kAsync_;
  static constexpr int kStages = kAsync ? decode_stages(kHeadDim, kRows) : 1;
  // Tensor cores for several rows (sm80 family): S = Q K^T and O = P V with mma.m16n8k16, the query rows as mma's
  // m = 16 (8 of them padding in a kernel for 8 rows), each warp's keys of a chunk 16 at a time, the head dim in
  // steps of 16; P stays in registers, as in the tiled kernels.
  static constexpr bool kMma = decode_mma(kHeadDim, kRows, kAsync_);
  using Mma = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Tensor cores in the sm70 family, for more rows than its CUDA cores take: WMMA 16x16x16, the 16 rows as m, on
  // shared tiles: Q's, and per warp its keys' K and V of a chunk (stored from the registers, so that the next
  // chunk's loads are in flight during the products) and S, then P in its place as error-corrected fp16
  // (sm70/wmma.cuh).
  static constexpr bool kWmma = decode_wmma(kHeadDim, kRows, kAsync_);
  static_assert(!kWmma || (kRows == 16 && std::is_same_v<Element, cutlass::half_t>));
  static constexpr bool kTensorCores = kMma || kWmma;
  static_assert(!kTensorCores || (kRows <= 16 && kKeysPerStep * kSteps % 16 == 0 && kHeadDim % 16 == 0));
  static_assert(kWarps * kKeysPerStep * kSteps >= 32, "the softmax reads a chunk 32 keys at a time");
  static constexpr int kWarpKeys = kKeysPerStep * kSteps;
  static constexpr int kChunk = kWarps * kWarpKeys;  // keys per chunk
  static_assert(kChunk == decode_chunk(kHeadDim, kRows, kAsync_));
  static constexpr int kRowsPerWarp = ceil_div(kRows, kWarps);  // the query rows whose statistics a warp owns
  // For a single query row, each key slot of a warp (the kLanesPerKey lanes of one key of a load) keeps the running
  // max and sum of its own keys; on tensor cores, each warp keeps its rows' over its own keys. Then the walk needs
  // no barrier between warps, no shared memory besides their stages or tiles, and no warp waits for another's
  // softmax. The epilogue merges the slots' and then the warps' statistics.
  static constexpr bool kOwnSoftmax = kRows == 1 || kTensorCores;
  static constexpr int kStats = kOwnSoftmax ? kWarps * kRows : kRows;  // statistics in shared memory at the end
  // kWmma's tiles, row-major, rows padded by 16 bytes (WMMA's loads take a leading dimension, no swizzle): Q's 16
  // rows; a warp's K and V rows of a chunk; its S (fp32, 16 x its keys), then P's hi' and lo (fp16) in its place;
  // its rows' rescale factors.
  static constexpr int kLdKV = kHeadDim + 8;  // elements
  static constexpr int kLdS = kWarpKeys + 8;  // floats of S, halves of P
  struct WmmaWarp {
    Element k[kWarpKeys][kLdKV], v[kWarpKeys][kLdKV];
    float s[16][kLdS];
    float alpha[16];
  };
  struct WmmaTiles {
    Element q[16][kLdKV];
    WmmaWarp warps[kWarps];
  };
  struct NoTiles {};
  // Shared memory (dynamic, all of it): the async stages, [stage][K, V][step][thread] 16 bytes, each lane's own,
  // or kWmma's tiles, which after the walk hold the warps' parts of O; where the warps share a softmax, the chunk's
  // scores and the rows' rescale factors; the rows' statistics.
  static constexpr int kRingBytes = kStages > 1 ? kStages * 2 * kSteps * kThreads * 16 : 0;
  static constexpr int kScoreRows = kOwnSoftmax ? 1 : kRows;
  struct SharedStorage {
    union {
      uint4 ring[kRingBytes > 0 ? kRingBytes / 16 : 1];
      float o_part[kWarps][kRows][kHeadDim];
      std::conditional_t<kWmma, WmmaTiles, NoTiles> tiles;
    };
    float scores[kScoreRows][kOwnSoftmax ? 1 : kChunk];
    float alphas[kScoreRows];
    float row_max[kStats];  // kOwnSoftmax: warp w's of row r at w kRows + r
    float row_sum[kStats];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes == decode_smem_bytes(kHeadDim, kRows, kAsync));
};

// 8 elements (16 bytes) as floats.
template <typename Element>
__device__ __forceinline__ void unpack8(uint4 const& x, float (&f)[8]) {
  auto const& a = *reinterpret_cast<cutlass::Array<Element, 8> const*>(&x);
  CUTE_UNROLL
  for (int e = 0; e < 8; ++e) f[e] = float(a[e]);
}

// The 16 bytes at column col of row r of head head_k of operand t (k or v).
template <typename Element>
__device__ __forceinline__ Element const* chunk_ptr(Operand const& t, KeyRow const& r, int head_k, int col) {
  return t.at<Element const>(r.batch, head_k, r.row) + col;
}

// dst = those 16 bytes where ok, else zeros: asynchronously (cp.async, waited for by the thread itself, the cache
// read once: utils.cuh) with kAsync, else a register load.
template <bool kAsync, typename Element>
__device__ __forceinline__ void fetch_chunk(uint4& dst, Operand const& t, KeyRow const& r, bool ok, int head_k,
                                            int col) {
  if constexpr (kAsync) {
    Element const* src = ok ? chunk_ptr<Element>(t, r, head_k, col) : static_cast<Element const*>(t.ptr);
    cp_async_read_once(&dst, src, ok);
  } else {
    dst = ok ? __ldg(reinterpret_cast<uint4 const*>(chunk_ptr<Element>(t, r, head_k, col))) : make_uint4(0, 0, 0, 0);
  }
}

// Split blockIdx.x of the keys of key-value head blockIdx.y of sequence blockIdx.z.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) decode_kernel(const FwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kRows;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kLanesPerKey = Traits::kLanesPerKey;
  constexpr int kKeysPerStep = Traits::kKeysPerStep;
  constexpr int kSteps = Traits::kSteps;
  constexpr int kChunk = Traits::kChunk;
  constexpr int kWarps = Traits::kWarps;
  constexpr bool kAsync = Traits::kAsync;
  constexpr int kStages = Traits::kStages;
  constexpr bool kMma = Traits::kMma;
  constexpr bool kWmma = Traits::kWmma;
  constexpr bool kTensorCores = Traits::kTensorCores;
  extern __shared__ uint4 smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int split = blockIdx.x, head_k = blockIdx.y;
  const Sequence seq = sequence<Variant::kGeneral>(p, blockIdx.z);
  const int group = p.nheads / p.nheads_k;
  const int rows = seq.seqlen_q * group;  // row r: query r / group of head head_k * group + r % group
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = lane / kLanesPerKey;       // the key of a load this lane reads
  const int col = (lane % kLanesPerKey) * 8;  // and its columns
  const bool col_ok = col < p.head_dim;
  auto head_of = [&](int r) { return head_k * group + r % group; };
  // Whether query row r exists: the rows past `rows` (a group of 4 in a kernel for 8) are skipped at run time.
  auto live = [&](int r) { return kRows == 1 || r < rows; };
  // With kMma, a lane's place in the mma fragments: rows quad_row and quad_row + 8 of A and C (query rows), columns
  // 2 quad_col and 2 quad_col + 1 of C (keys, or head dims), k 2 quad_col, 2 quad_col + 1 (+ 8) of A and B.
  const int quad_row = lane / 4, quad_col = lane % 4;

  // My columns of each query row (CUDA cores), and each row's visible keys and ALiBi slope.
  float q[kTensorCores ? 1 : kRows][8];
  // kMma: the rows quad_row + 8 h whose scores a lane holds, held h; kWmma: row lane % 16, whose softmax lanes r
  // and r + 16 share.
  constexpr int kRowsHeld = kMma ? 2 : kWmma ? 1 : kRows;
  int key_begin[kRowsHeld], key_end[kRowsHeld];
  float slope[kRowsHeld];
  const auto mask = MaskPolicy<true>::make(seq.seqlen_q, seq.seqlen_k, p.causal, p.window_left, p.window_right);
  CUTE_UNROLL
  for (int held = 0; held < kRowsHeld; ++held) {
    const int r = kMma ? quad_row + 8 * held : kWmma ? lane % 16 : held;
    const bool live = r < rows;
    const int i = live ? r / group : 0;
    if constexpr (!kTensorCores) {
      uint4 x = make_uint4(0, 0, 0, 0);
      if (live && col_ok)
        x = __ldg(reinterpret_cast<uint4 const*>(p.q.at<Element const>(seq.batch, head_of(r), seq.q_row0 + i) + col));
      unpack8<Element>(x, q[r]);
    }
    key_begin[held] = live ? mask.key_begin(i) : 0;
    key_end[held] = live ? mask.key_end(i) : 0;
    slope[held] = live && p.alibi_slopes != nullptr
                      ? p.alibi_slopes[seq.batch * p.alibi_batch_stride + head_of(r)] / p.softmax_scale
                      : 0.f;
  }
  const int shift = seq.seqlen_k - seq.seqlen_q;
  // With kMma: Q's A fragments, element j: query row quad_row + 8 (j % 2), head dims 16 kb + 8 (j / 2) +
  // 2 quad_col + {0, 1}.
  uint32_t q_frag[kMma ? kHeadDim / 16 : 1][4];
  if constexpr (kMma) {
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int r = quad_row + 8 * (j % 2);
      Element const* q_row = p.q.at<Element const>(seq.batch, head_of(r), seq.q_row0 + r / group);
      CUTE_UNROLL
      for (int kb = 0; kb < kHeadDim / 16; ++kb) {
        const int dim = kb * 16 + 8 * (j / 2) + 2 * quad_col;
        q_frag[kb][j] = live(r) && dim < p.head_dim ? *reinterpret_cast<uint32_t const*>(q_row + dim) : 0u;
      }
    }
  }
  const int page_shift = log2_page_size(p);

  // This split's chunks of the keys that some row sees.
  const int key_lo = mask.key_begin(0), key_hi = mask.key_end(seq.seqlen_q - 1);
  const int chunks = key_hi > key_lo ? ceil_div(key_hi - key_lo, kChunk) : 0;
  const int per_split = ceil_div(chunks, p.num_splits);
  const int chunk_begin = min(split * per_split, chunks), chunk_end = min(chunk_begin + per_split, chunks);

  float acc[kTensorCores ? 1 : kRows][8];  // my part of O: my columns, summed over my keys
  CUTE_UNROLL
  for (int r = 0; r < (kTensorCores ? 1 : kRows); ++r) {
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }
  // kMma: O's C fragments over my warp's keys, head dims 8 n + 2 quad_col + {0, 1}, rows quad_row (+ 8 for e >= 2).
  float o_frag[kMma ? kHeadDim / 8 : 1][4];
  CUTE_UNROLL
  for (int n = 0; n < (kMma ? kHeadDim / 8 : 1); ++n) {
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) o_frag[n][e] = 0.f;
  }
  // kWmma: O's accumulator tiles over my warp's keys (head dims 16 n on), holding p_scale times O; the row in its
  // tile of each element of an accumulator fragment, learned from a tile of row numbers (WMMA does not specify the
  // mapping; every accumulator fragment of the type shares it).
  sm70::FragAcc o_acc[kWmma ? kHeadDim / 16 : 1];
  int row_of[kWmma ? sm70::FragAcc::num_elements : 1];
  const float p_scale = p.fp16_correction ? exp2f(sm70::kLoScaleLog2) : 1.f;  // sm70/wmma.cuh: P as hi' and lo
  if constexpr (kWmma) {
    auto& tiles = smem.tiles;
    for (int idx = threadIdx.x; idx < 16 * (kHeadDim / 8); idx += Traits::kThreads) {  // Q's rows, zeros past them
      const int r = idx / (kHeadDim / 8), c = idx % (kHeadDim / 8) * 8;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (live(r) && c < p.head_dim) {
        x = __ldg(
            reinterpret_cast<uint4 const*>(p.q.at<Element const>(seq.batch, head_of(r), seq.q_row0 + r / group) + c));
      }
      *reinterpret_cast<uint4*>(&tiles.q[r][c]) = x;
    }
    float (&s)[16][Traits::kLdS] = tiles.warps[warp].s;
    CUTE_UNROLL
    for (int c = 0; c < 8; ++c) s[lane % 16][lane / 16 * 8 + c] = float(lane % 16);
    __syncwarp();
    sm70::FragAcc row_numbers;
    nvcuda::wmma::load_matrix_sync(row_numbers, &s[0][0], Traits::kLdS, nvcuda::wmma::mem_row_major);
    CUTE_UNROLL
    for (int e = 0; e < sm70::FragAcc::num_elements; ++e) row_of[e] = int(row_numbers.x[e]);
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 16; ++n) nvcuda::wmma::fill_fragment(o_acc[n], 0.f);
    __syncthreads();  // Q's tile is whole (and my warp's scratch read)
  }
  // Rows warp + j kWarps, in log2 units; with a single row, the row over my key slot's keys; with kMma, rows
  // quad_row + 8 j over my warp's keys (the sums over my quad's columns only, until the end); with kWmma, row
  // lane % 16 over my warp's keys (the sum over my half of them, until the end).
  constexpr int kOwnRows = kMma ? 2 : kWmma ? 1 : Traits::kRowsPerWarp;
  float m_own[kOwnRows], l_own[kOwnRows];
  CUTE_UNROLL
  for (int j = 0; j < kOwnRows; ++j) {
    m_own[j] = -INFINITY;
    l_own[j] = 0.f;
  }

  // The chunks' K and V on their way: with kStages > 1, a ring of stages in shared memory that cp.async fills
  // kStages - 1 chunks ahead, each lane reading back only the bytes it fetched (so its own wait is enough; with
  // kMma, only bytes its warp fetched, the warp synced after the wait and before a stage is refilled), and the rows
  // of a chunk looked up one fetch ahead (a paged cache's table read does not hold up the fetch); with one stage,
  // registers loaded at the top of the chunk's pass.
  // With kMma, the 16-byte pieces of a key row are permuted by the key (the XOR below), so that ldmatrix's reads of
  // one piece of 8 keys fall in distinct banks.
  uint4 regs[2][kStages == 1 ? kSteps : 1];
  auto ring_at = [&](int stage, int kv, int s, int key_slot, int piece) -> uint4& {
    if constexpr (kMma) {
      piece ^= kLanesPerKey >= 8 ? (s * kKeysPerStep + key_slot) & 7 : (key_slot >> 1) & 3;
    }
    return smem.ring[((stage * 2 + kv) * kSteps + s) * Traits::kThreads + warp * 32 + key_slot * kLanesPerKey + piece];
  };
  auto stage_at = [&](int stage, int kv, int s) -> uint4& {
    if constexpr (kStages == 1) {
      return regs[kv][s];
    } else {
      return ring_at(stage, kv, s, slot, lane % kLanesPerKey);
    }
  };
  // With kMma, piece `piece` of the warp's key `key` (of its kWarpKeys in the chunk).
  auto key_piece = [&](int stage, int kv, int key, int piece) -> uint4 const& {
    return ring_at(stage, kv, key / kKeysPerStep, key % kKeysPerStep, piece);
  };
  const int warp_key0 = warp * Traits::kWarpKeys;  // in the chunk
  KeyRow next[kSteps];  // the block-table entries of a paged cache are checked at the fetch, a pass after their load
  auto locate = [&](int chunk) {
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s)
      next[s] = key_row(p, seq, key_lo + chunk * kChunk + warp_key0 + s * kKeysPerStep + slot, key_hi, page_shift);
  };
  int fetched = chunk_begin;
  auto fetch = [&]() {  // chunk `fetched` into its stage (nothing past the split's end)
    if (fetched < chunk_end) {
      if constexpr (!kAsync) locate(fetched);
      const int stage = (fetched - chunk_begin) % kStages;
      bool ok[kSteps];
      CUTE_UNROLL
      for (int s = 0; s < kSteps; ++s) ok[s] = col_ok && key_readable(p, next[s]);
      CUTE_UNROLL
      for (int s = 0; s < kSteps; ++s)
        fetch_chunk<kAsync, Element>(stage_at(stage, 0, s), p.k, next[s], ok[s], head_k, col);
      CUTE_UNROLL
      for (int s = 0; s < kSteps; ++s)
        fetch_chunk<kAsync, Element>(stage_at(stage, 1, s), p.v, next[s], ok[s], head_k, col);
    }
    ++fetched;
    if constexpr (kAsync) {
      cp_async_commit();
      if (fetched < chunk_end) locate(fetched);
    }
  };
  if (kAsync && chunk_begin < chunk_end) locate(chunk_begin);
  CUTE_UNROLL
  for (int i = 0; i + 1 < kStages; ++i) fetch();
  if constexpr (kWmma) fetch();  // the first chunk, stored to the tiles at the top of its pass

  // Row r's score of key `key` in log2 units, from their dot product: the softcap, ALiBi, then the mask (-inf where
  // r does not see the key: outside [begin, end)).
  auto score = [&](float dot, int key, int r, int begin, int end, float slope_r) {
    if (p.softcap > 0.f) dot = tanh_fast(dot * p.softcap);
    dot -= slope_r * fabsf(float(r / group + shift - key));
    return key >= begin && key < end ? dot * p.softmax_scale_log2 : -INFINITY;
  };
  // My key slot's part of a chunk for a single row (kOwnSoftmax): its scores, the running max and sum, O rescaled and
  // its keys' P V added, all in the slot's lanes. The slot's kSteps dot products are reduced over its lanes by a
  // reduce-scatter, so that each lane ends with the whole dot products of kHeld keys (other lanes hold the others)
  // and scores and exponentiates only those; the probabilities are then handed to every lane of the slot. At head
  // dim 128 (16 lanes, 4 keys): 5 shuffles for the dot products instead of 16, 2 for the chunk's max and 4 for the
  // probabilities, and each key's score and exponential computed by 4 lanes instead of 16.
  constexpr int kSpread = kSteps < kLanesPerKey ? kSteps : kLanesPerKey;  // the lanes of a slot over which keys spread
  constexpr int kHeld = kSteps / kSpread;
  constexpr int kSpreadShift = cute::log_2(unsigned(kLanesPerKey / kSpread));  // lane bits below the spread ones
  auto own_pass = [&](auto stage, int key0) {  // (generic: compiled only where it is called)
    float x[kSteps];
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float kf[8];
      unpack8<Element>(stage_at(stage, 0, s), kf);
      x[s] = 0.f;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) x[s] = fmaf(q[0][e], kf[e], x[s]);
    }
    // Each round halves the values a lane holds: the half its lane bit o selects, plus the partner's of that half.
    // After them, x[j] is step spread kHeld + j's (spread: the lane's bits of the rounds), summed over those lanes.
    CUTE_UNROLL
    for (int n = kSteps, o = kLanesPerKey / 2; n > kHeld; n /= 2, o /= 2) {
      const bool upper = lane & o;
      CUTE_UNROLL
      for (int j = 0; j < n / 2; ++j) {
        const float give = upper ? x[j] : x[j + n / 2];
        x[j] = (upper ? x[j + n / 2] : x[j]) + __shfl_xor_sync(0xffffffff, give, o);
      }
    }
    CUTE_UNROLL
    for (int o = (1 << kSpreadShift) / 2; o >= 1; o /= 2) {  // then the lanes below the spread bits
      CUTE_UNROLL
      for (int j = 0; j < kHeld; ++j) x[j] += __shfl_xor_sync(0xffffffff, x[j], o);
    }
    const int spread = (lane % kLanesPerKey) >> kSpreadShift;
    float chunk_max = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kHeld; ++j) {
      x[j] = score(x[j], key0 + (spread * kHeld + j) * kKeysPerStep + slot, 0, key_begin[0], key_end[0], slope[0]);
      chunk_max = fmaxf(chunk_max, x[j]);
    }
    CUTE_UNROLL
    for (int o = kLanesPerKey / 2; o >= (1 << kSpreadShift); o /= 2) {
      chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffff, chunk_max, o));
    }
    const float m_new = fmaxf(m_own[0], chunk_max);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: P = 0
    const float alpha = exp2_approx(m_own[0] - m_use);     // 0 while nothing was seen
    l_own[0] *= alpha;  // of my kHeld keys of each chunk: summed over the spread lanes at the end
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc[0][e] *= alpha;
    CUTE_UNROLL
    for (int j = 0; j < kHeld; ++j) {
      x[j] = exp2_approx(x[j] - m_use);
      l_own[0] += x[j];
    }
    const int slot_lane0 = lane & ~(kLanesPerKey - 1);
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      const float prob = __shfl_sync(0xffffffff, x[s % kHeld], slot_lane0 + ((s / kHeld) << kSpreadShift));
      float vf[8];
      unpack8<Element>(stage_at(stage, 1, s), vf);
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[0][e] = fmaf(prob, vf[e], acc[0][e]);
    }
    m_own[0] = m_new;
  };

  // My warp's part of a chunk with kMma: S = Q K^T for its keys, 16 at a time (two n tiles of 8), the running max
  // and sum of its rows, O rescaled, and O += P V with P in registers (the C fragments of two n tiles are the A
  // fragment of one k step).
  auto mma_pass = [&](auto stage, int key0) {  // (generic: compiled only where it is called)
    constexpr int kBlocks = Traits::kWarpKeys / 16;
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
        uint32_t b[4];  // K^T's B fragments: keys 0-7 (b[0], b[1]) and 8-15 (b[2], b[3]) of the 16
        const int key = mb * 16 + (lane >> 4) * 8 + (lane & 7), piece = 2 * kb + (lane >> 3 & 1);
        cute::SM75_U32x4_LDSM_N::copy(reinterpret_cast<cute::uint128_t const&>(key_piece(stage, 0, key, piece)), b[0],
                                      b[1], b[2], b[3]);
        CUTE_UNROLL
        for (int t = 0; t < 2; ++t) {
          float (&c)[4] = x[mb][t];
          Traits::Mma::fma(c[0], c[1], c[2], c[3], q_frag[kb][0], q_frag[kb][1], q_frag[kb][2], q_frag[kb][3], b[2 * t],
                           b[2 * t + 1], c[0], c[1], c[2], c[3]);
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
          x[mb][t][e] = score(x[mb][t][e], key, quad_row + 8 * h, key_begin[h], key_end[h], slope[h]);
          chunk_max[h] = fmaxf(chunk_max[h], x[mb][t][e]);
        }
      }
    }
    float alpha[2], m_use[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int o = 1; o <= 2; o *= 2) chunk_max[h] = fmaxf(chunk_max[h], __shfl_xor_sync(0xffffffff, chunk_max[h], o));
      const float m_new = fmaxf(m_own[h], chunk_max[h]);
      m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: P = 0
      alpha[h] = exp2_approx(m_own[h] - m_use[h]);  // 0 while nothing was seen
      l_own[h] *= alpha[h];
      m_own[h] = m_new;
    }
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 8; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) o_frag[n][e] *= alpha[e / 2];
    }
    CUTE_UNROLL
    for (int mb = 0; mb < kBlocks; ++mb) {
      uint32_t a[4];  // P's A fragment: rows quad_row (a[0], a[2]) and + 8, keys 2 quad_col (+ 8 for a[2], a[3])
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int t = j / 2, h = j % 2;
        float prob[2];
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
          prob[e] = exp2_approx(x[mb][t][2 * h + e] - m_use[h]);
          l_own[h] += prob[e];
        }
        const auto pair =
            cutlass::NumericArrayConverter<Element, float, 2>{}(cutlass::Array<float, 2>{prob[0], prob[1]});
        a[j] = reinterpret_cast<uint32_t const&>(pair);
      }
      CUTE_UNROLL
      for (int db = 0; db < kHeadDim / 16; ++db) {
        uint32_t b[4];  // V's B fragments: head dims 16 db + 0-7 (b[0], b[1]) and + 8-15 (b[2], b[3])
        const int key = mb * 16 + (lane >> 3 & 1) * 8 + (lane & 7), piece = 2 * db + (lane >> 4);
        cute::SM75_U16x8_LDSM_T::copy(reinterpret_cast<cute::uint128_t const&>(key_piece(stage, 1, key, piece)), b[0],
                                      b[1], b[2], b[3]);
        CUTE_UNROLL
        for (int t = 0; t < 2; ++t) {
          float (&c)[4] = o_frag[2 * db + t];
          Traits::Mma::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b[2 * t], b[2 * t + 1], c[0], c[1], c[2],
                           c[3]);
        }
      }
    }
  };

  // My warp's part of a chunk with kWmma: its keys' K and V from my registers to its tiles, the next chunk's loads
  // issued, S = Q K^T into the scratch, each row's running max and sum (lanes r and r + 16 take half of row r's
  // keys each), P as hi' and lo in S's place, O rescaled by rows, then O += hi' V + lo V.
  auto wmma_pass = [&](auto& tiles, int key0) {  // (generic: compiled only where it is called)
    using namespace nvcuda;
    constexpr int kLdKV = Traits::kLdKV, kLdS = Traits::kLdS, kWarpKeys = Traits::kWarpKeys;
    auto& mine = tiles.warps[warp];
    __syncwarp();  // my warp is done with its tiles' previous chunk
    if (col < kHeadDim) {
      CUTE_UNROLL
      for (int s = 0; s < kSteps; ++s) {
        *reinterpret_cast<uint4*>(&mine.k[s * kKeysPerStep + slot][col]) = stage_at(0, 0, s);
        *reinterpret_cast<uint4*>(&mine.v[s * kKeysPerStep + slot][col]) = stage_at(0, 1, s);
      }
    }
    fetch();  // the next chunk, into the registers just stored
    __syncwarp();
    auto const* q_tile = reinterpret_cast<__half const*>(&tiles.q[0][0]);
    CUTE_UNROLL
    for (int kb = 0; kb < kWarpKeys / 16; ++kb) {
      sm70::FragAcc s_acc;
      wmma::fill_fragment(s_acc, 0.f);
      CUTE_UNROLL
      for (int d = 0; d < kHeadDim / 16; ++d) {
        sm70::FragA a;
        sm70::FragBCol b;
        wmma::load_matrix_sync(a, q_tile + 16 * d, kLdKV);
        wmma::load_matrix_sync(b, reinterpret_cast<__half const*>(&mine.k[16 * kb][16 * d]), kLdKV);
        wmma::mma_sync(s_acc, a, b, s_acc);
      }
      wmma::store_matrix_sync(&mine.s[0][16 * kb], s_acc, kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    constexpr int kHalf = kWarpKeys / 2;
    const int r = lane % 16, half = lane / 16;
    float x[kHalf];
    float chunk_max = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kHalf; ++j) {
      const int key = half * kHalf + j;
      x[j] = score(mine.s[r][key], key0 + key, r, key_begin[0], key_end[0], slope[0]);
      chunk_max = fmaxf(chunk_max, x[j]);
    }
    chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffff, chunk_max, 16));
    const float m_new = fmaxf(m_own[0], chunk_max);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: P = 0
    const float alpha = exp2_approx(m_own[0] - m_use);     // 0 while nothing was seen
    const bool rescale = __any_sync(0xffffffff, m_new != m_own[0]);
    l_own[0] *= alpha;
    m_own[0] = m_new;
    CUTE_UNROLL
    for (int j = 0; j < kHalf; ++j) {
      x[j] = exp2_approx(x[j] - m_use);
      l_own[0] += x[j];
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
      sm70::store_split<8>(part, p_scale, p_hi + at, p_lo + at);
    }
    if (half == 0) mine.alpha[r] = alpha;
    __syncwarp();
    if (rescale) {
      float alpha_of[sm70::FragAcc::num_elements];
      CUTE_UNROLL
      for (int e = 0; e < sm70::FragAcc::num_elements; ++e) alpha_of[e] = mine.alpha[row_of[e]];
      CUTE_UNROLL
      for (int n = 0; n < kHeadDim / 16; ++n) {
        CUTE_UNROLL
        for (int e = 0; e < sm70::FragAcc::num_elements; ++e) o_acc[n].x[e] *= alpha_of[e];
      }
    }
    CUTE_UNROLL
    for (int kb = 0; kb < kWarpKeys / 16; ++kb) {
      sm70::FragA hi, lo;
      wmma::load_matrix_sync(hi, p_hi + 16 * kb, kLdS);
      if (p.fp16_correction) wmma::load_matrix_sync(lo, p_lo + 16 * kb, kLdS);
      CUTE_UNROLL
      for (int n = 0; n < kHeadDim / 16; ++n) {
        sm70::FragBRow b;
        wmma::load_matrix_sync(b, reinterpret_cast<__half const*>(&mine.v[16 * kb][16 * n]), kLdKV);
        wmma::mma_sync(o_acc[n], hi, b, o_acc[n]);
        if (p.fp16_correction) wmma::mma_sync(o_acc[n], lo, b, o_acc[n]);
      }
    }
  };

  // The chunk's pass of several rows on CUDA cores: the warps' scores through shared memory, each row's softmax by
  // the warp that owns it, then every warp's P V.
  auto shared_pass = [&](auto stage, int key0) {  // (generic: compiled only where it is called)
    __syncthreads();                              // every warp has read the previous chunk's probabilities

    // Scores: the dot products, reduced over a key's lanes; lane kLanesPerKey-part r writes row r's.
    auto write_score = [&](float dot, int key_in_warp, int r, int begin, int end, float slope_r) {
      smem.scores[r][warp_key0 + key_in_warp] = score(dot, key0 + key_in_warp, r, begin, end, slope_r);
    };
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float kf[8];
      unpack8<Element>(stage_at(stage, 0, s), kf);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (!live(r)) continue;
        float dot = 0.f;
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) dot = fmaf(q[r][e], kf[e], dot);
        CUTE_UNROLL
        for (int o = kLanesPerKey / 2; o >= 1; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
        if (lane % kLanesPerKey == r % kLanesPerKey) {
          write_score(dot, s * kKeysPerStep + slot, r, key_begin[r], key_end[r], slope[r]);
        }
      }
    }
    __syncthreads();

    // The owning warps: new row max and sum, the rescale factor of O, the probabilities.
    CUTE_UNROLL
    for (int j = 0; j < Traits::kRowsPerWarp; ++j) {
      const int r = warp + j * kWarps;
      if (r < kRows && live(r)) {
        float x[kChunk / 32];
        float block_max = -INFINITY;
        CUTE_UNROLL
        for (int t = 0; t < kChunk / 32; ++t) {
          x[t] = smem.scores[r][lane + 32 * t];
          block_max = fmaxf(block_max, x[t]);
        }
        CUTE_UNROLL
        for (int o = 16; o >= 1; o /= 2) block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffff, block_max, o));
        const float m_new = fmaxf(m_own[j], block_max);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing seen yet: P = 0
        float sum = 0.f;
        CUTE_UNROLL
        for (int t = 0; t < kChunk / 32; ++t) {
          const float prob = exp2_approx(x[t] - m_use);
          smem.scores[r][lane + 32 * t] = prob;
          sum += prob;
        }
        CUTE_UNROLL
        for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
        const float alpha = exp2_approx(m_own[j] - m_use);  // 0 while nothing was seen
        l_own[j] = l_own[j] * alpha + sum;
        m_own[j] = m_new;
        if (lane == 0) smem.alphas[r] = alpha;
      }
    }
    __syncthreads();

    // O = alpha O + P V over my keys.
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (!live(r)) continue;
      const float alpha = smem.alphas[r];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
    }
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s) {
      float vf[8];
      unpack8<Element>(stage_at(stage, 1, s), vf);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (!live(r)) continue;
        const float prob = smem.scores[r][warp_key0 + s * kKeysPerStep + slot];
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(prob, vf[e], acc[r][e]);
      }
    }
  };

  for (int chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int key0 = key_lo + chunk * kChunk + warp_key0;
    const int stage = (chunk - chunk_begin) % kStages;
    if constexpr (kWmma) {
      wmma_pass(smem.tiles, key0);  // (which fetches the next chunk)
      continue;
    }
    if constexpr (kMma) __syncwarp();  // my warp's lanes are done with the stage that this fetch refills
    fetch();                           // chunk + kStages - 1, into the stage whose K and V the previous pass used up
    if constexpr (kAsync) cp_async_wait<kStages - 1>();
    if constexpr (kMma) {
      __syncwarp();  // each lane's copies of the chunk are seen by the warp's ldmatrix
      mma_pass(stage, key0);
    } else if constexpr (Traits::kOwnSoftmax) {
      own_pass(stage, key0);
    } else {
      shared_pass(stage, key0);
    }
  }

  if constexpr (kAsync) cp_async_wait<0>();  // (the fetches past the split's end were empty)

  // ---- Epilogue: O's parts summed over the keys of a warp, then over the warps; O / l and the log-sum-exp.
  if constexpr (kMma) {  // a lane's row sums cover its columns: the quad's sum is the warp's
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int o = 1; o <= 2; o *= 2) l_own[h] += __shfl_xor_sync(0xffffffff, l_own[h], o);
    }
  } else if constexpr (kWmma) {  // lanes r and r + 16 summed half of row r's keys each
    l_own[0] += __shfl_xor_sync(0xffffffff, l_own[0], 16);
  } else if constexpr (Traits::kOwnSoftmax) {  // the slots' statistics become the warp's: O, l rescaled to its max
    CUTE_UNROLL
    for (int o = kLanesPerKey / 2; o >= (1 << kSpreadShift); o /= 2) {  // the spread lanes' sums, the slot's
      l_own[0] += __shfl_xor_sync(0xffffffff, l_own[0], o);
    }
    float m = m_own[0];
    CUTE_UNROLL
    for (int o = kLanesPerKey; o < 32; o *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    const float f = m_own[0] == -INFINITY ? 0.f : exp2_approx(m_own[0] - m);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) acc[0][e] *= f;
    l_own[0] *= f;
    CUTE_UNROLL
    for (int o = kLanesPerKey; o < 32; o *= 2) l_own[0] += __shfl_xor_sync(0xffffffff, l_own[0], o);
    m_own[0] = m;
  }
  CUTE_UNROLL
  for (int r = 0; r < (kTensorCores ? 0 : kRows); ++r) {
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      CUTE_UNROLL
      for (int o = kLanesPerKey; o < 32; o *= 2) acc[r][e] += __shfl_xor_sync(0xffffffff, acc[r][e], o);
    }
  }
  __syncthreads();       // the stages' memory becomes o_part
  if constexpr (kMma) {  // C element e: row quad_row (+ 8 for e >= 2), head dim 8 n + 2 quad_col + e % 2
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 8; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = quad_row + 8 * (e / 2);
        if (r < kRows) smem.o_part[warp][r][8 * n + 2 * quad_col + e % 2] = o_frag[n][e];
      }
    }
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = quad_row + 8 * h;
      if (quad_col == 0 && r < kRows) {
        smem.row_max[warp * kRows + r] = m_own[h];
        smem.row_sum[warp * kRows + r] = l_own[h];
      }
    }
  } else if constexpr (kWmma) {
    CUTE_UNROLL
    for (int n = 0; n < kHeadDim / 16; ++n) {
      CUTE_UNROLL
      for (int e = 0; e < sm70::FragAcc::num_elements; ++e) o_acc[n].x[e] /= p_scale;
      nvcuda::wmma::store_matrix_sync(&smem.o_part[warp][0][16 * n], o_acc[n], kHeadDim, nvcuda::wmma::mem_row_major);
    }
    if (lane < 16) {
      smem.row_max[warp * kRows + lane] = m_own[0];
      smem.row_sum[warp * kRows + lane] = l_own[0];
    }
  } else if (slot == 0 && col < kHeadDim) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) smem.o_part[warp][r][col + e] = acc[r][e];
    }
  }
  CUTE_UNROLL
  for (int j = 0; j < (kTensorCores ? 0 : Traits::kRowsPerWarp); ++j) {
    const int r = Traits::kOwnSoftmax ? warp : warp + j * kWarps;  // a single row: the warp's statistics
    if (r < Traits::kStats && lane == 0) {
      smem.row_max[r] = m_own[j];
      smem.row_sum[r] = l_own[j];
    }
  }
  __syncthreads();
  constexpr int kColChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kRows * kColChunks; idx += Traits::kThreads) {
    const int r = idx / kColChunks, c = idx % kColChunks * 8;
    if (r >= rows || c >= p.head_dim) continue;
    const int i = r / group, head = head_of(r);
    // The row's max and sum, and each warp's weight: with kOwnSoftmax, the warps' statistics merged.
    float m = smem.row_max[r], l = smem.row_sum[r], weight[kWarps];
    CUTE_UNROLL
    for (int w = 0; w < kWarps; ++w) weight[w] = 1.f;
    if constexpr (Traits::kOwnSoftmax) {
      m = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, smem.row_max[w * kRows + r]);
      l = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        const float m_w = smem.row_max[w * kRows + r];
        weight[w] = m_w == -INFINITY ? 0.f : exp2_approx(m_w - m);
        l += weight[w] * smem.row_sum[w * kRows + r];
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key: O = 0
    float o[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      float x = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarps; ++w) x += weight[w] * smem.o_part[w][r][c + e];
      o[e] = x * inv;
    }
    const float lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    if (p.num_splits == 1) {
      cutlass::Array<Element, 8> out;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) out[e] = Element(o[e]);
      *reinterpret_cast<cutlass::Array<Element, 8>*>(p.o.at<Element>(seq.batch, head, seq.q_row0 + i) + c) = out;
      if (c == 0) p.lse[seq.stats(p, head) + i] = l > 0.f ? lse : INFINITY;
    } else {
      const int64_t row = split_row(p, split, seq.batch, head, i);
      float* dst = p.o_accum + row * kHeadDim + c;
      *reinterpret_cast<float4*>(dst) = make_float4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(o[4], o[5], o[6], o[7]);
      if (c == 0) p.lse_accum[row] = lse;
    }
  }

  // ---- With split_counters, the last split of this (sequence, key-value head) to finish merges its rows: each
  // split's parts are made visible device-wide before it counts itself in, and the last one sets the count back
  // to zero for the next call on the stream (no other split of this call touches it again).
  if (p.num_splits > 1 && p.split_counters != nullptr) {
    __threadfence();
    __syncthreads();                // (every thread's parts are written and fenced; o_part is no longer read)
    float& last = smem.row_max[0];  // 1: this split is the last
    if (threadIdx.x == 0) {
      int* counter = p.split_counters + blockIdx.z * gridDim.y + blockIdx.y;
      const bool is_last = atomicAdd(counter, 1) == p.num_splits - 1;
      if (is_last) *counter = 0;
      last = is_last ? 1.f : 0.f;
    }
    __syncthreads();
    if (last != 0.f) {
      __threadfence();  // the other splits' parts, counted in before my count, are read after it
      for (int r = warp; r < rows; r += kWarps) {
        merge_split_row<Element, kHeadDim, kDecodeMergeInFlight>(p, seq.batch, head_of(r), r / group, lane);
      }
    }
  }
}

// Host side: the decoding kernel for p (seqlen_q x group <= kDecodeMaxRows, a fixed-length batch), then the merge
// of its splits. kAsync: the sm80 family's cp.async stages.
template <typename Element, int kHeadDim, bool kAsync>
void run_decode(FwdParams const& p, cudaStream_t stream) {
  auto run = [&](auto traits) {
    using Traits = decltype(traits);
    launch(&decode_kernel<Traits>, dim3(p.num_splits, p.nheads_k, p.batch), Traits::kThreads, Traits::kSmemBytes,
           stream, p, "decoding");
  };
  const int rows = decode_kernel_rows(p.seqlen_q * (p.nheads / p.nheads_k));
  if (rows == 1) {
    run(DecodeTraits<Element, kHeadDim, 1, kAsync>{});
  } else if (rows == kDecodeMaxRows) {
    run(DecodeTraits<Element, kHeadDim, kDecodeMaxRows, kAsync>{});
  } else if constexpr (decode_tensor_cores(kHeadDim, kDecodeMaxMmaRows, kAsync)) {  // (decode_fits allows 16 only here)
    run(DecodeTraits<Element, kHeadDim, kDecodeMaxMmaRows, kAsync>{});
  }
  if (p.num_splits > 1 && p.split_counters == nullptr) merge_splits<Element, kHeadDim>(p, stream);
}

}  // namespace cuteflash

// What every pass of the decoding kernel (decode/kernel.cuh) shares: its tile constants (DecodeTraits), its shared
// memory (DecodeStorage) and a thread block's state (DecodeBlock): the rows and keys it serves, each row's visible
// keys, the ring of stages that a chunk's K and V arrive in, and the scores of a row and key.
//
// A pass is a type with its own registers (its part of O, its rows' running max and sum) and four members:
//   init(b)             Q and the accumulators, before the first chunk is fetched;
//   run(b, stage, key0) one chunk: scores, softmax, O rescaled and the chunk's P V added;
//   reduce(b)           its parts summed within each warp, after the last chunk;
//   store(b)            after a barrier: its warp's part of O to o_part, its rows' statistics to row_max and row_sum;
// and, from DecodePassBase, the hooks that the walk and the storage ask it about (below).
#pragma once

#include <cute/config.hpp>

#include "cuteflash/common/mask.cuh"
#include "cuteflash/common/softmax.cuh"
#include "cuteflash/common/utils.cuh"
#include "cuteflash/decode/config.h"

namespace cuteflash {

// Family: the kernel family whose decoding kernel this is. Family::kConfig: its DecodeConfig (config.h: cp.async or
// registers, where its tensor cores take over); Family::TensorPass<Traits>: its pass of several query rows on tensor
// cores (decode_tensor_cores).
template <typename Element_, int kHeadDim_, int kRows_, typename Family_>
struct DecodeTraits {
  using Element = Element_;
  using Family = Family_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = kRows_;  // query rows held (a block serves up to this many)
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // decode/config.h: the lanes that read a key row, 8 elements (16 bytes) each; the loads of K and of V per lane and
  // chunk; with kAsync, the chunks in flight in shared memory, else one in registers.
  static constexpr int kLanesPerKey = decode_lanes_per_key(kHeadDim);
  static constexpr int kKeysPerStep = 32 / kLanesPerKey;
  static constexpr DecodeConfig kConfig = Family::kConfig;
  static constexpr bool kAsync = kConfig.async;
  static constexpr int kSteps = decode_steps(kHeadDim, kRows, kConfig);
  static constexpr int kStages = kAsync ? decode_stages(kHeadDim, kRows) : 1;
  static constexpr bool kTensorCores = decode_tensor_cores(kHeadDim, kRows, kConfig);
  static_assert(!kTensorCores || (kRows <= 16 && kKeysPerStep * kSteps % 16 == 0 && kHeadDim % 16 == 0));
  static_assert(kWarps * kKeysPerStep * kSteps >= 32, "the softmax reads a chunk 32 keys at a time");
  static constexpr int kWarpKeys = kKeysPerStep * kSteps;
  static constexpr int kChunk = kWarps * kWarpKeys;  // keys per chunk
  static_assert(kChunk == decode_chunk(kHeadDim, kRows, kConfig));
  static constexpr int kRowsPerWarp = ceil_div(kRows, kWarps);  // the query rows whose statistics a warp owns
  // For a single query row, each key slot of a warp (the kLanesPerKey lanes of one key of a load) keeps the running
  // max and sum of its own keys; on tensor cores, each warp keeps its rows' over its own keys. Then the walk needs
  // no barrier between warps, no shared memory besides their stages or tiles, and no warp waits for another's
  // softmax. The epilogue merges the slots' and then the warps' statistics.
  static constexpr bool kOwnSoftmax = kRows == 1 || kTensorCores;
  static constexpr int kStats = kOwnSoftmax ? kWarps * kRows : kRows;  // statistics in shared memory at the end
  static constexpr int kRingBytes = kStages > 1 ? kStages * 2 * kSteps * kThreads * 16 : 0;
  static constexpr int kScoreRows = kOwnSoftmax ? 1 : kRows;
};

// The defaults of a pass's hooks.
struct DecodePassBase {
  struct NoTiles {};
  using Tiles = NoTiles;  // shared memory of the pass's own, beside the stages (a union with them)
  // The row (of the kRows) of each of the kRowsHeld rows whose visible keys a lane keeps.
  static constexpr int kRowsHeld = 1;
  __device__ __forceinline__ static int held_row(int held, int lane) { return held; }
  // The lanes of a warp read each other's bytes of a stage (ldmatrix): the warp syncs around each fetch.
  static constexpr bool kWarpReadsStage = false;
  // The pass issues the next chunk's fetch itself, once it has stored the registers it arrived in.
  static constexpr bool kFetchesItself = false;
  // Where piece `piece` (16 bytes) of key slot `key_slot` of step s lies in its row of the stage.
  __device__ __forceinline__ static int stage_piece(int piece, int s, int key_slot) { return piece; }
};

// Shared memory (dynamic, all of it): the async stages, [stage][K, V][step][thread] 16 bytes, each lane's own, or
// the pass's tiles, which after the walk hold the warps' parts of O; where the warps share a softmax, the chunk's
// scores and the rows' rescale factors; the rows' statistics.
template <typename Traits, typename Pass>
struct DecodeStorage {
  union {
    uint4 ring[Traits::kRingBytes > 0 ? Traits::kRingBytes / 16 : 1];
    float o_part[Traits::kWarps][Traits::kRows][Traits::kHeadDim];
    typename Pass::Tiles tiles;
  };
  float scores[Traits::kScoreRows][Traits::kOwnSoftmax ? 1 : Traits::kChunk];
  float alphas[Traits::kScoreRows];
  float row_max[Traits::kStats];  // kOwnSoftmax: warp w's of row r at w kRows + r
  float row_sum[Traits::kStats];
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
template <typename Traits, typename Pass>
struct DecodeBlock {
  using Element = typename Traits::Element;
  static constexpr int kRows = Traits::kRows;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kLanesPerKey = Traits::kLanesPerKey;
  static constexpr int kKeysPerStep = Traits::kKeysPerStep;
  static constexpr int kSteps = Traits::kSteps;
  static constexpr int kChunk = Traits::kChunk;
  static constexpr int kStages = Traits::kStages;
  static constexpr bool kAsync = Traits::kAsync;

  FwdParams const& p;
  DecodeStorage<Traits, Pass>& smem;
  int split, head_k;
  Sequence seq;
  int group;
  int rows;  // row r: query r / group of head head_k * group + r % group
  int warp, lane;
  int slot;  // the key of a load this lane reads
  int col;   // and its columns
  bool col_ok;
  MaskPolicy<true> mask;
  int key_begin[Pass::kRowsHeld], key_end[Pass::kRowsHeld];  // my held rows' visible keys, and ALiBi slopes
  float slope[Pass::kRowsHeld];
  int shift;
  int page_shift;
  int key_lo, key_hi;          // the keys that some row sees
  int chunk_begin, chunk_end;  // this split's chunks of them
  int warp_key0;               // my warp's first key in a chunk
  // The chunks' K and V on their way: with kStages > 1, a ring of stages in shared memory that cp.async fills
  // kStages - 1 chunks ahead, each lane reading back only the bytes it fetched (so its own wait is enough; where the
  // warp reads the stage, only bytes its warp fetched, the warp synced after the wait and before a stage is
  // refilled), and the rows of a chunk looked up one fetch ahead (a paged cache's table read does not hold up the
  // fetch); with one stage, registers loaded at the top of the chunk's pass.
  uint4 regs[2][kStages == 1 ? kSteps : 1];
  KeyRow next[kSteps];  // the block-table entries of a paged cache are checked at the fetch, a pass after their load
  int fetched;          // the next chunk to fetch

  __device__ __forceinline__ DecodeBlock(FwdParams const& p_, DecodeStorage<Traits, Pass>& smem_) : p(p_), smem(smem_) {
    split = blockIdx.x;
    head_k = blockIdx.y;
    seq = sequence<Variant::kGeneral>(p, blockIdx.z);
    group = p.nheads / p.nheads_k;
    rows = seq.seqlen_q * group;
    warp = threadIdx.x / 32;
    lane = threadIdx.x % 32;
    slot = lane / kLanesPerKey;
    col = (lane % kLanesPerKey) * 8;
    col_ok = col < p.head_dim;
    mask = MaskPolicy<true>::make(seq.seqlen_q, seq.seqlen_k, p.causal, p.window_left, p.window_right);
    CUTE_UNROLL
    for (int held = 0; held < Pass::kRowsHeld; ++held) {
      const int r = Pass::held_row(held, lane);
      const bool row_live = r < rows;
      const int i = row_live ? r / group : 0;
      key_begin[held] = row_live ? mask.key_begin(i) : 0;
      key_end[held] = row_live ? mask.key_end(i) : 0;
      slope[held] = row_live && p.alibi_slopes != nullptr
                        ? p.alibi_slopes[seq.batch * p.alibi_batch_stride + head_of(r)] / p.softmax_scale
                        : 0.f;
    }
    shift = seq.seqlen_k - seq.seqlen_q;
    page_shift = log2_page_size(p);
    key_lo = mask.key_begin(0);
    key_hi = mask.key_end(seq.seqlen_q - 1);
    const int chunks = key_hi > key_lo ? ceil_div(key_hi - key_lo, kChunk) : 0;
    const int per_split = ceil_div(chunks, p.num_splits);
    chunk_begin = min(split * per_split, chunks);
    chunk_end = min(chunk_begin + per_split, chunks);
    warp_key0 = warp * Traits::kWarpKeys;
  }

  __device__ int head_of(int r) const { return head_k * group + r % group; }
  // Whether query row r exists: the rows past `rows` (a group of 4 in a kernel for 8) are skipped at run time.
  __device__ bool live(int r) const { return kRows == 1 || r < rows; }
  // The 16 bytes of query row r at column c (zeros where the row or the column does not exist).
  __device__ __forceinline__ uint4 query_piece(int r, int c) const {
    if (!(live(r) && c < p.head_dim)) return make_uint4(0, 0, 0, 0);
    return __ldg(
        reinterpret_cast<uint4 const*>(p.q.at<Element const>(seq.batch, head_of(r), seq.q_row0 + r / group) + c));
  }

  __device__ uint4& ring_at(int stage, int kv, int s, int key_slot, int piece) {
    piece = Pass::stage_piece(piece, s, key_slot);
    return smem.ring[((stage * 2 + kv) * kSteps + s) * Traits::kThreads + warp * 32 + key_slot * kLanesPerKey + piece];
  }
  // My 16 bytes of step s of K (kv 0) or V (1) of a stage.
  __device__ uint4& stage_at(int stage, int kv, int s) {
    if constexpr (kStages == 1) {
      return regs[kv][s];
    } else {
      return ring_at(stage, kv, s, slot, lane % kLanesPerKey);
    }
  }
  // Piece `piece` of my warp's key `key` (of its kWarpKeys in the chunk).
  __device__ uint4 const& key_piece(int stage, int kv, int key, int piece) {
    return ring_at(stage, kv, key / kKeysPerStep, key % kKeysPerStep, piece);
  }

  __device__ void locate(int chunk) {
    CUTE_UNROLL
    for (int s = 0; s < kSteps; ++s)
      next[s] = key_row(p, seq, key_lo + chunk * kChunk + warp_key0 + s * kKeysPerStep + slot, key_hi, page_shift);
  }
  // Chunk `fetched` into its stage (nothing past the split's end).
  __device__ void fetch() {
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
  }

  // Row r's score of key `key` in log2 units, from their dot product: the softcap, ALiBi, then the mask (-inf where
  // r does not see the key: outside [begin, end)).
  __device__ float score(float dot, int key, int r, int begin, int end, float slope_r) const {
    if (p.softcap > 0.f) dot = tanh_fast(dot * p.softcap);
    dot -= slope_r * fabsf(float(r / group + shift - key));
    return key >= begin && key < end ? dot * p.softmax_scale_log2 : -INFINITY;
  }

  // The walk over this split's chunks, each fetched kStages - 1 chunks ahead (with one stage, at the top of its pass,
  // or by the pass itself) and handed to the pass.
  __device__ __forceinline__ void walk(Pass& pass) {
    fetched = chunk_begin;
    if (kAsync && chunk_begin < chunk_end) locate(chunk_begin);
    CUTE_UNROLL
    for (int i = 0; i + 1 < kStages; ++i) fetch();
    if constexpr (Pass::kFetchesItself) fetch();  // the first chunk, which the pass stores at the top of its run
    for (int chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      const int key0 = key_lo + chunk * kChunk + warp_key0;
      const int stage = (chunk - chunk_begin) % kStages;
      if constexpr (Pass::kFetchesItself) {
        pass.run(*this, stage, key0);
        continue;
      }
      if constexpr (Pass::kWarpReadsStage) __syncwarp();  // my warp's lanes are done with the stage this refills
      fetch();  // chunk + kStages - 1, into the stage whose K and V the previous pass used up
      if constexpr (kAsync) cp_async_wait<kStages - 1>();
      if constexpr (Pass::kWarpReadsStage) __syncwarp();  // each lane's copies of the chunk are seen by the warp
      pass.run(*this, stage, key0);
    }
    if constexpr (kAsync) cp_async_wait<0>();  // (the fetches past the split's end were empty)
  }
};

}  // namespace cuteflash

// Compile-time configuration of one sm70 kernel: tile shape, warps, shared-memory layout and the
// schedule of the backward's steps. The tiles come from sm70/tiles.h; this file says what each needs.
#pragma once

#include "cuteflash/sm70/wmma.cuh"
#include "cuteflash/sm70/tiles.h"

namespace cuteflash::sm70 {

using namespace cute;

// ---- Tunings for running the family on a newer GPU than its own ----
// The family ships for Volta and Turing, whose 64-96 KB of shared memory per SM hold one or two blocks.
// Compiled for an sm80+ GPU as well (CUTEFLASH_SM70_EXTRA_ARCHS, to test the family there), more blocks
// fit, and capping the registers per thread lets them run. These are the only code differences between
// the family's own GPUs and newer ones. Blocks per SM that the registers must allow (__launch_bounds__;
// 0: the compiler's choice; an explicit 1 is not the same, ptxas then takes up to 255):
//   forward, head dims <= 64: 3, 168 registers with a few bytes of spills (2 % faster on H200; this relies
//     on thread_index's range, without which the spills grow). At d=128 three would spill 724 bytes.
//   backward, head dims <= 128: 2, 128 registers for a few bytes of spills (20 % faster at d=128 on H200).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kNewerGpu = true;
#else
constexpr bool kNewerGpu = false;
#endif
constexpr int fwd_min_blocks(int head_dim) { return kNewerGpu && head_dim <= 64 ? 3 : 0; }
constexpr int bwd_min_blocks(int head_dim) { return kNewerGpu && head_dim <= 128 ? 2 : 0; }

// ---- Forward ----
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits {
  using Element = half_t;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;  // query rows per warp
  static constexpr int kRowTiles = kWarpRows / 16;     // 16-row tiles of queries per warp
  static_assert(kHeadDim % 32 == 0 && kBlockN % 32 == 0 && (kWarpRows == 16 || kWarpRows == 32));
  static constexpr int kMinBlocks = fwd_min_blocks(kHeadDim);

  // Row-major shared tiles padded by 16 bytes, so that the 16 rows of a WMMA load do not share banks
  // (WMMA loads take a pointer and a leading dimension: no swizzle).
  static constexpr int kLdQKV = kHeadDim + 8;  // halves
  // floats: per-warp S scratch, also O tiles at the end. Rows 8 banks apart: the accumulator stores of a
  // half-warp (4 rows of 32 bytes, as WMMA lowers on sm80+) hit distinct banks (rows 4 banks apart would
  // make them 2-way conflicts).
  static constexpr int kLdS = kBlockN + 8;
  static constexpr int kLdP = kBlockN + 8;  // halves: per-warp P hi / lo
  // Each warp's scratch holds its rows of S (fp32), then of P (hi', lo: fp16) in their place.
  static constexpr int kPLoOffset = kWarpRows * kLdP;  // halves
  static constexpr int kScratchBytes = kWarpRows * cute::max(kLdS * 4, 2 * kLdP * 2);
  static_assert(kScratchBytes % 32 == 0 && kPLoOffset * 2 % 32 == 0);  // WMMA: 256-bit aligned pointers
  using SmemLayoutQ = Layout<Shape<Int<kBlockM>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;
  using SmemLayoutKV = Layout<Shape<Int<kBlockN>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;

  using CopyQ = GmemTileCopy<kBlockM, kHeadDim, kNThreads>;
  using CopyKV = GmemTileCopy<kBlockN, kHeadDim, kNThreads>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    array_aligned<char, kNWarps * kScratchBytes, 32> scratch;  // S, then P, of each warp
    array_aligned<float, kBlockM> alpha;                       // each warp's row rescale factors of the current step
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// The traits of forward tile choice i (sm70/tiles.h) for a head dim.
template <int kHeadDim, int kChoice>
struct FwdTraitsChoice {
  static constexpr TileConfig kTile = sm70_fwd_tile_choice(kHeadDim, kChoice);
  using type = FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.n_warps>;
};

// ---- Backward ----
// The schedule of a backward step for a head dim. Up to 64, shared memory's bandwidth bounds a step,
// mostly through WMMA fragment loads; above, registers do (dK and dV take 64 of 128 at d=128).
struct BwdSchedule {
  // dV on the first half of the warps, dK on the other, each warp a whole 16-key row of its product, so
  // that a split A fragment (P^T or dS^T) serves 4 tiles instead of 2: a quarter of dV's and dK's
  // fragment loads fewer.
  bool split_key_products;
  // dS stored with the current scale s before the block's largest |dS| is known, and again in the rare
  // step that needs another s: one barrier less per step than storing it once s is known.
  bool eager_ds;
  // The order of the step's products: dQ, dV, dK; else dV, dK, dQ.
  bool dq_first;
};
// Head dims <= 64: 2 % faster for eager_ds, 1-2 % for dQ last, than the other way.
constexpr BwdSchedule kBandwidthBoundSchedule{true, true, false};
// Above: eager_ds is slower, dQ first 2 % faster at d=128.
constexpr BwdSchedule kRegisterBoundSchedule{false, false, true};

template <int kHeadDim_, int kBlockM_, int kBlockN_, Sm70QStaging kStaging_>
struct BwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per step (of a dK/dV thread block: all of its keys)
  static constexpr Sm70QStaging kStaging = kStaging_;
  static constexpr bool kPingPong = kStaging == Sm70QStaging::kPingPong;
  static constexpr BwdSchedule kSchedule = kHeadDim <= 64 ? kBandwidthBoundSchedule : kRegisterBoundSchedule;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMinBlocks = bwd_min_blocks(kHeadDim);
  static_assert(kHeadDim % 32 == 0 && kBlockM % 16 == 0 && kBlockN % 16 == 0);

  // Row-major shared tiles padded by 16 bytes per row against bank conflicts (WMMA loads take a
  // pointer and a leading dimension: no swizzle).
  static constexpr int kLdQKV = kHeadDim + 8;  // halves
  // floats: S and dP, (kBlockM, kBlockN) each. Rows 8 banks apart: the accumulator stores of 16 lanes
  // (4 rows of 8-byte pairs, as WMMA lowers on sm80+) hit distinct banks; the element-wise reads take one
  // row per quarter-warp and do not care.
  static constexpr int kLdS = kBlockN + 8;
  static constexpr int kLdP = kBlockN + 8;  // halves: P and dS hi / lo, (kBlockM, kBlockN)

  // The element-wise phase: each thread owns kCols consecutive columns of one row of S and dP.
  static constexpr int kCols = kBlockM * kBlockN / kNThreads;
  static constexpr int kThreadsPerRow = kBlockN / kCols;
  static_assert(kCols >= 1 && kThreadsPerRow * kCols == kBlockN && 32 % kThreadsPerRow == 0);

  // 16x16 output tiles of S and dP, dealt to the warps round-robin.
  static constexpr int kScoreTiles = (kBlockM / 16) * (kBlockN / 16);
  // Tiles of a row of S or dP per warp (sharing A): 2 where the block has twice as many tiles as warps.
  static constexpr int kScoreGroup = kScoreTiles >= kNWarps && (kBlockN / 16) % 2 == 0 ? 2 : 1;
  // dK and dV (key tiles), dQ (query tiles): a warp's tiles share their rows, the split A operand (P^T,
  // dS^T, dS: 2 fragments per step along K) loaded once per step for all of them, the B fragments (one
  // per tile and step) one at a time (sharing columns instead, B loaded once and A per tile for each
  // step, takes 50 % more fragment loads for dK and dV at d=128).
  using KeyTiles = WarpRowTiles<kBlockN / 16, kHeadDim / 16, kSchedule.split_key_products ? kNWarps / 2 : kNWarps>;
  using QueryTiles = WarpRowTiles<kBlockM / 16, kHeadDim / 16, kNWarps>;

  using SmemLayoutQ = Layout<Shape<Int<kBlockM>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;
  using SmemLayoutKV = Layout<Shape<Int<kBlockN>, Int<kHeadDim>>, Stride<Int<kLdQKV>, _1>>;
  using CopyQ = GmemTileCopy<kBlockM, kHeadDim, kNThreads>;
  using CopyKV = GmemTileCopy<kBlockN, kHeadDim, kNThreads>;

  // The Q region holds Q, dO (kQHalves each) and the warps' slots of a block-wide max; the scratch, S
  // and dP side by side, fp32. With kPingPong both regions take either role; without, region 0 is the Q
  // region and region 1 the scratch, which between steps also holds each warp's 16x16 fp32 tile on its
  // way out (its staging tile).
  static constexpr int kQHalves = cosize_v<SmemLayoutQ>;
  static constexpr int kQRegionBytes = 2 * kQHalves * 2 + kNWarps * 4;
  static constexpr int kScratchBytes = 2 * kBlockM * kLdS * 4;
  // A staging tile's leading dimension, in floats: 24 where the tiles fit in the scratch that way
  // (conflict-free accumulator stores and, in red_add_tile, reads), else 16, the shared memory the tile
  // variants of the smaller GPUs have (with kPingPong, at d=128, a V100 has no 4 KB to spare).
  static constexpr int kStageLd = !kPingPong && kScratchBytes >= kNWarps * 16 * 24 * 4 ? 24 : 16;
  static constexpr int kStageFloats = kNWarps * 16 * kStageLd;
  static constexpr int kRegionBytes[2] = {
      kPingPong ? cute::max(kQRegionBytes, kScratchBytes) : kQRegionBytes,
      kPingPong ? cute::max(kQRegionBytes, kScratchBytes) : cute::max(kScratchBytes, kStageFloats * 4)};

  struct SharedStorage {  // 32-byte alignment: WMMA loads and stores need 256-bit aligned pointers
    array_aligned<char, kRegionBytes[0], 32> region0;
    array_aligned<char, kRegionBytes[1], 32> region1;
    array_aligned<half_t, cosize_v<SmemLayoutKV>, 32> k, v;
    array_aligned<half_t, kBlockM * kLdP, 32> p_hi, p_lo, ds_hi, ds_lo;
    array_aligned<float, kPingPong ? kStageFloats : 8, 32> stage;  // with kPingPong (else in the scratch)
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));

  // The buffers of a step whose Q and dO are in region `which` (always 0 without kPingPong).
  struct Buffers {
    half_t* q;
    half_t* dout;
    float* warp_max;
    float* scratch;
  };
  __device__ static Buffers buffers(SharedStorage& smem, int which) {
    char* q_region = which == 0 ? smem.region0.data() : smem.region1.data();
    char* other = which == 0 ? smem.region1.data() : smem.region0.data();
    auto* q = reinterpret_cast<half_t*>(q_region);
    return {q, q + kQHalves, reinterpret_cast<float*>(q + 2 * kQHalves), reinterpret_cast<float*>(other)};
  }
  // The calling warp's staging tile.
  __device__ static float* stage(SharedStorage& smem, int warp) {
    return (kPingPong ? smem.stage.data() : reinterpret_cast<float*>(smem.region1.data())) + warp * 16 * kStageLd;
  }
};

// The traits of backward tile choice i (sm70/tiles.h) for a head dim.
template <int kHeadDim, int kChoice>
struct BwdTraitsChoice {
  static constexpr Sm70BwdTile kTile = sm70_bwd_tile_choice(kHeadDim, kChoice);
  using type = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.staging>;
};

}  // namespace cuteflash::sm70

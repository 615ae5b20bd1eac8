// The tile schedulers of the forward kernels: which query tiles of which (sequence, head) a thread block computes.
// for_each_tile and for_each_fwd_tile (sequence.cuh) walk a block's tiles for every batch kind, split keys and
// variable lengths included; TileScheduler serves fixed-length batches, one tile a block or persistent blocks.
#pragma once

namespace cuteflash {

// The query block a one-tile-per-block grid gives this block: from the last down, so that the heaviest causal tiles
// start first and the grid's tail is light.
__device__ __forceinline__ int heaviest_first_block() { return int(gridDim.x - 1 - blockIdx.x); }

// One tile of kBlockM query rows of one (sequence, head).
struct FwdTile {
  int m_block, head, batch;
};

// The tiles of a thread block, from the index t = first(), next(t), ... while valid(t) (and, kVarlen, while the tile
// lies within its sequence: the caller checks). Not persistent: the grid has a block per query block of each (sequence,
// head) up to the params' bound, m_block fastest and from the last down (so that the heaviest causal blocks start
// first); a block takes that one tile, or, kVarlen, that one and every gridDim.x-th after it within its sequence (a
// variable-length batch's may be longer than the bound, max_seqlen_q). Persistent (a block per multiprocessor, fixed
// lengths): every gridDim.x-th tile of all, m_block fastest, so that the blocks at work at one time read a few
// (sequence, head)'s keys and values, which stay in L2 for all of them.
template <bool kPersistent, bool kVarlen = false>
struct TileScheduler {
  static_assert(!(kPersistent && kVarlen));
  int m_blocks;  // query blocks per (sequence, head)
  int nheads;
  int tiles;

  // (One tile a block, fixed lengths: t = 0 only.)
  __device__ __forceinline__ int first() const {
    return kPersistent ? int(blockIdx.x) : kVarlen ? heaviest_first_block() : 0;
  }
  __device__ __forceinline__ int next(int t) const { return kPersistent || kVarlen ? t + int(gridDim.x) : 1; }
  __device__ __forceinline__ FwdTile tile(int t) const {
    if constexpr (kPersistent) {
      const int bh = t / m_blocks;
      return {t - bh * m_blocks, bh % nheads, bh / nheads};
    } else {
      return {kVarlen ? t : heaviest_first_block(), int(blockIdx.y), int(blockIdx.z)};
    }
  }
  __device__ __forceinline__ bool valid(int t) const { return kVarlen || t < tiles; }
};

}  // namespace cuteflash

// Tile sizes per (family, head dim, direction). constexpr so that both the kernels (as template
// arguments) and the host (to choose a variant that fits the device's shared memory) read one table.
#pragma once

namespace cuteflash {

struct TileConfig {
  int block_m;  // query rows per thread block
  int block_n;  // key/value rows per main-loop step
  int n_warps;

  constexpr int smem_bytes_fwd(int head_dim, int elem_bytes) const {
    return (block_m + 2 * block_n) * head_dim * elem_bytes;  // sQ (reused for sO), sK, sV
  }
};

// Head dims that get a kernel; other head dims run the next larger one with the extra columns
// masked off. Few instantiations keep the build short.
constexpr int kHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

constexpr int round_up_head_dim(int d) {
  for (int hd : kHeadDims) {
    if (d <= hd) return hd;
  }
  return -1;
}

// sm80 forward, for devices with large shared memory (A100: 163 KB, H100/H200: 227 KB).
// 128x128 with 4 warps for d <= 64 and 128x64 for d <= 128 follow FlashAttention-2's choices on sm80/sm90;
// larger head dims use 8 warps so that the O accumulator stays within the register file.
constexpr TileConfig sm80_fwd_tile(int head_dim) {
  return head_dim <= 64    ? TileConfig{128, 128, 4}
         : head_dim <= 128 ? TileConfig{128, 64, 4}
                           : TileConfig{128, 64, 8};
}

// The opt-in shared memory per block of sm86, sm89 and sm120 GPUs (99 KB).
constexpr int kSmallSmemBytes = 101376;

// sm80 forward for devices with about 99 KB of shared memory per block (sm86, sm89, sm120): the
// large-memory tile of head dims 224 and 256 does not fit there.
constexpr TileConfig sm80_fwd_tile_small_smem(int head_dim) {
  return head_dim <= 192 ? sm80_fwd_tile(head_dim) : TileConfig{64, 64, 4};
}

// sm80 backward: block_m query rows per inner step, block_n key rows per thread block, 8 warps. The
// block keeps dK and dV for its keys in registers: (block_n x head_dim) x 2 over 256 threads.
constexpr TileConfig sm80_bwd_tile(int head_dim) {
  return head_dim <= 128 ? TileConfig{64, 128, 8} : TileConfig{64, 64, 8};
}

// sQ, sdO, sK, sV, and sP, sdS (block_m x block_n each).
constexpr int sm80_bwd_smem_bytes(TileConfig t, int head_dim, int elem_bytes) {
  return ((2 * t.block_m + 2 * t.block_n) * head_dim + 2 * t.block_m * t.block_n) * elem_bytes;
}

// sm80 backward for devices with about 99 KB of shared memory per block (sm86, sm89, sm120): 64 x 64
// where the large tile does not fit (head dims 96 and 128). Head dims 192-256 have no tile there yet.
constexpr TileConfig sm80_bwd_tile_small_smem(int head_dim) {
  return sm80_bwd_smem_bytes(sm80_bwd_tile(head_dim), head_dim, 2) <= kSmallSmemBytes ? sm80_bwd_tile(head_dim)
                                                                                     : TileConfig{64, 64, 8};
}

}  // namespace cuteflash

// The tiles every family shares: the tile shape, the kernel head dims, and the split limits of a forward pass.
// constexpr, so that the kernels (as template arguments) and the host (choosing what fits a device) read one
// table; each family's own tiles live in its folder (sm70/tiles.h, sm80/tiles.h), the decoding kernel's in
// decode/config.h.
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

// The most splits of the keys a forward pass makes (the decoding kernel, and the tiled kernels for KV caches), and
// the fewest keys per split that the tiled kernels and the decoding kernel's tensor-core path choose: fewer would
// cost more in Q's load, O's fp32 part and its merge per split than their keys.
constexpr int kMaxSplits = 128;
constexpr int kMinKeysPerSplit = 256;

}  // namespace cuteflash

// Host helpers shared by the launchers of both families: the choice of the first tile variant that fits the
// device's shared memory, and a launch that raises the kernel's dynamic shared-memory limit first when it needs
// more than 48 KB.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuteflash/host/device.h"
#include "cuteflash/common/sequence.cuh"
#include "cuteflash/common/utils.cuh"

namespace cuteflash {

inline void require_smem(int needed, char const* what, int head_dim) {
  int available = max_smem_per_block();
  if (needed > available) {
    throw std::runtime_error(std::string("cuteflash: the ") + what + " kernel for head dim " +
                             std::to_string(head_dim) + " needs " + std::to_string(needed) +
                             " bytes of shared memory per block; this GPU offers " + std::to_string(available));
  }
}

// Calls launch_one(T{}) for the first of the tile variants First, Rest... whose shared memory fits
// this device (largest first), or raises if none does.
template <typename First, typename... Rest, typename LaunchOne>
void launch_fitting(LaunchOne const& launch_one, char const* what, int head_dim) {
  if constexpr (sizeof...(Rest) == 0) {
    require_smem(First::kSmemBytes, what, head_dim);
    launch_one(First{});
  } else if (First::kSmemBytes <= max_smem_per_block()) {
    launch_one(First{});
  } else {
    launch_fitting<Rest...>(launch_one, what, head_dim);
  }
}

template <Variant V>
using VariantConstant = std::integral_constant<Variant, V>;

// Calls launch_for(VariantConstant<V>{}) with V kFixed or kVarlen, the kind of batch of p: for the kernels
// without options (the backward's preprocess and conversions).
template <typename LaunchFor>
void for_batch_kind(FwdParams const& p, LaunchFor const& launch_for) {
  if (p.cu_seqlens_q != nullptr) {
    launch_for(VariantConstant<Variant::kVarlen>{});
  } else {
    launch_for(VariantConstant<Variant::kFixed>{});
  }
}

// Whether p sets an option that only the variants with has_options apply (params.h).
inline bool needs_general(FwdParams const& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.softcap > 0.f || p.alibi_slopes != nullptr ||
         p.rng_state != nullptr || p.seqused_k != nullptr;
}

// Calls launch_for(VariantConstant<V>{}) with the variant (sequence.cuh) that computes p.
template <typename LaunchFor>
void for_variant(FwdParams const& p, LaunchFor const& launch_for) {
  if (p.rng_state != nullptr && p.softcap > 0.f) {
    launch_for(VariantConstant<Variant::kSoftcapDropout>{});
  } else if (p.rng_state != nullptr) {
    launch_for(VariantConstant<Variant::kDropout>{});
  } else if (p.softcap > 0.f) {
    launch_for(VariantConstant<Variant::kSoftcap>{});
  } else if (needs_general(p)) {
    launch_for(VariantConstant<Variant::kGeneral>{});
  } else {
    for_batch_kind(p, launch_for);
  }
}

// Calls launch_for(std::bool_constant<kPaged>{}) for a forward kernel of variant V: kPaged when p's KV cache is
// paged. Kernels read pages only in the variants that serve caches (sequence.cuh), and only in kernels of their
// own: the page lookups in the key loop, even where never run, slow the kernels that read no pages by 4-15 % (the
// options' forward at head dim 128 on an H100).
template <Variant V, typename LaunchFor>
void for_paging(FwdParams const& p, LaunchFor const& launch_for) {
  if constexpr (serves_caches(V)) {
    if (p.block_table != nullptr) {
      launch_for(std::true_type{});
      return;
    }
  }
  launch_for(std::false_type{});
}

// The grid of a forward kernel with query tiles of block_m rows: a block per tile, head and sequence, times
// p.num_splits where the kernel splits the keys (for_each_fwd_tile).
inline dim3 fwd_grid(FwdParams const& p, int block_m) {
  return dim3(unsigned(ceil_div(p.seqlen_q, block_m) * std::max(p.num_splits, 1)), p.nheads, p.batch);
}

template <typename Params>
void launch(void (*kernel)(Params), dim3 grid, int threads, int smem, cudaStream_t stream, Params const& p,
            char const* what) {
  if (smem > 48 * 1024) allow_dynamic_smem(reinterpret_cast<void const*>(kernel), smem, what);
  kernel<<<grid, threads, smem, stream>>>(p);
  check_cuda(cudaGetLastError(), (std::string("launching the ") + what + " kernel").c_str());
}

}  // namespace cuteflash

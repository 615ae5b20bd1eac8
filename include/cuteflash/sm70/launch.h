// Host side shared by the sm70 launchers: which tile variants to compile and launch.
#pragma once

#include <utility>

#include "cuteflash/host/launch.h"
#include "cuteflash/sm70/tiles.h"

namespace cuteflash::sm70 {

// The sm70 family's GPUs offer 64 KB (Turing) to 96 KB (Volta) of shared memory per block.
constexpr int kMinSmemSm70 = 64 * 1024;
constexpr int kMaxSmemSm70 = 96 * 1024;

// launch_fitting for the sm70 family, over tile variants from large to small, compiling only those some
// GPU of the family would choose: a variant above 96 KB fits none (so a test on a bigger GPU runs what a
// V100 would), and the variants after one that fits in 64 KB would never be reached.
template <typename First, typename... Rest, typename LaunchOne>
void launch_fitting_sm70(LaunchOne const& launch_one, char const* what, int head_dim) {
  if constexpr (sizeof...(Rest) > 0 && First::kSmemBytes > kMaxSmemSm70) {
    launch_fitting_sm70<Rest...>(launch_one, what, head_dim);
  } else if constexpr (sizeof...(Rest) == 0 || First::kSmemBytes <= kMinSmemSm70) {
    launch_fitting<First>(launch_one, what, head_dim);
  } else if (First::kSmemBytes <= max_smem_per_block()) {
    launch_one(First{});
  } else {
    launch_fitting_sm70<Rest...>(launch_one, what, head_dim);
  }
}

template <template <int, int> class Choice, int kHeadDim, typename LaunchOne, int... kChoices>
void launch_choices(LaunchOne const& launch_one, char const* what, std::integer_sequence<int, kChoices...>) {
  launch_fitting_sm70<typename Choice<kHeadDim, kChoices>::type...>(launch_one, what, kHeadDim);
}

// launch_fitting_sm70 over the tile choices of sm70/tiles.h: Choice<kHeadDim, i>::type for i < kSm70TileChoices.
template <template <int, int> class Choice, int kHeadDim, typename LaunchOne>
void launch_tile_choices(LaunchOne const& launch_one, char const* what) {
  launch_choices<Choice, kHeadDim>(launch_one, what, std::make_integer_sequence<int, kSm70TileChoices>{});
}

}  // namespace cuteflash::sm70

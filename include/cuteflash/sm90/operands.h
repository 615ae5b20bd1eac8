// Host side of the sm90 kernels' operands: the global tensors their TMA descriptors are built over.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>

#include "cuteflash/common/params.h"

namespace cuteflash::sm90 {

using namespace cute;

// A stride TMA can take for a mode of `extent` elements: a mode of one element is never stepped along, so any stride
// serves (`packed`, that of a packed layout); TMA takes no stride of 0 (a broadcast view), which the caller copies.
inline int64_t tma_stride(int64_t stride, int extent, int64_t packed, char const* name) {
  if (extent == 1) return packed;
  if (stride == 0) {
    throw std::invalid_argument(std::string("cuteflash: the sm90 kernels cannot read ") + name +
                                " with a stride of 0 (an expanded tensor): pass it contiguous");
  }
  return stride;
}

// The (rows, head dim, heads, batch) tensor of operand t with the head dim contiguous, or, kTransposed, its
// (head dim, rows, heads, batch) view; its strides in elements made TMA-safe (tma_stride).
template <bool kTransposed, typename Element>
auto gmem_tensor(Operand const& t, int rows, int head_dim, int heads, int batch, char const* name) {
  rows = std::max(rows, 1);
  const int64_t row = tma_stride(t.row_stride, rows, head_dim, name);
  const int64_t head = tma_stride(t.head_stride, heads, row * rows, name);
  const int64_t batch_stride = tma_stride(t.batch_stride, batch, head * heads, name);
  auto ptr = make_gmem_ptr(static_cast<Element const*>(t.ptr));
  if constexpr (kTransposed) {
    return make_tensor(ptr, make_shape(head_dim, rows, heads, batch), make_stride(_1{}, row, head, batch_stride));
  } else {
    return make_tensor(ptr, make_shape(rows, head_dim, heads, batch), make_stride(row, _1{}, head, batch_stride));
  }
}

}  // namespace cuteflash::sm90

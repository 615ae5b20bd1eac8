// The pybind11 module cuteflash._C. It takes raw device pointers, sizes, strides, dtype codes and the
// CUDA stream as plain integers, so it neither includes nor links libtorch: one build serves every
// torch version. Python (python/cuteflash/_ops.py) validates the tensors first; the checks here guard
// what would otherwise be out-of-bounds memory access.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuteflash/dispatch.h"
#include "cuteflash/tile_config.h"

namespace py = pybind11;

namespace cuteflash {
namespace {

using Strides = std::array<int64_t, 3>;  // (batch, row, head), in elements

Family parse_family(std::string const& name) {
  if (name == "sm70") return Family::kSm70;
  if (name == "sm80") return Family::kSm80;
  throw std::invalid_argument("cuteflash: unknown kernel family '" + name + "' (expected 'sm70' or 'sm80')");
}

void require(bool ok, std::string const& what) {
  if (!ok) throw std::invalid_argument("cuteflash: " + what);
}

void check_operand(char const* name, uintptr_t ptr, Strides const& s) {
  std::string n(name);
  require(ptr != 0, n + " is a null pointer");
  // cp.async and the 16-byte epilogue stores move 8 elements at a time.
  require(ptr % 16 == 0, n + " must be 16-byte aligned");
  for (int64_t stride : s) require(stride >= 0 && stride % 8 == 0, n + " strides must be non-negative multiples of 8");
}

void set_strides(Strides const& s, int64_t& batch, int64_t& row, int64_t& head) {
  batch = s[0];
  row = s[1];
  head = s[2];
}

void fwd(std::string const& family_name, int dtype_code, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
         uintptr_t lse, Strides q_strides, Strides k_strides, Strides v_strides, Strides out_strides, int batch,
         int nheads, int nheads_k, int seqlen_q, int seqlen_k, int head_dim, float softmax_scale, bool causal,
         uintptr_t stream) {
  Family family = parse_family(family_name);
  require(dtype_code == int(DType::kFloat16) || dtype_code == int(DType::kBFloat16), "unknown dtype code");
  require(batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0, "sizes must be non-negative");
  require(nheads >= 1 && nheads_k >= 1 && nheads % nheads_k == 0, "nheads must be a multiple of nheads_k");
  require(nheads <= 65535 && batch <= 65535, "batch and nheads must be at most 65535");
  require(head_dim >= 8 && head_dim % 8 == 0, "head_dim must be a positive multiple of 8 (pad it)");
  int kernel_head_dim = round_up_head_dim(head_dim);
  require(kernel_head_dim > 0, "head_dim must be at most 256");
  require(softmax_scale > 0.f, "softmax_scale must be positive");
  if (batch == 0 || seqlen_q == 0) return;

  check_operand("q", q, q_strides);
  check_operand("k", k, k_strides);
  check_operand("v", v, v_strides);
  check_operand("out", out, out_strides);
  require(lse != 0 && lse % 4 == 0, "softmax_lse must be an aligned float32 buffer");

  FwdFn launch = find_fwd(family, DType(dtype_code), kernel_head_dim);
  require(launch != nullptr, "no " + family_name + " forward kernel for head dim " + std::to_string(kernel_head_dim) +
                                 " and this dtype was compiled in; rebuild with CUTEFLASH_HEADDIMS / CUTEFLASH_DTYPES "
                                 "including it");
  if (!family_runs(family)) {
    throw std::runtime_error("cuteflash: the " + family_name +
                             " kernels were not compiled for this GPU (or no CUDA GPU is usable); rebuild with "
                             "TORCH_CUDA_ARCH_LIST naming its compute capability");
  }

  FwdParams p{};
  p.q = reinterpret_cast<void const*>(q);
  p.k = reinterpret_cast<void const*>(k);
  p.v = reinterpret_cast<void const*>(v);
  p.o = reinterpret_cast<void*>(out);
  p.lse = reinterpret_cast<float*>(lse);
  set_strides(q_strides, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  set_strides(k_strides, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  set_strides(v_strides, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  set_strides(out_strides, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.batch = batch;
  p.nheads = nheads;
  p.nheads_k = nheads_k;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = softmax_scale * 1.4426950408889634f;  // log2(e)
  p.causal = causal;
  launch(p, reinterpret_cast<cudaStream_t>(stream));
}

py::dict build_info() {
  py::dict families;
#ifdef CUTEFLASH_HAS_SM70
  families["sm70"] = CUTEFLASH_SM70_TARGETS;
#endif
#ifdef CUTEFLASH_HAS_SM80
  families["sm80"] = CUTEFLASH_SM80_TARGETS;
#endif
  py::dict info;
  info["families"] = families;
  info["cuda_version"] = CUTEFLASH_CUDA_VERSION;
  info["kernels"] = compiled_kernels();
  return info;
}

}  // namespace
}  // namespace cuteflash

PYBIND11_MODULE(_C, m) {
  m.doc() = "cuteflash kernels; call them through cuteflash.flash_attn_func, not directly";
  m.def("fwd", &cuteflash::fwd, py::arg("family"), py::arg("dtype"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"),
        py::arg("out_strides"), py::arg("batch"), py::arg("nheads"), py::arg("nheads_k"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("head_dim"), py::arg("softmax_scale"), py::arg("causal"), py::arg("stream"));
  m.def("family_runs", [](std::string const& family) { return cuteflash::family_runs(cuteflash::parse_family(family)); },
        py::arg("family"), "Whether the family's code in this module runs on the current CUDA device.");
  m.def("build_info", &cuteflash::build_info, "Families, targets, CUDA version and kernels compiled in.");
}

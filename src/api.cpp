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
  // Offsets inside a block of rows are 32-bit (HeadRows, utils.cuh): 2^24 x 128 rows stays below 2^31.
  require(s[1] < (int64_t(1) << 24), n + " row stride must be below 2^24 elements (pass a contiguous tensor)");
}

void set_strides(Strides const& s, int64_t& batch, int64_t& row, int64_t& head) {
  batch = s[0];
  row = s[1];
  head = s[2];
}

// Checks the arguments shared by both directions (those the kernels would read out of bounds with) and
// fills the forward's params. Returns false when there is nothing to compute.
bool fill_fwd_params(FwdParams& p, DType dtype, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse,
                     Strides const& q_strides, Strides const& k_strides, Strides const& v_strides,
                     Strides const& out_strides, int batch, int nheads, int nheads_k, int seqlen_q, int seqlen_k,
                     int head_dim, float softmax_scale, bool causal, bool fp16_correction) {
  require(dtype == DType::kFloat16 || dtype == DType::kBFloat16, "unknown dtype code");
  require(batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0, "sizes must be non-negative");
  require(nheads >= 1 && nheads_k >= 1 && nheads % nheads_k == 0, "nheads must be a multiple of nheads_k");
  require(nheads <= 65535 && batch <= 65535, "batch and nheads must be at most 65535");
  require(head_dim >= 8 && head_dim % 8 == 0, "head_dim must be a positive multiple of 8 (pad it)");
  require(round_up_head_dim(head_dim) > 0, "head_dim must be at most 256");
  require(softmax_scale > 0.f, "softmax_scale must be positive");
  if (batch == 0 || seqlen_q == 0) return false;
  check_operand("q", q, q_strides);
  check_operand("k", k, k_strides);
  check_operand("v", v, v_strides);
  check_operand("out", out, out_strides);
  require(lse != 0 && lse % 4 == 0, "softmax_lse must be an aligned float32 buffer");

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
  p.fp16_correction = fp16_correction;
  return true;
}

template <typename Fn>
Fn require_kernel(Fn launch, Family family, std::string const& family_name, char const* direction, int head_dim) {
  require(launch != nullptr, std::string("no ") + family_name + " " + direction + " kernel for head dim " +
                                 std::to_string(round_up_head_dim(head_dim)) +
                                 " and this dtype was compiled in; rebuild with CUTEFLASH_HEADDIMS / CUTEFLASH_DTYPES "
                                 "/ CUTEFLASH_DIRECTIONS including it");
  if (!family_runs(family)) {
    throw std::runtime_error("cuteflash: the " + family_name +
                             " kernels were not compiled for this GPU (or no CUDA GPU is usable); rebuild with "
                             "TORCH_CUDA_ARCH_LIST naming its compute capability");
  }
  return launch;
}

void fwd(std::string const& family_name, int dtype_code, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
         uintptr_t lse, Strides q_strides, Strides k_strides, Strides v_strides, Strides out_strides, int batch,
         int nheads, int nheads_k, int seqlen_q, int seqlen_k, int head_dim, float softmax_scale, bool causal,
         bool fp16_correction, uintptr_t stream) {
  Family family = parse_family(family_name);
  FwdParams p{};
  if (!fill_fwd_params(p, DType(dtype_code), q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides, batch,
                       nheads, nheads_k, seqlen_q, seqlen_k, head_dim, softmax_scale, causal, fp16_correction)) {
    return;
  }
  FwdFn launch = require_kernel(find_fwd(family, DType(dtype_code), round_up_head_dim(head_dim)), family, family_name,
                                "forward", head_dim);
  launch(p, reinterpret_cast<cudaStream_t>(stream));
}

void bwd(std::string const& family_name, int dtype_code, uintptr_t dout, uintptr_t q, uintptr_t k, uintptr_t v,
         uintptr_t out, uintptr_t lse, uintptr_t dq, uintptr_t dq_accum, uintptr_t d_rowsum, uintptr_t dk, uintptr_t dv,
         Strides dout_strides, Strides q_strides, Strides k_strides, Strides v_strides, Strides out_strides,
         Strides dq_strides, Strides dk_strides, Strides dv_strides, int batch, int nheads, int nheads_k, int seqlen_q,
         int seqlen_k, int head_dim, float softmax_scale, bool causal, bool fp16_correction, bool deterministic,
         uintptr_t stream) {
  Family family = parse_family(family_name);
  BwdParams p{};
  if (!fill_fwd_params(p, DType(dtype_code), q, k, v, out, lse, q_strides, k_strides, v_strides, out_strides, batch,
                       nheads, nheads_k, seqlen_q, seqlen_k, head_dim, softmax_scale, causal, fp16_correction) ||
      seqlen_k == 0) {
    return;
  }
  check_operand("dout", dout, dout_strides);
  check_operand("dk", dk, dk_strides);
  check_operand("dv", dv, dv_strides);
  require(d_rowsum != 0 && d_rowsum % 4 == 0, "d_rowsum must be an aligned float32 buffer");
  check_operand("dq", dq, dq_strides);
  if (!deterministic) {
    require(dq_accum != 0 && dq_accum % 16 == 0, "dq_accum must be an aligned float32 buffer");
  }
  p.dout = reinterpret_cast<void const*>(dout);
  p.dk = reinterpret_cast<void*>(dk);
  p.dv = reinterpret_cast<void*>(dv);
  p.dq_accum = reinterpret_cast<float*>(dq_accum);
  p.dq_accum_rows = (seqlen_q + 127) / 128 * 128;
  p.dq = reinterpret_cast<void*>(dq);
  p.deterministic = deterministic;
  p.d_rowsum = reinterpret_cast<float*>(d_rowsum);
  set_strides(dout_strides, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  set_strides(dk_strides, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  set_strides(dv_strides, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  set_strides(dq_strides, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  BwdFn launch = require_kernel(find_bwd(family, DType(dtype_code), round_up_head_dim(head_dim)), family, family_name,
                                "backward", head_dim);
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
        py::arg("seqlen_k"), py::arg("head_dim"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("fp16_correction"), py::arg("stream"));
  m.def("bwd", &cuteflash::bwd, py::arg("family"), py::arg("dtype"), py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dq_accum"), py::arg("d_rowsum"),
        py::arg("dk"), py::arg("dv"), py::arg("dout_strides"), py::arg("q_strides"), py::arg("k_strides"),
        py::arg("v_strides"), py::arg("out_strides"), py::arg("dq_strides"), py::arg("dk_strides"),
        py::arg("dv_strides"), py::arg("batch"), py::arg("nheads"), py::arg("nheads_k"), py::arg("seqlen_q"),
        py::arg("seqlen_k"), py::arg("head_dim"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("fp16_correction"), py::arg("deterministic"), py::arg("stream"));
  m.def(
      "family_runs", [](std::string const& family) { return cuteflash::family_runs(cuteflash::parse_family(family)); },
      py::arg("family"), "Whether the family's code in this module runs on the current CUDA device.");
  m.def("build_info", &cuteflash::build_info, "Families, targets, CUDA version and kernels compiled in.");
}

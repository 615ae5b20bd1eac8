// The pybind11 module cuteflash._C. It takes raw device pointers, sizes, strides, dtype codes and the
// CUDA stream as plain integers, so it neither includes nor links libtorch: one build serves every
// torch version. Python (python/cuteflash/_ops.py) validates the tensors first; the checks here guard what
// would otherwise be out-of-bounds memory access.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "cuteflash/common/mask.h"
#include "cuteflash/common/tiles.h"
#include "cuteflash/decode/config.h"
#include "cuteflash/host/device.h"
#include "cuteflash/host/registry.h"

namespace py = pybind11;

namespace cuteflash {
namespace {

constexpr char const* kDTypeNames[] = {"float16", "bfloat16"};

// The index of a compiled family (host/registry.h) by its name.
int parse_family(std::string const& name) {
  std::vector<FamilyInfo> const& families = compiled_families();
  for (size_t i = 0; i < families.size(); ++i) {
    if (name == families[i].name) return int(i);
  }
  std::string names;  // (only for the message: every launch parses its family)
  for (FamilyInfo const& family : families) names += (names.empty() ? "" : ", ") + std::string(family.name);
  throw std::invalid_argument("cuteflash: no kernel family '" + name + "' is compiled into this build (compiled: " +
                              (names.empty() ? std::string("none") : names) + ")");
}

FamilyInfo const& family_info(int family) { return compiled_families()[size_t(family)]; }
char const* family_name(int family) { return family_info(family).name; }

void require(bool ok, std::string const& what) {
  if (!ok) throw std::invalid_argument("cuteflash: " + what);
}

// The dtype of a dtype code (params.h's DType), checked.
DType checked_dtype(int code) {
  require(code == int(DType::kFloat16) || code == int(DType::kBFloat16), "unknown dtype code");
  return DType(code);
}

// An operand's address: not null, and aligned to the kVectorBytes the kernels move at a time (params.h).
void check_address(char const* name, uintptr_t ptr) {
  if (ptr == 0 || ptr % kVectorBytes != 0) {
    throw std::invalid_argument(
        std::string("cuteflash: ") + name +
        (ptr == 0 ? " is a null pointer" : " must be " + std::to_string(kVectorBytes) + "-byte aligned"));
  }
}

// A head dim of elements of dtype: whole vectors (vector_elements), as the kernels read and write rows.
void check_head_dim(int head_dim, DType dtype, char const* what) {
  const int vector = vector_elements(dtype);
  require(head_dim >= vector && head_dim % vector == 0,
          std::string(what) + " must be a positive multiple of " + std::to_string(vector) + " (pad it)");
}

void check_operand(char const* name, Operand const& t, DType dtype) {
  check_address(name, reinterpret_cast<uintptr_t>(t.ptr));
  const std::string n(name);
  const int vector = vector_elements(dtype);
  for (int64_t stride : {t.batch_stride, t.row_stride, t.head_stride}) {
    require(stride >= 0 && stride % vector == 0,
            n + " strides must be non-negative multiples of " + std::to_string(vector));
  }
  // Offsets inside a block of rows are 32-bit (HeadRows, utils.cuh): 2^24 x 128 rows stays below 2^31.
  require(t.row_stride < (int64_t(1) << 24), n + " row stride must be below 2^24 elements (pass a contiguous tensor)");
}

// A variable-length batch's sequences (params.h): cu_seqlens_q and cu_seqlens_k, device pointers to batch + 1
// int32 offsets each, and the rows of q and of k; all zero for a fixed-length batch.
struct Varlen {
  uintptr_t cu_seqlens_q = 0;
  uintptr_t cu_seqlens_k = 0;
  int64_t total_q = 0;
  int64_t total_k = 0;

  bool on() const { return cu_seqlens_q != 0 || cu_seqlens_k != 0; }
};

// The options that take the general kernels (params.h): flash-attn's window_size, softcap, ALiBi slopes (a
// device pointer to fp32 slopes, per head or per (batch, head) with alibi_batch_stride nheads), and dropout
// (dropout_p > 0, with rng_state a device pointer to the call's Philox counter base, an int64).
struct Options {
  int window_left = -1;
  int window_right = -1;
  float softcap = 0.f;
  uintptr_t alibi_slopes = 0;
  int alibi_batch_stride = 0;
  double dropout_p = 0.0;
  uintptr_t rng_state = 0;
};

// The problem both directions share (python/cuteflash/_ops.py's Problem builds it, field for field): the kernel
// family and dtype, the operands (lse: a device pointer to fp32), the sizes (seqlen_q and seqlen_k: each sequence's
// lengths, or a variable-length batch's bounds on them), and the scale and mask.
struct Problem {
  std::string family;
  int dtype = 0;
  Operand q, k, v, out;
  uintptr_t lse = 0;
  int batch = 0;
  int nheads = 0;
  int nheads_k = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;
  float softmax_scale = 0.f;
  bool causal = false;
  bool fp16_correction = false;
};

// p's dropout fields (params.h) for dropout_p and rng_state.
void fill_dropout(FwdParams& p, double dropout_p, uintptr_t rng_state) {
  require(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1)");
  if (dropout_p == 0.0) return;
  require(rng_state != 0 && rng_state % 8 == 0, "dropout needs rng_state, an aligned int64 on the device");
  p.rng_state = reinterpret_cast<uint64_t const*>(rng_state);
  p.dropout_threshold = uint32_t(std::lround((1.0 - dropout_p) * 256.0));
  p.dropout_scale = float(1.0 / (1.0 - dropout_p));
}

// Fills p's options in a canonical form: causal bounds the right side at 0 by itself, a right bound of 0 alone
// is the causal mask, and in a fixed-length batch a side that bounds no row is dropped, so that the general
// kernels run only where an option changes the result.
void fill_options(FwdParams& p, Options const& o, bool varlen) {
  require(o.window_left >= -1 && o.window_right >= -1, "window_size entries must be -1 (unbounded) or >= 0");
  require(o.softcap >= 0.f, "softcap must be >= 0 (0: off)");
  require(o.alibi_slopes % 4 == 0, "alibi_slopes must be an aligned float32 buffer");
  int left = o.window_left, right = p.causal ? -1 : o.window_right;
  if (left < 0 && right == 0) {
    p.causal = true;
    right = -1;
  }
  if (!varlen) {
    // Row i sees keys from i + seqlen_k - seqlen_q - left: all of them for every row when left >= seqlen_k; up to
    // i + seqlen_k - seqlen_q + right: all for every row when right >= seqlen_q - 1.
    if (left >= p.seqlen_k) left = -1;
    if (right >= 0 && right >= p.seqlen_q - 1) right = -1;
  }
  p.window_left = left;
  p.window_right = right;
  // The softmax sees softcap * tanh(S * softmax_scale / softcap) (params.h).
  if (o.softcap > 0.f) {
    p.softcap = p.softmax_scale / o.softcap;
    p.softmax_scale = o.softcap;
    p.softmax_scale_log2 = o.softcap * 1.4426950408889634f;
  }
  p.alibi_slopes = reinterpret_cast<float const*>(o.alibi_slopes);
  p.alibi_batch_stride = o.alibi_batch_stride;
  fill_dropout(p, o.dropout_p, o.rng_state);
}

// Checks the arguments shared by both directions (those the kernels would read out of bounds with) and
// fills the forward's params. Returns false when there is nothing to compute.
bool fill_fwd_params(FwdParams& p, Problem const& problem, Varlen const& varlen, Options const& options,
                     bool kv_cache = false) {
  const DType dtype = checked_dtype(problem.dtype);
  Operand const &q = problem.q, &k = problem.k, &v = problem.v, &out = problem.out;
  const int batch = problem.batch, nheads = problem.nheads, nheads_k = problem.nheads_k, head_dim = problem.head_dim;
  int seqlen_q = problem.seqlen_q, seqlen_k = problem.seqlen_k;
  const uintptr_t lse = problem.lse;
  const float softmax_scale = problem.softmax_scale;
  require(batch >= 0 && seqlen_q >= 0 && seqlen_k >= 0, "sizes must be non-negative");
  require(seqlen_q < kMaxSeqlen && seqlen_k < kMaxSeqlen, "seqlen_q and seqlen_k must be below 2^30");
  require(nheads >= 1 && nheads_k >= 1 && nheads % nheads_k == 0, "nheads must be a multiple of nheads_k");
  require(nheads <= 65535 && batch <= 65535, "batch and nheads must be at most 65535");
  check_head_dim(head_dim, dtype, "head_dim");
  require(round_up_head_dim(head_dim) > 0, "head_dim must be at most 256");
  require(softmax_scale > 0.f, "softmax_scale must be positive");
  if (varlen.on()) {
    for (uintptr_t cu : {varlen.cu_seqlens_q, varlen.cu_seqlens_k}) {
      require(cu != 0 && cu % 4 == 0, "cu_seqlens_q and cu_seqlens_k must both be aligned int32 buffers");
    }
    require(varlen.total_q >= 0 && varlen.total_k >= 0 && varlen.total_q < kMaxSeqlen && varlen.total_k < kMaxSeqlen,
            "total_q and total_k must be non-negative and below 2^30");
    // (k and v of a KV cache keep theirs: the cache, not cu_seqlens_k, places each sequence's keys.)
    for (Operand const* t : {&q, &k, &v, &out}) {
      require(t->batch_stride == 0 || (kv_cache && (t == &k || t == &v)),
              "a variable-length batch's operands have a batch stride of 0");
    }
    if (batch == 0 || varlen.total_q == 0) return false;
    // The grids cover the bounds (at least one block), the offsets the rest (sequence.cuh).
    seqlen_q = std::max(seqlen_q, 1);
    seqlen_k = std::max(seqlen_k, 1);
  } else if (batch == 0 || seqlen_q == 0) {
    return false;
  }
  for (auto [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}, std::pair{&out, "out"}}) {
    check_operand(name, *t, dtype);
  }
  require(lse != 0 && lse % 4 == 0, "softmax_lse must be an aligned float32 buffer");

  p.q = q;
  p.k = k;
  p.v = v;
  p.o = out;
  p.lse = reinterpret_cast<float*>(lse);
  p.batch = batch;
  p.nheads = nheads;
  p.nheads_k = nheads_k;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.cu_seqlens_q = reinterpret_cast<int const*>(varlen.cu_seqlens_q);
  p.cu_seqlens_k = reinterpret_cast<int const*>(varlen.cu_seqlens_k);
  p.total_q = int(varlen.total_q);
  p.total_k = int(varlen.total_k);
  // lse: (batch, nheads, seqlen_q), or (nheads, total_q) for a variable-length batch.
  p.stats_batch_stride = varlen.on() ? 0 : int64_t(nheads) * seqlen_q;
  p.stats_head_stride = varlen.on() ? varlen.total_q : seqlen_q;
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = softmax_scale * 1.4426950408889634f;  // log2(e)
  p.causal = problem.causal;
  p.fp16_correction = problem.fp16_correction;
  fill_options(p, options, varlen.on());
  return true;
}

// A KV cache (params.h), for the forward pass: device pointers to int32 buffers (0: none) and the cache's sizes.
// kv_rows: rows of each cache batch (a paged cache: block_table's columns times page_size); kv_batch: cache batches.
struct Cache {
  uintptr_t seqused_k = 0;
  int seqlen_new = 0;
  uintptr_t leftpad_k = 0;
  uintptr_t kv_batch_idx = 0;
  int kv_batch = 0;
  int kv_rows = 0;
  uintptr_t block_table = 0;
  int64_t block_table_stride = 0;
  int page_size = 0;
  int num_pages = 0;
};

void require_int32_buffer(uintptr_t ptr, char const* name) {
  require(ptr % 4 == 0, std::string(name) + " must be an aligned int32 buffer");
}

void fill_cache(FwdParams& p, Cache const& c) {
  for (auto [ptr, name] : {std::pair{c.seqused_k, "cache_seqlens"}, std::pair{c.leftpad_k, "cache_leftpad"},
                           std::pair{c.kv_batch_idx, "cache_batch_idx"}, std::pair{c.block_table, "block_table"}}) {
    require_int32_buffer(ptr, name);
  }
  if (c.seqused_k == 0) {
    require(c.leftpad_k == 0 && c.kv_batch_idx == 0 && c.block_table == 0,
            "cache_leftpad, cache_batch_idx and block_table need cache_seqlens");
    return;
  }
  require(c.kv_rows >= 0 && c.kv_rows < kMaxSeqlen && c.seqlen_new >= 0 && c.seqlen_new < kMaxSeqlen,
          "the cache's rows must be below 2^30");
  require(c.kv_batch >= 1, "the cache needs at least one batch");
  p.seqused_k = reinterpret_cast<int const*>(c.seqused_k);
  p.seqlen_new = c.seqlen_new;
  p.leftpad_k = reinterpret_cast<int const*>(c.leftpad_k);
  p.kv_batch_idx = reinterpret_cast<int const*>(c.kv_batch_idx);
  p.kv_batch = c.kv_batch;
  p.kv_rows = c.kv_rows;
  if (c.block_table != 0) {
    require(c.page_size >= 16 && c.page_size % 16 == 0, "the page size of a paged cache must be a multiple of 16");
    require(c.num_pages >= 1 && c.block_table_stride >= 0, "a paged cache needs pages and a block_table");
    p.block_table = reinterpret_cast<int const*>(c.block_table);
    p.block_table_stride = c.block_table_stride;
    p.page_size = c.page_size;
    p.num_pages = c.num_pages;
  }
}

// Whether the decoding kernel (decode/) computes a forward pass of these sizes: a fixed-length batch without
// dropout whose query rows per key-value head (seqlen_q x group) are few (decode_max_rows).
bool decode_fits(int head_dim, int seqlen_q, int nheads, int nheads_k, bool varlen, bool dropout) {
  return !varlen && !dropout && nheads_k >= 1 &&
         int64_t(seqlen_q) * (nheads / nheads_k) <= decode_max_rows(round_up_head_dim(head_dim));
}

// The decoding kernel's split count: num_splits where the caller asks for some (capped by the chunks of keys and
// kMaxSplits), else enough blocks to fill the current device once: two per SM, four for a single query row where the
// kernel reads the keys into registers, fewer where the shared memory holds fewer; on tensor cores, at least
// kMinKeysPerSplit keys per split (with few key-value heads, filling the GPU would leave a split a chunk or two of
// keys, less than its fp32 part and merge cost). Several rows' registers allow no more than two. For a single row read
// with cp.async, two blocks per SM read the cache faster than four on an H100 (1 x 1 x 65536, batch x rows x keys with
// 32 heads of 128: 1 %; 8 x 1 x 8192, one split per head against two: 2 %; at head dim 64 the same or faster).
int decode_split_count(int family, int batch, int nheads, int nheads_k, int seqlen_q, int seqlen_k, int head_dim,
                       int num_splits) {
  const int rows = decode_kernel_rows(seqlen_q * (nheads / nheads_k));
  const DecodeConfig decode = family_info(family).decode;
  const int kernel_head_dim = round_up_head_dim(head_dim);
  const int chunk = decode_chunk(kernel_head_dim, rows, decode);
  const int chunks = std::max((seqlen_k + chunk - 1) / chunk, 1);
  int splits = num_splits;
  if (splits <= 0) {
    const DeviceLimits& device = device_limits();
    const int block_smem = decode_smem_bytes(kernel_head_dim, rows, decode) + 1024;  // + the driver's
    const int fill = rows == 1 && !decode.async ? 4 : 2;
    const int per_sm = std::max(std::min(fill, device.smem_per_sm / block_smem), 1);
    // Rounded down: a few blocks more than fit at once would take a second wave.
    const int64_t blocks = std::max<int64_t>(int64_t(batch) * nheads_k, 1);
    splits = int(std::min<int64_t>(per_sm * int64_t(device.sms) / blocks, kMaxSplits));
    if (decode_tensor_cores(kernel_head_dim, rows, decode)) splits = std::min(splits, seqlen_k / kMinKeysPerSplit);
  }
  return std::clamp(splits, 1, std::min(chunks, kMaxSplits));
}

// Throws unless the family's code in this module runs on the current device. The answer is kept per device (the
// probe, a cudaFuncGetAttributes, costs a few microseconds and runs before every launch).
constexpr int kMaxFamilies = 8;

void require_family_runs(int family) {
  static std::array<std::atomic<int8_t>, kMaxFamilies * kMaxDevices> known{};   // 0: not asked, 1: runs, -1: does not
  static const bool fits = compiled_families().size() <= size_t(kMaxFamilies);  // (asked once, not per launch)
  if (!fits) throw std::logic_error("cuteflash: more kernel families than kMaxFamilies");
  std::atomic<int8_t>& runs = known[kMaxFamilies * current_device() + family];
  if (runs.load(std::memory_order_relaxed) == 0) {
    runs.store(family_info(family).runs() ? 1 : -1, std::memory_order_relaxed);
  }
  if (runs.load(std::memory_order_relaxed) < 0) {
    throw std::runtime_error(std::string("cuteflash: the ") + family_name(family) +
                             " kernels were not compiled for this GPU (or no CUDA GPU is usable); rebuild with "
                             "TORCH_CUDA_ARCH_LIST naming its compute capability");
  }
}

// The family whose decoding kernel family launches (itself, or another compiled for the same GPUs: the registry's
// decode_from); throws where this build lacks it.
int decoding_family(int family) {
  const int decoding = family_info(family).decode_family;
  require(decoding >= 0, std::string("the ") + family_name(family) +
                             " family launches another family's decoding kernel, which this build lacks; rebuild with "
                             "TORCH_CUDA_ARCH_LIST naming this GPU's compute capability");
  return decoding;
}

// The launcher that find (find_fwd or find_bwd) has for the call's family, dtype and head dim; throws where the
// build holds none, or where the family's code does not run on this device.
template <typename Find>
auto require_kernel(Find find, int family, char const* direction, DType dtype, int head_dim) {
  const int kernel_head_dim = round_up_head_dim(head_dim);
  auto launch = find(family, dtype, kernel_head_dim);
  require(launch != nullptr, "no " + std::string(family_name(family)) + " " + direction + " kernel for head dim " +
                                 std::to_string(kernel_head_dim) + " and " + kDTypeNames[int(dtype)] +
                                 " was compiled in; rebuild with CUTEFLASH_HEADDIMS / CUTEFLASH_DTYPES "
                                 "/ CUTEFLASH_DIRECTIONS including it");
  require_family_runs(family);
  return launch;
}

// The tiled kernels' split count for a KV-cache call (a fixed-length batch): num_splits where the caller asks for
// some, else, where the blocks of the query tiles (batch x heads x tiles) fill less than the current device once,
// enough splits to fill it once (rounded down), each of at least kMinKeysPerSplit keys. A device runs two
// blocks of 4 warps per SM at once where their shared memory fits (the registers allow no more), one of 8.
int tiled_split_count(int family, int batch, int nheads, int seqlen_q, int seqlen_k, int head_dim, int num_splits) {
  const int kernel_head_dim = round_up_head_dim(head_dim);
  const TileConfig tile = family_info(family).split_tile(kernel_head_dim);
  const int key_blocks = std::max((seqlen_k + tile.block_n - 1) / tile.block_n, 1);
  int splits = num_splits;
  if (splits <= 0) {
    const DeviceLimits& device = device_limits();
    const int block_smem = tile.smem_bytes_fwd(kernel_head_dim, 2) + 1024;  // + the driver's
    const int per_sm = std::max(std::min(tile.n_warps == 4 ? 2 : 1, device.smem_per_sm / block_smem), 1);
    const int64_t blocks = int64_t(batch) * nheads * ((seqlen_q + tile.block_m - 1) / tile.block_m);
    splits = int(std::min<int64_t>(per_sm * int64_t(device.sms) / std::max<int64_t>(blocks, 1), kMaxSplits));
    splits = std::min(splits, seqlen_k / kMinKeysPerSplit);
  }
  return std::clamp(splits, 1, std::min(key_blocks, kMaxSplits));
}

// How a forward pass of these sizes runs: (decode, splits, o_accum_floats, lse_accum_floats): with the decoding
// kernel or the tiled kernels, in `splits` splits of the keys, which need o_accum_floats and lse_accum_floats of
// fp32 workspace (params.h) where splits > 1. The tiled kernels split the keys of KV-cache calls (cache) only.
// seqlen_k: the keys of a sequence, or their bound (a cache's rows). num_splits: flash-attn's (0: choose).
std::tuple<bool, int, int64_t, int64_t> fwd_plan(std::string const& family_name, int batch, int nheads, int nheads_k,
                                                 int seqlen_q, int seqlen_k, int head_dim, bool varlen, bool dropout,
                                                 bool cache, int num_splits) {
  require(nheads_k >= 1 && nheads % nheads_k == 0, "nheads must be a multiple of nheads_k");
  require(round_up_head_dim(head_dim) > 0, "head_dim must be at most 256");
  const int family = parse_family(family_name);
  const bool decode = decode_fits(head_dim, seqlen_q, nheads, nheads_k, varlen, dropout);
  int splits = 1;
  if (batch > 0 && seqlen_q > 0) {
    if (decode) {
      splits = decode_split_count(decoding_family(family), batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim,
                                  num_splits);
    } else if (cache && !varlen && !dropout) {
      splits = tiled_split_count(family, batch, nheads, seqlen_q, seqlen_k, head_dim, num_splits);
    }
  }
  const int64_t rows = splits > 1 ? int64_t(splits) * batch * nheads * seqlen_q : 0;
  return {decode, splits, rows * round_up_head_dim(head_dim), rows};
}

// An address that a prepared launch (FwdLaunch, BwdLaunch) takes anew at each call: given (not 0, `align`-byte
// aligned) where the prepared one was, 0 where it was not.
template <typename T>
T* readdress(T* prepared, uintptr_t given, uintptr_t align, char const* name) {
  if ((prepared != nullptr) != (given != 0) || given % align != 0) {
    throw std::invalid_argument(std::string("cuteflash: ") + name +
                                (prepared != nullptr ? " must be an aligned address" : " must be 0") +
                                " for this prepared launch");
  }
  return reinterpret_cast<T*>(given);
}

// Puts each address into its operand, having checked it (check_address).
void put_addresses(std::initializer_list<std::tuple<Operand*, uintptr_t, char const*>> operands) {
  for (auto [operand, ptr, name] : operands) {
    check_address(name, ptr);
    operand->ptr = reinterpret_cast<void*>(ptr);
  }
}

// A prepared launch's call, in both directions: checks that the current device is the one it was prepared on and that
// it takes no per-call tensors but its addresses (ALiBi slopes and dropout's seed are not among them), then puts the
// addresses of q, k, v, out, lse and a variable-length batch's offsets into call, a copy of the prepared params.
void readdress_problem(FwdParams& call, int device, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse,
                       uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k) {
  if (current_device() != device) {
    throw std::invalid_argument("cuteflash: a prepared launch runs on the device it was prepared on (" +
                                std::to_string(device) + ")");
  }
  require(call.alibi_slopes == nullptr && call.rng_state == nullptr,
          "a launch with ALiBi or dropout cannot be prepared");
  put_addresses({{&call.q, q, "q"}, {&call.k, k, "k"}, {&call.v, v, "v"}, {&call.o, out, "out"}});
  call.lse = readdress(call.lse, lse, 4, "softmax_lse");
  call.cu_seqlens_q = readdress(call.cu_seqlens_q, cu_seqlens_q, 4, "cu_seqlens_q");
  call.cu_seqlens_k = readdress(call.cu_seqlens_k, cu_seqlens_k, 4, "cu_seqlens_k");
}

// A checked forward pass, ready to launch: its params and kernel, for the device and stream it was prepared with.
// fwd launches one at once; fwd_launch returns it to the planned calls (python/cuteflash/_ops.py), which run it
// with each call's addresses and stream.
struct FwdLaunch {
  FwdParams p{};
  FwdFn kernel = nullptr;
  int device = 0;
  uintptr_t stream = 0;
  bool takes_counters = false;  // the decoding kernel, in splits

  // Launches p with these addresses in place of the prepared ones (the workspace where p splits the keys, the
  // cache's int32 buffers where p reads a cache) on `stream`.
  void run(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, uintptr_t stream_,
           uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, uintptr_t o_accum, uintptr_t lse_accum,
           uintptr_t split_counters, uintptr_t seqused_k, uintptr_t leftpad_k, uintptr_t kv_batch_idx,
           uintptr_t block_table) const {
    FwdParams call = p;
    readdress_problem(call, device, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k);
    call.o_accum = readdress(p.o_accum, o_accum, 16, "o_accum");
    call.lse_accum = readdress(p.lse_accum, lse_accum, 4, "lse_accum");
    // (counters are optional: a call captured in a CUDA graph merges its splits in a kernel of their own)
    if (split_counters % 4 != 0 || (split_counters != 0 && !takes_counters)) {
      throw std::invalid_argument("cuteflash: split_counters: aligned int32 counters, for a split decoding pass only");
    }
    call.split_counters = reinterpret_cast<int*>(split_counters);
    call.seqused_k = readdress(p.seqused_k, seqused_k, 4, "cache_seqlens");
    call.leftpad_k = readdress(p.leftpad_k, leftpad_k, 4, "cache_leftpad");
    call.kv_batch_idx = readdress(p.kv_batch_idx, kv_batch_idx, 4, "cache_batch_idx");
    call.block_table = readdress(p.block_table, block_table, 4, "block_table");
    kernel(call, reinterpret_cast<cudaStream_t>(stream_));
  }
};

std::optional<FwdLaunch> fwd_launch(Problem const& problem, Varlen const& varlen, Options const& options,
                                    uintptr_t stream, std::optional<Cache> const& cache_arg, bool decode,
                                    int num_splits, uintptr_t o_accum, uintptr_t lse_accum, int64_t accum_floats,
                                    uintptr_t split_counters) {
  const Cache cache = cache_arg.value_or(Cache{});
  const int family = parse_family(problem.family);
  FwdParams p{};
  if (!fill_fwd_params(p, problem, varlen, options, cache.seqused_k != 0)) return std::nullopt;
  const int batch = problem.batch, nheads = problem.nheads, head_dim = problem.head_dim, seqlen_q = problem.seqlen_q;
  fill_cache(p, cache);
  require(p.block_table == nullptr || p.rng_state == nullptr, "dropout with a paged cache is not implemented");
  require(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits must be in [1, 128] (fwd_plan)");
  require(!decode || decode_fits(head_dim, seqlen_q, nheads, problem.nheads_k, varlen.on(), p.rng_state != nullptr),
          "the decoding kernel does not compute this call (fwd_plan)");
  // The tiled kernels split the keys where their variant serves caches (sequence.cuh): KV-cache calls, whose
  // batches have fixed lengths.
  require(decode || num_splits == 1 || (p.seqused_k != nullptr && !varlen.on() && p.rng_state == nullptr),
          "the tiled kernels split the keys of KV-cache calls only (fwd_plan)");
  p.num_splits = num_splits;
  if (num_splits > 1) {
    const int64_t rows = int64_t(num_splits) * batch * nheads * seqlen_q;
    require(o_accum != 0 && o_accum % 16 == 0 && lse_accum != 0 && lse_accum % 4 == 0,
            "a split pass needs o_accum and lse_accum, aligned float32 buffers");
    require(accum_floats >= rows * round_up_head_dim(head_dim), "o_accum is smaller than fwd_plan says");
    p.o_accum = reinterpret_cast<float*>(o_accum);
    p.lse_accum = reinterpret_cast<float*>(lse_accum);
    // (batch x nheads_k zeros, left zero: the caller keeps them per stream; params.h)
    require(split_counters % 4 == 0 && (split_counters == 0 || decode),
            "split_counters: aligned int32 counters, for the decoding kernel only");
    p.split_counters = reinterpret_cast<int*>(split_counters);
  }
  FwdFn kernel = decode
                     ? require_kernel(find_decode, decoding_family(family), "decoding", DType(problem.dtype), head_dim)
                     : require_kernel(find_fwd, family, "forward", DType(problem.dtype), head_dim);
  return FwdLaunch{p, kernel, current_device(), stream, decode && num_splits > 1};
}

// Appends k_new and v_new (batch, seqlen_new, nheads_k, head_dim, of dtype code dtype) to the caches at row
// cache_seqlens[b] of each sequence b (cache_append.cuh); the caches' other arguments as in Cache.
void append_kv(std::string const& family_name, int dtype_code, Operand const& k_new, Operand const& v_new,
               Operand const& k_cache, Operand const& v_cache, int batch, int seqlen_new, int nheads_k, int head_dim,
               Cache const& cache, uintptr_t stream) {
  const int family = parse_family(family_name);
  const DType dtype = checked_dtype(dtype_code);
  require(batch >= 0 && seqlen_new >= 0 && nheads_k >= 1, "append_kv: sizes out of range");
  check_head_dim(head_dim, dtype, "append_kv: head_dim");
  if (batch == 0 || seqlen_new == 0) return;
  for (auto [t, name] : {std::pair{&k_new, "k"}, std::pair{&v_new, "v"}, std::pair{&k_cache, "k_cache"},
                         std::pair{&v_cache, "v_cache"}}) {
    check_operand(name, *t, dtype);
  }
  FwdParams p{};
  require(cache.seqused_k != 0, "appending to a cache needs cache_seqlens");
  fill_cache(p, cache);
  AppendParams a{k_new,          v_new,      k_cache,   v_cache,       element_bytes(dtype),
                 batch,          seqlen_new, nheads_k,  head_dim,      p.seqused_k,
                 p.kv_batch_idx, p.kv_batch, p.kv_rows, p.block_table, p.block_table_stride,
                 p.page_size,    p.num_pages};
  require_family_runs(family);
  family_info(family).append(a, reinterpret_cast<cudaStream_t>(stream));
}

// What the backward pass needs from its caller besides the gradients: dq_accum's size in floats (params.h),
// and whether D = rowsum(dO * O) may live in dq's memory: where the family says so (FamilyTraits::kRowsumInDq) and
// the pass is not deterministic (the deterministic dQ kernels read D and write dq).
// total_q: the rows of q of a variable-length batch, -1 for a fixed-length one.
std::pair<int64_t, bool> bwd_workspace(std::string const& family_name, int head_dim, int batch, int nheads,
                                       int seqlen_q, bool deterministic, int64_t total_q) {
  const int family = parse_family(family_name);
  const int kernel_head_dim = round_up_head_dim(head_dim);
  require(kernel_head_dim > 0, "head_dim must be at most 256");
  return {dq_accum_layout(batch, nheads, seqlen_q, total_q, kernel_head_dim, deterministic).floats,
          family_info(family).rowsum_in_dq && !deterministic};
}

// A checked backward pass, ready to launch (as FwdLaunch): bwd launches one at once, bwd_launch returns it to the
// planned calls.
struct BwdLaunch {
  BwdParams p{};
  BwdFn kernel = nullptr;
  int device = 0;
  uintptr_t stream = 0;

  // Launches p with these addresses in place of the prepared ones on `stream`.
  void run(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, uintptr_t lse, uintptr_t stream_,
           uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, uintptr_t dout, uintptr_t dq, uintptr_t dq_accum,
           uintptr_t d_rowsum, uintptr_t dk, uintptr_t dv) const {
    BwdParams call = p;
    readdress_problem(call, device, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k);
    put_addresses({{&call.dout, dout, "dout"}, {&call.dq, dq, "dq"}, {&call.dk, dk, "dk"}, {&call.dv, dv, "dv"}});
    call.d_rowsum = readdress(p.d_rowsum, d_rowsum, 4, "d_rowsum");
    call.dq_accum = readdress(p.dq_accum, dq_accum, 16, "dq_accum");
    if (p.dq_blocks_done != nullptr) {  // the counts follow the regions
      call.dq_blocks_done =
          reinterpret_cast<int*>(call.dq_accum + (reinterpret_cast<float*>(p.dq_blocks_done) - p.dq_accum));
    }
    kernel(call, reinterpret_cast<cudaStream_t>(stream_));
  }
};

std::optional<BwdLaunch> bwd_launch(Problem const& problem, Varlen const& varlen, Options const& options,
                                    uintptr_t stream, Operand const& dout, Operand const& dq, uintptr_t dq_accum,
                                    int64_t dq_accum_floats_given, uintptr_t d_rowsum, Operand const& dk,
                                    Operand const& dv, bool deterministic) {
  const int family = parse_family(problem.family);
  BwdParams p{};
  if (!fill_fwd_params(p, problem, varlen, options) || (varlen.on() ? varlen.total_k : problem.seqlen_k) == 0) {
    return std::nullopt;  // the caller zeroes the gradients
  }
  const int batch = problem.batch, nheads = problem.nheads, head_dim = problem.head_dim;
  for (auto [t, name] : {std::pair{&dout, "dout"}, std::pair{&dk, "dk"}, std::pair{&dv, "dv"}, std::pair{&dq, "dq"}}) {
    check_operand(name, *t, DType(problem.dtype));
  }
  if (varlen.on()) {
    for (Operand const* t : {&dout, &dk, &dv, &dq}) {
      require(t->batch_stride == 0, "a variable-length batch's operands have a batch stride of 0");
    }
  }
  require(d_rowsum != 0 && d_rowsum % 4 == 0, "d_rowsum must be an aligned float32 buffer");
  const DqAccumLayout layout = dq_accum_layout(batch, nheads, p.seqlen_q, varlen.on() ? varlen.total_q : -1,
                                               round_up_head_dim(head_dim), deterministic);
  const int64_t needed = layout.floats;
  if (needed > 0) {
    require(dq_accum != 0 && dq_accum % 16 == 0, "dq_accum must be an aligned float32 buffer");
    require(dq_accum_floats_given >= needed, "dq_accum holds " + std::to_string(dq_accum_floats_given) +
                                                 " floats; the pass needs " + std::to_string(needed) +
                                                 " (bwd_workspace)");
  }
  p.dout = dout;
  p.dk = dk;
  p.dv = dv;
  p.dq = dq;
  p.dq_accum = reinterpret_cast<float*>(dq_accum);
  p.dq_accum_head_rows = layout.head_rows;
  p.dq_accum_batch_rows = layout.batch_rows;
  if (needed > 0) {  // the counts follow the regions
    p.dq_blocks_done = reinterpret_cast<int*>(p.dq_accum + nheads * layout.head_rows * round_up_head_dim(head_dim));
  }
  p.d_rowsum = reinterpret_cast<float*>(d_rowsum);
  p.deterministic = deterministic;
  BwdFn kernel = require_kernel(find_bwd, family, "backward", DType(problem.dtype), head_dim);
  return BwdLaunch{p, kernel, current_device(), stream};
}

// fwd and bwd: prepare (fwd_launch, bwd_launch) and launch at once, on the stream given.
template <typename Launch, typename... Args>
auto at_once(std::optional<Launch> (*prepare)(Args...)) {
  return [prepare](Args... args) {
    if (std::optional<Launch> launch = prepare(args...)) {
      launch->kernel(launch->p, reinterpret_cast<cudaStream_t>(launch->stream));
    }
  };
}

// The dropout mask of a call (dropout.cuh), for return_attn_probs: keep, uint8 (batch, nheads, rows, cols) with
// rows and cols multiples of 16; a variable-length batch is told by cu_seqlens_q (its sequences index the batch).
void dropout_mask(std::string const& family_name, uintptr_t keep, int rows, int cols, int batch, int nheads,
                  int seqlen_q, int seqlen_k, uintptr_t cu_seqlens_q, int64_t total_q, int64_t total_k,
                  double dropout_p, uintptr_t rng_state, uintptr_t stream) {
  const int family = parse_family(family_name);
  require(keep != 0 && rows >= 0 && cols >= 0 && rows % 16 == 0 && cols % 16 == 0,
          "the dropout mask needs a buffer of rows x cols bytes per (batch, head), both multiples of 16");
  require(batch >= 0 && batch <= 65535 && nheads >= 1 && nheads <= 65535, "batch and nheads out of range");
  require(dropout_p > 0.0, "dropout_p must be > 0 for a dropout mask");
  FwdParams p{};
  p.batch = batch;
  p.nheads = nheads;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.cu_seqlens_q = reinterpret_cast<int const*>(cu_seqlens_q);
  p.total_q = int(total_q);
  p.total_k = int(total_k);
  fill_dropout(p, dropout_p, rng_state);
  if (batch == 0 || rows == 0 || cols == 0) return;
  require_family_runs(family);
  family_info(family).dropout_mask(p, reinterpret_cast<uint8_t*>(keep), rows, cols,
                                   reinterpret_cast<cudaStream_t>(stream));
}

py::dict build_info() {
  py::dict families;
  for (FamilyInfo const& family : compiled_families()) families[family.name] = family.targets;
  py::list kernels;
  for (KernelInfo const& k : compiled_kernels()) {
    py::dict entry;
    entry["family"] = family_name(k.family);
    entry["direction"] = k.direction;
    entry["dtype"] = kDTypeNames[int(k.dtype)];
    entry["head_dim"] = k.head_dim;
    kernels.append(entry);
  }
  py::dict info;
  info["families"] = families;
  info["cuda_version"] = CUTEFLASH_CUDA_VERSION;
  info["kernels"] = kernels;
  info["kernel_head_dims"] = std::vector<int>(std::begin(kHeadDims), std::end(kHeadDims));
  return info;
}

}  // namespace
}  // namespace cuteflash

// An Operand passes from Python as the tuple (data pointer, batch stride, row stride, head stride), strides in
// elements: building a tuple costs the caller a fraction of constructing a bound class.
namespace pybind11::detail {
template <>
struct type_caster<cuteflash::Operand> {
  PYBIND11_TYPE_CASTER(cuteflash::Operand, const_name("tuple[int, int, int, int]"));

  bool load(handle src, bool convert) {
    make_caster<std::tuple<uintptr_t, int64_t, int64_t, int64_t>> fields;
    if (!fields.load(src, convert)) return false;
    auto [ptr, batch_stride, row_stride, head_stride] =
        cast_op<std::tuple<uintptr_t, int64_t, int64_t, int64_t>>(std::move(fields));
    value = cuteflash::Operand{reinterpret_cast<void*>(ptr), batch_stride, row_stride, head_stride};
    return true;
  }
};

// Problem, Varlen, Options and Cache as the tuples of their fields in their order, for the same reason
// (python/cuteflash/_ops.py's Problem, KernelVarlen, KernelOptions and Cache arguments).
template <typename Struct, typename... Fields>
struct fields_caster {
  PYBIND11_TYPE_CASTER(Struct, const_name("tuple"));

  bool load(handle src, bool convert) {
    make_caster<std::tuple<Fields...>> fields;
    if (!fields.load(src, convert)) return false;
    value = std::apply([](auto&&... field) { return Struct{std::move(field)...}; },
                       cast_op<std::tuple<Fields...>>(std::move(fields)));
    return true;
  }
};

template <>
struct type_caster<cuteflash::Problem>
    : fields_caster<cuteflash::Problem, std::string, int, cuteflash::Operand, cuteflash::Operand, cuteflash::Operand,
                    cuteflash::Operand, uintptr_t, int, int, int, int, int, int, float, bool, bool> {};
template <>
struct type_caster<cuteflash::Varlen> : fields_caster<cuteflash::Varlen, uintptr_t, uintptr_t, int64_t, int64_t> {};
template <>
struct type_caster<cuteflash::Options>
    : fields_caster<cuteflash::Options, int, int, float, uintptr_t, int, double, uintptr_t> {};
template <>
struct type_caster<cuteflash::Cache>
    : fields_caster<cuteflash::Cache, uintptr_t, int, uintptr_t, uintptr_t, int, int, uintptr_t, int64_t, int, int> {};
}  // namespace pybind11::detail

// Binds a launcher (fwd, bwd) whose parameters begin with the problem, the batch's sequences, the options and the
// stream, followed by its own, `own`.
template <typename Func, typename... Own>
void def_launcher(py::module_& m, char const* name, Func func, Own&&... own) {
  m.def(name, func, py::arg("problem"), py::arg("varlen"), py::arg("options"), py::arg("stream"),
        std::forward<Own>(own)...);
}

// _ops.py calls fwd, bwd, their _launch forms, fwd_plan, bwd_workspace and append_kv with positional arguments, in
// the order of these signatures (keyword arguments cost the call a few microseconds).
PYBIND11_MODULE(_C, m) {
  m.doc() = "cuteflash kernels; call them through cuteflash.flash_attn_func, not directly";
  // fwd and fwd_launch, bwd and bwd_launch: the same parameters.
  auto def_fwd = [&m](char const* name, auto func) {
    def_launcher(m, name, func, py::arg("cache") = py::none(), py::arg("decode") = false, py::arg("num_splits") = 1,
                 py::arg("o_accum") = 0, py::arg("lse_accum") = 0, py::arg("accum_floats") = 0,
                 py::arg("split_counters") = 0);
  };
  auto def_bwd = [&m](char const* name, auto func) {
    def_launcher(m, name, func, py::arg("dout"), py::arg("dq"), py::arg("dq_accum"), py::arg("dq_accum_floats"),
                 py::arg("d_rowsum"), py::arg("dk"), py::arg("dv"), py::arg("deterministic"));
  };
  def_fwd("fwd", cuteflash::at_once(&cuteflash::fwd_launch));
  def_fwd("fwd_launch", &cuteflash::fwd_launch);
  def_bwd("bwd", cuteflash::at_once(&cuteflash::bwd_launch));
  def_bwd("bwd_launch", &cuteflash::bwd_launch);
  // A prepared launch: called with the addresses that change from call to call and the stream (FwdLaunch::run's,
  // BwdLaunch::run's parameters, positional).
  py::class_<cuteflash::FwdLaunch>(m, "FwdLaunch").def("__call__", &cuteflash::FwdLaunch::run);
  py::class_<cuteflash::BwdLaunch>(m, "BwdLaunch").def("__call__", &cuteflash::BwdLaunch::run);
  m.def("fwd_plan", &cuteflash::fwd_plan, py::arg("family"), py::arg("batch"), py::arg("nheads"), py::arg("nheads_k"),
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("head_dim"), py::arg("varlen"), py::arg("dropout"),
        py::arg("cache"), py::arg("num_splits"),
        "(decode, splits, o_accum_floats, lse_accum_floats): whether the decoding kernel (else the tiled ones) "
        "computes a forward pass, in how many splits of the keys, and their workspace in floats.");
  m.def("append_kv", &cuteflash::append_kv, py::arg("family"), py::arg("dtype"), py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("batch"), py::arg("seqlen_new"), py::arg("nheads_k"),
        py::arg("head_dim"), py::arg("cache"), py::arg("stream"),
        "Appends new keys and values to a KV cache at each sequence's cache_seqlens.");
  m.def("bwd_workspace", &cuteflash::bwd_workspace, py::arg("family"), py::arg("head_dim"), py::arg("batch"),
        py::arg("nheads"), py::arg("seqlen_q"), py::arg("deterministic"), py::arg("total_q") = -1,
        "(dq_accum_floats, d_rowsum_in_dq): dq_accum's size in floats, and whether D may live in dq's memory.");
  m.def("dropout_mask", &cuteflash::dropout_mask, py::kw_only(), py::arg("family"), py::arg("keep"), py::arg("rows"),
        py::arg("cols"), py::arg("batch"), py::arg("nheads"), py::arg("seqlen_q"), py::arg("seqlen_k"),
        py::arg("cu_seqlens_q"), py::arg("total_q"), py::arg("total_k"), py::arg("dropout_p"), py::arg("rng_state"),
        py::arg("stream"), "The dropout mask of a call, a byte per element (for return_attn_probs).");
  m.def(
      "family_runs",
      [](std::string const& family) { return cuteflash::family_info(cuteflash::parse_family(family)).runs(); },
      py::arg("family"), "Whether the family's code in this module runs on the current CUDA device.");
  m.def("build_info", &cuteflash::build_info,
        "Families and their targets, the CUDA version, the kernels compiled in and the kernel head dims.");
}

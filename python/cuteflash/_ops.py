"""The kernels as torch.library custom ops, so they work under torch.compile and CUDA graphs.

The ops take tensors whose head dim is a multiple of 8 (interface.py pads the others); everything
else about the layout is handled here, so calling the op directly is safe too.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple

import torch

from . import _families
from ._lib import (
    _DTYPE_NAMES,
    BACKEND_ENV,
    build_info,
    call_family,
    check_dtype,
    compiled_module,
    dtype_supported,
    kernel_head_dim,
)

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
SM70_CORRECTION_ENV = "CUTEFLASH_SM70_CORRECTION"


MAX_ROW_STRIDE = 2**24  # the kernels index inside a block of rows with 32-bit offsets


VECTOR_BYTES = 16  # what the kernels load and store at a time: operands, rows and strides are aligned to it


def vector_elements(dtype: torch.dtype) -> int:
    """The elements of dtype in VECTOR_BYTES (8 of fp16 or bf16): head dims and strides are multiples of it."""
    return VECTOR_BYTES // dtype.itemsize


def readable_strides(strides: tuple[int, ...], element_size: int) -> bool:
    """Whether the kernels can read a tensor of these strides (of elements of element_size bytes) in place where it
    is aligned to VECTOR_BYTES: last dim contiguous, every other stride a multiple of VECTOR_BYTES (aligned rows), row
    stride below MAX_ROW_STRIDE."""
    return (
        strides[-1] == 1 and math.gcd(*strides[:-1]) * element_size % VECTOR_BYTES == 0 and strides[-3] < MAX_ROW_STRIDE
    )


def in_place(t: torch.Tensor) -> bool:
    """Whether the kernels can read (or write) t in place: readable strides, aligned to VECTOR_BYTES. Slices of a
    packed qkv tensor can."""
    return readable_strides(t.stride(), t.element_size()) and t.data_ptr() % VECTOR_BYTES == 0


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it in place, else a contiguous copy."""
    if in_place(t):
        return t
    # contiguous() returns a contiguous view at an odd offset unchanged: clone it into aligned memory.
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


def _empty_contiguous(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor shaped like t (empty_like without the memory-format argument where t is
    contiguous: that argument doubles the call's host time)."""
    return torch.empty_like(t) if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)


def _operand(t: torch.Tensor) -> tuple[int, int, int, int]:
    """A (b, s, h, d) tensor, or a variable-length batch's (total, h, d), as the compiled module takes an operand:
    (data pointer, batch stride, row stride, head stride), a batch stride of 0 for the packed rows."""
    strides = t.stride()
    return (t.data_ptr(), strides[0] if len(strides) == 4 else 0, strides[-3], strides[-2])


# torch's raw queries of the current stream's handle and the current device, where this torch has them: the public
# torch.cuda.current_stream builds a Stream object on each call, several times the cost.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _launch(device: torch.device, kernel, *args, **kwargs):
    """Calls a function of the compiled module (a launcher, or a query of the device) with `device` as the current
    CUDA device (the kernels launch on the current one), switching only when it is not already."""
    if device.index == _current_device():
        return kernel(*args, **kwargs)
    with torch.cuda.device(device):
        return kernel(*args, **kwargs)


def _stream(device: torch.device) -> int:
    """The current CUDA stream of device, as the integer handle the launchers take."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


# The decoding kernel's split counters (params.h's split_counters) per (device, stream): int32 zeros that every
# call leaves zero, with which the last split of each sequence and key-value head merges the splits itself (no
# second launch). Calls on one stream run in order, and each stream has its own. A call captured in a CUDA graph
# gets none, since the graph may be replayed on another stream beside calls on this one: its splits are merged by a
# kernel of their own, with the same arithmetic.
_split_counters: dict[tuple[int, int, int], torch.Tensor] = {}


def _counters(device: torch.device, stream: int, count: int) -> int:
    """The address of `count` split counters for calls on `stream`, or 0 while the stream is being captured."""
    if device.index != _current_device() or torch.cuda.is_current_stream_capturing():
        return 0  # (capture is known for the current device's stream; another device's call merges in a kernel)
    # (cudaStreamPerThread, handle 2, is a different stream in each thread)
    key = (device.index, stream, threading.get_ident() if stream == 2 else 0)
    counters = _split_counters.get(key)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _split_counters[key] = counters
    return counters.data_ptr()


# os.environ's mapping of encoded names to encoded values, where this Python keeps one (CPython): read directly, a
# variable costs a tenth of os.environ.get.
_environ_data = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_kernel_env_keys = (
    (os.environ.encodekey(BACKEND_ENV), os.environ.encodekey(SM70_CORRECTION_ENV)) if _environ_data is not None else ()
)


def environment() -> tuple:
    """The environment variables that choose the kernels a call runs (the family, sm70's correction)."""
    if _environ_data is not None:
        return _environ_data.get(_kernel_env_keys[0]), _environ_data.get(_kernel_env_keys[1])
    return os.environ.get(BACKEND_ENV), os.environ.get(SM70_CORRECTION_ENV)


def _fp16_correction(family: str) -> bool:
    """A family with fp16 correction (_families.py; sm70): P (and dS) enter their fp16 tensor-core products
    error-corrected, unless CUTEFLASH_SM70_CORRECTION=0 (plain fp16, for comparison). Other families ignore the
    flag."""
    return not _families.get(family).fp16_correction or os.environ.get(SM70_CORRECTION_ENV, "1") != "0"


class Varlen(NamedTuple):
    """A variable-length batch: int32 offsets (batch + 1) of its sequences in q and in k, and the caller's
    bounds on their lengths, which size the grids (a longer sequence is still computed whole)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> Varlen | None:
    return None if cu_seqlens_q is None else Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def unpack(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """q, k and v as views of the inputs: k None means q is qkv packed (..., 3, nheads, d), v None that k is
    kv packed (..., 2, nheads_k, d)."""
    if k is None:
        return q.unbind(-3)
    if v is None:
        return (q, *k.unbind(-3))
    return q, k, v


def _lse_shape(q: torch.Tensor, varlen: Varlen | None) -> tuple[int, ...]:
    """(batch, nheads, seqlen_q), or (nheads, total_q) for a variable-length batch."""
    return (q.shape[1], q.shape[0]) if varlen is not None else (q.shape[0], q.shape[2], q.shape[1])


class Options(NamedTuple):
    """The options that take the general kernels: flash-attn's window_size (-1: an unbounded side), softcap
    (0.0: off), ALiBi slopes (fp32, (nheads,) or (batch, nheads), contiguous; None: off), and dropout_p with
    the call's rng_state (draw_rng_state; None where dropout_p is 0)."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng_state: torch.Tensor | None = None


NO_OPTIONS = Options()


def _option_features(options: Options) -> dict[str, bool]:
    """Which of the registry's option features (_families.FEATURES) a call uses: what only the general kernel variants
    compute (host/launch.h's needs_general, which also counts a KV cache)."""
    return {
        "window": options.window_left >= 0 or options.window_right >= 0,
        "softcap": options.softcap > 0,
        "alibi": options.alibi_slopes is not None,
        "dropout": options.dropout_p > 0,
    }


def _broadcast(*operands: torch.Tensor) -> bool:
    """Whether an operand has a stride of 0 over a dimension of more than one element (an expanded tensor)."""
    return any(0 in t.stride() and any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride())) for t in operands)


def _family_for(
    direction: str,
    q: torch.Tensor,
    varlen: bool,
    options: Options,
    cache: bool = False,
    family: str | None = None,
    operands: tuple[torch.Tensor, ...] = (),
    deterministic: bool = False,
) -> str:
    """The kernel family that computes a call on q (head dim a multiple of 8) on its device: the device's family (or
    `family`), or the one it hands the call to (the registry's rule, _families.takes). operands: the tensors the
    kernels read in place, for the rule's broadcast."""
    call = _families.Call(
        direction,
        _DTYPE_NAMES.get(q.dtype),
        kernel_head_dim(q.shape[-1]),
        varlen=varlen,
        cache=cache,
        broadcast=_broadcast(*operands),
        deterministic=deterministic,
        **_option_features(options),
    )
    return call_family(q.device, call, family)


def draw_rng_state(device: torch.device) -> torch.Tensor:
    """The random state of one call with dropout: one int64 on the GPU, the Philox counter base of
    include/cuteflash/dropout.cuh, drawn from torch's CUDA generator, so that torch.manual_seed governs the
    mask, and drawn on the GPU, so that a captured CUDA graph draws anew at each replay. The backward pass
    reads the same state and so the same mask."""
    return torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device)


def _sizes(q: torch.Tensor, varlen: Varlen | None) -> tuple[int, int, int]:
    """(batch, seqlen_q, nheads) of a call: a variable-length batch's seqlen_q is its bound."""
    if varlen is None:
        return q.shape[0], q.shape[1], q.shape[2]
    return varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, q.shape[1]


class Problem(NamedTuple):
    """What _C's launchers begin with: src/api.cpp's Problem, field for field. The kernel family and dtype code,
    the operands (_operand's tuples) and lse's address, the sizes (seqlen_q and seqlen_k: each sequence's lengths, or
    a variable-length batch's bounds on them), the scale and the mask."""

    family: str
    dtype: int
    q: tuple
    k: tuple
    v: tuple
    out: tuple
    lse: int
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    softmax_scale: float
    causal: bool
    fp16_correction: bool


class KernelVarlen(NamedTuple):
    """A variable-length batch as _C takes it (src/api.cpp's Varlen): the offsets' addresses and the rows of q and
    of k; all 0 for a fixed-length batch."""

    cu_seqlens_q: int = 0
    cu_seqlens_k: int = 0
    total_q: int = 0
    total_k: int = 0


class KernelOptions(NamedTuple):
    """Options as _C takes them (src/api.cpp's Options): tensors as addresses, ALiBi's batch stride (0: one slope
    per head), dropout_p 0 where there is no dropout."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: int = 0
    alibi_batch_stride: int = 0
    dropout_p: float = 0.0
    rng_state: int = 0


FIXED_LENGTH = KernelVarlen()


def _problem(
    family: str,
    q,
    k,
    v,
    out,
    lse,
    softmax_scale: float,
    causal: bool,
    varlen: Varlen | None,
    options: Options,
    sizes: tuple[int, int, int],
    seqlen_k: int | None = None,
) -> tuple[Problem, KernelVarlen, KernelOptions]:
    """The arguments that _C's launchers begin with, but the stream: the problem, the batch's sequences and the
    options. sizes: _sizes(q, varlen); seqlen_k: a KV cache's rows (default: k's)."""
    batch, seqlen_q, nheads = sizes
    if seqlen_k is None:
        seqlen_k = k.shape[1] if varlen is None else varlen.max_seqlen_k
    problem = Problem(
        family,
        _DTYPE_CODES[q.dtype],
        _operand(q),
        _operand(k),
        _operand(v),
        _operand(out),
        lse.data_ptr(),
        batch,
        nheads,
        k.shape[-2],  # nheads_k
        seqlen_q,
        seqlen_k,
        q.shape[-1],  # head_dim
        softmax_scale,
        causal,
        _fp16_correction(family),
    )
    if varlen is None:
        sequences = FIXED_LENGTH
    else:
        sequences = KernelVarlen(varlen.cu_seqlens_q.data_ptr(), varlen.cu_seqlens_k.data_ptr(), q.shape[0], k.shape[0])
    return problem, sequences, _kernel_options(options)


def _kernel_options(options: Options) -> KernelOptions:
    if options is NO_OPTIONS:
        return NO_KERNEL_OPTIONS
    slopes = options.alibi_slopes
    dropout = options.dropout_p > 0
    return KernelOptions(
        options.window_left,
        options.window_right,
        options.softcap,
        0 if slopes is None else slopes.data_ptr(),
        slopes.shape[-1] if slopes is not None and slopes.dim() == 2 else 0,  # alibi_batch_stride
        options.dropout_p if dropout else 0.0,
        options.rng_state.data_ptr() if dropout else 0,
    )


NO_KERNEL_OPTIONS = KernelOptions()


class Cache(NamedTuple):
    """A KV cache that the forward pass reads (flash_attn_with_kvcache): k and v are the caches, (batch_cache,
    seqlen_cache, nheads_k, d) or, paged, (num_pages, page_size, nheads_k, d) with block_table (batch,
    max_pages) int32. Sequence b uses keys [leftpad[b], seqlens[b] + seqlen_new) of cache batch batch_idx[b]
    (int32 (batch,) tensors; leftpad and batch_idx may be None)."""

    seqlens: torch.Tensor
    seqlen_new: int = 0
    leftpad: torch.Tensor | None = None
    batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _cache_arg(cache: Cache, k: torch.Tensor) -> tuple:
    """cache as the compiled module takes a Cache (src/api.cpp): the tuple of its fields, k being the k cache."""
    table = cache.block_table
    return (
        cache.seqlens.data_ptr(),
        cache.seqlen_new,
        _ptr(cache.leftpad),
        _ptr(cache.batch_idx),
        k.shape[0],  # kv_batch
        cache_rows(k, table),  # kv_rows
        _ptr(table),
        0 if table is None else table.stride(0),
        0 if table is None else k.shape[1],  # page_size
        0 if table is None else k.shape[0],  # num_pages
    )


def cache_rows(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The rows of each sequence's cache: seqlen_cache, or block_table's columns times the page size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _no_keys(q: torch.Tensor, k: torch.Tensor, varlen: Varlen | None) -> bool:
    """Whether no query can see a key (nor a kernel point at k's memory): k has no rows, or no batch."""
    return k.shape[-3] == 0 or (varlen is None and k.shape[0] == 0)


def fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    varlen: Varlen | None = None,
    options: Options = NO_OPTIONS,
    cache: Cache | None = None,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on unpacked q, k, v: returns out (like q) and the fp32 log-sum-exp (_lse_shape). With a
    cache, k and v are the caches (read in place: the caller checks their layout). num_splits: flash-attn's
    (0: chosen from the GPU's size; 1: none), for KV-cache calls (the decoding kernel splits flash_attn_func's
    decoding shapes too)."""
    family = _family_for("fwd", q, varlen is not None, options, cache is not None, operands=(q, k, v))
    check_dtype(family, q.dtype)
    q = _kernel_operand(q)
    if cache is None:
        k, v = _kernel_operand(k), _kernel_operand(v)
    out = _empty_contiguous(q)
    lse = q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)
    seqlen_k = k.shape[-3] if cache is None else cache_rows(k, cache.block_table)
    if seqlen_k == 0 or (varlen is None and k.shape[0] == 0):  # every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    nheads_k, head_dim = k.shape[-2:]
    sizes = batch, seqlen_q, nheads = _sizes(q, varlen)
    C = compiled_module()
    decode, splits, o_accum_floats, lse_accum_floats = _launch(
        q.device,
        C.fwd_plan,
        family,
        batch,
        nheads,
        nheads_k,
        seqlen_q,
        seqlen_k,
        head_dim,
        varlen is not None,
        options.dropout_p > 0,
        cache is not None,
        num_splits,
    )
    cache_arg = None if cache is None else _cache_arg(cache, k)
    counters = batch * nheads_k if decode else 0
    workspace = _split_workspace(q.device, _stream(q.device), splits, o_accum_floats, lse_accum_floats, counters)
    problem = _problem(family, q, k, v, out, lse, softmax_scale, causal, varlen, options, sizes, seqlen_k)
    _launch(q.device, C.fwd, *problem, _stream(q.device), cache_arg, decode, splits, *workspace)
    return out, lse


def _split_workspace(device, stream: int, splits: int, o_accum_floats: int, lse_accum_floats: int, counters: int):
    """fwd's last four arguments for a pass in `splits` splits of the keys: (o_accum, lse_accum, o_accum_floats,
    split_counters), with the fp32 workspace allocated where splits > 1 (o_accum, then lse_accum: o_accum_floats
    keeps it 16-byte aligned) and `counters` split counters (the decoding kernel's; 0: none) taken from _counters."""
    if splits <= 1:
        return 0, 0, o_accum_floats, 0
    accum = torch.empty(o_accum_floats + lse_accum_floats, dtype=torch.float32, device=device)
    o_accum = accum.data_ptr()
    return o_accum, o_accum + 4 * o_accum_floats, o_accum_floats, _counters(device, stream, counters) if counters else 0


def append_kv(k_cache, v_cache, k, v, cache: Cache) -> None:
    """Writes k and v (batch, seqlen_new, nheads_k, d) into the caches at each sequence's cache.seqlens (rows
    past a sequence's cache are left out)."""
    k, v = _kernel_operand(k), _kernel_operand(v)
    _launch(
        k.device,
        compiled_module().append_kv,
        _family_for("fwd", k, False, NO_OPTIONS, cache=True),
        _DTYPE_CODES[k.dtype],
        _operand(k),
        _operand(v),
        _operand(k_cache),
        _operand(v_cache),
        *k.shape,  # batch, seqlen_new, nheads_k, head_dim
        _cache_arg(cache, k_cache),
        _stream(k.device),
    )


def fwd_op_impl(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    rng_state: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel as the operator fwd computes it. q, k, v may be packed (unpack); cu_seqlens_q None: a
    fixed-length batch, whose max_seqlen_q/k are ignored; the options as Options. `deterministic` is kept for the
    backward pass."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    return fwd_impl(*unpack(q, k, v), softmax_scale, causal, varlen, options)


# The operator that torch.compile sees (and its autograd, registered below).
fwd = torch.library.custom_op("cuteflash::fwd", mutates_args=(), device_types="cuda")(fwd_op_impl)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest):
    """The op under torch.compile; else, when a gradient is wanted, the same autograd rules through
    torch.autograd.Function (Attention); otherwise the implementation directly. The op's dispatch and autograd
    layers take more host time per call than the kernels' launches. rest: the options (Options' fields), then
    deterministic."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest)
    if torch.compiler.is_compiling():
        return fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or any(t is not None and t.requires_grad for t in (k, v))):
        return Attention.apply(*args)
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return fwd_impl(*unpack(q, k, v), softmax_scale, causal, varlen, Options(*rest[:-1]))


@fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest):
    q = unpack(q, k, v)[0]
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)


def bwd_into(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    varlen: Varlen | None = None,
    options: Options = NO_OPTIONS,
) -> None:
    """Attention backward into dq, dk, dv (shaped like q, k, v; views of a packed gradient are written in
    place). With deterministic, dQ comes from a second kernel instead of fp32 atomics: bitwise
    reproducible, and slower."""
    family = _family_for("bwd", q, varlen is not None, options, operands=(q, k, v, dout), deterministic=deterministic)
    if "bwd" not in _families.get(family).directions:  # a family still being built (CUTEFLASH_BACKEND forces it)
        raise NotImplementedError(
            f"cuteflash: the {family} kernels have no backward pass yet; detach the inputs, or leave "
            f"{BACKEND_ENV} unset for the family this GPU runs by default"
        )
    if "bwd" not in build_info()["families"][family]["directions"]:
        raise NotImplementedError(
            f"cuteflash: this build has no {family} backward kernels (built with CUTEFLASH_DIRECTIONS=fwd); "
            "detach the inputs, or rebuild with the backward pass"
        )
    dout, q, k, v, out = (_kernel_operand(t) for t in (dout, q, k, v, out))
    if _no_keys(q, k, varlen) or q.numel() == 0:  # no query or no key: every gradient is zero
        for t in (dq, dk, dv):
            t.zero_()
        return
    sizes = batch, seqlen_q, nheads = _sizes(q, varlen)
    problem = _problem(family, q, k, v, out, lse, softmax_scale, causal, varlen, options, sizes)
    head_dim = q.shape[-1]
    nheads_k = k.shape[-2]
    C = compiled_module()
    # dq_accum (dQ's fp32 atomics; none for a deterministic pass) and where D = rowsum(dO * O) lives, as the
    # compiled module rules (params.h, api.cpp).
    dq_accum_floats, d_rowsum_in_dq = C.bwd_workspace(
        family, head_dim, batch, nheads, seqlen_q, deterministic, -1 if varlen is None else q.shape[0]
    )
    dq_accum = q.new_empty(dq_accum_floats, dtype=torch.float32)
    # The kernels write into dq, dk, dv in place where they can read them as operands (any view of a packed
    # gradient), else into fresh tensors copied over.
    dq_k = dq if in_place(dq) else _empty_contiguous(q)
    # D takes the first 4 * lse.numel() bytes of a contiguous dq (which holds 2 * head_dim of them per row of D),
    # else a buffer of its own
    d_rowsum = dq_k if d_rowsum_in_dq and dq_k.is_contiguous() else lse.new_empty(lse.shape)
    # A dK/dV per query head (for MQA/GQA, summed over each group below).
    grouped = nheads != nheads_k
    dk_k, dv_k = (
        t if not grouped and in_place(t) else q.new_empty(q.shape[:-3] + k.shape[-3:-2] + (nheads, head_dim))
        for t in (dk, dv)
    )
    _launch(
        q.device,
        C.bwd,
        *problem,
        _stream(q.device),
        _operand(dout),
        _operand(dq_k),
        dq_accum.data_ptr(),
        dq_accum_floats,
        d_rowsum.data_ptr(),
        _operand(dk_k),
        _operand(dv_k),
        deterministic,
    )
    if dq_k is not dq:
        dq.copy_(dq_k)
    _store_kv_grads(dk, dv, dk_k, dv_k, grouped)


def _store_kv_grads(dk, dv, dk_k, dv_k, grouped: bool) -> None:
    """dK and dV into dk and dv from what the kernels wrote (dk_k, dv_k): summed over each group of query heads where
    grouped (MQA/GQA: the kernels write them per query head), else copied where the kernels wrote elsewhere."""
    for given, computed in ((dk, dk_k), (dv, dv_k)):
        if grouped:
            nheads_k = given.shape[-2]
            torch.sum(computed.unflatten(-2, (nheads_k, computed.shape[-2] // nheads_k)), dim=-2, out=given)
        elif computed is not given:
            given.copy_(computed)


def bwd_op_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    rng_state: torch.Tensor | None,
    deterministic: bool,
) -> list[torch.Tensor]:
    """The gradients of the forward op's inputs that are given (q, k, v, or packed: one per input), as
    fresh tensors shaped like them."""
    grads = [_empty_contiguous(t) for t in (q, k, v) if t is not None]
    dq, dk, dv = unpack(*grads, *[None] * (3 - len(grads)))
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    bwd_into(dq, dk, dv, dout, *unpack(q, k, v), out, lse, softmax_scale, causal, deterministic, varlen, options)
    return grads


bwd = torch.library.custom_op("cuteflash::bwd", mutates_args=(), device_types="cuda")(bwd_op_impl)


@bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest):
    return [t.new_empty(t.shape) for t in (q, k, v) if t is not None]


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
     window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state)
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)  # as flash-attn: the log-sum-exp is returned for inspection only
    ctx.set_materialize_grads(False)  # lse's gradient stays None instead of a tensor of zeros


def _backward_with(bwd_fn):
    """The forward's backward rule, computing the gradients with bwd_fn (the op bwd, or its implementation)."""

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p = ctx.args
        grads = iter(
            bwd_fn(
                grad_out,
                q,
                k,
                v,
                out,
                lse,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
                window_left,
                window_right,
                softcap,
                alibi_slopes,
                dropout_p,
                rng_state,
                ctx.deterministic,
            )
        )
        dq, dk, dv = (next(grads) if t is not None else None for t in (q, k, v))
        return dq, dk, dv, *[None] * 13

    return backward


fwd.register_autograd(_backward_with(bwd), setup_context=_setup_context)


class Attention(torch.autograd.Function):
    """The forward op's autograd rules (the same context and backward) around the implementations, for eager
    calls."""

    @staticmethod
    def forward(ctx, *inputs):
        output = fwd_op_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward_with(bwd_op_impl))


class FwdPlan(NamedTuple):
    """A forward call on separate q, k, v (of a fixed- or variable-length batch), read in place, worked out once: the
    checks, the kernel family and the kernel's plan (fwd_plan), and _C.fwd's arguments but for the tensors' memory
    and the stream. interface.py keeps one per call signature, so that a repeated call pays for its allocations and
    its launch only (plan_forward, run_planned). bwd: the backward pass's plans per dout stride (BwdPlan, or False
    where dout is not read in place)."""

    device: int
    problem: Problem  # the planning call's; out: the layout of each call's out (its address a stand-in)
    sequences: KernelVarlen  # the planning call's (the addresses: stand-ins; each call passes its own)
    options: KernelOptions
    varlen: bool  # a variable-length batch: each call passes its cu_seqlens_q and cu_seqlens_k
    q_contiguous: bool
    lse_shape: tuple
    lse_strides: tuple
    splits: int
    accum_floats: tuple  # (o_accum_floats, lse_accum_floats), both 0 where splits == 1
    counters: int  # the decoding kernel's split counters, 0: none
    deterministic: bool
    bwd: dict
    launch: object  # _C.FwdLaunch: the checked launch, run with each call's addresses
    small_lse: bool  # lse fits _LSE_SCRATCH_FLOATS


class BwdPlan(NamedTuple):
    """The backward pass of a FwdPlan's calls for one dout stride: dq_accum's size, whether D lives in dq, whether dK
    and dV are summed over groups of query heads (MQA/GQA), whether q, k and v are contiguous (their gradients are
    allocated like them), and the checked launch (_C.BwdLaunch)."""

    dq_accum_floats: int
    d_rowsum_in_dq: bool
    grouped: bool
    contiguous: tuple
    launch: object


def _contiguous_strides(shape) -> tuple[int, int, int]:
    """The operand strides (batch, row, head) of a contiguous tensor of this shape; a batch stride of 0 for the
    packed rows (total, heads, dim) of a variable-length batch."""
    row = shape[-2] * shape[-1]
    return (shape[-3] * row if len(shape) == 4 else 0, row, shape[-1])


def plan_forward(
    q,
    k,
    v,
    softmax_scale: float,
    causal: bool,
    varlen: Varlen | None,
    options: Options,
    deterministic: bool,
    cache: Cache | None = None,
    num_splits: int = 0,
) -> FwdPlan | None:
    """The FwdPlan of a call whose arguments interface.py has checked (varlen's offsets contiguous), or None where
    the plan cannot serve it: an operand whose strides the kernels cannot read in place, a head dim that is padded,
    no query, no key or no sequence, or dropout or ALiBi (their tensors change per call). Each call checks its own
    addresses and that its device is the current one (run_planned). With a cache (a KV-cache call, num_splits
    flash-attn's), k and v are the caches."""
    seqlen_k = None if cache is None else cache_rows(k, cache.block_table)  # (None: k's rows, or varlen's bound)
    if (
        options.dropout_p > 0
        or options.alibi_slopes is not None
        or q.shape[-1] % vector_elements(q.dtype)
        or not all(readable_strides(t.stride(), t.element_size()) for t in (q, k, v))
        or _no_keys(q, k, varlen)
        or seqlen_k == 0
        or q.numel() == 0
        or (varlen is not None and varlen.cu_seqlens_q.numel() < 2)
        or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % VECTOR_BYTES
    ):
        return None
    family = _family_for("fwd", q, varlen is not None, options, cache is not None, operands=(q, k, v))
    if not dtype_supported(family, q.dtype):
        return None
    batch, seqlen_q, nheads = sizes = _sizes(q, varlen)
    nheads_k, head_dim = k.shape[-2:]
    # (q stands in for out and lse, whose memory each call allocates: out contiguous, lse (batch, nheads, seqlen_q)
    # or (nheads, total_q))
    problem, sequences, kernel_options = _problem(
        family, q, k, v, q, q, softmax_scale, causal, varlen, options, sizes, seqlen_k
    )
    seqlen_k = problem.seqlen_k
    decode, splits, o_accum_floats, lse_accum_floats = _launch(  # (fwd_plan reads the device's size)
        q.device, compiled_module().fwd_plan, family, batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim,
        varlen is not None, False, cache is not None, num_splits,
    )  # fmt: skip
    lse_shape = _lse_shape(q, varlen)
    lse_strides = (lse_shape[1], 1) if varlen is not None else (nheads * seqlen_q, seqlen_q, 1)
    out_strides = (0 if varlen is not None else seqlen_q * nheads * head_dim, nheads * head_dim, head_dim)
    counters = batch * nheads_k if decode and splits > 1 else 0
    # (q's address, 16-byte aligned, stands in for those of out, lse and the workspace: each call passes its own)
    stand_in = q.data_ptr()
    workspace = (stand_in, stand_in, o_accum_floats, stand_in if counters else 0) if splits > 1 else (0, 0, 0, 0)
    cache_arg = None if cache is None else _cache_arg(cache, k)
    problem = problem._replace(out=(stand_in, *out_strides))
    launch = _launch(
        q.device, compiled_module().fwd_launch, problem, sequences, kernel_options, _stream(q.device), cache_arg,
        decode, splits, *workspace,
    )  # fmt: skip
    return FwdPlan(
        q.device.index,
        problem,
        sequences,
        kernel_options,
        varlen is not None,
        q.is_contiguous(),
        lse_shape,
        lse_strides,
        splits,
        (o_accum_floats, lse_accum_floats),
        counters,
        deterministic,
        {},
        launch,
        math.prod(lse_shape) <= _LSE_SCRATCH_FLOATS,
    )


# The log-sum-exp of forward calls that do not keep it (planned calls without a gradient): kernels only write lse, so
# the calls of a device share one buffer (of _LSE_SCRATCH_FLOATS floats, for the calls whose lse fits), and its
# contents are never read. It is never freed, so that a CUDA graph that captured a call may hold its address.
_lse_scratch: dict[int, torch.Tensor] = {}
_LSE_SCRATCH_FLOATS = 1 << 18


def _lse_scratch_ptr(device: torch.device) -> int:
    """The address of the device's lse scratch, or 0 where it does not exist and the current stream is being
    captured (a buffer made during a capture would come from the graph's memory)."""
    scratch = _lse_scratch.get(device.index)
    if scratch is None:
        if torch.cuda.is_current_stream_capturing():
            return 0
        scratch = _lse_scratch[device.index] = torch.empty(_LSE_SCRATCH_FLOATS, dtype=torch.float32, device=device)
    return scratch.data_ptr()


def _run_planned(
    plan: FwdPlan, ptrs: tuple, q: torch.Tensor, keep_lse: bool = True, cache: tuple = (0, 0, 0, 0)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out and the log-sum-exp (None where not keep_lse) of a call that plan serves: ptrs are the addresses of its
    q, k, v (16-byte aligned), then of its cu_seqlens_q and cu_seqlens_k (0 for a fixed-length batch); cache: a
    KV-cache call's cache_seqlens, cache_leftpad, cache_batch_idx and block_table addresses (0: none)."""
    device = q.device
    out = torch.empty_like(q) if plan.q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    lse_ptr = _lse_scratch_ptr(device) if not keep_lse and plan.small_lse else 0
    if not lse_ptr:
        lse = torch.empty_strided(plan.lse_shape, plan.lse_strides, dtype=torch.float32, device=device)
        lse_ptr = lse.data_ptr()
    stream = _stream(device)
    workspace = _split_workspace(device, stream, plan.splits, *plan.accum_floats, plan.counters)
    plan.launch(*ptrs[:3], out.data_ptr(), lse_ptr, stream, *ptrs[3:], *workspace[:2], workspace[3], *cache)
    return out, lse


def _bwd_plan(plan: FwdPlan, dout: torch.Tensor, q, k, v) -> BwdPlan | bool:
    """plan's BwdPlan for dout's strides, made on first use; False where the kernels cannot read dout's strides in
    place or this build has no backward kernels (the general path then copies dout, or raises)."""
    key = dout.stride()
    bwd = plan.bwd.get(key)
    if bwd is None:
        # (the family that computes the backward pass, which may not be the forward's: the registry's rule)
        family = _family_for(
            "bwd",
            q,
            plan.varlen,
            Options(*plan.options[:3]),
            family=plan.problem.family,
            operands=(q, k, v, dout),
            deterministic=plan.deterministic,
        )
        problem = plan.problem._replace(family=family, fp16_correction=_fp16_correction(family))
        batch, nheads, seqlen_q = problem.batch, problem.nheads, problem.seqlen_q
        bwd = False
        if readable_strides(key, dout.element_size()) and "bwd" in build_info()["families"][family]["directions"]:
            dq_accum_floats, d_rowsum_in_dq = compiled_module().bwd_workspace(
                family, q.shape[-1], batch, nheads, seqlen_q, plan.deterministic, q.shape[0] if plan.varlen else -1
            )
            grouped = nheads != k.shape[-2]
            kv_grad = _contiguous_strides(k.shape[:-2] + q.shape[-2:] if grouped else k.shape)
            # (q's address, 16-byte aligned, stands in for the gradients' addresses: each call passes its own, and
            # its own q, k, v, out, lse and offsets)
            stand_in = q.data_ptr()
            launch = _launch(
                q.device, compiled_module().bwd_launch, problem, plan.sequences, plan.options, 0,
                (stand_in, *_operand(dout)[1:]), (stand_in, *_contiguous_strides(q.shape)),
                stand_in if dq_accum_floats else 0, dq_accum_floats, stand_in, (stand_in, *kv_grad),
                (stand_in, *kv_grad), plan.deterministic,
            )  # fmt: skip
            contiguous = (plan.q_contiguous, k.is_contiguous(), v.is_contiguous())
            bwd = BwdPlan(dq_accum_floats, d_rowsum_in_dq, grouped, contiguous, launch) if launch else False
        plan.bwd[key] = bwd
    return bwd


def _backward_planned(plan: FwdPlan, dout, q, k, v, out, lse, *cu_seqlens) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of a call that plan served (bwd_into's work with the checks and the planning done); cu_seqlens: a
    variable-length batch's cu_seqlens_q and cu_seqlens_k."""
    bwd = _bwd_plan(plan, dout, q, k, v)
    if not bwd or dout.data_ptr() % VECTOR_BYTES or q.device.index != _current_device():
        grads = [_empty_contiguous(t) for t in (q, k, v)]
        problem = plan.problem
        varlen = Varlen(*cu_seqlens, problem.seqlen_q, problem.seqlen_k) if plan.varlen else None
        options = Options(*plan.options[:3])  # (a planned call has neither ALiBi nor dropout)
        bwd_into(
            *grads, dout, q, k, v, out, lse, problem.softmax_scale, problem.causal, plan.deterministic, varlen, options
        )
        return tuple(grads)
    dq, dk, dv = (
        torch.empty_like(t) if contiguous else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t, contiguous in zip((q, k, v), bwd.contiguous)
    )
    dq_accum = torch.empty_strided((bwd.dq_accum_floats,), (1,), dtype=torch.float32, device=q.device)
    d_rowsum = dq if bwd.d_rowsum_in_dq else lse.new_empty(lse.shape)
    dk_k, dv_k = (dk, dv) if not bwd.grouped else (q.new_empty(k.shape[:-2] + q.shape[-2:]) for _ in range(2))
    cu_q, cu_k = (t.data_ptr() for t in cu_seqlens) if plan.varlen else (0, 0)
    bwd.launch(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), _stream(q.device), cu_q, cu_k,
        dout.data_ptr(), dq.data_ptr(), dq_accum.data_ptr(), d_rowsum.data_ptr(), dk_k.data_ptr(), dv_k.data_ptr(),
    )  # fmt: skip
    _store_kv_grads(dk, dv, dk_k, dv_k, bwd.grouped)
    return dq, dk, dv


class PlannedAttention(torch.autograd.Function):
    """Attention's autograd rules for the calls a FwdPlan serves: the same kernels, with the checks and the planning
    done once per signature. cu_seqlens: a variable-length batch's cu_seqlens_q and cu_seqlens_k. Returns out (the
    log-sum-exp is kept for the backward pass only)."""

    @staticmethod
    def forward(ctx, plan: FwdPlan, ptrs: tuple, q, k, v, *cu_seqlens):
        out, lse = _run_planned(plan, ptrs, q)
        ctx.save_for_backward(q, k, v, out, lse, *cu_seqlens)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        return None, None, *_backward_planned(ctx.plan, grad_out, *saved), *[None] * (len(saved) - 5)


# PlannedAttention.apply without the Python layer of Function.apply, which binds default arguments (forward has
# none) and serves functorch's transforms (run_planned takes the layer while one is active).
_apply_planned = super(torch.autograd.Function, PlannedAttention).apply
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def run_planned(plan: FwdPlan, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None) -> torch.Tensor | None:
    """out of a call with a FwdPlan (through PlannedAttention where a gradient is wanted), or None where this call
    cannot take it: an operand not 16-byte aligned, or another current device (the general path handles both)."""
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if (ptrs[0] | ptrs[1] | ptrs[2]) % VECTOR_BYTES or plan.device != _current_device():
        return None
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if plan.varlen else ()
    ptrs += tuple(t.data_ptr() for t in cu_seqlens) if cu_seqlens else (0, 0)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        apply = PlannedAttention.apply if _functorch_active() else _apply_planned
        return apply(plan, ptrs, q, k, v, *cu_seqlens)
    return _run_planned(plan, ptrs, q, keep_lse=False)[0]


class KvcachePlan(NamedTuple):
    """A flash_attn_with_kvcache call worked out once (interface.py keeps one per call signature): the forward pass's
    FwdPlan over the caches, the cache argument's fields but for its tensors' addresses, and, where the call appends
    new keys, append_kv's arguments but for the operands' addresses and the stream."""

    fwd: FwdPlan
    cache: tuple  # (seqlen_new, kv_batch, kv_rows, block_table_stride, page_size, num_pages)
    append: tuple | None  # k's, v's, k_cache's, v_cache's strides, then batch, seqlen_new, nheads_k, head_dim


def plan_kvcache(q, k_cache, v_cache, k, v, cache: Cache, softmax_scale, causal, options, num_splits):
    """The KvcachePlan of a checked call (the given int32 tensors contiguous), or None where plan_forward has none or
    k and v are not read in place."""
    fwd = plan_forward(q, k_cache, v_cache, softmax_scale, causal, None, options, False, cache, num_splits)
    if fwd is None or (k is not None and not all(readable_strides(t.stride(), t.element_size()) for t in (k, v))):
        return None
    cache_fields = _cache_arg(cache, k_cache)
    append = None
    if k is not None:
        append = (*(_operand(t)[1:] for t in (k, v, k_cache, v_cache)), *k.shape)
    return KvcachePlan(fwd, (cache_fields[1], *cache_fields[4:6], *cache_fields[7:]), append)


def run_planned_kvcache(plan: KvcachePlan, q, k_cache, v_cache, k, v, cache: Cache, keep_lse: bool) -> tuple | None:
    """out and the log-sum-exp (None where not keep_lse) of a flash_attn_with_kvcache call with a plan, having
    appended k and v, or None where this call cannot take it: an operand not 16-byte aligned, or another current
    device."""
    ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    new = () if k is None else (k.data_ptr(), v.data_ptr())
    if (
        ptrs[0] | ptrs[1] | ptrs[2] | (new[0] | new[1] if new else 0)
    ) % VECTOR_BYTES or plan.fwd.device != _current_device():
        return None
    cache_ptrs = (cache.seqlens.data_ptr(), _ptr(cache.leftpad), _ptr(cache.batch_idx), _ptr(cache.block_table))
    if new:
        fields = plan.cache  # (seqlen_new, kv_batch, kv_rows, block_table_stride, page_size, num_pages)
        cache_arg = (cache_ptrs[0], fields[0], *cache_ptrs[1:3], *fields[1:3], cache_ptrs[3], *fields[3:])
        ks, vs, kcs, vcs, *sizes = plan.append
        operands = ((new[0], *ks), (new[1], *vs), (ptrs[1], *kcs), (ptrs[2], *vcs))
        problem = plan.fwd.problem
        compiled_module().append_kv(problem.family, problem.dtype, *operands, *sizes, cache_arg, _stream(q.device))
    return _run_planned(plan.fwd, (*ptrs, 0, 0), q, keep_lse, cache_ptrs)


def kvcache_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache after its checks and rotary embedding: appends k and v (when given) to the caches in
    place at cache_seqlens, then attends q to each sequence's cache. Returns out and the log-sum-exp
    (batch, nheads, seqlen_q)."""
    cache = Cache(cache_seqlens, 0 if k is None else k.shape[1], cache_leftpad, cache_batch_idx, block_table)
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache)
    options = Options(window_left, window_right, softcap, alibi_slopes)
    return fwd_impl(q, k_cache, v_cache, softmax_scale, causal, None, options, cache, num_splits)


# The op declares that it writes the caches, so that torch.compile orders it against their other uses.
fwd_kvcache = torch.library.custom_op(
    "cuteflash::fwd_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda"
)(kvcache_impl)


def forward_kvcache(*args):
    """fwd_kvcache: the op under torch.compile, otherwise its implementation directly (the dispatcher's cost per
    call is a large part of a decoding step's)."""
    return fwd_kvcache(*args) if torch.compiler.is_compiling() else kvcache_impl(*args)


@fwd_kvcache.register_fake
def _(q, *rest):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


@torch.library.custom_op("cuteflash::dropout_mask", mutates_args=(), device_types="cuda")
def dropout_mask(
    rng_state: torch.Tensor,
    dropout_p: float,
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    cu_seqlens_q: torch.Tensor | None,
    total_q: int,
    total_k: int,
) -> torch.Tensor:
    """The dropout mask that the kernels drew for a call with rng_state, True where kept: bool (batch, nheads,
    seqlen_q, seqlen_k) rounded up to multiples of 128 (flash-attn's S_dmask shape). Element (i, j) of
    (b, h) is row i and key j of sequence b, and so it is in a variable-length batch (cu_seqlens_q given; its
    seqlen_q and seqlen_k the bounds, total_q and total_k its operands' rows)."""
    keep = torch.empty(
        (batch, nheads, _round128(seqlen_q), _round128(seqlen_k)), dtype=torch.uint8, device=rng_state.device
    )
    # (the family that computes the call's forward pass: one with dropout, of no particular dtype or head dim)
    family = call_family(rng_state.device, _families.Call("fwd", None, None, cu_seqlens_q is not None, dropout=True))
    _launch(
        rng_state.device,
        compiled_module().dropout_mask,
        family=family,
        keep=keep.data_ptr(),
        rows=keep.shape[2],
        cols=keep.shape[3],
        batch=batch,
        nheads=nheads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        cu_seqlens_q=0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        total_q=total_q,
        total_k=total_k,
        dropout_p=dropout_p,
        rng_state=rng_state.data_ptr(),
        stream=_stream(rng_state.device),
    )
    return keep.view(torch.bool)


@dropout_mask.register_fake
def _(rng_state, dropout_p, batch, nheads, seqlen_q, seqlen_k, cu_seqlens_q, total_q, total_k):
    shape = (batch, nheads, _round128(seqlen_q), _round128(seqlen_k))
    return rng_state.new_empty(shape, dtype=torch.bool)

"""The kernels as torch.library custom ops, so they work under torch.compile and CUDA graphs.

The ops take tensors whose head dim is a multiple of 8 (interface.py pads the others); everything
else about the layout is handled here, so calling the op directly is safe too.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ._lib import build_info, compiled_module, select_family

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
SM70_CORRECTION_ENV = "CUTEFLASH_SM70_CORRECTION"


MAX_ROW_STRIDE = 2**24  # the kernels index inside a block of rows with 32-bit offsets


def in_place(t: torch.Tensor) -> bool:
    """Whether the kernels can read (or write) t in place: last dim contiguous, 16-byte aligned rows,
    row stride below MAX_ROW_STRIDE. Slices of a packed qkv tensor can."""
    aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    return t.stride(-1) == 1 and aligned and t.stride(-3) < MAX_ROW_STRIDE


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it in place, else a contiguous copy."""
    if in_place(t):
        return t
    # contiguous() returns a contiguous view at an odd offset unchanged: clone it into aligned memory.
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


def _operand(t: torch.Tensor):
    """A (b, s, h, d) tensor, or a variable-length batch's (total, h, d), as the compiled module's Operand:
    data pointer and (batch, row, head) strides (a batch stride of 0 for the packed rows)."""
    batch_stride = t.stride(0) if t.dim() == 4 else 0
    return compiled_module().Operand(t.data_ptr(), batch_stride, t.stride(-3), t.stride(-2))


def _launch(device: torch.device, kernel, **kwargs):
    """Calls a function of the compiled module (a launcher, or a query of the device) with `device` as the current
    CUDA device (the kernels launch on the current one), switching only when it is not already."""
    if device.index == torch.cuda.current_device():
        return kernel(**kwargs)
    with torch.cuda.device(device):
        return kernel(**kwargs)


def _fp16_correction(family: str) -> bool:
    """sm70: P (and dS) enter their fp16 tensor-core products error-corrected, unless
    CUTEFLASH_SM70_CORRECTION=0 (plain fp16, for comparison). The sm80 kernels ignore the flag."""
    return family != "sm70" or os.environ.get(SM70_CORRECTION_ENV, "1") != "0"


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


def draw_rng_state(device: torch.device) -> torch.Tensor:
    """The random state of one call with dropout: one int64 on the GPU, the Philox counter base of
    include/cuteflash/dropout.cuh, drawn from torch's CUDA generator, so that torch.manual_seed governs the
    mask, and drawn on the GPU, so that a captured CUDA graph draws anew at each replay. The backward pass
    reads the same state and so the same mask."""
    return torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device)


def _problem(
    family: str, q, k, v, out, lse, softmax_scale: float, causal: bool, varlen: Varlen | None, options: Options
) -> dict:
    """The keyword arguments that _C.fwd and _C.bwd share: the problem, and the stream it runs on."""
    nheads, head_dim = q.shape[-2:]
    nheads_k = k.shape[-2]
    problem = dict(
        family=family,
        dtype=_DTYPE_CODES[q.dtype],
        q=_operand(q),
        k=_operand(k),
        v=_operand(v),
        out=_operand(out),
        lse=lse.data_ptr(),
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        softmax_scale=softmax_scale,
        causal=causal,
        fp16_correction=_fp16_correction(family),
        stream=torch.cuda.current_stream(q.device).cuda_stream,
        window_left=options.window_left,
        window_right=options.window_right,
        softcap=options.softcap,
    )
    slopes = options.alibi_slopes
    if slopes is not None:
        problem.update(alibi_slopes=slopes.data_ptr(), alibi_batch_stride=slopes.shape[-1] if slopes.dim() == 2 else 0)
    if options.dropout_p > 0:
        problem.update(dropout_p=options.dropout_p, rng_state=options.rng_state.data_ptr())
    if varlen is None:
        return dict(problem, batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1])
    return dict(
        problem,
        batch=varlen.cu_seqlens_q.numel() - 1,
        seqlen_q=varlen.max_seqlen_q,
        seqlen_k=varlen.max_seqlen_k,
        cu_seqlens_q=varlen.cu_seqlens_q.data_ptr(),
        cu_seqlens_k=varlen.cu_seqlens_k.data_ptr(),
        total_q=q.shape[0],
        total_k=k.shape[0],
    )


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


def _cache_arg(cache: Cache, k: torch.Tensor):
    """The compiled module's Cache for cache, whose k cache is k."""
    table = cache.block_table
    return compiled_module().Cache(
        seqused_k=cache.seqlens.data_ptr(),
        seqlen_new=cache.seqlen_new,
        leftpad_k=_ptr(cache.leftpad),
        kv_batch_idx=_ptr(cache.batch_idx),
        kv_batch=k.shape[0],
        kv_rows=cache_rows(k, table),
        block_table=_ptr(table),
        block_table_stride=0 if table is None else table.stride(0),
        page_size=0 if table is None else k.shape[1],
        num_pages=0 if table is None else k.shape[0],
    )


def cache_rows(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The rows of each sequence's cache: seqlen_cache, or block_table's columns times the page size."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _gather_pages(cache: Cache, k: torch.Tensor, v: torch.Tensor) -> tuple[Cache, torch.Tensor, torch.Tensor]:
    """A paged cache as a contiguous one, (batch, max_pages * page_size, nheads_k, d) per sequence, for the tiled
    kernels (which read contiguous caches; the decoding kernel reads pages in place). Pages outside the cache read
    as zeros, as in the decoding kernel."""
    table = cache.block_table.long()
    valid = (table >= 0) & (table < k.shape[0])
    index = table.clamp(0, k.shape[0] - 1)
    k, v = (torch.where(valid[..., None, None, None], t[index], 0).flatten(1, 2) for t in (k, v))
    return cache._replace(batch_idx=None, block_table=None), k, v


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
    (0: chosen from the GPU's size; 1: none), for the calls the decoding kernel computes."""
    family = select_family(q.device)
    if family == "sm70" and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 needs an sm80 GPU (compute capability 8.0+); use float16 on this GPU")
    q = _kernel_operand(q)
    if cache is None:
        k, v = _kernel_operand(k), _kernel_operand(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    seqlen_k = k.shape[-3] if cache is None else cache_rows(k, cache.block_table)
    if seqlen_k == 0 or (varlen is None and k.shape[0] == 0):  # every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    problem = _problem(family, q, k, v, out, lse, softmax_scale, causal, varlen, options)
    plan = _launch(
        q.device,
        compiled_module().fwd_plan,
        family=family,
        batch=problem["batch"],
        nheads=problem["nheads"],
        nheads_k=problem["nheads_k"],
        seqlen_q=problem["seqlen_q"],
        seqlen_k=seqlen_k,
        head_dim=problem["head_dim"],
        varlen=varlen is not None,
        dropout=options.dropout_p > 0,
        num_splits=num_splits,
    )
    if cache is not None:
        if cache.block_table is not None and plan["splits"] == 0:
            cache, k, v = _gather_pages(cache, k, v)
            problem.update(k=_operand(k), v=_operand(v))
        problem.update(cache=_cache_arg(cache, k), seqlen_k=seqlen_k)
    if plan["splits"] > 1:
        o_accum = torch.empty(plan["o_accum_floats"], dtype=torch.float32, device=q.device)
        lse_accum = torch.empty(plan["lse_accum_floats"], dtype=torch.float32, device=q.device)
        problem.update(o_accum=o_accum.data_ptr(), lse_accum=lse_accum.data_ptr(), accum_floats=o_accum.numel())
    _launch(q.device, compiled_module().fwd, **problem, num_splits=plan["splits"])
    return out, lse


def append_kv(k_cache, v_cache, k, v, cache: Cache) -> None:
    """Writes k and v (batch, seqlen_new, nheads_k, d) into the caches at each sequence's cache.seqlens (rows
    past a sequence's cache are left out)."""
    k, v = _kernel_operand(k), _kernel_operand(v)
    _launch(
        k.device,
        compiled_module().append_kv,
        family=select_family(k.device),
        k=_operand(k),
        v=_operand(v),
        k_cache=_operand(k_cache),
        v_cache=_operand(v_cache),
        batch=k.shape[0],
        seqlen_new=k.shape[1],
        nheads_k=k.shape[2],
        head_dim=k.shape[3],
        cache=_cache_arg(cache, k_cache),
        stream=torch.cuda.current_stream(k.device).cuda_stream,
    )


@torch.library.custom_op("cuteflash::fwd", mutates_args=(), device_types="cuda")
def fwd(
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
    """The forward kernel as an operator that torch.compile and autograd see. q, k, v may be packed
    (unpack); cu_seqlens_q None: a fixed-length batch, whose max_seqlen_q/k are ignored; the options as
    Options. `deterministic` is kept for the backward pass."""
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    return fwd_impl(*unpack(q, k, v), softmax_scale, causal, varlen, options)


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest):
    """The op under torch.compile or when a gradient is wanted; otherwise the implementation directly,
    which skips the dispatcher's cost per call. rest: the options (Options' fields), then deterministic."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
    ):
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest)
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
    family = select_family(q.device)
    if "bwd" not in build_info()["families"][family]["directions"]:
        raise NotImplementedError(
            f"cuteflash: this build has no {family} backward kernels (built with CUTEFLASH_DIRECTIONS=fwd); "
            "detach the inputs, or rebuild with the backward pass"
        )
    dout, q, k, v, out = (_kernel_operand(t) for t in (dout, q, k, v, out))
    problem = _problem(family, q, k, v, out, lse, softmax_scale, causal, varlen, options)
    nheads, head_dim = q.shape[-2:]
    nheads_k = k.shape[-2]
    if _no_keys(q, k, varlen) or q.numel() == 0:  # no query or no key: every gradient is zero
        for t in (dq, dk, dv):
            t.zero_()
        return
    f32 = dict(dtype=torch.float32, device=q.device)
    # dq_accum (dQ's fp32 atomics; none for a deterministic pass) and where D = rowsum(dO * O) lives, as the
    # compiled module rules (params.h, api.cpp).
    workspace = compiled_module().bwd_workspace(
        family=family,
        head_dim=head_dim,
        batch=problem["batch"],
        nheads=nheads,
        seqlen_q=problem["seqlen_q"],
        deterministic=deterministic,
        total_q=-1 if varlen is None else q.shape[0],
    )
    dq_accum = torch.empty(workspace["dq_accum_floats"], **f32)
    # The kernels write into dq, dk, dv in place where they can read them as operands (any view of a packed
    # gradient), else into fresh tensors copied over.
    dq_k = dq if in_place(dq) else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if workspace["d_rowsum_in_dq"] and dq_k.is_contiguous():
        d_rowsum = dq_k.view(-1)[: 2 * lse.numel()].view(torch.float32).view(lse.shape)
    else:
        d_rowsum = torch.empty(lse.shape, **f32)
    # A dK/dV per query head (for MQA/GQA, summed over each group below).
    grouped = nheads != nheads_k
    dk_k, dv_k = (
        t
        if not grouped and in_place(t)
        else torch.empty(q.shape[:-3] + k.shape[-3:-2] + (nheads, head_dim), dtype=q.dtype, device=q.device)
        for t in (dk, dv)
    )
    _launch(
        q.device,
        compiled_module().bwd,
        **problem,
        dout=_operand(dout),
        dq=_operand(dq_k),
        dq_accum=dq_accum.data_ptr(),
        dq_accum_floats=dq_accum.numel(),
        d_rowsum=d_rowsum.data_ptr(),
        dk=_operand(dk_k),
        dv=_operand(dv_k),
        deterministic=deterministic,
    )
    if dq_k is not dq:
        dq.copy_(dq_k)
    for given, computed in ((dk, dk_k), (dv, dv_k)):
        if grouped:
            torch.sum(computed.unflatten(-2, (nheads_k, nheads // nheads_k)), dim=-2, out=given)
        elif computed is not given:
            given.copy_(computed)


@torch.library.custom_op("cuteflash::bwd", mutates_args=(), device_types="cuda")
def bwd(
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
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v) if t is not None]
    dq, dk, dv = unpack(*grads, *[None] * (3 - len(grads)))
    varlen = _varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = Options(window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state)
    bwd_into(dq, dk, dv, dout, *unpack(q, k, v), out, lse, softmax_scale, causal, deterministic, varlen, options)
    return grads


@bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest):
    return [t.new_empty(t.shape) for t in (q, k, v) if t is not None]


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, *rest = inputs
    *options, deterministic = rest
    options = Options(*options)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, options.alibi_slopes, options.rng_state)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = options.window_left, options.window_right, options.softcap
    ctx.dropout_p = options.dropout_p
    ctx.mark_non_differentiable(lse)  # as flash-attn: the log-sum-exp is returned for inspection only
    ctx.set_materialize_grads(False)  # lse's gradient stays None instead of a tensor of zeros


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = ctx.saved_tensors
    grads = iter(
        bwd(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_left,
            ctx.window_right,
            ctx.softcap,
            alibi_slopes,
            ctx.dropout_p,
            rng_state,
            ctx.deterministic,
        )
    )
    dq, dk, dv = (next(grads) if t is not None else None for t in (q, k, v))
    return dq, dk, dv, *[None] * 13


fwd.register_autograd(_backward, setup_context=_setup_context)


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
    family = select_family(rng_state.device)
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
        stream=torch.cuda.current_stream(rng_state.device).cuda_stream,
    )
    return keep.view(torch.bool)


@dropout_mask.register_fake
def _(rng_state, dropout_p, batch, nheads, seqlen_q, seqlen_k, cu_seqlens_q, total_q, total_k):
    shape = (batch, nheads, _round128(seqlen_q), _round128(seqlen_k))
    return rng_state.new_empty(shape, dtype=torch.bool)

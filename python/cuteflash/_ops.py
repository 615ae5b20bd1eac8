"""The kernels as torch.library custom ops, so they work under torch.compile and CUDA graphs.

The ops take tensors whose head dim is a multiple of 8 (interface.py pads the others); everything
else about the layout is handled here, so calling the op directly is safe too.
"""

from __future__ import annotations

import os

import torch

from ._lib import build_info, compiled_module, select_family

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
SM70_CORRECTION_ENV = "CUTEFLASH_SM70_CORRECTION"


MAX_ROW_STRIDE = 2**24  # the kernels index inside a block of rows with 32-bit offsets


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can read it in place (last dim contiguous, 16-byte aligned rows, row
    stride below MAX_ROW_STRIDE), else a contiguous copy. Slices of a packed qkv tensor pass unchanged."""
    aligned = t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    if t.stride(-1) == 1 and aligned and t.stride(1) < MAX_ROW_STRIDE:
        return t
    # contiguous() returns a contiguous view at an odd offset unchanged: clone it into aligned memory.
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


def _operand(t: torch.Tensor):
    """A (b, s, h, d) tensor as the compiled module's Operand: data pointer and (batch, row, head) strides."""
    return compiled_module().Operand(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _launch(device: torch.device, kernel, **kwargs) -> None:
    """Calls a launcher of the compiled module with `device` as the current CUDA device (the kernels
    launch on the current one), switching only when it is not already."""
    if device.index == torch.cuda.current_device():
        kernel(**kwargs)
    else:
        with torch.cuda.device(device):
            kernel(**kwargs)


def _fp16_correction(family: str) -> bool:
    """sm70: P (and dS) enter their fp16 tensor-core products error-corrected, unless
    CUTEFLASH_SM70_CORRECTION=0 (plain fp16, for comparison). The sm80 kernels ignore the flag."""
    return family != "sm70" or os.environ.get(SM70_CORRECTION_ENV, "1") != "0"


def _problem(family: str, q, k, v, out, lse, softmax_scale: float, causal: bool) -> dict:
    """The keyword arguments that _C.fwd and _C.bwd share: the problem, and the stream it runs on."""
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    return dict(
        family=family,
        dtype=_DTYPE_CODES[q.dtype],
        q=_operand(q),
        k=_operand(k),
        v=_operand(v),
        out=_operand(out),
        lse=lse.data_ptr(),
        batch=batch,
        nheads=nheads,
        nheads_k=nheads_k,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=head_dim,
        softmax_scale=softmax_scale,
        causal=causal,
        fp16_correction=_fp16_correction(family),
        stream=torch.cuda.current_stream(q.device).cuda_stream,
    )


def fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: returns out (b, s_q, h, d) and the fp32 log-sum-exp (b, h, s_q)."""
    family = select_family(q.device)
    if family == "sm70" and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 needs an sm80 GPU (compute capability 8.0+); use float16 on this GPU")
    q, k, v = (_kernel_operand(t) for t in (q, k, v))
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if seqlen_k == 0:  # no key at all: every row is empty (and k, v have no memory to point at)
        return out.zero_(), lse.fill_(float("inf"))
    _launch(q.device, compiled_module().fwd, **_problem(family, q, k, v, out, lse, softmax_scale, causal))
    return out, lse


@torch.library.custom_op("cuteflash::fwd", mutates_args=(), device_types="cuda")
def fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel as an operator that torch.compile and autograd see (`deterministic` is kept
    for the backward pass)."""
    return fwd_impl(q, k, v, softmax_scale, causal)


def forward(q, k, v, softmax_scale: float, causal: bool, deterministic: bool):
    """The op under torch.compile or when a gradient is wanted; otherwise the implementation directly,
    which skips the dispatcher's cost per call."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        return fwd(q, k, v, softmax_scale, causal, deterministic)
    return fwd_impl(q, k, v, softmax_scale, causal)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cuteflash::bwd", mutates_args=(), device_types="cuda")
def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: dq, dk, dv from dout and what the forward pass saved. With deterministic,
    dQ comes from a second kernel instead of fp32 atomics: bitwise reproducible, and slower."""
    family = select_family(q.device)
    if "bwd" not in build_info()["families"][family]["directions"]:
        raise NotImplementedError(
            f"cuteflash: this build has no {family} backward kernels (built with CUTEFLASH_DIRECTIONS=fwd); "
            "detach the inputs, or rebuild with the backward pass"
        )
    dout, q, k, v, out = (_kernel_operand(t) for t in (dout, q, k, v, out))
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # dq_accum (dQ's fp32 atomics; none for a deterministic pass) and where D = rowsum(dO * O) lives, as the
    # compiled module rules (params.h, api.cpp).
    workspace = compiled_module().bwd_workspace(
        family=family, head_dim=head_dim, batch=batch, nheads=nheads, seqlen_q=seqlen_q, deterministic=deterministic
    )
    dq_accum = torch.empty(workspace["dq_accum_floats"], **f32)
    if workspace["d_rowsum_in_dq"]:
        d_rowsum = dq.view(-1)[: 2 * batch * nheads * seqlen_q].view(torch.float32)
    else:
        d_rowsum = torch.empty((batch, nheads, seqlen_q), **f32)
    # A dK/dV per query head (for MQA/GQA, summed over each group below).
    dk = torch.empty((batch, seqlen_k, nheads, head_dim), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    if batch and seqlen_q and seqlen_k:
        _launch(
            q.device,
            compiled_module().bwd,
            **_problem(family, q, k, v, out, lse, softmax_scale, causal),
            dout=_operand(dout),
            dq=_operand(dq),
            dq_accum=dq_accum.data_ptr(),
            dq_accum_floats=dq_accum.numel(),
            d_rowsum=d_rowsum.data_ptr(),
            dk=_operand(dk),
            dv=_operand(dv),
            deterministic=deterministic,
        )
    else:  # no query or no key: every gradient is zero
        dk.zero_()
        dv.zero_()
        dq.zero_()
    if nheads != nheads_k:
        groups = nheads // nheads_k
        dk = dk.view(batch, seqlen_k, nheads_k, groups, head_dim).sum(3)
        dv = dv.view(batch, seqlen_k, nheads_k, groups, head_dim).sum(3)
    return dq, dk, dv


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)  # as flash-attn: the log-sum-exp is returned for inspection only
    ctx.set_materialize_grads(False)  # lse's gradient stays None instead of a tensor of zeros


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)

"""LayerNorm and RMSNorm fused with the residual add before them, with flash-attn's `layer_norm_fn`,
`rms_norm_fn`, `LayerNorm` and `RMSNorm` (flash_attn.ops.triton.layer_norm): names, signatures and results.

    y, residual = rms_norm_fn(x, weight, None, residual=residual, prenorm=True, residual_in_fp32=True)

One pass over each row computes x' = dropout(x * rowscale) (+ dropout(x1)) (+ residual), keeps x' where the caller
or the backward pass needs it (the `residual_out` that prenorm returns), and writes y = norm(x') * weight + bias
(and y1 = norm(x') * weight1 + bias1). Statistics in fp32. The backward pass reads x' and the row statistics once
and writes every input gradient, the weight and bias gradients summed per program and then across programs.

The kernels are Triton's: CUDA tensors on every GPU whose Triton compiles for it (Triton's own ptxas: Volta needs
a Triton release from a CUDA 12 toolchain, as the PyTorch builds for CUDA 12 have). Rows up to 65536 bytes.
CPU tensors run the same kernels in Triton's interpreter when TRITON_INTERPRET=1 (for tests); otherwise they raise.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

__all__ = ["LayerNorm", "RMSNorm", "layer_norm_fn", "layer_norm_ref", "rms_norm_fn", "rms_norm_ref"]


def _kernels():
    try:
        from . import _triton_norm
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            f"cuteflash.layer_norm runs Triton kernels, and Triton does not import here ({error}); install the "
            "triton package that matches your torch (pip install triton)"
        ) from error
    return _triton_norm


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"x is on {x.device}: cuteflash.layer_norm runs on CUDA tensors (or on the CPU in Triton's interpreter, "
            "TRITON_INTERPRET=1); use torch.nn.functional.layer_norm / rms_norm there"
        )


def _rows(name: str, t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """t as (rows, N) with a unit last stride, after checking it is shaped like x."""
    if t is None:
        return None
    if t.shape != shape:
        raise ValueError(f"{name} must have x's shape {tuple(shape)}, got {tuple(t.shape)}")
    t = t.reshape(-1, shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _buffer(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A caller's output buffer as (rows, N), a view of it (so that the kernel writes the caller's memory)."""
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        raise ValueError(f"{name} must have x's shape {tuple(shape)}, got {getattr(t, 'shape', t)}")
    try:
        rows = t.view(-1, shape[-1])
    except RuntimeError:
        rows = None
    if rows is None or rows.stride(-1) != 1:
        raise ValueError(f"{name} must be viewable as (rows, {shape[-1]}) with a unit last stride (e.g. contiguous)")
    return rows


def _vector(name: str, t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (n,):
        raise ValueError(f"{name} must be ({n},), the last dim of x, got {tuple(t.shape)}")
    return t.contiguous()


def _programs(device: torch.device, rows: int, block: int) -> int:
    """How many programs share the backward pass's rows: per SM, 8 for rows of up to 1024 elements down to 1 from
    8192 (measured on an H100: fewer programs of longer rows keep the SMs as busy, with fewer partial sums of the
    weight gradients to add up)."""
    if device.type != "cuda":
        return max(1, min(rows, 4))
    per_sm = max(1, min(8, 8192 // block))
    return max(1, min(rows, torch.cuda.get_device_properties(device).multi_processor_count * per_sm))


def _warps(block: int) -> int:
    """The forward pass's warps for rows of `block` (a power of two) elements."""
    return min(max(block // 256, 1), 16)


def _bwd_warps(block: int) -> int:
    """The backward pass's warps: each program walks its rows one after another."""
    return min(max(block // 256, 1), 16)


class _Dropout:
    """The dropout of one call: a Philox seed drawn on x's device by torch's generator (so that torch.manual_seed,
    a forked RNG state and CUDA-graph replays draw as they do for torch's own dropout), read by the kernels, and
    the keep threshold on 24 random bits; the backward pass regenerates the forward pass's mask from the same
    seed."""

    def __init__(self, p: float, device: torch.device):
        self.p = p
        self.seed = torch.randint(0, 2**62, (1,), device=device) if p > 0 else None
        self.threshold = round(p * 2**24)
        self.scale = 1.0 / (1.0 - p) if p < 1 else 0.0


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0, rowscale=None,
        prenorm=False, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
        out_dtype=None, out=None, residual_out=None,
    ):  # fmt: skip
        kernels = _kernels()
        _check_device(x)
        shape = x.shape
        n = shape[-1]
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        if x1 is not None and rowscale is not None:
            raise ValueError("rowscale does not apply with x1 (parallel norms), as in flash-attn; pass one")
        if weight1 is None and bias1 is not None:
            raise ValueError("bias1 needs weight1")
        x2 = _rows("x", x, shape)
        residual2, x12 = _rows("residual", residual, shape), _rows("x1", x1, shape)
        weight, bias = _vector("weight", weight, n), _vector("bias", bias, n)
        weight1, bias1 = _vector("weight1", weight1, n), _vector("bias1", bias1, n)
        if rowscale is not None:
            if rowscale.shape != shape[:-1]:
                raise ValueError(f"rowscale must be {tuple(shape[:-1])}, x's leading dims, got {rowscale.shape}")
            rowscale = rowscale.reshape(-1).contiguous()
        block = kernels.triton.next_power_of_2(n)
        if block * x.element_size() > 65536:
            raise ValueError(f"x's rows of {n} elements pass 65536 bytes, the most one program normalises")
        rows = x2.shape[0]
        residual_dtype = residual.dtype if residual is not None else torch.float32 if residual_in_fp32 else x.dtype
        # x' is kept where it differs from x (or the caller passes residual_out to fill)
        changed = residual is not None or x1 is not None or rowscale is not None or dropout_p > 0
        store = changed or residual_dtype != x.dtype or residual_out is not None
        if residual_out is not None:
            residual_out = _buffer("residual_out", residual_out, shape)
        elif store:
            residual_out = torch.empty((rows, n), dtype=residual_dtype, device=x.device)
        else:
            residual_out = x2
        out_dtype = x.dtype if out_dtype is None else out_dtype
        y = _buffer("out", out, shape) if out is not None else torch.empty((rows, n), dtype=out_dtype, device=x.device)
        y1 = torch.empty_like(y) if weight1 is not None else None
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        drop = _Dropout(dropout_p, x.device)
        store_mask = return_dropout_mask and dropout_p > 0
        mask = torch.empty((rows, n), dtype=torch.bool, device=x.device) if store_mask else None
        mask1 = torch.empty((rows, n), dtype=torch.bool, device=x.device) if store_mask and x1 is not None else None
        if rows:
            with _on(x.device):
                kernels.norm_fwd[(rows,)](
                    x2, x12, residual2, rowscale, weight, bias, weight1, bias1,
                    y, y1, residual_out, mask, mask1, mean, rstd,
                    x2.stride(0), _stride(x12), _stride(residual2), y.stride(0), _stride(y1), residual_out.stride(0),
                    n, eps, drop.threshold, drop.seed, drop.scale,
                    RMS=is_rms_norm, HAS_X1=x1 is not None, HAS_RES=residual is not None,
                    HAS_ROWSCALE=rowscale is not None, HAS_B=bias is not None, HAS_W1=weight1 is not None,
                    HAS_B1=bias1 is not None, STORE_RES=store, DROPOUT=dropout_p > 0, STORE_MASK=store_mask,
                    ZERO_CENTERED=zero_centered_weight, BLOCK=block, num_warps=_warps(block),
                )  # fmt: skip
        ctx.save_for_backward(residual_out, weight, bias, weight1, bias1, rowscale, mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.x_dtype, ctx.drop, ctx.block = shape, x.dtype, drop, block
        ctx.flags = (is_rms_norm, residual is not None, x1 is not None, prenorm, zero_centered_weight)
        result = [y.reshape(shape)]
        if weight1 is not None:
            result.append(y1.reshape(shape))
        if prenorm:
            result.append(residual_out.reshape(shape))
        if return_dropout_mask:
            for m in (mask, mask1):
                result.append(m.reshape(shape) if m is not None else None)
            ctx.mark_non_differentiable(*(m for m in (mask, mask1) if m is not None))
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    def backward(ctx, dy, *grads):
        kernels = _kernels()
        x, weight, bias, weight1, bias1, rowscale, mean, rstd = ctx.saved_tensors
        is_rms_norm, has_residual, has_x1, prenorm, zero_centered = ctx.flags
        shape, n, rows = ctx.shape, ctx.shape[-1], x.shape[0]
        # (gradients of unused outputs arrive as None: no zeros are written or read for an unused residual_out)
        dy = _rows("dy", dy, shape) if dy is not None else torch.zeros((rows, n), dtype=ctx.x_dtype, device=x.device)
        dy1 = _rows("dy1", grads[0], shape) if weight1 is not None else None
        if dy1 is None and weight1 is not None:
            dy1 = torch.zeros_like(dy)
        dres_out = _rows("dresidual_out", grads[int(weight1 is not None)], shape) if prenorm else None
        dx = torch.empty((rows, n), dtype=ctx.x_dtype, device=x.device)
        dx1 = torch.empty_like(dx) if has_x1 else None
        dres = torch.empty((rows, n), dtype=x.dtype, device=x.device) if has_residual else None
        programs = _programs(x.device, rows, ctx.block)
        per_program = -(-rows // programs)
        partial = dict(device=x.device, dtype=torch.float32)
        dw, db = torch.empty((programs, n), **partial), torch.empty((programs, n), **partial)
        dw1 = torch.empty((programs, n), **partial) if weight1 is not None else None
        db1 = torch.empty((programs, n), **partial) if weight1 is not None else None
        drop = ctx.drop
        if rows:
            with _on(x.device):
                kernels.norm_bwd[(programs,)](
                    x, weight, weight1, dy, dy1, dres_out, mean, rstd, rowscale,
                    dx, dx1, dres, dw, db, dw1, db1,
                    x.stride(0), dy.stride(0), _stride(dy1), _stride(dres_out), dx.stride(0), _stride(dx1),
                    _stride(dres), rows, per_program, n, drop.threshold, drop.seed, drop.scale,
                    RMS=is_rms_norm, HAS_W1=weight1 is not None, HAS_DRES_OUT=dres_out is not None,
                    HAS_RES=has_residual, HAS_X1=has_x1, HAS_ROWSCALE=rowscale is not None,
                    DROPOUT=drop.p > 0, ZERO_CENTERED=zero_centered, BLOCK=ctx.block, num_warps=_bwd_warps(ctx.block),
                )  # fmt: skip
        else:
            dw.zero_(), db.zero_()
            if weight1 is not None:
                dw1.zero_(), db1.zero_()

        def total(part, like):
            return part.sum(0).to(like.dtype) if like is not None else None

        return (
            dx.reshape(shape),
            total(dw, weight),
            total(db, bias),
            dres.reshape(shape) if has_residual else None,
            dx1.reshape(shape) if has_x1 else None,
            total(dw1, weight1),
            total(db1, bias1),
            *(None,) * 11,
        )


def _on(device: torch.device):
    """The context that makes device current for a Triton launch (Triton launches on the current device)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _stride(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.stride(0)


def layer_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0, rowscale=None,
    prenorm=False, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
    out_dtype=None, out=None, residual_out=None,
):  # fmt: skip
    """norm(dropout(x * rowscale) + dropout(x1) + residual) * weight + bias, flash-attn's signature.

    Arguments:
        x: (..., N) float16, bfloat16 or float32, on a CUDA device.
        weight, bias: (N,); bias may be None. zero_centered_weight: the norm multiplies by weight + 1.
        residual: like x, or None: added after the dropout. Its dtype is residual_out's (else float32 with
            residual_in_fp32, else x's).
        x1, weight1, bias1: a second input summed into the row, and a second output norm(x') * weight1 + bias1.
        eps: added to the variance (the mean square with is_rms_norm).
        dropout_p: dropout of x (and of x1, with its own mask) before the sum; the masks come from torch's
            generator on x's device (a seed a call), so torch.manual_seed repeats them and a CUDA graph's replays
            draw new ones.
        rowscale: (...,), x's leading dims, or None: multiplies each row of x before its dropout.
        prenorm: also return residual_out, the sum the norm read (the next block's residual).
        return_dropout_mask: also return the masks of x and x1 (bool, True where kept; None where not drawn).
        out_dtype: y's dtype (default x's). out, residual_out: tensors to write y and residual_out into.
    Return:
        y, then y1 with weight1, then residual_out with prenorm, then the two masks with return_dropout_mask; a
        single tensor where that is all. Differentiable in x, weight, bias, residual, x1, weight1, bias1.
    """
    return LayerNormFn.apply(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
        zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out, residual_out,
    )  # fmt: skip


def rms_norm_fn(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0, rowscale=None,
    prenorm=False, residual_in_fp32=False, zero_centered_weight=False, return_dropout_mask=False, out_dtype=None,
    out=None, residual_out=None,
):  # fmt: skip
    """layer_norm_fn with is_rms_norm=True: x' / sqrt(mean(x'^2) + eps) * weight + bias."""
    return LayerNormFn.apply(
        x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, residual_in_fp32,
        zero_centered_weight, True, return_dropout_mask, out_dtype, out, residual_out,
    )  # fmt: skip


class _Norm(torch.nn.Module):
    is_rms_norm = False

    def __init__(self, hidden_size, eps, dropout_p, zero_centered_weight, bias, device, dtype):
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        (torch.nn.init.zeros_ if self.zero_centered_weight else torch.nn.init.ones_)(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layer_norm_fn(
            x, self.weight, self.bias, residual=residual, eps=self.eps,
            dropout_p=self.drop.p if self.drop is not None and self.training else 0.0, prenorm=prenorm,
            residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight,
            is_rms_norm=self.is_rms_norm,
        )  # fmt: skip


class RMSNorm(_Norm):
    """flash-attn's RMSNorm module: a weight (ones; zeros with zero_centered_weight), no bias, optional dropout of
    the input in training; forward(x, residual=None, prenorm=False, residual_in_fp32=False)."""

    is_rms_norm = True

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None, dtype=None):
        super().__init__(hidden_size, eps, dropout_p, zero_centered_weight, False, device, dtype)


class LayerNorm(_Norm):
    """flash-attn's LayerNorm module: weight and bias, optional dropout of the input in training; forward as
    RMSNorm's."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None, dtype=None):
        super().__init__(hidden_size, eps, dropout_p, zero_centered_weight, True, device, dtype)


def _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
               zero_centered_weight, dropout_mask, dropout_mask1, upcast, rms):  # fmt: skip
    dtype = x.dtype
    if upcast:
        x, weight, bias, residual, x1, weight1, bias1 = (
            None if t is None else t.double() for t in (x, weight, bias, residual, x1, weight1, bias1)
        )
    if zero_centered_weight:
        weight = weight + 1
        weight1 = None if weight1 is None else weight1 + 1
    if rowscale is not None:
        x = x * rowscale[..., None].to(x.dtype)
    if dropout_p > 0:
        x = x.masked_fill(~dropout_mask, 0) / (1 - dropout_p)
        if x1 is not None:
            x1 = x1.masked_fill(~dropout_mask1, 0) / (1 - dropout_p)
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = x + residual

    def norm(w, b):
        if rms:
            y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
            y = y if b is None else y + b
        else:
            y = F.layer_norm(x, x.shape[-1:], w, b, eps)
        return y if upcast else y.to(dtype)

    result = [norm(weight, bias)]
    if weight1 is not None:
        result.append(norm(weight1, bias1))
    if prenorm:
        result.append(x)
    return result[0] if len(result) == 1 else tuple(result)


def layer_norm_ref(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0, rowscale=None,
    prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None, upcast=False,
):  # fmt: skip
    """The composition layer_norm_fn fuses, in torch: in x's dtype, or with upcast in float64 throughout (the
    outputs too). Dropout needs the masks the kernel returned."""
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                      zero_centered_weight, dropout_mask, dropout_mask1, upcast, False)  # fmt: skip


def rms_norm_ref(
    x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0, rowscale=None,
    prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None, upcast=False,
):  # fmt: skip
    """layer_norm_ref's RMSNorm."""
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                      zero_centered_weight, dropout_mask, dropout_mask1, upcast, True)  # fmt: skip

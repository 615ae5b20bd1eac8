"""flash-attn 2.8's flash_attn.flash_attn_interface, on cuteflash.

The public functions are cuteflash's, whose signatures are flash-attn 2.8's. The private functions that libraries
built on flash-attn call for the softmax's log-sum-exp (ring-flash-attn calls _flash_attn_forward,
_flash_attn_backward and their varlen pair) are custom ops in the flash_attn namespace, as flash-attn 2.7+ registers
them (torch.ops.flash_attn._flash_attn_forward, ...), with flash-attn 2.8.3's signatures, return values and fake
implementations. Where they differ from flash-attn (docs/compat.md):

- rng_state is a (2,) int64 tensor as in flash-attn, but its first element is cuteflash's Philox counter base and
  its second is unused (flash-attn's: seed and offset). Pass it back to the backward function as returned; a
  backward call with dropout and no rng_state raises, where flash-attn would draw a new (wrong) mask.
- softmax_d, the backward functions' return value, is D = rowsum(dO * O) in flash-attn's layout, computed from
  dout and out after the kernels (times 1 - dropout_p, as flash-attn stores it).
- NotImplementedError: dropout together with block_table, leftpad_k or seqused_k of _flash_attn_varlen_forward,
  which read the keys as a KV cache (forward only, as in flash-attn).
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

from cuteflash import _ops
from cuteflash import interface as _cuteflash
from cuteflash.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

# Elements of dout and out that softmax_d reads at a time: bounds their fp32 copies to 64 MB each.
_SOFTMAX_D_CHUNK = 2**24


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def round_multiple(x: int, m: int) -> int:
    """x rounded up to a multiple of m (flash-attn's helper, which some consumers import)."""
    return (x + m - 1) // m * m


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """x with a contiguous last dimension (a copy only where it is not), or None (flash-attn's helper)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


USE_TRITON_ROCM = False  # flash-attn's flag for its ROCm Triton backend, which this package never is


def _keeps_all(dropout_p: float) -> bool:
    """Whether dropout_p > 0 drops nothing and scales by exactly 1 in the kernels (keep threshold (1 - p) 256 rounds
    to 256, 1 / (1 - p) rounds to 1.0 in fp32), so that the kernels without dropout compute the same bits: p below
    about 3e-8, as diffusers passes (1e-30) to get the log-sum-exp of a training call."""
    scale_fp32 = struct.unpack("f", struct.pack("f", 1 / (1 - dropout_p)))[0]
    return 0 < dropout_p and round((1 - dropout_p) * 256) == 256 and scale_fp32 == 1.0


def _check_head_dim(q: torch.Tensor) -> None:
    if q.shape[-1] % 8:
        raise ValueError(
            f"flash-attn's private functions take head dims that are multiples of 8 (flash_attn_func pads the "
            f"others), got {q.shape[-1]}"
        )


def _check_like(name: str, t, like: torch.Tensor, like_name: str) -> None:
    """t must have like's shape, dtype and device, and a contiguous last dimension."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be shaped like {like_name} {tuple(like.shape)}, {like.dtype} on {like.device}, with a "
            f"contiguous last dimension; got {tuple(t.shape)}, {t.dtype} on {t.device}, strides {t.stride()}"
        )


def _check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> _ops.Varlen:
    return _ops.Varlen(*_cuteflash._check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _new_rng_state(device: torch.device, dropout_p: float) -> torch.Tensor:
    """flash-attn's (2,) int64 rng_state: cuteflash's Philox counter base (drawn only with dropout), then 0."""
    if dropout_p == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return F.pad(_ops.draw_rng_state(device), (0, 1))


def _kernel_rng_state(rng_state, device: torch.device) -> torch.Tensor:
    """The Philox counter base in a forward call's rng_state (this package's (2,) or cuteflash's (1,))."""
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64 or rng_state.numel() == 0:
        raise ValueError("rng_state must be the int64 tensor that the forward call returned")
    if rng_state.device != device:
        raise ValueError(f"rng_state is on {rng_state.device} but q is on {device}")
    return rng_state.contiguous().view(-1)[:1]


def _options(q, batch: int, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, rng_state):
    left, right, softcap, alibi_slopes = _cuteflash._check_options(
        q, batch, (window_size_left, window_size_right), softcap, alibi_slopes
    )
    return _ops.Options(left, right, softcap, alibi_slopes, dropout_p, rng_state)


def _forward(
    q,
    k,
    v,
    varlen,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    """out, softmax_lse, S_dmask, rng_state of flash-attn's forward functions; varlen: None or (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    dropout_p = _cuteflash._check_dropout(dropout_p)
    if return_softmax and dropout_p == 0:
        raise ValueError("return_softmax needs dropout_p > 0, as in flash-attn (S_dmask shows the dropout mask)")
    _cuteflash._check_qkv(q, k, v, varlen is not None)
    _check_head_dim(q)
    softmax_scale = _cuteflash._check_scale(softmax_scale)
    varlen = None if varlen is None else _check_varlen(q, *varlen)
    batch = q.shape[0] if varlen is None else varlen.cu_seqlens_q.numel() - 1
    rng_state = _new_rng_state(q.device, dropout_p)
    options = _options(
        q,
        batch,
        dropout_p,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        rng_state[:1] if dropout_p > 0 else None,
    )
    kernel_options = options._replace(dropout_p=0.0, rng_state=None) if _keeps_all(dropout_p) else options
    out, lse = _ops.fwd_impl(q, k, v, softmax_scale, bool(causal), varlen, kernel_options)
    if return_softmax:
        probs_varlen = (None, None, 0, 0) if varlen is None else varlen
        s_dmask = _cuteflash._attn_probs(
            q.detach(), k.detach(), lse, probs_varlen, softmax_scale, bool(causal), options
        )
    else:
        s_dmask = q.new_empty((0,))
    return out, lse, s_dmask, rng_state


def _softmax_d(dout: torch.Tensor, out: torch.Tensor, varlen: _ops.Varlen | None, dropout_p: float) -> torch.Tensor:
    """flash-attn's softmax_d: D = rowsum(dO * O) times the keep probability 1 - dropout_p, fp32, in flash-attn's
    padded layout: (batch, nheads, seqlen_q rounded up to 128), or (nheads, total_q + 128 * batch) with sequence
    b's rows from cu_seqlens_q[b] + 128 * b. Zero elsewhere."""
    rows_dim = dout.dim() - 3  # of (batch, seqlen_q, nheads, d) or (total_q, nheads, d)
    d = torch.empty(dout.shape[:-1], dtype=torch.float32, device=dout.device)
    step = max(1, _SOFTMAX_D_CHUNK * dout.shape[rows_dim] // max(1, dout.numel()))
    for start in range(0, dout.shape[rows_dim], step):
        rows = (slice(None),) * rows_dim + (slice(start, start + step),)
        d[rows] = torch.sum(dout[rows].float() * out[rows].float(), dim=-1)
    if dropout_p > 0:
        d *= 1 - dropout_p
    if varlen is None:
        batch, seqlen_q, nheads = dout.shape[:3]
        softmax_d = d.new_zeros((batch, nheads, _round128(seqlen_q)))
        softmax_d[:, :, :seqlen_q] = d.view(batch, seqlen_q, nheads).transpose(1, 2)
        return softmax_d
    cu_seqlens_q = varlen.cu_seqlens_q
    batch, (total_q, nheads) = cu_seqlens_q.numel() - 1, d.shape
    row = torch.arange(total_q, dtype=cu_seqlens_q.dtype, device=d.device)
    sequence = torch.searchsorted(cu_seqlens_q[1:], row, right=True)  # batch for rows past the last sequence
    d.masked_fill_((row >= cu_seqlens_q[-1]).unsqueeze(-1), 0)
    softmax_d = d.new_zeros((nheads, total_q + 128 * batch))
    softmax_d[:, row + 128 * sequence] = d.t()
    return softmax_d


def _backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    varlen,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state,
):
    """flash-attn's backward functions: dq, dk, dv written in place (allocated where None, as flash-attn does, and
    then dropped); returns softmax_d."""
    dropout_p = _cuteflash._check_dropout(dropout_p)
    kernel_dropout_p = 0.0 if _keeps_all(dropout_p) else dropout_p
    if kernel_dropout_p > 0 and rng_state is None:
        raise ValueError(
            "dropout_p > 0 needs the rng_state that the forward call returned, so that the backward pass drops what "
            "the forward pass dropped"
        )
    _cuteflash._check_qkv(q, k, v, varlen is not None)
    _check_head_dim(q)
    _check_like("dout", dout, q, "q")
    _check_like("out", out, q, "q")
    softmax_scale = _cuteflash._check_scale(softmax_scale)
    varlen = None if varlen is None else _check_varlen(q, *varlen)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if varlen is None else (q.shape[1], q.shape[0])
    if not (
        isinstance(softmax_lse, torch.Tensor)
        and softmax_lse.dtype == torch.float32
        and tuple(softmax_lse.shape) == lse_shape
        and softmax_lse.device == q.device
    ):
        got = (softmax_lse.dtype, tuple(softmax_lse.shape)) if isinstance(softmax_lse, torch.Tensor) else softmax_lse
        raise ValueError(f"softmax_lse must be the forward call's float32 log-sum-exp, shape {lse_shape}; got {got}")
    batch = q.shape[0] if varlen is None else varlen.cu_seqlens_q.numel() - 1
    kernel_rng_state = _kernel_rng_state(rng_state, q.device) if kernel_dropout_p > 0 else None
    options = _options(
        q, batch, kernel_dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, kernel_rng_state
    )
    grads = []
    for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g is None:
            g = torch.empty_like(t)
        else:
            _check_like(name, g, t, name[1])
        grads.append(g)
    _ops.bwd_into(
        *grads,
        dout,
        q,
        k,
        v,
        out,
        softmax_lse.contiguous(),
        softmax_scale,
        bool(causal),
        bool(deterministic),
        varlen,
        options,
    )
    return _softmax_d(dout, out, varlen, dropout_p)


def _zero_rows_past(cu_seqlens: torch.Tensor, rows_dim: int, *tensors: torch.Tensor, value: float = 0.0) -> None:
    """Fills the rows (along dim rows_dim) past the last sequence of cu_seqlens with value, without reading the
    offsets on the host."""
    for t in tensors:
        past = torch.arange(t.shape[rows_dim], device=t.device) >= cu_seqlens[-1]
        t.masked_fill_(past.view(-1, *[1] * (t.dim() - rows_dim - 1)), value)


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cuda")
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention forward on q, k, v (batch, seqlen, nheads, headdim), headdim a multiple of 8: out, softmax_lse
    (batch, nheads, seqlen_q) fp32, S_dmask (with return_softmax, which needs dropout; else an empty tensor) and
    rng_state (2,) int64, for _flash_attn_backward."""
    return _forward(
        q,
        k,
        v,
        None,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
    )


@_flash_attn_forward.register_fake
def _(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    batch, seqlen_q, nheads, _ = q.shape
    s_dmask = (batch, nheads, _round128(seqlen_q), _round128(k.shape[1])) if return_softmax else (0,)
    return (
        q.new_empty(q.shape),  # contiguous, as the kernels write it
        q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
        q.new_empty(s_dmask),
        q.new_empty((2,), dtype=torch.int64),
    )


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cuda")
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_flash_attn_forward on a variable-length batch: q (total_q, nheads, headdim), k and v (total_k, nheads_k,
    headdim), or with block_table paged caches; softmax_lse is (nheads, total_q). seqused_k (batch,) int32: the keys
    sequence b uses, from the start of its keys (default cu_seqlens_k[b + 1] - cu_seqlens_k[b]); leftpad_k (batch,)
    int32: its keys begin that many rows later. block_table, seqused_k and leftpad_k: forward only, no dropout.
    num_splits: 0 or 1 (no split of the keys here); more raises, as in flash-attn. With zero_tensors, the rows of
    out past the last sequence are zeros and their log-sum-exp -inf."""
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    if num_splits > 1:
        raise RuntimeError("num_splits > 1 is not supported by _flash_attn_varlen_forward; pass 0 or 1")
    if block_table is not None or seqused_k is not None or leftpad_k is not None:
        if return_softmax:
            raise ValueError(
                "return_softmax needs dropout_p > 0, which block_table, seqused_k and leftpad_k do not take"
            )
        with torch.no_grad():  # forward only
            out, lse, _ = _cuteflash._cache_varlen(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p,
                _cuteflash._check_scale(softmax_scale),
                causal,
                (window_size_left, window_size_right),
                softcap,
                alibi_slopes,
                True,
                block_table,
                seqused_k,
                leftpad_k,
            )
        outputs = out, lse, q.new_empty((0,)), _new_rng_state(q.device, 0.0)
    else:
        outputs = _forward(
            q,
            k,
            v,
            (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            return_softmax,
        )
    if zero_tensors:
        _zero_rows_past(cu_seqlens_q, 0, outputs[0])
        _zero_rows_past(cu_seqlens_q, 1, outputs[1], value=float("-inf"))
    return outputs


@_flash_attn_varlen_forward.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
    num_splits=0,
):
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    s_dmask = (batch, nheads, _round128(max_seqlen_q), _round128(max_seqlen_k)) if return_softmax else (0,)
    return (
        q.new_empty(q.shape),  # contiguous, as the kernels write it
        q.new_empty((nheads, total_q), dtype=torch.float32),
        q.new_empty(s_dmask),
        q.new_empty((2,), dtype=torch.int64),
    )


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradients of _flash_attn_forward, written into dq, dk, dv (shaped like q, k, v; views are written in
    place); returns softmax_d (batch, nheads, seqlen_q rounded up to 128), fp32. With dropout, rng_state is the
    forward call's."""
    return _backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        None,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )


@_flash_attn_backward.register_fake
def _(dout, q, *rest):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, nheads, _round128(seqlen_q)), dtype=torch.float32)


@torch.library.custom_op(
    "flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types="cuda"
)
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """_flash_attn_backward on a variable-length batch; returns softmax_d (nheads, total_q + 128 * batch). With
    zero_tensors, the rows of dq, dk and dv past the last sequence are zeros."""
    softmax_d = _backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )
    if zero_tensors:
        _zero_rows_past(cu_seqlens_q, 0, *[t for t in (dq,) if t is not None])
        _zero_rows_past(cu_seqlens_k, 0, *[t for t in (dk, dv) if t is not None])
    return softmax_d


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, *rest):
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    return q.new_empty((nheads, total_q + 128 * batch), dtype=torch.float32)


# flash-attn 2.7+'s names for its ops, which libraries call to reach the log-sum-exp (diffusers' flash backends call
# them positionally, with dropout_p=1e-30 in training: _keeps_all runs that without the dropout kernels).
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward

# flash-attn's compiled module, with its positional entry points (xtuner calls flash_attn_gpu.varlen_fwd).
import flash_attn_2_cuda as flash_attn_gpu  # noqa: E402, F401 (it calls the ops above)

"""flash-attn's functions, backed by cuteflash's kernels. Switching is a change of import:

from cuteflash import flash_attn_func   # instead of: from flash_attn import flash_attn_func
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _ops

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


def _check_unsupported(dropout_p, window_size, softcap, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p}: dropout is not implemented in cuteflash yet; pass 0.0")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"window_size={tuple(window_size)}: sliding-window attention is not implemented "
            "in cuteflash yet; pass (-1, -1)"
        )
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: softcapping is not implemented in cuteflash yet; pass 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not implemented in cuteflash yet; pass None")


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; cuteflash supports torch.float16 and torch.bfloat16: "
                f"convert with {name}.half() or {name}.bfloat16()"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, _, nheads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"q has batch {batch} but k and v have batch {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q has head dim {head_dim} but k and v have {k.shape[3]}; they must match")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported: cuteflash supports head dims 1 to {MAX_HEAD_DIM}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"q has {nheads} heads, k and v have {nheads_k}: the number of query heads must be a "
            "multiple of the number of key/value heads (MQA/GQA)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; cuteflash runs on CUDA GPUs: move it with {name}.cuda()")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _attention(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
):
    _check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    _check_qkv(q, k, v)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    # The kernels read 8 elements at a time: pad the head dim with zeros, which add nothing to QK^T
    # and produce zero columns of O that are cut off again.
    pad = -head_dim % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out, lse = _ops.forward(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))
    if pad:
        out = out[..., :head_dim]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """Exact attention softmax(Q K^T * softmax_scale) V, without materialising the attention matrix.

    K and V may have fewer heads than Q (multi-query / grouped-query attention): nheads must be a
    multiple of nheads_k, and query head i reads key/value head i // (nheads // nheads_k).

    causal=True keeps key j for query i when j <= i + seqlen_k - seqlen_q: the diagonal of the mask
    ends in the bottom-right corner of the (seqlen_q, seqlen_k) score matrix. Drawn with x = kept,
    . = masked, for seqlen_q = 2, seqlen_k = 5 (left) and seqlen_q = 5, seqlen_k = 2 (right):

        x x x x .        . .
        x x x x x        . .
                         . .
                         x .
                         x x

    A query that keeps no key (the top three rows on the right) gets an output of zeros.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA GPU.
        k: (batch_size, seqlen_k, nheads_k, headdim), same dtype and device.
        v: (batch_size, seqlen_k, nheads_k, headdim), same dtype and device.
        dropout_p: float. Dropout probability; only 0.0 is implemented.
        softmax_scale: float. Scaling of QK^T before the softmax; default 1 / sqrt(headdim).
        causal: bool. Whether to apply the (bottom-right aligned) causal mask.
        window_size, softcap, alibi_slopes: not implemented yet; only the defaults are accepted.
        deterministic: bool. Whether the backward pass must be bitwise reproducible: dQ then comes from a
            second kernel that walks the keys of each query block in a fixed order, instead of fp32
            atomics whose order varies between runs (slower: the backward pass recomputes S and dP).
        return_attn_probs: bool. Also return the log-sum-exp (for testing; no attention matrix is made).
    Return:
        out: (batch_size, seqlen_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q), float32: the log-sum-exp of
            each row of QK^T * softmax_scale (+inf for a row that sees no key).
        None [if return_attn_probs]: in place of flash-attn's dropout mask.
    """
    return _attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """flash_attn_func for q, k and v stacked in one tensor: qkv (batch_size, seqlen, 3, nheads, headdim).

    q, k and v are read in place through their strides, not copied. Arguments and return values are
    those of flash_attn_func.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {shape}")
    return _attention(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """flash_attn_func with k and v stacked in one tensor: kv (batch_size, seqlen_k, 2, nheads_k, headdim).

    k and v are read in place through their strides. Arguments and return values are those of
    flash_attn_func.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {shape}")
    return _attention(
        q,
        kv[:, :, 0],
        kv[:, :, 1],
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )

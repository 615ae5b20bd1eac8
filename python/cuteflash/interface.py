"""flash-attn's functions, backed by cuteflash's kernels. Switching is a change of import:

from cuteflash import flash_attn_func   # instead of: from flash_attn import flash_attn_func
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from . import _ops, reference

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16)


def _check_dropout(dropout_p) -> float:
    if not (isinstance(dropout_p, (int, float)) and 0 <= dropout_p < 1):
        raise ValueError(f"dropout_p must be a number in [0, 1) (0.0: no dropout, as in evaluation), got {dropout_p!r}")
    return float(dropout_p)


def _attn_probs(q, k, lse, varlen, softmax_scale, causal, options: _ops.Options) -> torch.Tensor:
    """flash-attn's S_dmask for a call with dropout: (batch, nheads, seqlen_q, seqlen_k), both rounded up to
    multiples of 128 (the bounds for a variable-length batch), in q's dtype: the softmax probabilities (in
    fp32 from q, k and the kernel's lse), those that dropout dropped negated, zeros past each sequence. Testing
    only: O(seqlen_q * seqlen_k) memory, and a variable-length batch's offsets are read on the host."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = varlen
    fixed = cu_seqlens_q is None
    nheads = q.shape[-2]
    batch = q.shape[0] if fixed else cu_seqlens_q.numel() - 1
    keep = _ops.dropout_mask(
        options.rng_state,
        options.dropout_p,
        batch,
        nheads,
        q.shape[1] if fixed else max_seqlen_q,
        k.shape[1] if fixed else max_seqlen_k,
        cu_seqlens_q,
        0 if fixed else q.shape[0],
        0 if fixed else k.shape[0],
    )
    window = (options.window_left, options.window_right)
    slopes = options.alibi_slopes

    def probs_of(q, k, lse, slopes):  # one batch (or sequence): (b, h, s_q, s_k) fp32
        scores = reference.scores_ref(q, k, softmax_scale, causal, torch.float32, window, options.softcap, slopes)
        return torch.exp(scores - lse.unsqueeze(-1))

    probs = torch.zeros(keep.shape, dtype=torch.float32, device=q.device)
    if fixed:
        probs[:, :, : q.shape[1], : k.shape[1]] = probs_of(q, k, lse, slopes)
    else:
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(batch):
            q0, k0 = starts_q[b], starts_k[b]
            len_q, len_k = min(starts_q[b + 1] - q0, keep.shape[2]), min(starts_k[b + 1] - k0, keep.shape[3])
            slopes_b = slopes[b : b + 1] if slopes is not None and slopes.dim() == 2 else slopes
            probs[b : b + 1, :, :len_q, :len_k] = probs_of(
                q[q0 : q0 + len_q].unsqueeze(0), k[k0 : k0 + len_k].unsqueeze(0), lse[:, q0 : q0 + len_q], slopes_b
            )
    return torch.where(keep, probs, -probs).to(q.dtype)


def _check_options(q, batch: int, window_size, softcap, alibi_slopes) -> tuple:
    """window_size as two ints (a negative side: unbounded, -1), softcap as a float >= 0, and alibi_slopes
    (fp32, (nheads,) or (batch, nheads), on q's device) checked; returns them as _ops.fwd takes them."""
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}"
        ) from None
    window = tuple(max(w, -1) for w in (left, right))
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off), got {softcap!r}")
    if alibi_slopes is not None:
        nheads = q.shape[-2]
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(
                f"alibi_slopes has dtype {alibi_slopes.dtype}; it must be torch.float32: convert with "
                "alibi_slopes.float()"
            )
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(
                f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch_size, nheads) = ({batch}, {nheads}), "
                f"got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(
                f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}; move it with "
                "alibi_slopes.to(q.device)"
            )
        alibi_slopes = alibi_slopes.contiguous()
    return (*window, float(softcap), alibi_slopes)


def _check_qkv(q, k, v, varlen: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; cuteflash supports torch.float16 and torch.bfloat16: "
                f"convert with {name}.half() or {name}.bfloat16()"
            )
        if varlen and t.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions (total_seqlen, nheads, headdim) in a variable-length batch, "
                f"got shape {tuple(t.shape)}"
            )
        if not varlen and t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    nheads, head_dim = q.shape[-2:]
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k and v have batch {k.shape[0]}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"q has head dim {head_dim} but k and v have {k.shape[-1]}; they must match")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported: cuteflash supports head dims 1 to {MAX_HEAD_DIM}")
    nheads_k = k.shape[-2]
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


def _check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """The checks of a variable-length batch's arguments that need no synchronisation with the GPU: the
    offsets' values stay unread on the host. The kernels clamp them to q's and k's rows, and compute each
    sequence whole whatever the bounds say (max_seqlen_q/k only size the launch)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {cu.dtype}; it must be torch.int32: convert with {name}.int()")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"{name} must be 1-D with batch_size + 1 offsets, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it with {name}.to(q.device)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} offsets and cu_seqlens_k {cu_seqlens_k.numel()}: both must "
            "have batch_size + 1"
        )
    bounds = []
    for name, bound in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        try:
            bound = operator.index(bound)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(bound).__name__}") from None
        if not 0 <= bound < 2**30:
            raise ValueError(f"{name} must be in [0, 2^30), got {bound}")
        bounds.append(bound)
    return cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), *bounds


def _attention(
    q,
    k,
    v,
    varlen,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
):
    """q, k, v as _ops.unpack reads them (k None: q is qkv packed; v None: k is kv packed); varlen: None, or
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    dropout_p = _check_dropout(dropout_p)
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    unpacked = _ops.unpack(q, k, v)
    _check_qkv(*unpacked, varlen is not None)
    varlen = (None, None, 0, 0) if varlen is None else _check_varlen(q, *varlen)
    batch = q.shape[0] if varlen[0] is None else varlen[0].numel() - 1
    options = _check_options(unpacked[0], batch, window_size, softcap, alibi_slopes)
    if dropout_p > 0 and options[2] > 0:
        raise NotImplementedError(
            "softcap together with dropout_p > 0 is not implemented in cuteflash yet; pass softcap=0.0 or dropout_p=0.0"
        )
    rng_state = _ops.draw_rng_state(q.device) if dropout_p > 0 else None
    options = _ops.Options(*options, dropout_p, rng_state)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    # The kernels read 8 elements at a time: pad the head dim with zeros, which add nothing to QK^T
    # and produce zero columns of O that are cut off again.
    pad = -head_dim % 8
    if pad:
        q, k, v = (None if t is None else F.pad(t, (0, pad)) for t in (q, k, v))
    out, lse = _ops.forward(q, k, v, *varlen, float(softmax_scale), bool(causal), *options, bool(deterministic))
    if pad:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    if dropout_p == 0:
        return out, lse, None
    q, k = (t.detach() for t in _ops.unpack(q, k, v)[:2])
    return out, lse, _attn_probs(q, k, lse, varlen, softmax_scale, bool(causal), options)


def _check_packed(name: str, t, shape: tuple[str, ...]) -> None:
    """t must have the dims that `shape` names, the one of them that is a number its size."""
    count = next(int(d) for d in shape if d.isdigit())
    if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or t.shape[-3] != count:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape ({', '.join(shape)}), got {got}")


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
        dropout_p: float. Dropout probability on the attention probabilities, in [0, 1): each is dropped
            with probability dropout_p and the others divided by 1 - dropout_p. The mask comes from a Philox
            generator seeded from torch's CUDA generator (torch.manual_seed governs it; a CUDA graph draws a
            new one at each replay), and the backward pass uses the same. Pass 0.0 in evaluation.
        softmax_scale: float. Scaling of QK^T before the softmax; default 1 / sqrt(headdim).
        causal: bool. Whether to apply the (bottom-right aligned) causal mask.
        window_size: (left, right). Sliding-window attention: query i keeps key j when
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves a side
            unbounded, and causal=True sets right to 0. Key blocks outside the window are skipped, so the
            cost grows with the window rather than with seqlen_k.
        softcap: float. When > 0, the scores become softcap * tanh(scores / softcap) before the softmax
            (scores = QK^T * softmax_scale), as in Gemma 2; 0.0 turns it off.
        alibi_slopes: (nheads,) or (batch_size, nheads), float32, or None. ALiBi: adds
            -slope * |i + seqlen_k - seqlen_q - j| to the score of query i and key j (after the softcap).
        deterministic: bool. Whether the backward pass must be bitwise reproducible: dQ then comes from a
            second kernel that walks the keys of each query block in a fixed order, instead of fp32
            atomics whose order varies between runs (slower: the backward pass recomputes S and dP).
        return_attn_probs: bool. Also return the log-sum-exp and, with dropout, the attention probabilities
            with the dropout mask (for testing: that matrix takes O(seqlen_q * seqlen_k) memory).
    Return:
        out: (batch_size, seqlen_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q), float32: the log-sum-exp of
            each row of QK^T * softmax_scale (+inf for a row that sees no key).
        S_dmask [if return_attn_probs]: with dropout_p > 0, (batch_size, nheads, seqlen_q_rounded,
            seqlen_k_rounded), both rounded up to multiples of 128, in q's dtype: the softmax probabilities
            before dropout, negated where dropout dropped them (flash-attn's encoding: S_dmask >= 0 is the
            kept mask, S_dmask.abs() the probabilities), zeros past seqlen_q and seqlen_k. Without dropout, None.
    """
    return _attention(
        q,
        k,
        v,
        None,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """flash_attn_func for q, k and v stacked in one tensor: qkv (batch_size, seqlen, 3, nheads, headdim).

    q, k and v are read in place through their strides, not copied, and the backward pass writes their
    gradients into one tensor shaped like qkv. Arguments and return values are those of flash_attn_func.
    """
    _check_packed("qkv", qkv, ("batch", "seqlen", "3", "nheads", "headdim"))
    return _attention(
        qkv,
        None,
        None,
        None,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """flash_attn_func with k and v stacked in one tensor: kv (batch_size, seqlen_k, 2, nheads_k, headdim).

    k and v are read in place through their strides, and the backward pass writes their gradients into one
    tensor shaped like kv. Arguments and return values are those of flash_attn_func.
    """
    _check_packed("kv", kv, ("batch", "seqlen_k", "2", "nheads_k", "headdim"))
    return _attention(
        q,
        kv,
        None,
        None,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """flash_attn_func for a batch of sequences of different lengths, packed one after another without
    padding (cuteflash.bert_padding.unpad_input makes such a batch from a padded one).

    Sequence b has the rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of
    k and v; it attends to its own keys only. causal aligns each sequence's mask to the bottom-right corner of
    its own (seqlen_q, seqlen_k) score matrix, as flash_attn_func does for the whole batch. Sequences may be
    empty; a query that sees no key gets an output of zeros.

    Arguments:
        q: (total_q, nheads, headdim), float16 or bfloat16, on a CUDA GPU.
        k: (total_k, nheads_k, headdim), same dtype and device; nheads a multiple of nheads_k (MQA/GQA).
        v: (total_k, nheads_k, headdim).
        cu_seqlens_q: (batch_size + 1,), torch.int32, on q's device: the sequences' offsets in q, from 0.
        cu_seqlens_k: (batch_size + 1,), torch.int32: their offsets in k and v.
        max_seqlen_q: int. The longest sequence of q, as the caller knows it (no synchronisation with the
            GPU reads it from the offsets). It sizes the launch only: a longer sequence is still computed
            whole, more slowly; a bound far above the longest launches idle thread blocks.
        max_seqlen_k: int. The same for k and v.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic: as flash_attn_func.
        return_attn_probs: bool. Also return the log-sum-exp and, with dropout, the attention probabilities
            with the dropout mask (for testing: it reads cu_seqlens on the host).
        block_table: paged key/value caches; not implemented yet, only None is accepted.
    Return:
        out: (total_q, nheads, headdim). Rows of q outside every sequence are left undefined.
        softmax_lse [if return_attn_probs]: (nheads, total_q), float32.
        S_dmask [if return_attn_probs]: with dropout_p > 0, (batch_size, nheads, max_seqlen_q_rounded,
            max_seqlen_k_rounded), sequence b's probabilities at [b, :, :seqlen_q, :seqlen_k], encoded as
            flash_attn_func's. Without dropout, None.
    """
    if block_table is not None:
        raise NotImplementedError(
            "block_table: a paged key/value cache is not implemented in cuteflash yet; pass None with k and v "
            "holding each sequence's keys and values"
        )
    return _attention(
        q,
        k,
        v,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """flash_attn_varlen_func with q, k and v stacked in one tensor: qkv (total, 3, nheads, headdim), and one
    set of offsets cu_seqlens (batch_size + 1,) and bound max_seqlen for queries and keys.

    q, k and v are read in place, and the backward pass writes their gradients into one tensor shaped like
    qkv. Arguments and return values are those of flash_attn_varlen_func.
    """
    _check_packed("qkv", qkv, ("total", "3", "nheads", "headdim"))
    return _attention(
        qkv,
        None,
        None,
        (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """flash_attn_varlen_func with k and v stacked in one tensor: kv (total_k, 2, nheads_k, headdim).

    k and v are read in place, and the backward pass writes their gradients into one tensor shaped like kv.
    Arguments and return values are those of flash_attn_varlen_func.
    """
    _check_packed("kv", kv, ("total_k", "2", "nheads_k", "headdim"))
    return _attention(
        q,
        kv,
        None,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )

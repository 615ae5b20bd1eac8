"""flash-attn's functions, backed by cuteflash's kernels. Switching is a change of import:

from cuteflash import flash_attn_func   # instead of: from flash_attn import flash_attn_func
"""

from __future__ import annotations

import math
import operator
import threading

import torch
import torch.nn.functional as F

from . import _ops, reference
from .rotary import apply_rotary_emb

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


def _check_scale(softmax_scale) -> float:
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _check_options(q, batch: int, window_size, softcap, alibi_slopes) -> tuple:
    """window_size as two ints (a negative side: unbounded, -1), softcap as a float >= 0, and alibi_slopes
    (fp32, (nheads,) or (batch, nheads), on q's device) checked; returns them as _ops.fwd takes them."""
    try:
        left, right = window_size
        window = (max(operator.index(left), -1), max(operator.index(right), -1))
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}"
        ) from None
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


def _check_qkv(q, k, v, varlen: bool, names=("q", "k", "v"), same_batch: bool = True) -> None:
    """q, k, v (as `names` calls them): tensors of one supported dtype and device, shaped alike; same_batch: k's
    batch is q's."""
    dims = 3 if varlen else 4
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; cuteflash supports torch.float16 and torch.bfloat16: "
                f"convert with {name}.half() or {name}.bfloat16()"
            )
        if t.dim() != dims:
            layout = (
                "(total_seqlen, nheads, headdim) in a variable-length batch"
                if varlen
                else "(batch, seqlen, nheads, headdim)"
            )
            raise ValueError(f"{name} must have {dims} dimensions {layout}, got shape {tuple(t.shape)}")
    qn, kn, vn = names
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{qn}, {kn}, {vn} must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{kn} and {vn} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    nheads, head_dim = q.shape[-2:]
    if not varlen and same_batch and k.shape[0] != q.shape[0]:
        raise ValueError(f"{qn} has batch {q.shape[0]} but {kn} and {vn} have batch {k.shape[0]}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{qn} has head dim {head_dim} but {kn} and {vn} have {k.shape[-1]}; they must match")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported: cuteflash supports head dims 1 to {MAX_HEAD_DIM}")
    nheads_k = k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"{qn} has {nheads} heads, {kn} and {vn} have {nheads_k}: the number of query heads must be a "
            "multiple of the number of key/value heads (MQA/GQA)"
        )
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        name, t = next((name, t) for name, t in zip(names, (q, k, v)) if not t.is_cuda)
        raise ValueError(f"{name} is on {t.device}; cuteflash runs on CUDA GPUs: move it with {name}.cuda()")
    if not (q.get_device() == k.get_device() == v.get_device()):
        raise ValueError(f"{qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")


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


# The plans of calls made (_ops.FwdPlan, or False for a signature that the planned path does not serve), per call
# signature (_plan_key). Emptied when full: a workload repeats few signatures.
_plans: dict = {}
_MAX_PLANS = 1024


def _signature(t) -> tuple | None:
    """What a plan key holds of a tensor argument (None: not given)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _find_plan(key) -> tuple:
    """(key, its plan: an _ops plan, False for a signature that the planned path does not serve, None for one not
    seen yet); (None, None) for no key or one that holds an argument that cannot be hashed."""
    try:
        return key, None if key is None else _plans.get(key)
    except TypeError:
        return None, None


def _keep_plan(key, plan):
    """Keeps plan (or False for None) for key's calls, and returns it."""
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = plan = plan or False
    return plan


def _options_key(softmax_scale, causal, window_size, softcap) -> tuple | None:
    """The part of a plan key (_plan_key, _kvcache_key) that holds the scalar arguments both kinds of call take, with
    their types, and the environment that picks the kernels; None for a window_size that is not a tuple of two."""
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    window_types = (type(window_size[0]), type(window_size[1]))
    scalars = (softmax_scale, type(softmax_scale), bool(causal), window_size, window_types, softcap, type(softcap))
    return scalars + _ops.environment()


def _plan_key(q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs) -> tuple | None:  # fmt: skip
    """The signature of an eager call on separate q, k, v tensors (of a fixed- or variable-length batch) without
    dropout, ALiBi or return_attn_probs, or None for another call. It holds what the checks, the padding and the
    kernel's plan read (shapes, strides, dtypes, devices, the scalar arguments with their types, the environment that
    picks the kernel family; so also what the registry's rule for the family of a call reads, _families.takes), so
    that a call with the key of one that passed them passes them too; the tensors' addresses are checked per call
    (_ops.run_planned). It may hold an argument that cannot be hashed."""
    if (
        alibi_slopes is not None
        or return_attn_probs
        or type(dropout_p) not in (float, int)
        or dropout_p != 0
        or not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor)
        or torch.compiler.is_compiling()
        or (options := _options_key(softmax_scale, causal, window_size, softcap)) is None
    ):
        return None
    key = (_signature(q), _signature(k), _signature(v), bool(deterministic), options)
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        if not (type(cu_q) is torch.Tensor and type(cu_k) is torch.Tensor):
            return None
        key += (_signature(cu_q), _signature(cu_k), max_q, type(max_q), max_k, type(max_k))
    return key


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
    key = _plan_key(
        q, k, v, varlen, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip
    key, plan = _find_plan(key)
    if plan:
        out = _ops.run_planned(plan, q, k, v, *(varlen or ())[:2])
        if out is not None:
            return out
    given_varlen = varlen
    dropout_p = _check_dropout(dropout_p)
    if softmax_scale is not None:
        _check_scale(softmax_scale)
    unpacked = _ops.unpack(q, k, v)
    _check_qkv(*unpacked, varlen is not None)
    varlen = (None, None, 0, 0) if varlen is None else _check_varlen(q, *varlen)
    batch = q.shape[0] if varlen[0] is None else varlen[0].numel() - 1
    options = _check_options(unpacked[0], batch, window_size, softcap, alibi_slopes)
    rng_state = _ops.draw_rng_state(q.device) if dropout_p > 0 else None
    options = _ops.Options(*options, dropout_p, rng_state)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    # The kernels read 16 bytes at a time: pad the head dim with zeros, which add nothing to QK^T
    # and produce zero columns of O that are cut off again.
    pad = -head_dim % _ops.vector_elements(q.dtype)
    if pad:
        q, k, v = (None if t is None else F.pad(t, (0, pad)) for t in (q, k, v))
    if plan is None and key is not None and not pad:  # checked: plan the calls with its signature
        # (a plan passes the offsets as given: they must be contiguous, as the checked ones are)
        if given_varlen is None or all(cu.is_contiguous() for cu in given_varlen[:2]):
            checked_varlen = None if given_varlen is None else _ops.Varlen(*varlen)
            args = (float(softmax_scale), bool(causal), checked_varlen, options, bool(deterministic))
            plan = _ops.plan_forward(q, k, v, *args)
        plan = _keep_plan(key, plan)
        if plan:
            out = _ops.run_planned(plan, q, k, v, *(given_varlen or ())[:2])
            if out is not None:
                return out
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
        block_table: (batch_size, max_num_blocks_per_seq), torch.int32, or None: k and v are then paged caches
            (num_blocks, page_block_size, nheads_k, headdim), as flash_attn_with_kvcache reads them, and sequence
            b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages (more than its pages
            hold raises RuntimeError, as flash_attn_with_kvcache's check). Forward only: with inputs that
            require grad the forward pass runs, and a backward pass through it raises NotImplementedError.
    Return:
        out: (total_q, nheads, headdim). Rows of q outside every sequence are left undefined.
        softmax_lse [if return_attn_probs]: (nheads, total_q), float32.
        S_dmask [if return_attn_probs]: with dropout_p > 0, (batch_size, nheads, max_seqlen_q_rounded,
            max_seqlen_k_rounded), sequence b's probabilities at [b, :, :seqlen_q, :seqlen_k], encoded as
            flash_attn_func's. Without dropout, None.
    """
    if block_table is not None:
        return _cache_varlen(
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
            window_size,
            softcap,
            alibi_slopes,
            return_attn_probs,
            block_table,
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


def _check_int32(name: str, t, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """An optional int32 tensor of the given shape on `device`, made contiguous."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32: convert with {name}.int()")
    if t.dim() != len(shape) or any(want >= 0 and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {tuple(d if d >= 0 else 'any' for d in shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with {name}.to(q.device)")
    return t.contiguous()


def _check_caches(
    q, k_cache, v_cache, batch: int, block_table, names=("q", "k_cache", "v_cache")
) -> torch.Tensor | None:
    """k_cache and v_cache: q's dtype, device and head dim, and where that is a multiple of 16 bytes (the caches are
    then read and written in place, else through padded copies) a layout the kernels take as it is; with block_table
    (returned checked) paged, pages of a multiple of 16 rows."""
    _check_qkv(q, k_cache, v_cache, False, names, same_batch=False)
    vector = _ops.vector_elements(q.dtype)
    for name, t in zip(names[1:], (k_cache, v_cache)):
        # (Under torch.compile the addresses are unknown when tracing: the compiled module checks them at run time.)
        if q.shape[-1] % vector == 0 and not torch.compiler.is_compiling() and not _ops.in_place(t):
            raise ValueError(
                f"{name} must have a contiguous last dimension, 16-byte aligned rows and strides that are "
                f"multiples of {vector} elements (a tensor made with torch.empty / torch.zeros is); got strides "
                f"{t.stride()}"
            )
    if block_table is None:
        return None
    block_table = _check_int32("block_table", block_table, (batch, -1), q.device)
    if k_cache.shape[1] % 16:
        raise ValueError(
            f"the page size of a paged cache (k_cache.shape[1]) must be a multiple of 16, got {k_cache.shape[1]}"
        )
    return block_table


def _table_overflow(needed: int, block_table, page_size: int) -> None:
    """Raises RuntimeError naming block_table where a sequence needs `needed` key rows and its pages hold fewer."""
    capacity = block_table.shape[1] * page_size
    if needed > capacity:
        raise RuntimeError(
            f"block_table addresses {capacity} key rows per sequence ({block_table.shape[1]} pages of {page_size}), "
            f"but a sequence needs {needed} (its cache_seqlens plus the new keys, or its key count): give "
            "block_table more columns (pages) or shorten the sequence"
        )


# A pinned host buffer and an event per (device, dtype, thread), into which _check_table_capacity copies the lengths.
_length_readers: dict = {}


def _check_table_capacity(lengths, block_table, page_size: int, extra: int = 0):
    """Checks that no sequence's keys pass the rows block_table addresses: lengths + extra, lengths an int or an
    integer tensor of each sequence's end row before `extra` new keys. The kernels never read past the table (they
    clamp each sequence to it); this tells the caller that the keys past it were left out.

    An int is checked at once. A CUDA tensor is copied to pinned host memory behind the work already queued; the
    returned callable waits for that copy alone and raises: call it after launching the call's kernels, so that the
    wait overlaps them. Where the copy would break a CUDA-graph capture or a torch.compile trace, nothing is read
    and the clamp stands. Returns None where there is nothing left to check."""
    if not isinstance(lengths, torch.Tensor):
        _table_overflow(lengths + extra, block_table, page_size)
        return None
    count = lengths.numel()
    if count == 0 or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    if lengths.device.type != "cuda":
        _table_overflow(int(lengths.max()) + extra, block_table, page_size)
        return None
    key = (lengths.device.index, lengths.dtype, threading.get_ident())
    reader = _length_readers.get(key)
    if reader is None or reader[0].numel() < count:
        host = torch.empty(max(count, 64), dtype=lengths.dtype, pin_memory=True)
        reader = _length_readers[key] = (host, torch.cuda.Event())
    host, event = reader
    host = host[:count]
    host.copy_(lengths.reshape(-1), non_blocking=True)
    event.record(torch.cuda.current_stream(lengths.device))

    def finish():
        event.synchronize()
        _table_overflow(int(host.max()) + extra, block_table, page_size)

    return finish


def _finish(check) -> None:
    """Runs what _check_table_capacity left to check after the launch."""
    if check is not None:
        check()


class _ForwardOnly(torch.autograd.Function):
    """Attention through a KV cache (a paged one, or one with per-sequence used lengths) for inputs that require
    grad: the forward pass runs as for any input, and a backward pass raises NotImplementedError naming what it
    lacks."""

    @staticmethod
    def forward(ctx, what: str, run, q, k, v):
        ctx.what = what
        out, lse = run(q, k, v)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.what}: the backward pass through a KV cache is not implemented (flash-attn has none either); "
            "detach the inputs, or call flash_attn_varlen_func without it to train"
        )


def _pad_head_dim(t: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    """t with `pad` zero columns appended to its last dim (a copy), or t where pad is 0 or t is None."""
    return t if t is None or not pad else F.pad(t, (0, pad))


def _cache_varlen(
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
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    block_table,
    seqused_k=None,
    leftpad_k=None,
):
    """A variable-length batch's forward pass with keys read as a KV cache: paged (block_table; k and v (num_blocks,
    page_block_size, nheads_k, headdim)), and/or with each sequence's keys narrowed to [leftpad_k[b], seqused_k[b])
    of its own (flash-attn's varlen_fwd: without seqused_k, cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys; a paged
    sequence's rows are those of its pages, unpaged ones start at cu_seqlens_k[b]). Forward only, as in flash-attn:
    inputs that require grad get an output whose backward pass raises."""
    what = "block_table" if block_table is not None else "seqused_k" if seqused_k is not None else "leftpad_k"
    if _check_dropout(dropout_p) > 0:
        raise NotImplementedError(f"dropout_p > 0 with {what} is not implemented; pass dropout_p=0.0")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a (total_q, nheads, headdim) tensor in a variable-length batch")
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = _check_varlen(
        q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    batch = cu_seqlens_q.numel() - 1
    head_dim = q.shape[-1]
    paged = block_table is not None
    table_check = None
    if paged:
        block_table = _check_caches(q.unsqueeze(0), k, v, batch, block_table, ("q", "k", "v"))
    else:
        _check_qkv(q, k, v, True)
    seqused_k = _check_int32("seqused_k", seqused_k, (batch,), q.device)
    leftpad_k = _check_int32("leftpad_k", leftpad_k, (batch,), q.device)
    window_left, window_right, softcap, alibi_slopes = _check_options(q, batch, window_size, softcap, alibi_slopes)
    scale = head_dim**-0.5 if softmax_scale is None else _check_scale(softmax_scale)
    # Each sequence's keys as a cache reads them: rows [leftpad, used) of its pages, or of k from its offset on.
    used = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]) if seqused_k is None else seqused_k
    if paged:
        table_check = _check_table_capacity(used, block_table, k.shape[1])
        cache = _ops.Cache(used.int(), leftpad=leftpad_k, block_table=block_table)
    else:
        start = cu_seqlens_k[:-1]
        leftpad = start if leftpad_k is None else start + leftpad_k
        cache = _ops.Cache((start + used).int(), leftpad=leftpad.int())
    pad = -head_dim % _ops.vector_elements(q.dtype)  # the kernels read 16 bytes at a time: zero columns, cut off
    options = _ops.Options(window_left, window_right, softcap, alibi_slopes)

    def run(q, k, v):
        q, k, v = (_pad_head_dim(t, pad) for t in (q, k, v))
        if not paged:  # one cache batch of every row, read by each sequence (batch stride 0)
            k, v = (_ops._kernel_operand(t).unsqueeze(0).expand(batch, *t.shape) for t in (k, v))
        rows = _ops.cache_rows(k, block_table)
        varlen = _ops.Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, rows)
        out, lse = _ops.fwd_impl(q, k, v, scale, bool(causal), varlen, options, cache)
        return out[..., :head_dim] if pad else out, lse

    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _ForwardOnly.apply(what, run, q, k, v)
    else:
        out, lse = run(q, k, v)
    _finish(table_check)
    return (out, lse, None) if return_attn_probs else out


def _kvcache_key(q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits) -> tuple | None:  # fmt: skip
    """_plan_key for flash_attn_with_kvcache: the signature of an eager call with cache_seqlens a tensor, without
    rotary embeddings or ALiBi, or None for another call."""
    tensors = (q, k_cache, v_cache, cache_seqlens)
    optional = (k, v, cache_batch_idx, cache_leftpad, block_table)
    if (
        rotary_cos is not None
        or alibi_slopes is not None
        or not all(type(t) is torch.Tensor for t in tensors)
        or q.shape[-1] % _ops.vector_elements(q.dtype)
        or not all(t is None or type(t) is torch.Tensor for t in optional)
        or torch.compiler.is_compiling()
        or (options := _options_key(softmax_scale, causal, window_size, softcap)) is None
    ):
        return None
    return ("kvcache", *map(_signature, tensors), *map(_signature, optional), num_splits, type(num_splits), options)


def _kvcache_padded(q, k_cache, v_cache, k, v, softmax_scale, **kwargs):
    """flash_attn_with_kvcache (kwargs: its other arguments) at a head dim that is not a multiple of 8, which the
    kernels cannot read in place: q, the caches and the new keys are copied with zero columns appended, and the
    caches copied back where new keys were appended to them."""
    head_dim = q.shape[-1]
    pad = -head_dim % _ops.vector_elements(q.dtype)
    k_padded, v_padded = _pad_head_dim(k_cache, pad), _pad_head_dim(v_cache, pad)
    result = flash_attn_with_kvcache(
        _pad_head_dim(q, pad), k_padded, v_padded, _pad_head_dim(k, pad), _pad_head_dim(v, pad),
        softmax_scale=head_dim**-0.5 if softmax_scale is None else softmax_scale,  # the unpadded head dim's default
        **kwargs,
    )  # fmt: skip
    if k is not None:
        k_cache.copy_(k_padded[..., :head_dim])
        v_cache.copy_(v_padded[..., :head_dim])
    if isinstance(result, tuple):
        return result[0][..., :head_dim], result[1]
    return result[..., :head_dim]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to a KV cache, for inference: incremental decoding, chunked prefill, speculative decoding.

    When k and v are given they are first written into k_cache and v_cache, *in place*, at rows cache_seqlens[b],
    cache_seqlens[b] + 1, ... of each sequence b, and attended to with the rest of its cache. The caches must be
    large enough: a new row past a sequence's cache is not written (and not attended to).

    With rotary_cos and rotary_sin (needs k and v), the new keys are rotated at positions cache_seqlens[b],
    cache_seqlens[b] + 1, ... before they are written, and so is q where causal or a window is set; otherwise
    every query is rotated at position cache_seqlens[b]. rotary_interleaved=True pairs dimensions (0, 1), (2, 3),
    ... (GPT-J); False pairs i with i + rotary_dim / 2 (GPT-NeoX).

    The masks are flash_attn_func's, with seqlen_k each sequence's number of keys (cache_seqlens[b] + seqlen_new,
    less cache_leftpad[b]): causal aligns the diagonal to the last key. When a handful of query rows share a
    key/value head (seqlen_q x nheads / nheads_k <= 16 at head dims up to 128, <= 8 above, as in decoding), a
    kernel built for reading the cache runs; more rows run the tiled kernels of flash_attn_func.
    Either splits the keys across thread blocks when the batch, heads (and query tiles) alone would leave the GPU
    idle; the splits' results are merged by their log-sum-exp, in a fixed order (the result does not depend on
    timing). Launch shapes depend on sizes only, and no host synchronisation but block_table's check (below): the
    call can be captured in a CUDA graph.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim), float16 or bfloat16; headdim at most 256. A headdim that is
            not a multiple of 8 is zero-padded: the call then copies q and both caches whole into padded temporaries
            (and the caches back, when k and v are appended), which costs about three times the attention's reading
            of a long cache: keep such caches short, or pad the model's head dim once.
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table paged caches
            (num_blocks, page_block_size, nheads_k, headdim) with page_block_size a multiple of 16. Read and
            written in place: last dimension contiguous, 16-byte aligned rows.
        k, v: (batch_size, seqlen_new, nheads_k, headdim) or None: new keys and values to append.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) or None (cuteflash.rotary.apply_rotary_emb's).
        cache_seqlens: int, or (batch_size,) torch.int32: the keys each cache holds before k and v are appended.
            None: the whole cache (seqlen_cache, or the pages of block_table); needed when k and v are given.
        cache_batch_idx: (batch_size,) torch.int32 or None: the cache batch of each sequence (default b). Indices
            out of range are clamped when read and skipped when appending.
        cache_leftpad: (batch_size,) torch.int32 or None: the first cache row of each sequence (default 0).
        block_table: (batch_size, max_num_blocks_per_seq) torch.int32 or None: the pages of each sequence; row r of
            the sequence is row r % page_block_size of page block_table[b, r // page_block_size]. A page index out
            of range reads as zeros and is not written. A sequence whose cache_seqlens[b] + seqlen_new passes the
            rows of its pages (max_num_blocks_per_seq * page_block_size) raises RuntimeError naming block_table, as
            in flash-attn 2.8.4: a cache_seqlens tensor is then copied to the host behind the queued work, and the
            call waits for that copy after launching its kernels (which run on the lengths clamped to the table, so
            the new keys within it are written before the error). While a CUDA graph is captured, or under
            torch.compile, that check is skipped: the kernels never read past the table, and the keys past it are
            neither written nor attended to.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as flash_attn_func.
        num_splits: int. 0 picks the number of key splits from the GPU's SM count; 1 turns splitting off; n > 1
            asks for n (at most 128, and no more than the keys allow).
        return_softmax_lse: bool. Also return the log-sum-exp (batch_size, nheads, seqlen_q), float32.
    Return:
        out: (batch_size, seqlen_q, nheads, headdim), and softmax_lse if return_softmax_lse. No backward pass.
    """
    key = _kvcache_key(
        q, k_cache, v_cache, k, v, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, window_size, softcap, alibi_slopes, num_splits,
    )  # fmt: skip
    key, plan = _find_plan(key)
    given = _ops.Cache(cache_seqlens, 0, cache_leftpad, cache_batch_idx, block_table)
    if plan:
        table_check = None
        if block_table is not None:
            table_check = _check_table_capacity(
                cache_seqlens, block_table, k_cache.shape[1], 0 if k is None else k.shape[1]
            )
        result = _ops.run_planned_kvcache(plan, q, k_cache, v_cache, k, v, given, return_softmax_lse)
        _finish(table_check)
        if result is not None:
            return result if return_softmax_lse else result[0]
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(
            f"q must be a (batch_size, seqlen_q, nheads, headdim) tensor, got "
            f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    batch, seqlen_q = q.shape[:2]
    block_table = _check_caches(q, k_cache, v_cache, batch, block_table)
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(
            f"k_cache has {k_cache.shape[0]} batches for {batch} sequences: pass cache_batch_idx, or caches with a "
            "batch per sequence"
        )
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (new keys and values to append) or neither")
    if k is not None:
        _check_qkv(q, k, v, False, ("q", "k", "v"))
        if k.shape[2] != k_cache.shape[2]:
            raise ValueError(f"k has {k.shape[2]} heads but k_cache has {k_cache.shape[2]}; they must match")
        if cache_seqlens is None:
            raise ValueError("appending k and v needs cache_seqlens: the keys each cache holds before them")
    if q.shape[-1] % _ops.vector_elements(q.dtype):
        return _kvcache_padded(
            q, k_cache, v_cache, k, v, softmax_scale, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            block_table=block_table, causal=causal, window_size=window_size, softcap=softcap,
            rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits,
            return_softmax_lse=return_softmax_lse,
        )  # fmt: skip
    rows = _ops.cache_rows(k_cache, block_table)
    if cache_seqlens is None:
        cache_seqlens = rows
    table_check = None
    if block_table is not None and isinstance(cache_seqlens, (int, torch.Tensor)):
        table_check = _check_table_capacity(
            cache_seqlens, block_table, k_cache.shape[1], 0 if k is None else k.shape[1]
        )
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= rows:
            raise ValueError(f"cache_seqlens must be in [0, {rows}] (the cache's rows), got {cache_seqlens}")
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    cache_seqlens = _check_int32("cache_seqlens", cache_seqlens, (batch,), q.device)
    cache_batch_idx = _check_int32("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    cache_leftpad = _check_int32("cache_leftpad", cache_leftpad, (batch,), q.device)
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx does not apply to a paged cache: block_table names each sequence's pages")
    window_left, window_right, softcap, alibi_slopes = _check_options(q, batch, window_size, softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else _check_scale(softmax_scale)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen for the GPU, 1: no split), got {num_splits!r}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin, or neither")
    if plan is None and key is not None:  # checked: plan the calls with its signature
        # (a plan passes the int32 tensors as given: they must be contiguous, as the checked ones are)
        if all(t is None or t.is_contiguous() for t in given[:1] + given[2:]):
            cache = given._replace(seqlen_new=0 if k is None else k.shape[1])
            options = _ops.Options(window_left, window_right, softcap)
            plan = _ops.plan_kvcache(q, k_cache, v_cache, k, v, cache, float(scale), bool(causal), options, num_splits)
        plan = _keep_plan(key, plan)
        if plan:
            result = _ops.run_planned_kvcache(plan, q, k_cache, v_cache, k, v, given, return_softmax_lse)
            if result is not None:
                _finish(table_check)
                return result if return_softmax_lse else result[0]
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin apply to new keys: pass k and v as well")
        local = tuple(window_size) != (-1, -1)
        if causal or local:
            q = apply_rotary_emb(q, rotary_cos, rotary_sin, rotary_interleaved, seqlen_offsets=cache_seqlens)
        else:  # every query at position cache_seqlens
            q = apply_rotary_emb(
                q.reshape(batch, 1, -1, q.shape[-1]),
                rotary_cos,
                rotary_sin,
                rotary_interleaved,
                seqlen_offsets=cache_seqlens,
            ).view(q.shape)
        k = apply_rotary_emb(k, rotary_cos, rotary_sin, rotary_interleaved, seqlen_offsets=cache_seqlens)
    out, lse = _ops.forward_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        float(scale),
        bool(causal),
        window_left,
        window_right,
        softcap,
        alibi_slopes,
        num_splits,
    )
    _finish(table_check)
    return (out, lse) if return_softmax_lse else out

"""Plain PyTorch attention with cuteflash's semantics, for tests and the benchmark's checks.

It materialises the (seqlen_q, seqlen_k) score matrix: O(N^2) memory, for reference only.
"""

from __future__ import annotations

import torch


def window_mask(seqlen_q: int, seqlen_k: int, window_size, causal: bool = False, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where masked: query i sees key j when
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (a negative side: unbounded;
    causal: right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    masked = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        masked |= j < i - left
    if right >= 0:
        masked |= j > i + right
    return masked


def scores_ref(
    q,
    k,
    softmax_scale=None,
    causal=False,
    compute_dtype=torch.float64,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
):
    """The scores the softmax sees, (b, h, s_q, s_k) in ``compute_dtype``: q (b, s_q, h, d) and k (b, s_k, h_k, d)
    as attention_ref takes them; scores = QK^T * softmax_scale, then softcap * tanh(scores / softcap), then the
    ALiBi bias -slope * |i + s_k - s_q - j|, then -inf where the mask (causal, window_size) hides a key."""
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    q, k = (t.to(compute_dtype) for t in (q, k))
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype)
        slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(slopes.shape[0], -1, 1, 1)
        i = torch.arange(seqlen_q, device=q.device).unsqueeze(1) + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=q.device).unsqueeze(0)
        scores = scores - slopes * (i - j).abs().to(compute_dtype)
    if causal or tuple(window_size) != (-1, -1):
        mask = window_mask(seqlen_q, seqlen_k, window_size, causal, q.device)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def attention_ref(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    compute_dtype=torch.float64,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    dropout_mask=None,
):
    """Attention in flash-attn's layout, computed in ``compute_dtype``.

    q (b, s_q, h, d), k and v (b, s_k, h_k, d) with h a multiple of h_k. Returns (out, lse): out in
    ``compute_dtype`` (b, s_q, h, d) and the log-sum-exp (b, h, s_q) in float32 or float64. A query that
    sees no key gets out = 0 and lse = +inf, as the kernels. ``compute_dtype=q.dtype`` gives PyTorch's
    own error in that dtype, the yardstick of the tests. window_size, softcap and alibi_slopes ((h,) or
    (b, h)) as flash_attn_func (scores_ref). dropout_mask (bool, (b, h, s_q, s_k) or larger, True where kept,
    as read back with return_attn_probs): the probabilities it drops become 0 and the others are divided by
    1 - dropout_p; lse stays that of all of them.
    """
    scores = scores_ref(q, k, softmax_scale, causal, compute_dtype, window_size, softcap, alibi_slopes)
    v = v.to(compute_dtype)
    groups = q.shape[2] // v.shape[2]
    if groups > 1:
        v = v.repeat_interleave(groups, dim=2)
    lse = torch.logsumexp(scores.float() if compute_dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    empty = torch.isneginf(lse)  # rows with every key masked: softmax gives NaN there
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    if dropout_mask is not None:
        kept = dropout_mask[:, :, : probs.shape[2], : probs.shape[3]]
        probs = probs.masked_fill(~kept, 0.0) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.masked_fill(empty, float("inf"))

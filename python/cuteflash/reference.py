"""Plain PyTorch attention with cuteflash's semantics, for tests and the benchmark's checks.

It materialises the (seqlen_q, seqlen_k) score matrix: O(N^2) memory, for reference only.
"""

from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool, True where masked: key j is hidden from query i when j > i + seqlen_k - seqlen_q."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j > i + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, softmax_scale=None, causal=False, compute_dtype=torch.float64):
    """Attention in flash-attn's layout, computed in ``compute_dtype``.

    q (b, s_q, h, d), k and v (b, s_k, h_k, d) with h a multiple of h_k. Returns (out, lse): out in
    ``compute_dtype`` (b, s_q, h, d) and the log-sum-exp (b, h, s_q) in float32 or float64. A query that
    sees no key gets out = 0 and lse = +inf, as the kernels. ``compute_dtype=q.dtype`` gives PyTorch's
    own error in that dtype, the yardstick of the tests.
    """
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(scores.float() if compute_dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    empty = torch.isneginf(lse)  # rows with every key masked: softmax gives NaN there
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.masked_fill(empty, float("inf"))

"""Rotary position embeddings (RoPE) with flash-attn's `apply_rotary_emb` name, signature and semantics. Pure
torch: any device (Volta included), any floating dtype, autograd.

    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=cache_seqlens)

The first rotary_dim = 2 * cos.shape[-1] features of each head are rotated, the rest pass through. Token t of a
sequence (its index inside the sequence, plus the sequence's offset) takes row t of cos and sin; a position past
their last row is left unrotated, as in flash-attn. The rotation is computed in fp32 (float64 stays float64).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_emb"]


def _positions(x: torch.Tensor, seqlen_offsets: int | torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The position of each token of x, shaped like x's leading dims: (batch, seqlen) or (total,)."""
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=x.device).expand(batch, seqlen)
        sequence = torch.arange(batch, device=x.device)[:, None]  # each token's sequence, broadcast
    else:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int64)
        rows = torch.arange(x.shape[0], device=x.device)
        sequence = torch.searchsorted(cu_seqlens[1:], rows, right=True).clamp_(max=cu_seqlens.numel() - 2)
        positions = rows - cu_seqlens[sequence]
    if isinstance(seqlen_offsets, torch.Tensor):
        return positions + seqlen_offsets.to(device=x.device, dtype=torch.int64)[sequence]
    return positions + seqlen_offsets


def _check(x, cos, sin, seqlen_offsets, cu_seqlens) -> None:
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] == 0:
        raise ValueError(
            f"cos and sin must both be (seqlen_rotary, rotary_dim / 2), seqlen_rotary >= 1; got {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    if x.dim() != (3 if cu_seqlens is not None else 4):
        raise ValueError(
            "x must be (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens; got "
            f"{tuple(x.shape)}"
        )
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} exceeds the head dim {x.shape[-1]}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        raise ValueError("cu_seqlens must be (batch + 1,)")
    batch = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.shape != (batch,):
        raise ValueError(f"seqlen_offsets must be an int or ({batch},); got {tuple(seqlen_offsets.shape)}")


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Rotates the first rotary_dim features of each head of x by its position's angles.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (batch + 1,) giving each
    sequence's rows. cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim. interleaved: rotate the
    pairs (0, 1), (2, 3), ... (GPT-J) rather than the halves' pairs (i, i + rotary_dim / 2) (GPT-NeoX).
    seqlen_offsets: an int or a (batch,) tensor added to every position of a sequence (the cached length when
    decoding with a KV cache). inplace: write the result into x and return x. max_seqlen: accepted for
    flash-attn's signature; the positions come from cu_seqlens.
    """
    del max_seqlen  # flash-attn's kernels size their grid with it; here every row is found from cu_seqlens
    _check(x, cos, sin, seqlen_offsets, cu_seqlens)
    half = cos.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    positions = _positions(x, seqlen_offsets, cu_seqlens)
    inside = positions < cos.shape[0]  # past the table: cos 1, sin 0
    rows = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.to(compute)[rows], 1.0).unsqueeze(-2)  # (..., 1, half)
    s = torch.where(inside[..., None], sin.to(compute)[rows], 0.0).unsqueeze(-2)
    rotated = x[..., : 2 * half].to(compute)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = out.to(x.dtype)
    if inplace:
        x[..., : 2 * half] = out
        return x
    return torch.cat((out, x[..., 2 * half :]), dim=-1)

"""Rotary position embeddings (RoPE) with flash-attn's `apply_rotary_emb` name, signature and semantics, autograd
included. fp16, bf16 and fp32 tensors on a CUDA device run a Triton kernel (one pass over x, the backward pass the
conjugate rotation; cuteflash/_triton_norm.py); other dtypes and devices, and cos/sin that want a gradient, run
the same rotation in torch operations.

    q = apply_rotary_emb(q, cos, sin, interleaved=False, seqlen_offsets=cache_seqlens)

The first rotary_dim = 2 * cos.shape[-1] features of each head are rotated, the rest pass through. Token t of a
sequence (its index inside the sequence, plus the sequence's offset) takes row t of cos and sin; a position past
their last row is left unrotated, as in flash-attn. The rotation is computed in fp32 (float64 stays float64).
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "RotaryEmbedding",
    "apply_rotary",
    "apply_rotary_emb",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


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
    if _fused_ok(x, cos, sin, inplace):
        if cu_seqlens is None:  # the kernel finds each token's position from its index
            given = isinstance(seqlen_offsets, torch.Tensor)
            offsets = seqlen_offsets.to(device=x.device).contiguous() if given else None
            where = (None, x.shape[1], offsets, 0 if given else int(seqlen_offsets))
        else:
            where = (_positions(x, seqlen_offsets, cu_seqlens).reshape(-1).contiguous(), 1, None, 0)
        return _Rotate.apply(x, cos, sin, where, interleaved, inplace, False)
    return _composed(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens)


def _composed(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens) -> torch.Tensor:
    """apply_rotary_emb in torch operations: float64, cos and sin that want a gradient, other devices."""
    half = cos.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    positions = _positions(x, seqlen_offsets, cu_seqlens)
    inside = positions < cos.shape[0]  # past the table: cos 1, sin 0
    rows = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.to(compute)[rows], 1.0).unsqueeze(-2)  # (..., 1, half)
    s = torch.where(inside[..., None], sin.to(compute)[rows], 0.0).unsqueeze(-2)
    rotated = x[..., : 2 * half].to(compute, copy=inplace)  # (a copy: x's values are overwritten below)
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


def _fused_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool) -> bool:
    """Whether the Triton kernel takes the call: fp16, bf16 or fp32 on a CUDA device (or the CPU in Triton's
    interpreter), a unit last stride, tokens that one stride steps through (in place: without a copy), and no
    gradient wanted for cos and sin (the kernel gives none; the composition does)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        return False
    if not (x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    if inplace and x.dim() == 4 and x.stride(0) != x.shape[1] * x.stride(1):
        return False
    try:
        from . import _triton_norm  # noqa: F401
    except ImportError:
        return False
    return True


def _rotate(x, cos, sin, where, interleaved: bool, inplace: bool, conjugate: bool) -> torch.Tensor:
    """The Triton kernel's rotation of x (..., nheads, headdim). where: (positions, seqlen, offsets, offset): each
    token's position (a tensor), or None and the tokens' sequence length with the sequences' offsets (a tensor, or
    None and one int for all)."""
    positions, seqlen, offsets, offset = where
    from . import _triton_norm as kernels
    from .layer_norm import _on

    tokens = x.reshape(-1, *x.shape[-2:])  # a view wherever _fused_ok let an in-place call through
    out = tokens if inplace else torch.empty_like(tokens)
    cos, sin = cos.contiguous(), sin.contiguous()
    heads, headdim = tokens.shape[1:]
    half = cos.shape[1]
    block_k = kernels.triton.next_power_of_2(half)
    block_h = min(kernels.triton.next_power_of_2(heads), max(1, 2048 // block_k))
    if tokens.shape[0] and heads:
        with _on(x.device):
            kernels.rotary[(tokens.shape[0], -(-heads // block_h))](
                tokens, out, cos, sin, positions, offsets, tokens.stride(0), tokens.stride(1), out.stride(0),
                out.stride(1), cos.stride(0), heads, headdim, half, cos.shape[0], seqlen, offset,
                GIVEN_POS=positions is not None, HAS_OFFSETS=offsets is not None, INTERLEAVED=interleaved,
                CONJUGATE=conjugate, COPY_TAIL=not inplace and headdim > 2 * half, BLOCK_H=block_h, BLOCK_K=block_k,
                BLOCK_TAIL=kernels.triton.next_power_of_2(max(headdim - 2 * half, 1)), num_warps=4,
            )  # fmt: skip
    return x if inplace else out.view(x.shape)


class _Rotate(torch.autograd.Function):
    """The fused rotation, with its backward pass: the gradient rotated back (the conjugate rotation)."""

    @staticmethod
    def forward(ctx, x, cos, sin, where, interleaved, inplace, conjugate):
        out = _rotate(x, cos, sin, where, interleaved, inplace, conjugate)
        if inplace:
            ctx.mark_dirty(x)
        ctx.cos, ctx.sin, ctx.where = cos, sin, where  # (not saved tensors: none of them is an output or gets a grad)
        ctx.flags = (interleaved, conjugate)
        return out

    @staticmethod
    def backward(ctx, grad):
        interleaved, conjugate = ctx.flags
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return _rotate(grad, ctx.cos, ctx.sin, ctx.where, interleaved, False, not conjugate), *(None,) * 6


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """flash-attn's flash_attn.ops.triton.rotary.apply_rotary: apply_rotary_emb with its arguments in that order,
    and conjugate=True for the inverse rotation (the angles negated: the backward pass of a rotation)."""
    return apply_rotary_emb(
        x, cos, -sin if conjugate else sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen
    )


def _split_qkv(qkv: torch.Tensor, num_heads_q: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of q and k in a packed qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2
    num_heads_k, headdim) with num_heads_q (MQA/GQA)."""
    if qkv.dim() == 5 and qkv.shape[2] == 3 and num_heads_q is None:
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None or (qkv.shape[2] - num_heads_q) % 2 or qkv.shape[2] <= num_heads_q:
        raise ValueError(
            "qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, "
            f"headdim) with num_heads_q; got {tuple(qkv.shape)} and num_heads_q={num_heads_q}"
        )
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]


def apply_rotary_emb_qkv_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cos_k: torch.Tensor | None = None,
    sin_k: torch.Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    num_heads_q: int | None = None,
) -> torch.Tensor:
    """Rotates q and k of a packed qkv in place (flash-attn's function of this name) and returns qkv: (batch,
    seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q. k
    takes cos_k and sin_k where given (xPos), else cos and sin."""
    q, k = _split_qkv(qkv, num_heads_q)
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, True,
                     seqlen_offsets)  # fmt: skip
    return qkv


def apply_rotary_emb_kv_(
    kv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Rotates k of a packed kv (batch, seqlen, 2, nheads_k, headdim) in place and returns kv."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's flash_attn.layers.rotary.RotaryEmbedding: rotates q and k of packed qkv (or q and packed kv) in
    place by position, with a cos/sin table cached up to the longest position seen.

    dim: the rotary dim (the first dim features of each head rotate); base: the angles' base, position t rotating
    pair i by t base^(-2i / dim); interleaved: GPT-J's pairs (0, 1), (2, 3), ... rather than GPT-NeoX's halves;
    scale_base: xPos (Sun et al.): q's rotation is scaled by s_i^((t - seqlen / 2) / scale_base) and k's by its
    inverse, s_i = (2i + 0.4 dim) / (1.4 dim). The table is computed in fp32 and kept in the inputs' dtype, as
    flash-attn keeps it (_cos_cached, _sin_cached, and _cos_k_cached, _sin_k_cached for xPos).
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base=None, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        pairs = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
        scale = (pairs + 0.4 * dim) / (1.4 * dim) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> torch.Tensor:
        return self.base ** -(torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Recomputes the table for positions 0..seqlen-1 where it is shorter, on another device or dtype, or an
        inference tensor while training."""
        cached = self._cos_cached
        if not (
            cached is None
            or seqlen > self._seq_len_cached
            or cached.device != torch.device(device if device is not None else cached.device)
            or cached.dtype != (dtype if dtype is not None else cached.dtype)
            or (self.training and cached.is_inference())
        ):
            return
        self._seq_len_cached = seqlen
        # fp32 angles whatever the module's dtype: positions times frequencies lose most of their bits in bf16
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        power = (torch.arange(seqlen, device=device, dtype=torch.float32) - seqlen // 2) / self.scale_base
        scale = self.scale.to(device) ** power[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(
        self,
        qkv: torch.Tensor,
        kv: torch.Tensor | None = None,
        seqlen_offset: int | torch.Tensor = 0,
        max_seqlen: int | None = None,
        num_heads_q: int | None = None,
    ):
        """qkv: packed (apply_rotary_emb_qkv_'s shapes) where kv is None, else q (batch, seqlen, nheads, headdim)
        and kv (batch, seqlen, 2, nheads_k, headdim). seqlen_offset: an int or a (batch,) tensor added to each
        sequence's positions (the cached length in decoding); with a tensor, pass max_seqlen to size the table.
        Rotates in place; returns qkv, or (q, kv)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k, sin_k = (self._cos_k_cached, self._sin_k_cached) if xpos else (None, None)
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, self._cos_cached, self._sin_cached, cos_k, sin_k, self.interleaved, seqlen_offset, num_heads_q
            )
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        kv = apply_rotary_emb_kv_(
            kv,
            cos_k if xpos else self._cos_cached,
            sin_k if xpos else self._sin_cached,
            self.interleaved,
            seqlen_offset,
        )
        return q, kv

"""flash-attn 2.8's compiled module, flash_attn_2_cuda, on cuteflash: its five entry points with their positional
parameters and return values, for libraries that call them directly (TransformerEngine imports varlen_bwd from it;
xtuner calls flash_attn.flash_attn_interface.flash_attn_gpu.varlen_fwd and varlen_bwd).

Each is a thin layer over the compatibility package's private functions: the same checks, kernels and differences
(docs/compat.md). flash-attn's optional output and gradient buffers (out, dq, dk, dv) are written when given and
allocated when not; the `gen` slot must be None, as in flash-attn 2.8.4.
"""

from __future__ import annotations

import torch

from flash_attn import flash_attn_interface as _fi

__all__ = ["fwd", "varlen_fwd", "bwd", "varlen_bwd", "fwd_kvcache"]


def _no_generator(gen) -> None:
    if gen is not None:
        raise RuntimeError(
            "the `generator` argument is no longer supported (as in flash-attn 2.8.4); pass None: dropout draws from "
            "torch's CUDA generator (torch.manual_seed)"
        )


def _into(given: torch.Tensor | None, result: torch.Tensor, name: str) -> torch.Tensor:
    """result, or `given` with result copied into it where the caller passed a buffer."""
    if given is None:
        return result
    if given.shape != result.shape or given.dtype != result.dtype or given.device != result.device:
        raise ValueError(
            f"{name} must be shaped like the result {tuple(result.shape)}, {result.dtype} on {result.device}; got "
            f"{tuple(given.shape)}, {given.dtype} on {given.device}"
        )
    return given.copy_(result)


def _grads(dq, dk, dv, q, k, v) -> list[torch.Tensor]:
    return [torch.empty_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v))]


def fwd(q, k, v, out_, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, gen_):  # fmt: skip
    """mha_fwd: [out, softmax_lse, S_dmask, rng_state] of q, k, v (batch, seqlen, nheads, headdim)."""
    _no_generator(gen_)
    out, lse, s_dmask, rng_state = _fi._flash_attn_forward(
        q, k, v, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    )  # fmt: skip
    return [_into(out_, out, "out"), lse, s_dmask, rng_state]


def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, gen_, num_splits=0):  # fmt: skip
    """mha_varlen_fwd: [out, softmax_lse, S_dmask, rng_state] of a variable-length batch (total, nheads, headdim),
    or of paged caches with block_table. num_splits (2.8.4's last parameter): 0 or 1."""
    _no_generator(gen_)
    out, lse, s_dmask, rng_state = _fi._flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
        zero_tensors, num_splits,
    )  # fmt: skip
    return [_into(out_, out, "out"), lse, s_dmask, rng_state]


def bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, gen_, rng_state):  # fmt: skip
    """mha_bwd: [dq, dk, dv, softmax_d], the gradients written into dq_, dk_, dv_ where given."""
    _no_generator(gen_)
    grads = _grads(dq_, dk_, dv_, q, k, v)
    softmax_d = _fi._flash_attn_backward(
        dout, q, k, v, out, softmax_lse, *grads, p_dropout, softmax_scale, is_causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip
    return [*grads, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
               max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
               softcap, deterministic, gen_, rng_state):  # fmt: skip
    """mha_varlen_bwd: [dq, dk, dv, softmax_d] of a variable-length batch."""
    _no_generator(gen_)
    grads = _grads(dq_, dk_, dv_, q, k, v)
    softmax_d = _fi._flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, *grads, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout,
        softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        rng_state, zero_tensors,
    )  # fmt: skip
    return [*grads, softmax_d]


def fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_, cache_batch_idx_, leftpad_k_,
                block_table_, alibi_slopes_, out_, softmax_scale, is_causal, window_size_left, window_size_right,
                softcap, is_rotary_interleaved, num_splits):  # fmt: skip
    """mha_fwd_kvcache: [out, softmax_lse] (flash_attn_with_kvcache's, appending k_ and v_ to the caches in place)."""
    out, lse = _fi.flash_attn_with_kvcache(
        q, kcache, vcache, k_, v_, rotary_cos_, rotary_sin_, seqlens_k_, cache_batch_idx_, leftpad_k_, block_table_,
        softmax_scale, is_causal, (window_size_left, window_size_right), softcap, is_rotary_interleaved,
        alibi_slopes_, num_splits, return_softmax_lse=True,
    )  # fmt: skip
    return [_into(out_, out, "out"), lse]

"""FlashAttention-3's interface (hopper/flash_attn_interface.py: its functions, their signatures and argument order,
and the torch.ops.flash_attn_3 custom ops) on cuteflash's kernels, so that code written for FA3 (transformers'
flash_attention_3, diffusers' _flash_3 backend) runs on every GPU cuteflash serves: Volta, Turing and Ampere too,
which FA3 never did, in fp16 there (bf16 from sm80).

What FA3 has and cuteflash's kernels do not yet raises NotImplementedError naming the argument: qv, the FP8
descales (q_descale, k_descale, v_descale), seqused_q, and in flash_attn_with_kvcache cu_seqlens_q,
cu_seqlens_k_new, max_seqlen_q and rotary_seqlens. num_splits (beyond the KV cache, where cuteflash splits too),
pack_gqa and sm_margin tune FA3's scheduling and are accepted and ignored. scheduler_metadata is accepted and
ignored (get_scheduler_metadata returns an empty tensor).

attention_chunk (Llama 4's chunked attention: query i sees key j only where both lie in the same chunk of
attention_chunk positions, on top of the causal mask or window) regroups each sequence into one sequence per chunk,
so that the variable-length kernels do it exactly: the chunk's queries, attending to the chunk's keys with the
mask aligned as in the whole sequence. A KV-cache call takes it for one query per sequence (decoding), as a left
pad at the start of the query's chunk.

Return values follow FA3's current hopper/ code: flash_attn_func and flash_attn_varlen_func return out, or
(out, softmax_lse) with return_attn_probs=True (FA3 before its 2025 interface change returned (out, softmax_lse)
always; callers that index [0] of a tuple work with both); flash_attn_with_kvcache returns out, or
(out, softmax_lse) with return_softmax_lse=True (FA3 appends its split accumulators there).
"""

from __future__ import annotations

import torch

from cuteflash import _ops
from cuteflash import interface as _cuteflash

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]

USE_TRITON_ROCM = False


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def round_up_headdim(head_size: int) -> int:
    """The head dim FA3 compiles a kernel for, at or above head_size."""
    for size in (64, 96, 128, 192):
        if head_size <= size:
            return size
    return 256


def _refuse(**arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(
                f"{name} is not implemented in cuteflash's FA3 interface (no kernel takes it yet: FP8 descales, qv, "
                f"seqused_q; or a KV-cache argument of the op); pass {name}=None"
            )


def _check_chunk(attention_chunk) -> int:
    if not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0 (0: no chunks), got {attention_chunk!r}")
    return attention_chunk


def _chunk_groups(cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, chunk: int):
    """Offsets that cut each sequence of a variable-length batch into one sequence per chunk of keys, computed on
    the GPU: sequence b becomes groups -1, 0, ..., G - 1 (G = ceil(max_seqlen_k / chunk)). Group g >= 0 holds the
    keys of chunk g ([g * chunk, (g + 1) * chunk) of its positions) and the queries at those positions (a query's
    position is its index plus seqlen_k - seqlen_q, the bottom-right alignment); group -1 holds the queries before
    position 0, with no keys. Within a group the bottom-right alignment puts each query at its own position again,
    so the causal mask and windows are those of the whole sequence."""
    groups = -(-max_seqlen_k // chunk)
    starts = torch.arange(groups, device=cu_seqlens_q.device, dtype=torch.int64) * chunk
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    q_len, k_len = (cu_q[1:] - cu_q[:-1])[:, None], (cu_k[1:] - cu_k[:-1])[:, None]
    first_key = torch.minimum(starts[None], k_len)
    first_query = torch.minimum((starts[None] - (k_len - q_len)).clamp(min=0), q_len)
    zero = torch.zeros_like(q_len)
    q_at = (torch.cat((zero, first_query), 1) + cu_q[:-1, None]).reshape(-1)
    k_at = (torch.cat((zero, first_key), 1) + cu_k[:-1, None]).reshape(-1)
    return torch.cat((q_at, cu_q[-1:])).int(), torch.cat((k_at, cu_k[-1:])).int()


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
            window_size, attention_chunk, softcap, deterministic):  # fmt: skip
    """out and softmax_lse (nheads, total_q) of a variable-length batch, chunked or not."""
    window_size = tuple(window_size)
    if seqused_k is not None:
        if attention_chunk:
            raise NotImplementedError("attention_chunk with seqused_k is not implemented; pass one of them")
        out, lse, _ = _cuteflash._cache_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, causal,
            window_size, softcap, None, True, None, seqused_k=seqused_k,
        )  # fmt: skip
        return out, lse
    if attention_chunk:
        if not isinstance(cu_seqlens_q, torch.Tensor) or not isinstance(cu_seqlens_k, torch.Tensor):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be int32 tensors")
        cu_seqlens_q, cu_seqlens_k = _chunk_groups(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_k), attention_chunk)
        max_seqlen_k = min(int(max_seqlen_k), attention_chunk)
    out, lse, _ = _cuteflash.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, causal, window_size,
        softcap, None, deterministic, True,
    )  # fmt: skip
    return out, lse


def _fixed(q, k, v, softmax_scale, causal, window_size, attention_chunk, softcap, deterministic):
    """out and softmax_lse (batch, nheads, seqlen_q) of a fixed-length batch; chunked through _varlen."""
    if not attention_chunk:
        out, lse, _ = _cuteflash.flash_attn_func(
            q, k, v, 0.0, softmax_scale, causal, tuple(window_size), softcap, None, deterministic, True
        )
        return out, lse
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (batch_size, seqlen, nheads, headdim) tensor")
    batch, seqlen_q, nheads = q.shape[:3]
    seqlen_k = k.shape[1]
    if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k and v must have the same batch size (and k, v the same seqlen): {q.shape}, {k.shape}")
    rows = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    out, lse = _varlen(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), rows * seqlen_q,
        rows * seqlen_k, seqlen_q, seqlen_k, None, softmax_scale, causal, window_size, attention_chunk, softcap,
        deterministic,
    )  # fmt: skip
    return out.view(q.shape), lse.view(nheads, batch, seqlen_q).transpose(0, 1)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):  # fmt: skip
    """flash_attn_func of q, k, v packed in qkv: (batch, seqlen, 3, nheads, headdim), or with num_heads_q
    (batch, seqlen, num_heads_q + 2 * nheads_k, headdim) for MQA/GQA."""
    _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if qkv.dim() == 5:
        q, k, v = qkv.unbind(dim=2)
    else:
        if num_heads_q is None:
            raise ValueError("qkv of 4 dims needs num_heads_q: (batch, seqlen, num_heads_q + 2 * nheads_k, headdim)")
        nheads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, nheads_k, nheads_k], dim=2)
    return flash_attn_func(
        q, k, v, softmax_scale, causal, window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
        deterministic=deterministic, return_attn_probs=return_attn_probs,
    )  # fmt: skip


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):  # fmt: skip
    """Exact attention of q (batch_size, seqlen_q, nheads, headdim) to k, v (batch_size, seqlen_k, nheads_k,
    headdim), FA3's signature: cuteflash.flash_attn_func's arguments (causal aligned bottom-right, window_size,
    softcap, MQA/GQA, deterministic backward), plus attention_chunk (see the module's docstring). Returns out, or
    (out, softmax_lse (batch_size, nheads, seqlen_q)) with return_attn_probs."""
    _refuse(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse = _fixed(
        q, k, v, softmax_scale, causal, window_size, _check_chunk(attention_chunk), softcap, deterministic
    )
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):  # fmt: skip
    """flash_attn_func for sequences packed one after another (q (total_q, nheads, headdim), sequence b at rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1]). seqused_k: (batch,) int32, the keys each sequence uses from the start of
    its cu_seqlens_k slot (forward only: a backward pass through it raises). Returns out, or (out, softmax_lse
    (nheads, total_q)) with return_attn_probs."""
    _refuse(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, seqused_q=seqused_q)
    out, lse = _varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
        window_size, _check_chunk(attention_chunk), softcap, deterministic,
    )  # fmt: skip
    return (out, lse) if return_attn_probs else out


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges attention computed over splits of the keys, FA3's layouts: out_partial (num_splits, batch, seqlen,
    nheads, headdim) and lse_partial (num_splits, batch, seqlen, nheads), fp32, into (out (batch, seqlen, nheads,
    headdim) in out_dtype (default out_partial's), lse (batch, seqlen, nheads)); a split of no keys (lse -inf) adds
    nothing."""
    if out_partial.dim() != 5 or lse_partial.shape != out_partial.shape[:4]:
        raise ValueError(
            "out_partial must be (num_splits, batch, seqlen, nheads, headdim) and lse_partial (num_splits, batch, "
            f"seqlen, nheads); got {tuple(out_partial.shape)} and {tuple(lse_partial.shape)}"
        )
    lse = torch.logsumexp(lse_partial, dim=0)
    weight = torch.exp(lse_partial - lse).nan_to_num_(0.0, 0.0, 0.0)  # (splits, batch, seqlen, nheads)
    merged = torch.einsum("sblh,sblhd->blhd", weight, out_partial.float())
    merged = merged.to(out_dtype or out_partial.dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return merged, lse


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):  # fmt: skip
    """cuteflash.flash_attn_with_kvcache with FA3's signature: page_table is cuteflash's block_table (pages of any
    multiple of 16 rows); appends, rotary embeddings, cache_batch_idx, cache_leftpad, windows, softcap and split
    keys as there. attention_chunk with one query per sequence. Returns out, or (out, softmax_lse) with
    return_softmax_lse. No backward pass."""
    _refuse(
        qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q, rotary_seqlens=rotary_seqlens,
    )  # fmt: skip
    if _check_chunk(attention_chunk):
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
            raise NotImplementedError(
                "attention_chunk in flash_attn_with_kvcache is implemented for one query per sequence (seqlen_q 1); "
                "for more, call flash_attn_varlen_func on the sequence"
            )
        cache_leftpad = _chunk_leftpad(q, k_cache, k, cache_seqlens, cache_leftpad, page_table, attention_chunk)
    result = _cuteflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        softmax_scale, causal, tuple(window_size), softcap, rotary_interleaved, None, num_splits, return_softmax_lse,
    )  # fmt: skip
    return tuple(result) if return_softmax_lse else result


def _chunk_leftpad(q, k_cache, k, cache_seqlens, cache_leftpad, page_table, chunk: int) -> torch.Tensor:
    """The first cache row a decoding query sees under attention_chunk: the start of its position's chunk. Positions
    count from the sequence's first row (cache_leftpad, as in FA3); the query's is that of the last key, at row
    cache_seqlens + seqlen_new - 1."""
    batch = q.shape[0]
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = _ops.cache_rows(k_cache, page_table)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    first = 0 if cache_leftpad is None else cache_leftpad.long()
    position = (cache_seqlens.long() + new - 1 - first).clamp(min=0)
    return (first + position // chunk * chunk).int()


def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    cache_leftpad=None,
    page_size=None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):  # fmt: skip
    """FA3 precomputes its tile scheduler's plan here; cuteflash plans each call itself, so this returns an empty
    int32 tensor on cache_seqlens' device, which flash_attn_with_kvcache accepts as scheduler_metadata."""
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)


# ---- The custom ops (torch.ops.flash_attn_3), with FA3's schemas.


@torch.library.custom_op("flash_attn_3::_flash_attn_forward", mutates_args=(), device_types="cuda")
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    out_: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    page_table: torch.Tensor | None = None,
    kv_batch_idx: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    seqlens_rotary: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA3's forward op: (out, softmax_lse, out_accum, softmax_lse_accum), the accumulators empty (cuteflash merges
    its splits itself). Attention only, fixed-length or variable-length (seqused_k included): the KV-cache arguments
    (k_new, v_new, page_table, kv_batch_idx, leftpad_k, rotary_*) raise NotImplementedError (call
    flash_attn_with_kvcache), and so does out_ (the op allocates its output; FA3's schema declares no mutation)."""
    _refuse(
        out_=out_, qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, seqused_q=seqused_q,
        k_new=k_new, v_new=v_new, page_table=page_table, kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, seqlens_rotary=seqlens_rotary, cu_seqlens_k_new=cu_seqlens_k_new,
    )  # fmt: skip
    window = (window_size_left, window_size_right)
    if cu_seqlens_q is None and (cu_seqlens_k is not None or seqused_k is not None):
        raise NotImplementedError(
            "cu_seqlens_k or seqused_k without cu_seqlens_q is not implemented; pass both offsets (a variable-length "
            "batch) or call flash_attn_with_kvcache"
        )
    with torch.no_grad():
        if cu_seqlens_q is None:
            out, lse = _fixed(q, k, v, softmax_scale, causal, window, _check_chunk(attention_chunk), softcap, False)
        else:
            out, lse = _varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                window, _check_chunk(attention_chunk), softcap, False,
            )  # fmt: skip
    empty = q.new_empty((0,), dtype=torch.float32)
    return out, lse.contiguous(), empty, empty.clone()


@torch.library.register_fake("flash_attn_3::_flash_attn_forward")
def _flash_attn_forward_fake(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                             cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                             max_seqlen_q=None, max_seqlen_k=None, *args, **kwargs):  # fmt: skip
    out = torch.empty_like(q)
    if cu_seqlens_q is None:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    empty = q.new_empty((0,), dtype=torch.float32)
    return out, lse, empty, empty.clone()


@torch.library.custom_op("flash_attn_3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cuda")
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    sequed_q: torch.Tensor | None = None,
    sequed_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    """FA3's backward op: dq, dk, dv written in place; returns softmax_d, D = rowsum(dout * out) (fp32, the
    layout of softmax_lse). Attention without chunks (FA3's backward op takes none)."""
    _refuse(sequed_q=sequed_q, sequed_k=sequed_k)
    varlen = None
    if cu_seqlens_q is not None:
        varlen = _ops.Varlen(*_cuteflash._check_varlen(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    _cuteflash._check_qkv(q, k, v, varlen is not None)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else _cuteflash._check_scale(softmax_scale)
    batch = q.shape[0] if varlen is None else varlen.cu_seqlens_q.numel() - 1
    left, right, softcap, _ = _cuteflash._check_options(q, batch, (window_size_left, window_size_right), softcap, None)
    grads = [torch.empty_like(t) if g is None else g for g, t in ((dq, q), (dk, k), (dv, v))]
    _ops.bwd_into(
        *grads, dout, q, k, v, out, softmax_lse.contiguous(), scale, bool(is_causal), bool(deterministic), varlen,
        _ops.Options(left, right, softcap),
    )  # fmt: skip
    d = (dout.float() * out.float()).sum(-1)  # (batch, seqlen, nheads) or (total, nheads)
    return d.transpose(1, 2).contiguous() if varlen is None else d.t().contiguous()


@torch.library.register_fake("flash_attn_3::_flash_attn_backward")
def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, *args, **kwargs):  # fmt: skip
    return torch.empty_like(softmax_lse)


flash_attn_3_gpu = torch.ops.flash_attn_3

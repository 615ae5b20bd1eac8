"""flash-attn's flash_attn.modules.mha: the attention functions it re-exports (nanotron imports
flash_attn_varlen_kvpacked_func from here) and get_alibi_slopes. Its nn.Module classes (MHA, ParallelMHA,
FlashSelfAttention, ...) are not provided yet: importing them raises ImportError."""

from __future__ import annotations

import math

from flash_attn.flash_attn_interface import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn.utils.distributed import get_dim_for_local_rank

__all__ = [
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "get_alibi_slopes",
    "get_dim_for_local_rank",
]


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's slopes for nheads heads (Press et al.): the geometric sequence 2^(-8 i / n), i = 1..n, for n the
    largest power of two <= nheads, then for the rest the odd terms of the sequence for 2n."""

    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 2 ** math.floor(math.log2(nheads))
    return powers(n) + powers(2 * n)[0::2][: nheads - n]

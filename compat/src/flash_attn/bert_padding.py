"""flash-attn's flash_attn.bert_padding: cuteflash's functions of the same names, pure torch (any device).

flash-attn's module also hands out einops' rearrange and repeat, which consumers import from it (verl, OpenRLHF);
they come from einops on first use, so that this package needs einops only where they are used.
"""

from cuteflash.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)

__all__ = [
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def __getattr__(name: str):
    if name in ("rearrange", "repeat"):
        try:
            import einops
        except ImportError:
            raise ImportError(
                f"flash_attn.bert_padding.{name} is einops.{name}, as in flash-attn: pip install einops"
            ) from None
        return getattr(einops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

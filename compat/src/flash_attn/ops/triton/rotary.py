"""flash-attn's flash_attn.ops.triton.rotary.apply_rotary (ModernBERT's unpadded rotary calls it, in place, with
conjugate=True for its backward pass): cuteflash.rotary's, in plain torch."""

from cuteflash.rotary import apply_rotary

__all__ = ["apply_rotary"]

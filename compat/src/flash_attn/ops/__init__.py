"""flash-attn's flash_attn.ops: the rotary op (flash_attn.ops.triton.rotary)."""

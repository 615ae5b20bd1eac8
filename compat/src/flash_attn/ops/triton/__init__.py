"""flash-attn's flash_attn.ops.triton: rotary's apply_rotary (plain torch here)."""

"""flash-attn's flash_attn.ops.triton: rotary's apply_rotary, the fused LayerNorm / RMSNorm, cross-entropy."""

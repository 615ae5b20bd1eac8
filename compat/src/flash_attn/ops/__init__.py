"""flash-attn's flash_attn.ops: the Triton ops (flash_attn.ops.triton: rotary, layer_norm, cross_entropy)."""

"""flash-attn's flash_attn.losses: the cross-entropy loss module."""

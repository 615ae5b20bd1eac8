"""flash-attn's flash_attn.layers.rotary: cuteflash.rotary's functions and RotaryEmbedding module, in plain torch,
so that they run on every GPU (flash-attn's are Triton kernels): apply_rotary_emb (and its alias
apply_rotary_emb_func), apply_rotary_emb_qkv_ and apply_rotary_emb_kv_ (in place), RotaryEmbedding (ModernBERT,
mamba's mha, nanotron subclass or call it)."""

from cuteflash.rotary import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_

apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias of the same function

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]

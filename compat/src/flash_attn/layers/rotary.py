"""flash-attn's flash_attn.layers.rotary.apply_rotary_emb: cuteflash's, in plain torch, so it runs on every GPU
(flash-attn's is a Triton kernel). flash-attn's RotaryEmbedding module and its in-place qkv/kv variants are not
provided: importing them fails."""

from cuteflash.rotary import apply_rotary_emb

apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias of the same function

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]

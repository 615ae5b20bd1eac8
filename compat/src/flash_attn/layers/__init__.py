"""flash-attn's flash_attn.layers: only the rotary embedding's function (layers.rotary)."""

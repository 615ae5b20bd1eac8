"""flash-attn's flash_attn.bert_padding: cuteflash's functions of the same names, pure torch (any device)."""

from cuteflash.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]

"""flash-attn's flash_attn.modules: the names of flash_attn.modules.mha that consumers import (nanotron)."""

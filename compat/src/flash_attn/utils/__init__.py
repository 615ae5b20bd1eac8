"""flash-attn's flash_attn.utils: the distributed helpers that consumers import (flash_attn.utils.distributed)."""

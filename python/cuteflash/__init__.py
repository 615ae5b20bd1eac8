"""cuteflash: FlashAttention for NVIDIA GPUs from Volta to Hopper, a drop-in for flash_attn's functions."""

from ._lib import build_info
from .interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "build_info", "__version__"]

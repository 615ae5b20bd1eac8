"""FlashAttention-3's package flash_attn_3, on cuteflash's kernels: its interface is the top-level module
flash_attn_interface (also flash_attn_3.flash_attn_interface); importing it registers the torch.ops.flash_attn_3
custom ops."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flash_attn_3")
except PackageNotFoundError:  # a source tree on sys.path
    __version__ = "3.0.0"

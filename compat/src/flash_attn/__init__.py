"""flash-attn 2.8's Python API on cuteflash's kernels, so that code written for flash-attn (transformers'
"flash_attention_2", TRL's padding-free training, ring-flash-attn) runs on GPUs from Volta to Hopper.

The public functions are cuteflash's own; flash_attn.flash_attn_interface adds flash-attn's private functions and
custom ops (torch.ops.flash_attn.*). Importing this package does not initialise CUDA.
"""

from pkgutil import extend_path

from cuteflash import __version__ as _cuteflash_version

from ._version import compat_version
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# Other distributions may add subpackages to flash_attn (flash-attn-4's flash_attn.cute), as flash-attn allows.
__path__ = extend_path(__path__, __name__)

__version__ = compat_version(_cuteflash_version)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "__version__",
]

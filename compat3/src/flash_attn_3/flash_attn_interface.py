"""flash_attn_3.flash_attn_interface: the top-level flash_attn_interface's names, as FA3's package re-exports them."""

import flash_attn_interface as _interface
from flash_attn_interface import *  # noqa: F403

_flash_attn_forward = _interface._flash_attn_forward
_flash_attn_backward = _interface._flash_attn_backward

"""flash-attn's flash_attn.ops.triton.cross_entropy: cross_entropy_loss, cuteflash.cross_entropy's Triton
kernels."""

from cuteflash.cross_entropy import CrossEntropyLossFn as CrossEntropyLoss
from cuteflash.cross_entropy import cross_entropy_loss

__all__ = ["CrossEntropyLoss", "cross_entropy_loss"]

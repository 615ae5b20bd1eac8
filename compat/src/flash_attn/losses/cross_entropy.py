"""flash-attn's flash_attn.losses.cross_entropy: the CrossEntropyLoss module (reductions, z-loss, a vocabulary
split over a process group), on cuteflash.cross_entropy."""

from cuteflash.cross_entropy import CrossEntropyLoss

__all__ = ["CrossEntropyLoss"]

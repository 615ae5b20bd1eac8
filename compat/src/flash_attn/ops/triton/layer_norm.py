"""flash-attn's flash_attn.ops.triton.layer_norm: the fused residual add + LayerNorm / RMSNorm functions and
modules, cuteflash.layer_norm's Triton kernels."""

from cuteflash.layer_norm import (
    LayerNorm,
    LayerNormFn,
    RMSNorm,
    layer_norm_fn,
    layer_norm_ref,
    rms_norm_fn,
    rms_norm_ref,
)

__all__ = ["LayerNorm", "LayerNormFn", "RMSNorm", "layer_norm_fn", "layer_norm_ref", "rms_norm_fn", "rms_norm_ref"]

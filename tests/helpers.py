"""Shared checks for the GPU tests: the 2x-PyTorch error rule and poisoned allocations."""

import pytest
import torch

from cuteflash.reference import attention_ref


def require_support(dtype=None, backward=False) -> None:
    """Skip, with the reason, what the kernel family serving this GPU does not do (bf16 and the
    backward pass on sm70, e.g. under CUTEFLASH_BACKEND=sm70)."""
    from cuteflash._lib import build_info, select_family

    family = select_family(torch.device("cuda"))
    entry = build_info()["families"][family]
    if dtype == torch.bfloat16 and "bfloat16" not in entry["dtypes"]:
        pytest.skip(f"the {family} family has no bf16 kernels")
    if backward and "bwd" not in entry["directions"]:
        pytest.skip(f"the {family} family has no backward kernels yet")


def require_head_dim(head_dim: int) -> None:
    """Skip a kernel head dim that this build did not compile for the family serving this GPU."""
    from cuteflash._lib import build_info, kernel_head_dim, select_family

    family = select_family(torch.device("cuda"))
    if kernel_head_dim(head_dim) not in build_info()["families"][family]["head_dims"]:
        pytest.skip(f"this build has no {family} kernel for head dim {head_dim}")


def poison_cache(*like: torch.Tensor) -> None:
    """Fill memory of the caching allocator with NaN, so that outputs allocated next start as NaN and an
    element the kernel forgets to write fails the finiteness check."""
    blocks = [torch.full_like(t, float("nan")) for t in like]
    del blocks


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item() if x.numel() else 0.0


def assert_close_2x(name: str, out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor) -> None:
    """out's max error against the float64 reference is at most 2x PyTorch's (same dtype) + 1e-5."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), finite), f"{name}: non-finite values where the reference has none"
    err, pt_err = max_err(out[finite], ref[finite]), max_err(pt[finite], ref[finite])
    assert err <= 2 * pt_err + 1e-5, f"{name}: max error {err:.3e} > 2 x PyTorch's {pt_err:.3e} + 1e-5"


def references(q, k, v, causal, softmax_scale=None):
    """(float64 reference, PyTorch in the input dtype), each as (out, lse)."""
    ref = attention_ref(q, k, v, softmax_scale, causal, compute_dtype=torch.float64)
    pt = attention_ref(q, k, v, softmax_scale, causal, compute_dtype=q.dtype)
    return ref, pt

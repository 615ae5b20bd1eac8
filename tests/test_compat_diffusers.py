"""diffusers' attention dispatcher (models/attention_dispatch.py) on the compatibility packages: its flash,
flash_varlen and _flash_3 backends and the context-parallel forward and backward ops (which call flash-attn's
_wrapped_* ops positionally, with dropout_p=1e-30 to get the log-sum-exp), forward and backward, against the float64
reference with the 2x rule. diffusers decides at import which backends it can use, from the installed distributions
(flash-attn >= 2.6.3, flash_attn_3)."""

from __future__ import annotations

import pytest
import torch

from cuteflash.reference import attention_ref

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dispatch(flash_attn_compat):
    module = pytest.importorskip("diffusers.models.attention_dispatch")
    if not module._CAN_USE_FLASH_ATTN:
        pytest.skip("diffusers does not see the flash-attn distribution (pip install ./compat)")
    return module


def _inputs(dtype, seqlen_q=96, seqlen_k=96):
    """q, k, v in diffusers' layout (batch, seqlen, heads, head dim), leaves that require grad."""
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 1000 + seqlen_k)
    shapes = ((2, seqlen_q, 4, 64), (2, seqlen_k, 4, 64), (2, seqlen_k, 4, 64))
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_() for s in shapes]


def _check(name, out, q, k, v, causal, assert_close_2x, keys=None, backward=True):
    """out (and its gradients) against attention_ref on the same inputs (keys: each batch's key count)."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout) if backward else None
    for b in range(q.shape[0]):
        n = k.shape[1] if keys is None else keys[b]
        inputs = (q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n])
        results = []
        for compute in (torch.float64, q.dtype):
            ref, _ = attention_ref(*inputs, causal=causal, compute_dtype=compute)
            results.append((ref, torch.autograd.grad(ref, inputs, dout[b : b + 1].to(compute))))
        (ref, ref_grads), (pt, pt_grads) = results
        assert_close_2x(f"{name} out[{b}]", out[b : b + 1], ref, pt)
        if not backward:
            continue
        mine = (grads[0][b : b + 1], grads[1][b : b + 1, :n], grads[2][b : b + 1, :n])
        for what, g, r, p in zip(("dq", "dk", "dv"), mine, ref_grads, pt_grads):
            assert_close_2x(f"{name} {what}[{b}]", g, r, p)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["flash", "_flash_3"])
def test_backend(dispatch, backend, dtype, causal, require_support, assert_close_2x):
    require_support(dtype, backward=True)
    if backend == "_flash_3" and not dispatch._CAN_USE_FLASH_ATTN_3:
        pytest.skip("diffusers does not see the flash_attn_3 distribution (pip install ./compat3)")
    q, k, v = _inputs(dtype)
    # diffusers wraps FA3's function in a custom op of its own without an autograd formula: _flash_3 is forward-only
    backward = backend != "_flash_3"
    with torch.set_grad_enabled(backward):
        out = dispatch.dispatch_attention_fn(q, k, v, is_causal=causal, backend=backend)
    _check(backend, out, q, k, v, causal, assert_close_2x, backward=backward)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flash_varlen_with_a_key_mask(dispatch, dtype, require_support, assert_close_2x):
    """flash_varlen packs each batch's keys under a (batch, seqlen_k) mask of valid keys."""
    require_support(dtype, backward=True)
    q, k, v = _inputs(dtype, 80, 120)
    keys = [120, 57]
    mask = torch.arange(120, device="cuda")[None, :] < torch.tensor(keys, device="cuda")[:, None]
    out = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend="flash_varlen")
    _check("flash_varlen", out, q, k, v, False, assert_close_2x, keys=keys)


class _Ctx:
    """What diffusers' forward and backward ops use of an autograd context."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_context_parallel_ops_with_keep_all_dropout(dispatch, dtype, require_support, assert_close_2x):
    """The ops diffusers' context parallelism drives: _wrapped_flash_attn_forward with dropout_p=1e-30 (inputs that
    require grad), its lse in (batch, seqlen, heads), and _wrapped_flash_attn_backward from what it saved."""
    require_support(dtype, backward=True)
    q, k, v = _inputs(dtype)
    ctx = _Ctx()
    out, lse = dispatch._flash_attention_forward_op(ctx, q, k, v, is_causal=True, return_lse=True)
    assert ctx.dropout_p == 1e-30 and lse.shape == (2, 96, 4)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    pt_out, pt_lse = attention_ref(q, k, v, causal=True, compute_dtype=dtype)
    assert_close_2x("out", out, ref_out, pt_out)
    assert_close_2x("lse", lse, ref_lse.permute(0, 2, 1), pt_lse.permute(0, 2, 1))
    dout = torch.randn_like(out)
    grads = dispatch._flash_attention_backward_op(ctx, dout)[:3]
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    pt_grads = torch.autograd.grad(pt_out, (q, k, v), dout)
    for what, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert_close_2x(what, g, r, p)

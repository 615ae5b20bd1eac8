"""The sm70 family's error-corrected fp16: what it buys against plain fp16 on a stress case, measured
against float64. Runs where the sm70 family serves the GPU (a V100, or CUTEFLASH_BACKEND=sm70 with
the family compiled for the test GPU)."""

import pytest
import torch

from cuteflash import flash_attn_func, flash_attn_with_kvcache
from cuteflash._lib import select_family
from cuteflash._ops import SM70_CORRECTION_ENV
from cuteflash.reference import attention_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_sm70():
    if select_family(torch.device("cuda")) != "sm70":
        pytest.skip("the sm70 family does not serve this GPU (force it with CUTEFLASH_BACKEND=sm70)")


def stress_case(seqlen, head_dim, logit_scale, dout_scale, seed=0):
    """Long rows, a peaked softmax (q and k scaled up) and a small upstream gradient: P and dS span many
    binades, and dS is far below fp16's normal range unless scaled."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, seqlen, 1, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
    dout = torch.randn(shape, device="cuda", generator=g) * dout_scale
    return [t.half() for t in (q * logit_scale, k * logit_scale, v, dout)]


def cuteflash_grads(q, k, v, dout, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves, causal=causal).backward(dout)
    return [t.grad for t in leaves]


def rounding_floor(ref: torch.Tensor) -> float:
    """One unit in the last place of fp16 at the largest |ref|: rounding to fp16 alone can put an
    output that far from the exact result (half of it, plus the kernel's tiny fp32 error)."""
    _, exponent = torch.frexp(ref.abs().max())  # max = m 2^e, m in [0.5, 1): fp16 spacing 2^(e - 11)
    return 2.0 ** (max(exponent.item(), -13) - 11)


@pytest.mark.parametrize("seqlen,logit_scale,dout_scale", [(8192, 1.5, 1e-3), (16384, 1.0, 1e-4)])
def test_backward_correction_halves_the_error(seqlen, logit_scale, dout_scale, monkeypatch, reference_grads, max_err):
    q, k, v, dout = stress_case(seqlen, 64, logit_scale, dout_scale)
    ref = reference_grads(q, k, v, dout, True, torch.float64)
    pt = reference_grads(q, k, v, dout, True, torch.float16)
    corrected = cuteflash_grads(q, k, v, dout, True)
    monkeypatch.setenv(SM70_CORRECTION_ENV, "0")
    plain = cuteflash_grads(q, k, v, dout, True)
    errs = {}
    for name, c, u, r, p in zip(("dq", "dk", "dv"), corrected, plain, ref, pt):
        errs[name] = (max_err(c, r), max_err(u, r), max_err(p, r), rounding_floor(r))
    print(
        f"\nseqlen {seqlen}, logits x{logit_scale}, dout x{dout_scale}: "
        + "; ".join(
            f"{n}: corrected {c:.3e}, plain fp16 {u:.3e}, PyTorch fp16 {p:.3e}, fp16 rounding {f:.3e}"
            for n, (c, u, p, f) in errs.items()
        )
    )
    for name, (err_c, err_u, err_pt, floor) in errs.items():
        assert err_c <= 2 * err_pt + 1e-5, name
        # Half the plain kernel's error, unless both are within the rounding of the output to fp16 (dv
        # here: P is error-corrected, but the fp16 output's own rounding dominates both kernels' error).
        assert err_c <= max(0.5 * err_u, floor), name


def collapsing_case(kind):
    """Inputs whose dS shrinks by many binades from one block of the backward to the next.
    "dout": dO shrinks 2^-4 every 32 query rows under a peaked softmax. "probs": queries alternate, 32
    rows at a time, between two directions that favour one of two key blocks each by about 65 nats, so a
    key block's P drops to about 2^-94 from one query block to the next (and a query block's from one
    key block to the next)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (2, 512, 2, 64) if kind == "dout" else (1, 256, 1, 64)
    q, k, v, dout = (torch.randn(shape, device="cuda", generator=g) for _ in range(4))
    rows = torch.arange(shape[1], device="cuda").view(1, -1, 1, 1)
    if kind == "dout":
        return [t.half() for t in (3 * q, 3 * k, v, dout * torch.exp2(-4.0 * (rows // 32)))]
    e0 = torch.zeros(shape[-1], device="cuda")
    e0[0] = 16.0
    q = 0.5 * q + torch.where((rows // 32) % 2 == 0, 1.0, -1.0) * e0
    k = 0.5 * k + torch.where((rows // 64) % 2 == 0, 1.0, -1.0) * e0
    return [t.half() for t in (q, k, v, dout)]


@pytest.mark.parametrize("kind", ["dout", "probs"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_gradients_collapsing_between_blocks(kind, deterministic, reference_grads, assert_close_2x):
    """The backward keeps dK (and the deterministic dQ) in units of dS's scale, raised when a step's dS
    is much smaller than the previous ones': it must stay exact and finite, also where the raise is
    capped (the sums would near fp32's range)."""
    q, k, v, dout = collapsing_case(kind)
    ref = reference_grads(q, k, v, dout, False, torch.float64)
    pt = reference_grads(q, k, v, dout, False, torch.float16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves, deterministic=deterministic).backward(dout)
    for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, ref, pt):
        assert torch.isfinite(leaf.grad).all(), name
        assert_close_2x(name, leaf.grad, r, p)


def test_forward_correction_is_not_worse(monkeypatch, max_err):
    q, k, v, _ = stress_case(16384, 128, 0.25, 1.0)  # near-uniform rows: P ~ 1/seqlen
    out_ref, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    out_pt, _ = attention_ref(q, k, v, causal=True, compute_dtype=torch.float16)
    corrected = flash_attn_func(q, k, v, causal=True)
    monkeypatch.setenv(SM70_CORRECTION_ENV, "0")
    plain = flash_attn_func(q, k, v, causal=True)
    err_c, err_u, err_pt = max_err(corrected, out_ref), max_err(plain, out_ref), max_err(out_pt, out_ref)
    print(
        f"\nforward, seqlen 16384, near-uniform: corrected {err_c:.3e}, plain fp16 {err_u:.3e}, "
        f"PyTorch fp16 {err_pt:.3e}"
    )
    assert err_c <= 2 * err_pt + 1e-5
    assert err_c <= err_u


def test_decoding_correction_removes_the_bias(monkeypatch, max_err):
    """The decoding kernel's tensor-core path (16 query rows of one head) corrects P as the tiled kernels do. One key
    in 16 scores higher than the others (so each warp's running max, over 16 keys at a time, is the row's), and the
    other keys share one P per row (0.52-0.95, not exact in fp16); V is about 1.5. Plain fp16 P moves each row's O
    by P's rounding error, on top of O's own rounding; corrected P does not."""
    from cuteflash._lib import compiled_module

    seqlen_k, rows, head_dim = 2048, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.zeros(1, rows, 1, head_dim, device="cuda")
    q[0, :, 0, 0] = 0.05 + 0.04 * torch.arange(rows, device="cuda")
    k = torch.zeros(1, seqlen_k, 1, head_dim, device="cuda")
    k[0, :, 0, 0] = 1.0
    k[0, ::16, 0, 0] = 2.0
    v = 1.5 + 0.01 * torch.randn(1, seqlen_k, 1, head_dim, device="cuda", generator=g)
    q, k, v = q.half(), k.half(), v.half()
    assert compiled_module().fwd_plan("sm70", 1, 1, 1, rows, seqlen_k, head_dim, False, False, True, 0)[0]
    out_ref, _ = attention_ref(q, k, v, softmax_scale=1.0, compute_dtype=torch.float64)
    out_pt, _ = attention_ref(q, k, v, softmax_scale=1.0, compute_dtype=torch.float16)
    corrected = flash_attn_with_kvcache(q, k, v, softmax_scale=1.0, num_splits=1)
    monkeypatch.setenv(SM70_CORRECTION_ENV, "0")
    plain = flash_attn_with_kvcache(q, k, v, softmax_scale=1.0, num_splits=1)
    err_c, err_u, err_pt = max_err(corrected, out_ref), max_err(plain, out_ref), max_err(out_pt, out_ref)
    print(f"\ndecoding, one P for 15 keys in 16: corrected {err_c:.3e}, plain fp16 {err_u:.3e}, PyTorch {err_pt:.3e}")
    assert err_c <= 2 * err_pt + 1e-5
    assert err_c < 0.75 * err_u

"""Sliding windows, softcap and ALiBi (the options the general kernels apply), alone and together, fixed-length
and variable-length, forward and backward, checked against the float64 reference with the 2x rule."""

import pytest
import torch

from cuteflash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_varlen_func
from cuteflash.reference import attention_ref

pytestmark = pytest.mark.gpu


def _slopes(batch: int, nheads: int, per_batch: bool) -> torch.Tensor:
    """ALiBi slopes as models use them (2^(-8 i / nheads)), per head or varied per (batch, head)."""
    base = torch.tensor([2 ** (-8 * (i + 1) / nheads) for i in range(nheads)], device="cuda")
    return base * torch.linspace(0.5, 1.5, batch, device="cuda").unsqueeze(1) if per_batch else base


def _reference(q, k, v, dout, compute_dtype, **options):
    """out, lse and (where dout is given) dq, dk, dv of the reference computed in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_(dout is not None) for t in (q, k, v)]
    out, lse = attention_ref(*leaves, compute_dtype=compute_dtype, **options)
    if dout is None:
        return out, lse, None
    out.backward(dout.to(compute_dtype))
    return out, lse, [t.grad for t in leaves]


def _check(q, k, v, assert_close_2x, backward=True, **options):
    """flash_attn_func with options against the references: out, lse and the gradients."""
    dout = torch.randn_like(q) if backward else None
    out_ref, lse_ref, grads_ref = _reference(q, k, v, dout, torch.float64, **options)
    out_pt, lse_pt, grads_pt = _reference(q, k, v, dout, q.dtype, **options)
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*leaves, return_attn_probs=True, **options)
    assert_close_2x("out", out, out_ref, out_pt)
    assert_close_2x("lse", lse, lse_ref, lse_pt)
    if backward:
        out.backward(dout)
        for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, grads_ref, grads_pt):
            assert_close_2x(name, leaf.grad, r, p)


WINDOWS = [
    ((16, 0), False),  # a sliding window, non-causal spelling
    ((40, -1), True),  # causal with a left window (Mistral's form)
    ((32, 48), False),  # both sides
    ((-1, 24), False),  # the right side only
    ((0, 0), False),  # the diagonal alone
    ((1000, 1000), False),  # wider than the sequences: no mask at all
]


@pytest.mark.parametrize("window_size,causal", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(128, 128), (97, 203), (203, 97), (1, 77)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_window(window_size, causal, seqlen_q, seqlen_k, head_dim, make_qkv, assert_close_2x, require_support):
    require_support(torch.float16, backward=True)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.float16)
    _check(q, k, v, assert_close_2x, causal=causal, window_size=window_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(dtype, softcap, causal, make_qkv, assert_close_2x, require_support):
    require_support(dtype, backward=True)
    # Scores of a few units: the softcap of 5 bends them, that of 30 hardly.
    q, k, v = make_qkv(2, 150, 170, 4, 4, 64, dtype, scale=2.0)
    _check(q, k, v, assert_close_2x, causal=causal, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(dtype, per_batch, causal, make_qkv, assert_close_2x, require_support):
    require_support(dtype, backward=True)
    q, k, v = make_qkv(2, 130, 190, 8, 2, 128, dtype)
    _check(q, k, v, assert_close_2x, causal=causal, alibi_slopes=_slopes(2, 8, per_batch))


MANY_BLOCKS = {
    "window": dict(window_size=(300, 40)),
    "causal-window-alibi": dict(causal=True, window_size=(257, -1), alibi=True),
    "alibi": dict(alibi=True),
    "causal-softcap-alibi": dict(causal=True, softcap=5.0, alibi=True),
}


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", MANY_BLOCKS.values(), ids=MANY_BLOCKS.keys())
def test_windows_and_alibi_over_many_blocks(
    options, dtype, head_dim, make_qkv, assert_close_2x, require_support, require_head_dim
):
    """Sequences of several query and key blocks, whose windows begin and end inside blocks on both sides (and leave
    whole blocks out), with and without ALiBi, and the softcap with ALiBi, at every head dim."""
    require_support(dtype, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 700, 900, 4, 2, head_dim, dtype)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = _slopes(2, 4, True)
    _check(q, k, v, assert_close_2x, **options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_windows_and_alibi_deterministic(head_dim, make_qkv, assert_close_2x, require_support, require_head_dim):
    """A deterministic backward pass with a window and ALiBi: the reference's gradients (2x rule), the same bits
    twice."""
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 500, 600, 4, 2, head_dim, torch.float16)
    options = dict(causal=True, window_size=(200, -1), alibi_slopes=_slopes(2, 4, False))
    dout = torch.randn_like(q)
    _, _, grads_ref = _reference(q, k, v, dout, torch.float64, **options)
    _, _, grads_pt = _reference(q, k, v, dout, q.dtype, **options)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, deterministic=True, **options).backward(dout)
        grads.append([t.grad for t in leaves])
    for name, first, second, r, p in zip(("dq", "dk", "dv"), *grads, grads_ref, grads_pt):
        assert_close_2x(name, first, r, p)
        assert torch.equal(first, second), name


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_everything_together(head_dim, deterministic, make_qkv, assert_close_2x, require_support, require_head_dim):
    """Window + causal + softcap + ALiBi + GQA at each head dim, both backward paths."""
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 190, 230, 6, 2, head_dim, torch.float16, scale=1.5)
    options = dict(causal=True, window_size=(70, -1), softcap=10.0, alibi_slopes=_slopes(2, 6, True))
    dout = torch.randn_like(q)
    out_ref, lse_ref, grads_ref = _reference(q, k, v, dout, torch.float64, **options)
    out_pt, lse_pt, grads_pt = _reference(q, k, v, dout, q.dtype, **options)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*leaves, return_attn_probs=True, deterministic=deterministic, **options)
    out.backward(dout)
    assert_close_2x("out", out, out_ref, out_pt)
    assert_close_2x("lse", lse, lse_ref, lse_pt)
    for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, grads_ref, grads_pt):
        assert_close_2x(name, leaf.grad, r, p)
    if deterministic:  # bitwise repeatable with the options too
        again = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*again, deterministic=True, **options).backward(dout)
        for leaf, other in zip(leaves, again):
            assert torch.equal(leaf.grad, other.grad)


@pytest.mark.parametrize("softcap", [8.0, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_options(causal, softcap, assert_close_2x, require_support):
    """Each sequence of a variable-length batch with its own window, softcap (or none) and ALiBi slopes per (batch,
    head)."""
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = [0, 1, 75, 190, 33], [40, 0, 130, 190, 1]
    nheads, nheads_k, head_dim = 4, 2, 64
    cu_q, cu_k = (torch.tensor([0, *n], device="cuda").cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    slopes = _slopes(len(lengths_q), nheads, True)
    options = dict(causal=causal, window_size=(30, 20), softcap=softcap)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), alibi_slopes=slopes, return_attn_probs=True, **options
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        seq = [t[s].unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys))]
        seq_options = dict(options, alibi_slopes=slopes[b])
        dout_b = dout[rows].unsqueeze(0)
        out_ref, lse_ref, grads_ref = _reference(*seq, dout_b, torch.float64, **seq_options)
        out_pt, lse_pt, grads_pt = _reference(*seq, dout_b, torch.float16, **seq_options)
        assert_close_2x(f"out of sequence {b}", out[rows].unsqueeze(0), out_ref, out_pt)
        assert_close_2x(f"lse of sequence {b}", lse[:, rows].unsqueeze(0), lse_ref, lse_pt)
        for name, leaf, s, r, p in zip(("dq", "dk", "dv"), leaves, (rows, keys, keys), grads_ref, grads_pt):
            assert_close_2x(f"{name} of sequence {b}", leaf.grad[s].unsqueeze(0), r, p)


def test_options_packed_and_compiled(make_qkv, assert_close_2x, require_support):
    """The options through a packed entry point under torch.compile(fullgraph=True), forward and backward."""
    require_support(torch.float16, backward=True)
    q, k, v = make_qkv(2, 100, 140, 4, 2, 64, torch.float16)
    slopes = _slopes(2, 4, False)
    options = dict(causal=True, window_size=(50, 0), softcap=20.0, alibi_slopes=slopes)
    kv = torch.stack([k, v], dim=2).requires_grad_()
    qq = q.detach().clone().requires_grad_()
    compiled = torch.compile(lambda q, kv: flash_attn_kvpacked_func(q, kv, **options), fullgraph=True)
    out = compiled(qq, kv)
    dout = torch.randn_like(out)
    out.backward(dout)
    out_ref, _, grads_ref = _reference(q, k, v, dout, torch.float64, **options)
    out_pt, _, grads_pt = _reference(q, k, v, dout, torch.float16, **options)
    assert_close_2x("out", out, out_ref, out_pt)
    assert_close_2x("dq", qq.grad, grads_ref[0], grads_pt[0])
    assert_close_2x("dk", kv.grad[:, :, 0], grads_ref[1], grads_pt[1])
    assert_close_2x("dv", kv.grad[:, :, 1], grads_ref[2], grads_pt[2])


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(window_size=(8,)), TypeError, "window_size"),
        (dict(window_size=(1.5, 2)), TypeError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes"),
        (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes"),
    ],
)
def test_bad_options(options, error, match):
    q = torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(error, match=match):
        flash_attn_func(q, q, q, **options)


def test_alibi_slopes_on_another_device():
    q = torch.randn(2, 16, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(4))

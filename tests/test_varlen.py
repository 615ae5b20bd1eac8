"""Variable-length batches: flash_attn_varlen_func and its packed variants, forward and backward, checked
sequence by sequence against the float64 reference with the 2x rule."""

import pytest
import torch

from cuteflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from cuteflash.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def _lengths(batch: int, longest: int) -> tuple[list[int], list[int]]:
    """Random lengths of queries and keys up to `longest`, seqlen_q != seqlen_k within a sequence: the first
    four sequences have (queries, keys) = (0, n), (1, n), (0, 1), (n, 0). No sequence has queries and a
    single key: then P = 1, the exact dq and dk are 0, and the 2x rule would demand 1e-5 of what fp32
    rounding gives (test_bwd.py's test_backward_single_key covers that case)."""
    assert batch >= 4
    lengths_q, lengths_k = (torch.randint(2, longest + 1, (batch,)).tolist() for _ in range(2))
    lengths_q[:4] = [0, 1, 0, lengths_q[3]]
    lengths_k[:4] = [lengths_k[0], lengths_k[1], 1, 0]
    return lengths_q, lengths_k


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)


def _make_varlen(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, require_support):
    require_support(dtype)
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=dtype)
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _sequences(t: torch.Tensor, offsets: torch.Tensor):
    """The rows of each sequence of t (packed along dim 0), with a batch dim of 1."""
    bounds = offsets.tolist()
    return [t[a:b].unsqueeze(0) for a, b in zip(bounds[:-1], bounds[1:])]


def _check_forward(q, k, v, cu_q, cu_k, out, lse, causal, assert_close_2x):
    """out (total_q, h, d) and lse (h, total_q) of each sequence against the references."""
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    seqs = zip(_sequences(q, cu_q), _sequences(k, cu_k), _sequences(v, cu_k), _sequences(out, cu_q))
    bounds = cu_q.tolist()
    for b, (qs, ks, vs, os) in enumerate(seqs):
        out_ref, lse_ref = attention_ref(qs, ks, vs, causal=causal, compute_dtype=torch.float64)
        out_pt, lse_pt = attention_ref(qs, ks, vs, causal=causal, compute_dtype=q.dtype)
        assert_close_2x(f"out of sequence {b}", os, out_ref, out_pt)
        lse_b = lse[:, bounds[b] : bounds[b + 1]].unsqueeze(0)
        assert_close_2x(f"lse of sequence {b}", lse_b, lse_ref, lse_pt)


def _check_backward(q, k, v, cu_q, cu_k, dout, grads, causal, reference_grads, assert_close_2x):
    """dq, dk, dv (packed like q, k, v) of each sequence against the references."""
    for b, (qs, ks, vs, dos) in enumerate(
        zip(_sequences(q, cu_q), _sequences(k, cu_k), _sequences(v, cu_k), _sequences(dout, cu_q))
    ):
        ref = reference_grads(qs, ks, vs, dos, causal, torch.float64)
        pt = reference_grads(qs, ks, vs, dos, causal, q.dtype)
        for name, grad, offsets, r, p in zip(("dq", "dk", "dv"), grads, (cu_q, cu_k, cu_k), ref, pt):
            assert_close_2x(f"{name} of sequence {b}", _sequences(grad, offsets)[b], r, p)


def _run_varlen(q, k, v, cu_q, cu_k, causal, max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """Forward and backward through flash_attn_varlen_func: out, lse, dout and the gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    max_q = max_seqlen_q if max_seqlen_q is not None else int(cu_q.diff().max())
    max_k = max_seqlen_k if max_seqlen_k is not None else int(cu_k.diff().max())
    out, lse, _ = flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max_q, max_k, causal=causal, deterministic=deterministic, return_attn_probs=True
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    return out.detach(), lse, dout, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [59, 64, 128, 256])
def test_varlen(head_dim, causal, dtype, require_support, require_head_dim, assert_close_2x, reference_grads):
    """Random lengths from 0 up, seqlen_q != seqlen_k within a sequence, both directions."""
    require_support(dtype, backward=True)
    require_head_dim(head_dim)
    lengths_q, lengths_k = _lengths(7, 300)
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 3, 3, head_dim, dtype, require_support)
    out, lse, dout, grads = _run_varlen(q, k, v, cu_q, cu_k, causal)
    torch.cuda.synchronize()
    _check_forward(q, k, v, cu_q, cu_k, out, lse, causal, assert_close_2x)
    _check_backward(q, k, v, cu_q, cu_k, dout, grads, causal, reference_grads, assert_close_2x)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (6, 1)], ids=["gqa", "mqa"])
def test_varlen_gqa_mqa(nheads, nheads_k, causal, require_support, assert_close_2x, reference_grads):
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = _lengths(5, 200)
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, nheads, nheads_k, 64, torch.float16, require_support)
    out, lse, dout, grads = _run_varlen(q, k, v, cu_q, cu_k, causal)
    _check_forward(q, k, v, cu_q, cu_k, out, lse, causal, assert_close_2x)
    _check_backward(q, k, v, cu_q, cu_k, dout, grads, causal, reference_grads, assert_close_2x)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_understated_max_seqlen(causal, require_support, assert_close_2x, reference_grads):
    """max_seqlen below the longest sequence sizes a smaller launch; every sequence is still computed whole."""
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = [0, 1, 700, 129, 300], [5, 0, 650, 900, 64]
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 2, 2, 64, torch.float16, require_support)
    for max_q, max_k in ((1, 1), (200, 100), (0, 0)):
        out, lse, dout, grads = _run_varlen(q, k, v, cu_q, cu_k, causal, max_q, max_k)
        _check_forward(q, k, v, cu_q, cu_k, out, lse, causal, assert_close_2x)
        _check_backward(q, k, v, cu_q, cu_k, dout, grads, causal, reference_grads, assert_close_2x)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_rows_past_the_batch_stay_out_of_its_results(
    head_dim, causal, require_support, require_head_dim, assert_close_2x, reference_grads
):
    """q, k, v and dout with rows past cu_seqlens[-1] (a buffer longer than the batch) that hold NaN: every
    sequence's results are as without them. A kernel that loads whole blocks reads rows past a sequence's end,
    which the masks leave out with zeros, and a zero times a NaN is not zero."""
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    lengths_q, lengths_k = _lengths(5, 300)
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 2, 2, head_dim, torch.float16, require_support)

    def padded(t):
        return torch.cat([t, torch.full((37, *t.shape[1:]), float("nan"), device="cuda", dtype=t.dtype)])

    leaves = [padded(t).requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, return_attn_probs=True
    )
    dout = torch.randn_like(q)
    out.backward(padded(dout))
    total_q, total_k = q.shape[0], k.shape[0]
    _check_forward(q, k, v, cu_q, cu_k, out.detach()[:total_q], lse[:, :total_q], causal, assert_close_2x)
    grads = [leaves[0].grad[:total_q], leaves[1].grad[:total_k], leaves[2].grad[:total_k]]
    _check_backward(q, k, v, cu_q, cu_k, dout, grads, causal, reference_grads, assert_close_2x)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_equal_lengths_match_fixed_length(causal, dtype, require_support):
    """A batch of equal lengths through varlen runs the fixed-length batch's tiles: the same bits."""
    require_support(dtype, backward=True)
    batch, seqlen_q, seqlen_k, nheads, head_dim = 3, 257, 190, 4, 128
    q, k, v, cu_q, cu_k = _make_varlen(
        [seqlen_q] * batch, [seqlen_k] * batch, nheads, nheads, head_dim, dtype, require_support
    )
    out, lse, dout, grads = _run_varlen(q, k, v, cu_q, cu_k, causal, seqlen_q, seqlen_k, deterministic=True)
    leaves = [t.detach().view(batch, -1, nheads, head_dim).clone().requires_grad_() for t in (q, k, v)]
    out_fixed, lse_fixed, _ = flash_attn_func(*leaves, causal=causal, deterministic=True, return_attn_probs=True)
    out_fixed.backward(dout.view(out_fixed.shape))
    assert torch.equal(out, out_fixed.detach().view(out.shape))
    assert torch.equal(lse, lse_fixed.permute(1, 0, 2).reshape(lse.shape))
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert torch.equal(grad, leaf.grad.view(grad.shape)), name


def test_varlen_deterministic_is_bitwise_reproducible(require_support):
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = _lengths(6, 500)
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 4, 2, 64, torch.float16, require_support)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        max_q, max_k = max(lengths_q), max(lengths_k)
        flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=True, deterministic=True).backward(dout)
        runs.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_qkvpacked(causal, require_support, assert_close_2x, reference_grads):
    require_support(torch.bfloat16, backward=True)
    lengths = [0, 2, *torch.randint(3, 301, (4,)).tolist()]  # no single key with queries: see _lengths
    cu = _offsets(lengths)
    qkv = torch.randn(sum(lengths), 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    leaf = qkv.clone().requires_grad_()
    out, lse, _ = flash_attn_varlen_qkvpacked_func(leaf, cu, max(lengths), causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = qkv.unbind(1)
    _check_forward(q, k, v, cu, cu, out.detach(), lse, causal, assert_close_2x)
    assert leaf.grad.shape == qkv.shape
    _check_backward(q, k, v, cu, cu, dout, leaf.grad.unbind(1), causal, reference_grads, assert_close_2x)


@pytest.mark.parametrize("nheads_k", [4, 2], ids=["mha", "gqa"])
def test_varlen_kvpacked(nheads_k, require_support, assert_close_2x, reference_grads):
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = _lengths(5, 300)
    q, _, _, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 4, nheads_k, 64, torch.float16, require_support)
    kv = torch.randn(sum(lengths_k), 2, nheads_k, 64, device="cuda", dtype=torch.float16)
    leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()]
    max_q, max_k = max(lengths_q), max(lengths_k)
    out, lse, _ = flash_attn_varlen_kvpacked_func(
        *leaves, cu_q, cu_k, max_q, max_k, causal=True, return_attn_probs=True
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    k, v = kv.unbind(1)
    _check_forward(q, k, v, cu_q, cu_k, out.detach(), lse, True, assert_close_2x)
    assert leaves[1].grad.shape == kv.shape
    grads = (leaves[0].grad, *leaves[1].grad.unbind(1))
    _check_backward(q, k, v, cu_q, cu_k, dout, grads, True, reference_grads, assert_close_2x)


def test_varlen_through_torch_compile_and_cuda_graphs(require_support, assert_close_2x, reference_grads):
    """fullgraph torch.compile with the backward pass, then a CUDA graph of the forward: no host sync."""
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = [3, 200, 0, 77], [3, 150, 9, 300]
    q, k, v, cu_q, cu_k = _make_varlen(lengths_q, lengths_k, 4, 4, 64, torch.float16, require_support)

    @torch.compile(fullgraph=True)
    def loss(q, k, v, dout):
        return (flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True).float() * dout.float()).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    loss(*leaves, dout).backward()
    _check_backward(q, k, v, cu_q, cu_k, dout, [t.grad for t in leaves], True, reference_grads, assert_close_2x)

    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    q.copy_(torch.randn_like(q))  # new inputs in the captured buffers
    graph.replay()
    torch.cuda.synchronize()
    expected = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    assert torch.equal(out, expected)


def _cuda_int32(*values):
    return torch.tensor(values, device="cuda", dtype=torch.int32)


@pytest.mark.parametrize(
    "name,value,error,match",
    [
        (
            "cu_seqlens_q",
            lambda: torch.tensor([0, 4, 10], device="cuda"),
            TypeError,
            "cu_seqlens_q has dtype torch.int64",
        ),
        ("cu_seqlens_k", lambda: torch.tensor([0, 6, 12], dtype=torch.int32), ValueError, "cu_seqlens_k is on cpu"),
        ("cu_seqlens_q", lambda: _cuda_int32([0, 4, 10]), ValueError, "cu_seqlens_q must be 1-D"),
        ("cu_seqlens_k", lambda: _cuda_int32(0, 12), ValueError, "cu_seqlens_q has 3 offsets and cu_seqlens_k 2"),
        ("max_seqlen_q", lambda: -1, ValueError, r"max_seqlen_q must be in \[0, 2\^30\)"),
        ("max_seqlen_k", lambda: "6", TypeError, "max_seqlen_k must be an int"),
        ("q", lambda: torch.randn(1, 10, 2, 64, device="cuda", dtype=torch.float16), ValueError, "q must have 3 dim"),
        ("v", lambda: torch.randn(11, 2, 64, device="cuda", dtype=torch.float16), ValueError, "k and v must have"),
        ("block_table", lambda: _cuda_int32([0], [1]), ValueError, "k must have 4 dimensions"),
    ],
)
def test_varlen_bad_input(name, value, error, match):
    kv = torch.randn(12, 2, 64, device="cuda", dtype=torch.float16)
    args = dict(
        q=torch.randn(10, 2, 64, device="cuda", dtype=torch.float16),
        k=kv,
        v=kv,
        cu_seqlens_q=_cuda_int32(0, 4, 10),
        cu_seqlens_k=_cuda_int32(0, 6, 12),
        max_seqlen_q=6,
        max_seqlen_k=6,
    )
    args[name] = value()
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**args)


def test_varlen_packed_shapes():
    with pytest.raises(ValueError, match=r"qkv must have shape \(total, 3, nheads, headdim\)"):
        flash_attn_varlen_qkvpacked_func(torch.randn(2, 16, 3, 4, 64, device="cuda", dtype=torch.float16), None, 16)
    with pytest.raises(ValueError, match=r"kv must have shape \(total_k, 2, nheads_k, headdim\)"):
        flash_attn_varlen_kvpacked_func(
            torch.randn(16, 4, 64, device="cuda", dtype=torch.float16),
            torch.randn(16, 3, 4, 64, device="cuda", dtype=torch.float16),
            None,
            None,
            16,
            16,
        )

"""Dropout: the mask's statistics, the forward and backward passes against the reference with the mask read
back through return_attn_probs (2x rule), alone and with the other options (softcap included), fixed-length and
variable-length, the same mask in every kernel family, repeatability under torch.manual_seed, torch.compile and CUDA
graphs."""

import pytest
import torch

from cuteflash import _ops, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from cuteflash.reference import attention_ref, scores_ref

pytestmark = pytest.mark.gpu


def _kept(s_dmask: torch.Tensor) -> torch.Tensor:
    """The kept mask of S_dmask: its non-negative entries (the sign bit, so that a dropped 0 reads dropped)."""
    return ~torch.signbit(s_dmask)


def _reference(q, k, v, dout, compute_dtype, kept, dropout_p, **options):
    """out, lse, and dq, dk, dv of the reference with the mask `kept`, computed in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, compute_dtype=compute_dtype, dropout_p=dropout_p, dropout_mask=kept, **options)
    out.backward(dout.to(compute_dtype))
    return out, lse, [t.grad for t in leaves]


def _check(q, k, v, dropout_p, assert_close_2x, deterministic=False, mask=None, **options):
    """flash_attn_func with dropout, forward and backward, against the references with its own mask (or `mask`,
    which its own must equal). Returns the mask."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = flash_attn_func(
        *leaves, dropout_p=dropout_p, return_attn_probs=True, deterministic=deterministic, **options
    )
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    rounded = (-seqlen_q % 128 + seqlen_q, -seqlen_k % 128 + seqlen_k)
    assert s_dmask.shape == (batch, nheads, *rounded) and s_dmask.dtype == q.dtype
    kept = _kept(s_dmask)
    if mask is not None:
        assert torch.equal(kept, mask)
        kept = mask
    dout = torch.randn_like(q)
    out.backward(dout)
    out_ref, lse_ref, grads_ref = _reference(q, k, v, dout, torch.float64, kept, dropout_p, **options)
    out_pt, lse_pt, grads_pt = _reference(q, k, v, dout, q.dtype, kept, dropout_p, **options)
    assert_close_2x("out", out, out_ref, out_pt)
    assert_close_2x("lse", lse, lse_ref, lse_pt)
    for name, leaf, r, p in zip(("dq", "dk", "dv"), leaves, grads_ref, grads_pt):
        assert_close_2x(name, leaf.grad, r, p)
    return kept


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_kept_fraction(dropout_p, make_qkv, require_support):
    """On 2 x 8 x 1024 x 1024 scores, the kept fraction is within 1 % of 1 - p, and so is that of each place in
    the eight-element units the mask is drawn in, of each head and of the first and last rows; the heads' masks
    differ."""
    require_support(torch.float16)
    q, k, v = make_qkv(2, 1024, 1024, 8, 8, 64, torch.float16)
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, return_attn_probs=True)
    kept = _kept(s_dmask).float()
    target = 1 - dropout_p

    def assert_fraction(name, x):
        assert abs(x.mean().item() - target) <= 0.01 * target, f"{name}: kept {x.mean().item():.4f}, want {target}"

    assert_fraction("all", kept)
    # (b, h, i / 16, i / 8 % 2, i % 8, j / 16, j / 8 % 2, j % 8 / 2, j % 2): a place is (i / 8 % 2, its byte)
    units = kept.unflatten(3, (-1, 2, 4, 2)).unflatten(2, (-1, 2, 8))
    for r in range(2):
        for c in range(4):
            assert_fraction(f"unit place ({r}, {c})", units[:, :, :, r, :, :, c // 2, :, c % 2])
    for h in range(8):
        assert_fraction(f"head {h}", kept[:, h])
    assert_fraction("first rows", kept[:, :, :64])
    assert_fraction("last rows", kept[:, :, -64:])
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0, 0], kept[1, 0])


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_probabilities(softcap, make_qkv, require_support):
    """S_dmask's magnitudes are the softmax probabilities (of the softcapped scores), zero past seqlen_q and
    seqlen_k."""
    require_support(torch.float16)
    q, k, v = make_qkv(2, 100, 150, 4, 2, 64, torch.float16)
    _, _, s_dmask = flash_attn_func(q, k, v, dropout_p=0.3, causal=True, softcap=softcap, return_attn_probs=True)
    probs = torch.softmax(scores_ref(q, k, causal=True, compute_dtype=torch.float32, softcap=softcap), dim=-1)
    torch.testing.assert_close(s_dmask[:, :, :100, :150].abs().float(), probs, atol=1e-3, rtol=1e-2)
    assert not s_dmask[:, :, 100:].any() and not s_dmask[:, :, :, 150:].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(128, 128), (97, 203), (203, 97), (1, 77)])
def test_dropout(dtype, causal, seqlen_q, seqlen_k, make_qkv, assert_close_2x, require_support):
    require_support(dtype, backward=True)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype)
    _check(q, k, v, 0.17, assert_close_2x, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(128, 128), (97, 203), (203, 97), (1, 77)])
def test_softcap_with_dropout(dtype, causal, seqlen_q, seqlen_k, make_qkv, assert_close_2x, require_support):
    """Softcap and dropout together (kernels of their own): dropout acts on the probabilities of the softcapped
    scores, and the backward pass applies the softcap's factor to dS of the kept probabilities."""
    require_support(dtype, backward=True)
    # Scores of a few units, which the softcap of 5 bends (as in test_options.py).
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype, scale=2.0)
    _check(q, k, v, 0.17, assert_close_2x, causal=causal, softcap=5.0)


@pytest.mark.parametrize("head_dim", [64, 72, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_softcap_with_dropout_head_dims(
    head_dim, causal, deterministic, make_qkv, assert_close_2x, require_support, require_head_dim
):
    """Softcap and dropout with GQA at a few head dims (72: the kernel of head dim 96, part of its tile), both backward
    paths. Without the causal mask, the sm80 forward runs the softcap inside the softmax in its unmasked blocks."""
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 190, 230, 6, 2, head_dim, torch.float16, scale=1.5)
    _check(q, k, v, 0.25, assert_close_2x, deterministic=deterministic, causal=causal, softcap=10.0)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_dropout_with_everything(
    head_dim, deterministic, softcap, make_qkv, assert_close_2x, require_support, require_head_dim
):
    """Dropout + window + causal + ALiBi + GQA, with and without softcap, at each head dim, both backward paths."""
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 190, 230, 6, 2, head_dim, torch.float16, scale=1.5)
    slopes = torch.rand(2, 6, device="cuda") * 0.3
    options = dict(causal=True, window_size=(70, -1), alibi_slopes=slopes, softcap=softcap)
    _check(q, k, v, 0.25, assert_close_2x, deterministic=deterministic, **options)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_a_call_moves_between_families(head_dim, softcap, make_qkv, assert_close_2x, monkeypatch, require_head_dim):
    """The mask is a function of the seed and of an element's place, the same in every family's kernels: under one
    seed, each family this GPU runs (CUTEFLASH_BACKEND) computes the forward and backward passes with the mask the
    first family's S_dmask shows (the 2x rule against the reference with that mask; a mask that differed in a few
    elements would break it)."""
    from cuteflash._lib import build_info, select_family

    families = []
    for family in build_info()["families"]:
        monkeypatch.setenv("CUTEFLASH_BACKEND", family)
        try:
            select_family(torch.cuda.current_device())
        except RuntimeError:  # not compiled for this GPU, or too new for it
            continue
        families.append(family)
    if len(families) < 2:
        pytest.skip(f"one kernel family runs on this GPU ({', '.join(families)})")
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 190, 230, 6, 2, head_dim, torch.float16, scale=1.5)
    slopes = torch.rand(2, 6, device="cuda") * 0.3
    options = dict(causal=True, window_size=(90, -1), alibi_slopes=slopes, softcap=softcap)
    mask = None
    for family in families:
        monkeypatch.setenv("CUTEFLASH_BACKEND", family)
        torch.manual_seed(11)
        mask = _check(q, k, v, 0.3, assert_close_2x, mask=mask, **options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_sm70_tiles_of_smaller_gpus(
    smem_limit, head_dim, softcap, make_qkv, assert_close_2x, require_support, require_head_dim
):
    """The sm70 tiles of a T4 and a V100 (imitated through smem_limit), whose threads hold 2 to 32 columns of a row:
    the forward and backward kernels drop what the mask kernel draws, with and without softcap."""
    family, _ = smem_limit
    if family != "sm70":
        pytest.skip("the sm80 tiles for less shared memory hold dropout's units as the default tiles do")
    require_support(torch.float16, backward=True)
    require_head_dim(head_dim)
    q, k, v = make_qkv(2, 190, 230, 4, 2, head_dim, torch.float16)
    _check(q, k, v, 0.2, assert_close_2x, causal=True, softcap=softcap)


def test_repeatable_under_manual_seed(make_qkv, require_support):
    """The same seed gives the same mask and gradients (deterministic: bitwise); another seed another mask."""
    require_support(torch.float16, backward=True)
    q, k, v = make_qkv(2, 200, 200, 4, 4, 64, torch.float16)
    dout = torch.randn_like(q)

    def run(seed):
        torch.manual_seed(seed)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, _, s_dmask = flash_attn_func(*leaves, dropout_p=0.2, deterministic=True, return_attn_probs=True)
        out.backward(dout)
        return out, _kept(s_dmask), [t.grad for t in leaves]

    out, kept, grads = run(1)
    out_again, kept_again, grads_again = run(1)
    assert torch.equal(out, out_again) and torch.equal(kept, kept_again)
    for g, h in zip(grads, grads_again):
        assert torch.equal(g, h)
    out_other, kept_other, _ = run(2)
    assert not torch.equal(kept, kept_other) and not torch.equal(out, out_other)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 8.0])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(causal, softcap, deterministic, assert_close_2x, require_support):
    """Each sequence of a variable-length batch against the reference with its part of S_dmask, with and without
    softcap, both backward paths. No sequence has a single key: there the reference's gradients are exactly 0,
    while the kernels' D = rowsum(dO O) (as FlashAttention's) carries the rounding of O = V / (1 - p) to fp16."""
    require_support(torch.float16, backward=True)
    lengths_q, lengths_k = [0, 1, 75, 190, 33], [40, 0, 130, 190, 9]
    nheads, nheads_k, head_dim, dropout_p = 4, 2, 64, 0.3
    cu_q, cu_k = (torch.tensor([0, *n], device="cuda").cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = flash_attn_varlen_func(
        *leaves,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        dropout_p,
        causal=causal,
        window_size=(60, -1),
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=True,
    )
    assert s_dmask.shape == (len(lengths_q), nheads, 256, 256)
    dout = torch.randn_like(out)
    out.backward(dout)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        seq = [t[s].unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys))]
        kept = _kept(s_dmask[b : b + 1])
        assert not s_dmask[b, :, lengths_q[b] :].any() and not s_dmask[b, :, :, lengths_k[b] :].any()
        options = dict(causal=causal, window_size=(60, -1), softcap=softcap)
        dout_b = dout[rows].unsqueeze(0)
        out_ref, lse_ref, grads_ref = _reference(*seq, dout_b, torch.float64, kept, dropout_p, **options)
        out_pt, lse_pt, grads_pt = _reference(*seq, dout_b, torch.float16, kept, dropout_p, **options)
        assert_close_2x(f"out of sequence {b}", out[rows].unsqueeze(0), out_ref, out_pt)
        for name, leaf, s, r, p in zip(("dq", "dk", "dv"), leaves, (rows, keys, keys), grads_ref, grads_pt):
            assert_close_2x(f"{name} of sequence {b}", leaf.grad[s].unsqueeze(0), r, p)


def test_compiled(make_qkv, require_support):
    """Under torch.compile(fullgraph=True), dropout draws from torch's generator: the same seed gives the same
    output and gradients, and the output is not that without dropout."""
    require_support(torch.float16, backward=True)
    q, k, v = make_qkv(2, 100, 100, 4, 4, 64, torch.float16)
    qkv = torch.stack([q, k, v], dim=2)
    compiled = torch.compile(lambda qkv: flash_attn_qkvpacked_func(qkv, 0.2, causal=True), fullgraph=True)

    def run():
        torch.manual_seed(7)
        x = qkv.detach().clone().requires_grad_()
        out = compiled(x)
        out.backward(torch.ones_like(out))
        return out, x.grad

    (out, grad), (out_again, grad_again) = run(), run()
    assert torch.equal(out, out_again) and torch.equal(grad, grad_again)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert not torch.allclose(out, flash_attn_qkvpacked_func(qkv, 0.0, causal=True))


def test_cuda_graph_draws_at_each_replay(make_qkv, require_support):
    require_support(torch.float16)
    q, k, v = make_qkv(1, 128, 128, 2, 2, 64, torch.float16)
    flash_attn_func(q, k, v, dropout_p=0.5)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, dropout_p=0.5)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first, out)
    assert torch.isfinite(out).all()


def test_mask_is_philox(require_support):
    """The mask kernel's bits are those of Philox-2x32-10 (checked against Random123's known answer) at the
    counters include/cuteflash/dropout.cuh documents: a unit is rows (i, i + 8) x columns (j, j + 1, j + 8,
    j + 9), a byte per element."""
    require_support()

    def philox(lo, hi, key, rounds=10):
        for _ in range(rounds):
            product = 0xD256D193 * lo
            lo, hi = ((product >> 32) ^ key ^ hi) & 0xFFFFFFFF, product & 0xFFFFFFFF
            key = (key + 0x9E3779B9) & 0xFFFFFFFF
        return lo, hi

    assert philox(0x243F6A88, 0x85A308D3, 0x13198A2E) == (0xDD7CE038, 0xF62A4C12)
    base, p = 2**64 - 5, 0.37  # a base that wraps around 2^64 within the call
    rng_state = torch.tensor([base - 2**64], dtype=torch.int64, device="cuda")
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 40, 30
    keep = _ops.dropout_mask(rng_state, p, batch, nheads, seqlen_q, seqlen_k, None, 0, 0).cpu()
    threshold = round((1 - p) * 256)
    row_units, col_units = (seqlen_q + 15) // 16 * 8, (seqlen_k + 15) // 16 * 4
    for b, h, i, j in [(0, 0, 0, 0), (0, 0, 9, 3), (1, 2, 39, 29), (1, 1, 17, 12), (0, 2, 24, 0), (1, 0, 30, 26)]:
        unit = ((b * nheads + h) * row_units + i // 16 * 8 + i % 8) * col_units + j // 16 * 4 + j % 8 // 2
        counter = (base + unit) % 2**64
        words = philox(counter & 0xFFFFFFFF, counter >> 32, 0x2545F491)
        byte = (words[(i // 8) % 2] >> (8 * (j % 2 + 2 * (j // 8 % 2)))) & 0xFF
        assert bool(keep[b, h, i, j]) == (byte < threshold), (b, h, i, j)

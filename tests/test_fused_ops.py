"""cuteflash.layer_norm and cuteflash.cross_entropy (flash-attn's flash_attn.ops.triton.layer_norm, cross_entropy
and flash_attn.losses): outputs and gradients against float64 references with the 2x rule (the error at most twice
that of the PyTorch composition in the input dtype, plus 1e-5), every option, the dropout masks read back, the
vocabulary split over two processes. On a GPU the kernels run compiled; without one, in Triton's interpreter
(conftest sets TRITON_INTERPRET=1 there), so these tests run wherever Triton is installed."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused ops are Triton kernels")

from cuteflash.cross_entropy import CrossEntropyLoss, cross_entropy_loss  # noqa: E402
from cuteflash.layer_norm import LayerNorm, RMSNorm, layer_norm_fn, layer_norm_ref, rms_norm_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest: bfloat16 runs on GPUs only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _err(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _check_2x(name, ours, ref, pt) -> None:
    bound = 2 * _err(pt, ref) + 1e-5
    assert _err(ours, ref) <= bound, f"{name}: error {_err(ours, ref):.3g} > 2x the composition's + 1e-5 ({bound:.3g})"


# options: (residual, x1 with weight1/bias1, dropout_p, rowscale, prenorm, residual_in_fp32, zero_centered_weight)
NORM_OPTIONS = {
    "plain": (False, False, 0.0, False, False, False, False),
    "residual-prenorm-fp32": (True, False, 0.0, False, True, True, False),
    "parallel-dropout": (True, True, 0.15, False, True, False, False),
    "rowscale-dropout-zero-centered": (False, False, 0.3, True, True, True, True),
}


@pytest.mark.parametrize("option", list(NORM_OPTIONS))
@pytest.mark.parametrize("hidden", [96, 520])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_norm_matches_reference(rms, dtype, hidden, option):
    residual_on, parallel, p, rowscale_on, prenorm, in_fp32, zero_centered = NORM_OPTIONS[option]
    torch.manual_seed(hidden)
    shape = (3, 7, hidden)
    dev = dict(device=DEVICE, dtype=dtype)
    x = torch.randn(shape, **dev)
    residual = torch.randn(shape, **dev) if residual_on else None
    x1 = torch.randn(shape, **dev) if parallel else None
    weight, bias = torch.rand(hidden, **dev) + 0.5, torch.randn(hidden, **dev)
    weight1, bias1 = (torch.rand(hidden, **dev) + 0.5, torch.randn(hidden, **dev)) if parallel else (None, None)
    rowscale = torch.rand(shape[:-1], **dev) + 0.5 if rowscale_on else None
    bias = None if rms else bias
    bias1 = None if rms else bias1
    leaves = [t for t in (x, residual, x1, weight, bias, weight1, bias1) if t is not None]
    for t in leaves:
        t.requires_grad_()
    got = layer_norm_fn(
        x, weight, bias, residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=1e-5, dropout_p=p,
        rowscale=rowscale, prenorm=prenorm, residual_in_fp32=in_fp32, zero_centered_weight=zero_centered,
        is_rms_norm=rms, return_dropout_mask=True,
    )  # fmt: skip
    *outs, mask, mask1 = got
    if p > 0:
        assert mask.dtype == torch.bool and abs(mask.float().mean().item() - (1 - p)) < 0.05
        assert (mask1 is not None) == parallel
    else:
        assert mask is None and mask1 is None
    if prenorm:
        want = residual.dtype if residual is not None else torch.float32 if in_fp32 else dtype
        assert outs[-1].dtype == want
    ref_fn = rms_norm_ref if rms else layer_norm_ref
    kwargs = dict(
        residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=1e-5, dropout_p=p, rowscale=rowscale,
        prenorm=prenorm, zero_centered_weight=zero_centered, dropout_mask=mask, dropout_mask1=mask1,
    )  # fmt: skip
    # the reference in float64 throughout, its gradients too (leaves of its own, not rounded back to dtype)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    as64 = dict(zip(map(id, leaves), leaves64))
    kwargs64 = {name: as64.get(id(t), t) for name, t in kwargs.items()}
    ref = ref_fn(as64[id(x)], as64[id(weight)], as64.get(id(bias)), upcast=True, **kwargs64)
    pt = ref_fn(x, weight, bias, upcast=False, **kwargs)
    ref, pt = (r if isinstance(r, tuple) else (r,) for r in (ref, pt))
    assert len(outs) == len(ref)
    for i, (o, r, q) in enumerate(zip(outs, ref, pt)):
        _check_2x(f"output {i}", o, r, q)
    grads_out = [torch.randn_like(o) for o in outs]
    mine = torch.autograd.grad(outs, leaves, grads_out)
    ref_grads = torch.autograd.grad(ref, leaves64, [g.double() for g in grads_out])
    pt_grads = torch.autograd.grad(pt, leaves, [g.to(q.dtype) for g, q in zip(grads_out, pt)])
    for i, (g, r, q) in enumerate(zip(mine, ref_grads, pt_grads)):
        assert g.dtype == leaves[i].dtype
        _check_2x(f"gradient {i}", g, r, q)


def test_norm_dropout_masks_follow_the_seed():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)

    def masks(seed):
        torch.manual_seed(seed)
        return layer_norm_fn(x, w, None, dropout_p=0.5, return_dropout_mask=True)[1]

    assert torch.equal(masks(1), masks(1))
    assert not torch.equal(masks(1), masks(2))


def test_norm_writes_into_given_buffers():
    x, residual = torch.randn(5, 64, device=DEVICE), torch.randn(5, 64, device=DEVICE)
    w, b = torch.rand(64, device=DEVICE), torch.randn(64, device=DEVICE)
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    y, r = layer_norm_fn(x, w, b, residual=residual, prenorm=True, out=out, residual_out=residual_out)
    assert y.data_ptr() == out.data_ptr() and r.data_ptr() == residual_out.data_ptr()
    torch.testing.assert_close(r, x + residual)
    torch.testing.assert_close(y, F.layer_norm(x + residual, (64,), w, b, 1e-6))


def test_norm_refuses_buffers_it_cannot_write_in_place():
    x = torch.randn(4, 6, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="out must have x's shape"):
        layer_norm_fn(x, w, None, out=torch.empty(24, 32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be viewable"):
        layer_norm_fn(x, w, None, out=torch.empty(32, 6, 4, device=DEVICE).permute(2, 1, 0))
    with pytest.raises(ValueError, match="residual_out must be viewable"):
        layer_norm_fn(x, w, None, residual=x, residual_out=torch.empty(6, 4, 32, device=DEVICE).transpose(0, 1))


def test_norm_modules():
    x, residual = torch.randn(2, 3, 32, device=DEVICE), torch.randn(2, 3, 32, device=DEVICE)
    rms, ln = RMSNorm(32, eps=1e-6, device=DEVICE), LayerNorm(32, eps=1e-6, device=DEVICE)
    assert rms.bias is None and torch.equal(rms.weight, torch.ones(32, device=DEVICE))
    assert torch.equal(ln.bias, torch.zeros(32, device=DEVICE))
    y, r = rms(x, residual, prenorm=True, residual_in_fp32=True)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (32,), eps=1e-6))
    torch.testing.assert_close(ln(x), F.layer_norm(x, (32,), eps=1e-6))
    zero = RMSNorm(32, zero_centered_weight=True, device=DEVICE)
    assert torch.equal(zero.weight, torch.zeros(32, device=DEVICE))
    torch.testing.assert_close(zero(x), F.rms_norm(x, (32,), eps=1e-5))


def test_norm_bad_input_names_the_argument():
    x = torch.randn(3, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        layer_norm_fn(x, w, None, residual=torch.randn(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        layer_norm_fn(x, torch.ones(8, device=DEVICE), None)
    with pytest.raises(ValueError, match="rowscale"):
        layer_norm_fn(x, w, None, x1=x, rowscale=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p"):
        layer_norm_fn(x, w, None, dropout_p=1.0)


def _xent_reference(logits, labels, smoothing, scale, z, ignore_index=-100):
    zl = logits * scale
    lse = torch.logsumexp(zl.float() if zl.dtype != torch.float64 else zl, -1)
    loss = F.cross_entropy(zl, labels, reduction="none", label_smoothing=smoothing, ignore_index=ignore_index)
    z_loss = torch.where(labels == ignore_index, 0.0, z * lse.square())
    return loss + z_loss.to(loss.dtype), z_loss


@pytest.mark.parametrize("vocab", [1000, 5000])
@pytest.mark.parametrize("options", [(0.0, 1.0, 0.0), (0.1, 0.7, 1e-2)], ids=["plain", "smoothing-scale-zloss"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_matches_reference(dtype, options, vocab):
    smoothing, scale, z = options
    torch.manual_seed(vocab)
    logits = (torch.randn(9, vocab, device=DEVICE) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (9,), device=DEVICE)
    labels[3] = -100
    losses, z_losses = cross_entropy_loss(logits, labels, label_smoothing=smoothing, logit_scale=scale,
                                          lse_square_scale=z)  # fmt: skip
    assert losses.dtype == z_losses.dtype == torch.float32 and losses[3] == 0 and z_losses[3] == 0
    ref, ref_z = _xent_reference(logits.double(), labels, smoothing, scale, z)
    pt, _ = _xent_reference(logits, labels, smoothing, scale, z)
    _check_2x("losses", losses, ref, pt)
    torch.testing.assert_close(z_losses.double(), ref_z, rtol=1e-5, atol=1e-6)
    dloss = torch.randn(9, device=DEVICE)
    (mine,) = torch.autograd.grad(losses, logits, dloss)
    (ref_g,) = torch.autograd.grad(ref, logits, dloss.double())
    (pt_g,) = torch.autograd.grad(pt, logits, dloss.to(pt.dtype))
    assert mine.dtype == dtype and not mine[3].any()
    _check_2x("gradient", mine, ref_g, pt_g)


def test_cross_entropy_inplace_backward_and_module():
    torch.manual_seed(0)
    logits = torch.randn(6, 300, device=DEVICE)
    labels = torch.tensor([1, -100, 5, 7, -100, 299], device=DEVICE)
    a = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(cross_entropy_loss(a, labels)[0].sum(), a)
    b = logits.clone()
    leaf = b.requires_grad_()
    (got,) = torch.autograd.grad(cross_entropy_loss(leaf, labels, inplace_backward=True)[0].sum(), leaf)
    assert got.data_ptr() == leaf.data_ptr()  # the gradient was written over the logits
    torch.testing.assert_close(got, expected)
    mean = CrossEntropyLoss()(logits, labels)
    torch.testing.assert_close(mean, F.cross_entropy(logits, labels))
    loss, z = CrossEntropyLoss(reduction="sum", lse_square_scale=0.5, return_z_loss=True)(logits, labels)
    lse = torch.logsumexp(logits, -1)[labels != -100]
    torch.testing.assert_close(z, 0.5 * lse.square().sum())
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, reduction="sum") + z)
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")
    # precomputed_lse is taken where flash-attn takes it (logit_scale 1, no smoothing), and only there
    from cuteflash.cross_entropy import CrossEntropyLossFn

    wrong = torch.zeros(6, device=DEVICE)
    torch.testing.assert_close(CrossEntropyLossFn.apply(logits, labels)[0], cross_entropy_loss(logits, labels)[0])
    assert not torch.equal(cross_entropy_loss(logits, labels, wrong)[0], cross_entropy_loss(logits, labels)[0])
    scaled = cross_entropy_loss(logits, labels, wrong, logit_scale=2.0)[0]
    torch.testing.assert_close(scaled, cross_entropy_loss(logits, labels, logit_scale=2.0)[0])
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss(logits, labels[:3])


WORLD = 2


def _split_vocab_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=2))
    torch.manual_seed(0)  # the same logits on both ranks; each takes its half of the vocabulary
    logits = torch.randn(5, 600, dtype=torch.float64) * 3
    labels = torch.tensor([3, 599, -100, 300, 299])
    mine = logits[:, rank * 300 : (rank + 1) * 300].float().requires_grad_()
    group = dist.group.WORLD
    losses, z = cross_entropy_loss(mine, labels, label_smoothing=0.1, lse_square_scale=1e-2, process_group=group)
    (grad,) = torch.autograd.grad(losses.sum(), mine)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"losses": losses.tolist(), "z": z.tolist(), "grad": grad.tolist()}, f)
    dist.destroy_process_group()


def test_cross_entropy_vocabulary_split_over_two_processes(tmp_path):
    import torch.distributed as dist

    if DEVICE != "cpu" or not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("runs on the CPU over gloo (Triton's interpreter)")
    torch.multiprocessing.spawn(_split_vocab_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    torch.manual_seed(0)
    logits = (torch.randn(5, 600, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.tensor([3, 599, -100, 300, 299])
    ref, ref_z = _xent_reference(logits, labels, 0.1, 1.0, 1e-2)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["z"], dtype=torch.float64), ref_z, rtol=1e-5, atol=1e-6)
        half = ref_grad[:, rank * 300 : (rank + 1) * 300]
        torch.testing.assert_close(torch.tensor(got["grad"], dtype=torch.float64), half, rtol=1e-4, atol=1e-6)


def test_norm_gradient_through_one_output():
    """Gradients through y alone, or through residual_out alone (the other output unused: its gradient is None)."""
    x, residual = (torch.randn(4, 48, device=DEVICE, dtype=torch.float64).float().requires_grad_() for _ in range(2))
    w = (torch.rand(48, device=DEVICE) + 0.5).requires_grad_()
    y, r = layer_norm_fn(x, w, None, residual=residual, prenorm=True, is_rms_norm=True)
    got = torch.autograd.grad(y.sum(), (x, residual, w))
    want = torch.autograd.grad(F.rms_norm(x + residual, (48,), w, 1e-6).sum(), (x, residual, w))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    y, r = layer_norm_fn(x, w, None, residual=residual, prenorm=True, is_rms_norm=True)
    dx, dres, dw = torch.autograd.grad((2 * r).sum(), (x, residual, w), allow_unused=True)
    assert torch.equal(dx, torch.full_like(x, 2.0)) and torch.equal(dres, dx)
    assert dw is None or not dw.any()


@pytest.mark.parametrize("layout", ["fixed", "varlen"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rotary_kernel_matches_the_composition(dtype, interleaved, layout):
    """cuteflash.rotary's Triton kernel (fp16/bf16/fp32) against its float64 composition: a partial rotary_dim,
    positions past the table (offsets 5 and 9 with a table of 12 rows), in place and not, and the gradient (the
    conjugate rotation)."""
    from cuteflash.rotary import apply_rotary, apply_rotary_emb

    torch.manual_seed(3)
    cos, sin = (f(torch.rand(12, 6, device=DEVICE) * 6) for f in (torch.cos, torch.sin))
    if layout == "fixed":
        x = torch.randn(2, 7, 3, 20, device=DEVICE)
        kwargs = dict(seqlen_offsets=torch.tensor([5, 0], device=DEVICE, dtype=torch.int32))
    else:
        x = torch.randn(11, 3, 20, device=DEVICE)
        kwargs = dict(seqlen_offsets=torch.tensor([9, 1], device=DEVICE, dtype=torch.int32),
                      cu_seqlens=torch.tensor([0, 4, 11], device=DEVICE, dtype=torch.int32), max_seqlen=7)  # fmt: skip
    x = x.to(dtype)
    ref = apply_rotary_emb(x.double(), cos.double(), sin.double(), interleaved, **kwargs)
    leaf = x.clone().requires_grad_()
    out = apply_rotary_emb(leaf, cos, sin, interleaved, **kwargs)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    inplace = x.clone()
    assert apply_rotary_emb(inplace, cos, sin, interleaved, inplace=True, **kwargs) is inplace
    assert torch.equal(inplace, out.detach())
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    back = apply_rotary(dout.double(), cos.double(), sin.double(), interleaved=interleaved, conjugate=True, **kwargs)
    torch.testing.assert_close(grad.double(), back, rtol=tol, atol=tol)

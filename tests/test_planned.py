"""The planned path (interface._plans, _ops.FwdPlan): a repeated eager call on separate q, k, v takes its checks and
kernel plan from the first call of its signature. It must compute what the general path computes, bit for bit, and
refuse and fall back exactly where the general path would."""

import pytest
import torch

from cuteflash import (
    _ops,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    interface,
)


def test_plan_keys():
    """The calls that get a key (and so may get a plan), and what tells keys apart (no GPU needed)."""
    q, k, v = (torch.zeros(1, 4, 2, 8, dtype=torch.float16) for _ in range(3))

    def key(q=q, **kw):
        args = dict(varlen=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False)  # fmt: skip
        return interface._plan_key(q, k, v, *{**args, **kw}.values())

    assert key() == key() and key() is not None
    for kw in (dict(dropout_p=0.1), dict(alibi_slopes=torch.ones(2)), dict(return_attn_probs=True),
               dict(window_size=[-1, -1]), dict(dropout_p=torch.tensor(0.0))):  # fmt: skip
        assert key(**kw) is None, kw
    for kw in (dict(causal=True), dict(softcap=1.0), dict(softmax_scale=0.5), dict(window_size=(-1.0, -1)),
               dict(softcap=0), dict(q=q.transpose(1, 2).contiguous().transpose(1, 2))):  # fmt: skip
        assert key(**kw) != key(), kw
    cu = torch.zeros(2, dtype=torch.int32)
    assert key(varlen=(cu, cu, 4, 4)) != key(varlen=(cu, cu, 5, 4))
    assert key(varlen=(cu, cu.long(), 4, 4)) != key(varlen=(cu, cu, 4, 4))
    assert key(varlen=(cu, [0, 4], 4, 4)) is None


@pytest.fixture
def general_path(monkeypatch):
    """A function that runs fn with no plan made or used (every call takes the general path)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(interface, "_plans", {})
            m.setattr(_ops, "plan_forward", lambda *args: None)
            return fn()

    return run


def _call(q, k, v, dout, clone=True, **kwargs):
    """out and, with dout, the gradients of q, k, v (of copies of them, unless clone is False)."""
    leaves = [(t.detach().clone() if clone else t).requires_grad_(dout is not None) for t in (q, k, v)]
    out = flash_attn_func(*leaves, **kwargs)
    if dout is None:
        return (out,)
    out.backward(dout)
    return (out, *(t.grad for t in leaves))


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim): grouped heads; a single query row (the decoding kernel,
# its keys split); more keys than queries.
SHAPES = [(2, 130, 130, 4, 4, 64), (2, 77, 300, 6, 2, 128), (3, 1, 2048, 8, 2, 128), (1, 33, 129, 2, 1, 32)]
OPTIONS = [dict(causal=True), dict(causal=False, window_size=(32, 8)), dict(causal=True, softcap=20.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS, ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_planned_calls_equal_the_general_path(shape, options, backward, make_qkv, require_support, general_path):
    """Three calls of one signature (the first makes the plan) give the general path's out, dq, dk and dv bit for bit
    (the deterministic backward pass, whose dQ has a fixed summation order)."""
    if backward:
        require_support(backward=True)
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, torch.float16)
    dout = torch.randn_like(q) if backward else None
    kwargs = dict(options, deterministic=True)
    expected = general_path(lambda: _call(q, k, v, dout, **kwargs))
    interface._plans.clear()
    for _ in range(3):
        got = _call(q, k, v, dout, **kwargs)
        for name, x, y in zip(("out", "dq", "dk", "dv"), got, expected):
            assert torch.equal(x, y), f"{name} differs from the general path's"
    assert any(isinstance(plan, _ops.FwdPlan) for plan in interface._plans.values())


@pytest.mark.gpu
def test_strided_views_and_misaligned_tensors(make_qkv, require_support, general_path):
    """q and dout as transposed views (read in place through their strides: a plan), and a q 8 bytes off a 16-byte
    boundary after a plan was made for its signature (the general path copies it): the same results."""
    require_support(backward=True)
    q, k, v = make_qkv(2, 96, 96, 4, 4, 64, torch.float16)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # (b, s, h, d) with the heads outermost
    dout = torch.randn_like(q).transpose(1, 2).contiguous().transpose(1, 2)
    kwargs = dict(causal=True, deterministic=True)
    interface._plans.clear()
    for _ in range(2):
        got = _call(q_t, k, v, dout, **kwargs)
        expected = general_path(lambda: _call(q_t, k, v, dout, **kwargs))
        for x, y in zip(got, expected):
            assert torch.equal(x, y)
    buffer = torch.empty(q.numel() + 4, dtype=q.dtype, device=q.device)
    shifted = buffer[4:].view(q.shape).copy_(q)  # 8 bytes past the allocation's start
    dout = dout.contiguous()
    first = _call(q, k, v, dout, **kwargs)
    assert shifted.data_ptr() % 16 and isinstance(interface._plans.get(_key(q, k, v, kwargs)), _ops.FwdPlan)
    for x, y in zip(_call(shifted, k, v, dout, clone=False, **kwargs), first):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_planned_calls_on_new_tensors(causal, make_qkv, require_support, general_path):
    """Calls of one signature on q, k, v at new addresses, with new values, each give their own general path's out: a
    plan holds no address (the sm90 kernels' TMA descriptors hold one, and are built at every call)."""
    shape = (2, 200, 333, 4, 2, 128)
    interface._plans.clear()
    held = []  # kept alive, so that no call's tensors reuse an earlier call's memory
    for _ in range(3):
        q, k, v = make_qkv(*shape, torch.float16)
        held.append((q, k, v))
        args = (q, k, v, None)
        expected = general_path(lambda args=args: _call(*args, clone=False, causal=causal))[0]
        assert torch.equal(_call(*args, clone=False, causal=causal)[0], expected)
    assert any(isinstance(plan, _ops.FwdPlan) for plan in interface._plans.values())


def _key(q, k, v, kwargs):
    """The plan key of flash_attn_func(q, k, v, **kwargs)."""
    return interface._plan_key(
        q, k, v, None, 0.0, None, kwargs.get("causal", False), (-1, -1), 0.0, None, kwargs.get("deterministic", False),
        False,
    )  # fmt: skip


@pytest.mark.gpu
def test_a_plan_does_not_skip_the_checks(make_qkv):
    """After a plan was made for one call, calls that differ in what the checks read are still checked."""
    q, k, v = make_qkv(1, 64, 64, 4, 4, 64, torch.float16)
    flash_attn_func(q, k, v, causal=True)
    flash_attn_func(q, k, v, causal=True)
    with pytest.raises(TypeError, match="one dtype"):
        flash_attn_func(q, k.bfloat16(), v, causal=True)
    with pytest.raises(ValueError, match="same shape"):
        flash_attn_func(q, k, v[:, :32], causal=True)
    with pytest.raises(ValueError, match="cuteflash runs on CUDA GPUs"):
        flash_attn_func(q.cpu(), k, v, causal=True)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, k, v, causal=True, window_size=(-1.0, -1))
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(q, k, v, causal=True, softmax_scale=-1.0)


@pytest.mark.gpu
def test_signatures_that_are_not_planned(make_qkv):
    """A padded head dim, dropout and packed q, k, v make no plan."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 60, torch.float16)
    interface._plans.clear()
    flash_attn_func(q, k, v)
    q, k, v = (t[..., :56] for t in (q, k, v))
    flash_attn_func(q, k, v, dropout_p=0.1)
    flash_attn_qkvpacked_func(torch.stack((q, k, v), dim=2))
    assert not interface._plans


@pytest.mark.gpu
def test_the_environment_picks_the_plan(make_qkv, monkeypatch):
    """CUTEFLASH_BACKEND chooses the family of the plan that serves a call, as it does for the general path."""
    from cuteflash._lib import build_info

    if not {"sm70", "sm80"} <= build_info()["families"].keys() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs both kernel families and a GPU that runs both")
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.float16)
    for family in ("sm80", "sm70", "sm80"):
        monkeypatch.setenv("CUTEFLASH_BACKEND", family)
        flash_attn_func(q, k, v)
        assert interface._plans[_key(q, k, v, {})].problem.family == family


def _varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, **kwargs)
    if dout is None:
        return (out,)
    out.backward(dout)
    return (out, *(t.grad for t in leaves))


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS, ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("nheads_k", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_planned_varlen_calls_equal_the_general_path(nheads_k, options, backward, require_support, general_path):
    """flash_attn_varlen_func: the offsets pass per call; planned calls give the general path's results bit for
    bit, and offsets that are not contiguous (which the general path copies) make no plan."""
    if backward:
        require_support(backward=True)
    require_support(torch.float16)
    lens_q, lens_k = [5, 130, 0, 64], [7, 100, 33, 64]
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0)], dtype=torch.int32, device="cuda") for n in (lens_q, lens_k)
    )
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lens_k), nheads_k, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    dout = torch.randn_like(q) if backward else None
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout)
    kwargs = dict(options, deterministic=True)
    expected = general_path(lambda: _varlen_call(*args, **kwargs))
    interface._plans.clear()
    for _ in range(3):
        for name, x, y in zip(("out", "dq", "dk", "dv"), _varlen_call(*args, **kwargs), expected):
            assert torch.equal(x, y), f"{name} differs from the general path's"
    assert [type(plan) for plan in interface._plans.values()] == [_ops.FwdPlan]
    strided_q, strided_k = (torch.stack((cu, cu), dim=1)[:, 0] for cu in (cu_q, cu_k))
    for _ in range(2):
        got = _varlen_call(q, k, v, strided_q, strided_k, *args[5:], **kwargs)
        for x, y in zip(got, expected):
            assert torch.equal(x, y)
    assert sorted(map(bool, interface._plans.values())) == [False, True]


KV_CASES = [
    # (seqlen_q, nheads, nheads_k, new keys, page size, leftpad, batch_idx, num_splits)
    (1, 8, 2, 1, None, False, True, 0),  # the decoding kernel, its keys split, appending
    (1, 4, 4, 0, 16, True, False, 3),  # paged, three splits
    (40, 4, 2, 40, None, True, False, 0),  # the tiled kernels, appending
    (40, 4, 4, 40, 32, False, False, 1),  # the tiled kernels over a paged cache
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: "q{}-h{}/{}-new{}-page{}-lp{}-bi{}-s{}".format(*c))
def test_planned_kvcache_calls_equal_the_general_path(case, require_head_dim, general_path):
    """flash_attn_with_kvcache: planned calls append and attend as the general path does, bit for bit; int32
    arguments that are not contiguous (which the general path copies) make no plan."""
    seqlen_q, nheads, nheads_k, new, page, leftpad, batch_idx, splits = case
    require_head_dim(128)
    batch, rows = 3, 320
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(batch, seqlen_q, nheads, 128, **dev)
    k_cache, v_cache = (torch.randn(batch + 2, rows, nheads_k, 128, **dev) for _ in range(2))
    k, v = (torch.randn(batch, new, nheads_k, 128, **dev) if new else None for _ in range(2))
    ints = dict(dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([0, 131, rows - new], **ints)
    pad = torch.tensor([0, 57, 100], **ints) if leftpad else None
    idx = torch.tensor([4, 0, 2], **ints) if batch_idx else None
    table = None
    if page is not None:  # each sequence's rows as pages of the pool, in reverse order
        k_cache, v_cache = (t[:batch].reshape(-1, page, nheads_k, 128) for t in (k_cache, v_cache))
        table = torch.arange(k_cache.shape[0], **ints).flip(0).view(batch, -1).contiguous()

    def run(seqlens=seqlens, pad=pad, keep_lse=True):
        kc, vc = k_cache.clone(), v_cache.clone()
        result = flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, cache_leftpad=pad, block_table=table,
            causal=True, num_splits=splits, return_softmax_lse=keep_lse,
        )  # fmt: skip
        return (*result, kc, vc) if keep_lse else (result, None, kc, vc)

    expected = general_path(run)
    interface._plans.clear()
    for keep_lse in (False, True, True):  # (the plan made by a call without the log-sum-exp serves one with it)
        for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), run(keep_lse=keep_lse), expected):
            assert x is None if name == "lse" and not keep_lse else torch.equal(x, y), f"{name} differs"
    assert [type(plan) for plan in interface._plans.values()] == [_ops.KvcachePlan]
    strided = torch.stack((seqlens, seqlens), dim=1)[:, 0]
    for _ in range(2):
        for x, y in zip(run(seqlens=strided), expected):
            assert torch.equal(x, y)
    assert sorted(map(bool, interface._plans.values())) == [False, True]


@pytest.mark.gpu
def test_prepared_launches_check_their_addresses(make_qkv, require_support):
    """The launches a plan keeps (_C.FwdLaunch, _C.BwdLaunch) refuse a null or misaligned address, and one that the
    prepared launch does not take, with a ValueError (never a kernel reading out of bounds)."""
    require_support(backward=True)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 64, 64, 2, 2, 64, torch.float16))
    interface._plans.clear()
    dout = torch.randn_like(q)  # (the gradient of a sum, all strides 0, would be copied: no backward plan)
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True).backward(dout)
    plan = interface._plans[_key(q, k, v, dict(causal=True))]
    (bwd,) = plan.bwd.values()
    torch.cuda.synchronize()
    addr, stream = q.data_ptr(), torch.cuda.current_stream().cuda_stream
    fwd_ok = [addr] * 5 + [stream] + [0] * 9  # q, k, v, out, lse, stream, then none of the optional addresses
    for index, bad in ((0, 0), (2, addr + 8), (4, addr + 2), (6, addr), (11, addr)):
        with pytest.raises(ValueError, match="cuteflash"):
            plan.launch(*fwd_ok[:index], bad, *fwd_ok[index + 1 :])
    bwd_ok = [addr] * 5 + [stream, 0, 0] + [addr] * 6
    for index, bad in ((8, 0), (9, addr + 8), (6, addr)):
        with pytest.raises(ValueError, match="cuteflash"):
            bwd.launch(*bwd_ok[:index], bad, *bwd_ok[index + 1 :])
    torch.cuda.synchronize()  # nothing was launched: the stream is clean


@pytest.mark.gpu
def test_planned_calls_captured_in_a_cuda_graph(make_qkv, monkeypatch):
    """A planned call without a gradient writes its log-sum-exp to the device's shared scratch: made outside a
    capture (a buffer that stays), and not made during one. Replays compute the eager call's out."""
    q, k, v = make_qkv(2, 128, 128, 4, 4, 64, torch.float16)
    interface._plans.clear()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v, causal=True)  # makes the plan (warm-up outside the capture)
        monkeypatch.setattr(_ops, "_lse_scratch", {})
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert not _ops._lse_scratch  # not made during the capture
    expected = flash_attn_func(q, k, v, causal=True)  # makes the scratch
    assert _ops._lse_scratch
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True)) and not torch.equal(out, expected)

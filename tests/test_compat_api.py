"""The flash-attn compatibility package's API: flash-attn 2.8.3's signatures (against a list written from its
source), its custom ops in the flash_attn namespace with their fake implementations, the errors for what cuteflash
does not implement, and on the GPU the private functions that ring-flash-attn calls, against the references with
the 2x rule."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cuteflash
from cuteflash import _ops
from cuteflash import interface as cuteflash_interface
from cuteflash.reference import attention_ref

R = inspect.Parameter.empty  # a parameter without default
_OPTIONS = [
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
]
_VARLEN = [("cu_seqlens_q", R), ("cu_seqlens_k", R), ("max_seqlen_q", R), ("max_seqlen_k", R)]

# flash-attn 2.8.3's parameters (name, default), in order, from flash_attn/flash_attn_interface.py,
# flash_attn/bert_padding.py and flash_attn/layers/rotary.py.
FLASH_ATTN_2_8_3 = {
    "flash_attn_qkvpacked_func": [("qkv", R)] + _OPTIONS,
    "flash_attn_kvpacked_func": [("q", R), ("kv", R)] + _OPTIONS,
    "flash_attn_func": [("q", R), ("k", R), ("v", R)] + _OPTIONS,
    "flash_attn_varlen_qkvpacked_func": [("qkv", R), ("cu_seqlens", R), ("max_seqlen", R)] + _OPTIONS,
    "flash_attn_varlen_kvpacked_func": [("q", R), ("kv", R)] + _VARLEN + _OPTIONS,
    "flash_attn_varlen_func": [("q", R), ("k", R), ("v", R)] + _VARLEN + _OPTIONS + [("block_table", None)],
    "flash_attn_with_kvcache": [
        ("q", R),
        ("k_cache", R),
        ("v_cache", R),
        ("k", None),
        ("v", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("block_table", None),
        ("softmax_scale", None),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("softcap", 0.0),
        ("rotary_interleaved", True),
        ("alibi_slopes", None),
        ("num_splits", 0),
        ("return_softmax_lse", False),
    ],
    "_flash_attn_forward": [
        (n, R)
        for n in "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
        "return_softmax".split()
    ],
    "_flash_attn_varlen_forward": [("q", R), ("k", R), ("v", R)]
    + _VARLEN
    + [
        ("dropout_p", R),
        ("softmax_scale", R),
        ("causal", R),
        ("window_size_left", -1),
        ("window_size_right", -1),
        ("softcap", 0.0),
        ("alibi_slopes", None),
        ("return_softmax", False),
        ("block_table", None),
        ("leftpad_k", None),
        ("seqused_k", None),
        ("zero_tensors", False),
        ("num_splits", 0),  # 2.8.4's addition
    ],
    "_flash_attn_backward": [(n, R) for n in "dout q k v out softmax_lse dq dk dv".split()]
    + [
        (n, R)
        for n in "dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
        "deterministic".split()
    ]
    + [("rng_state", None)],
    "_flash_attn_varlen_backward": [(n, R) for n in "dout q k v out softmax_lse dq dk dv".split()]
    + _VARLEN
    + [
        (n, R)
        for n in "dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
        "deterministic".split()
    ]
    + [("rng_state", None), ("zero_tensors", False)],
    "bert_padding.unpad_input": [("hidden_states", R), ("attention_mask", R), ("unused_mask", None)],
    "bert_padding.pad_input": [("hidden_states", R), ("indices", R), ("batch", R), ("seqlen", R)],
    "layers.rotary.apply_rotary_emb": [
        ("x", R),
        ("cos", R),
        ("sin", R),
        ("interleaved", False),
        ("inplace", False),
        ("seqlen_offsets", 0),
        ("cu_seqlens", None),
        ("max_seqlen", None),
    ],
}
PRIVATE = ["_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward", "_flash_attn_varlen_backward"]


def _function(flash_attn, name: str):
    """The package's function of that name (in flash_attn_interface unless the name says a module); for a custom
    op, the function it was made from, which is what ring-flash-attn inspects (its get_default_args reads a
    CustomOpDef's _init_fn)."""
    module, _, attr = name.rpartition(".")
    fn = getattr(importlib.import_module(f"flash_attn.{module or 'flash_attn_interface'}"), attr)
    return getattr(fn, "_init_fn", fn)


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_8_3))
def test_signatures_are_flash_attn_2_8_3s(name, flash_attn_compat):
    parameters = inspect.signature(_function(flash_attn_compat, name)).parameters.values()
    assert [(p.name, p.default) for p in parameters] == FLASH_ATTN_2_8_3[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)  # passed positionally too


@pytest.mark.parametrize("name", PRIVATE)
def test_custom_ops_in_the_flash_attn_namespace(name, flash_attn_compat):
    """torch.ops.flash_attn.<name> is the function itself, with flash-attn's schema: the arguments in order, the
    backward functions writing dq, dk and dv, and a fake implementation."""
    op = getattr(torch.ops.flash_attn, name)
    assert getattr(flash_attn_compat.flash_attn_interface, name)._opoverload is op.default
    schema = op.default._schema
    assert [a.name for a in schema.arguments] == [n for n, _ in FLASH_ATTN_2_8_3[name]]
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == (["dq", "dk", "dv"] if "backward" in name else [])
    assert len(schema.returns) == (4 if "forward" in name else 1)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), "Meta")


def test_ring_flash_attn_reads_the_defaults(flash_attn_compat):
    """ring-flash-attn fills its calls from the private functions' defaults (its utils.get_default_args)."""
    fn = flash_attn_compat.flash_attn_interface._flash_attn_varlen_backward
    assert not inspect.isfunction(fn)
    spec = inspect.getfullargspec(fn._init_fn)
    defaults = dict(zip(spec.args[-len(spec.defaults) :], spec.defaults))
    assert defaults == {"rng_state": None, "zero_tensors": False}


def test_public_functions_are_cuteflashs(flash_attn_compat):
    for name in FLASH_ATTN_2_8_3:
        if not name.startswith("_") and "." not in name:
            assert getattr(flash_attn_compat, name) is getattr(cuteflash, name)
    from cuteflash import bert_padding, rotary
    from flash_attn import bert_padding as fa_bert_padding
    from flash_attn.layers import rotary as fa_rotary

    for name in ("index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"):
        assert getattr(fa_bert_padding, name) is getattr(bert_padding, name)
    assert fa_rotary.apply_rotary_emb is fa_rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


@pytest.mark.parametrize("return_softmax", [False, True])
def test_fake_forward_shapes_are_flash_attn_s(return_softmax, flash_attn_compat):
    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 64, dtype=torch.float16)
        k = torch.empty(2, 300, 2, 64, dtype=torch.float16)
        out, lse, s_dmask, rng_state = torch.ops.flash_attn._flash_attn_forward(
            q, k, k, 0.1, 0.125, True, -1, -1, 0.0, None, return_softmax
        )
        q_v, k_v = torch.empty(150, 8, 64, dtype=torch.bfloat16), torch.empty(170, 2, 64, dtype=torch.bfloat16)
        cu = torch.empty(4, dtype=torch.int32)
        out_v, lse_v, s_dmask_v, rng_state_v = torch.ops.flash_attn._flash_attn_varlen_forward(
            q_v, k_v, k_v, cu, cu, 70, 130, 0.1, 0.125, True, return_softmax=return_softmax
        )
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    assert (lse.shape, lse.dtype) == ((2, 8, 100), torch.float32)
    assert (s_dmask.shape, s_dmask.dtype) == ((2, 8, 128, 384) if return_softmax else (0,), q.dtype)
    assert (rng_state.shape, rng_state.dtype) == ((2,), torch.int64)
    assert (out_v.shape, out_v.dtype) == (q_v.shape, q_v.dtype)
    assert (lse_v.shape, lse_v.dtype) == ((8, 150), torch.float32)
    assert (s_dmask_v.shape, s_dmask_v.dtype) == ((3, 8, 128, 256) if return_softmax else (0,), q_v.dtype)
    assert (rng_state_v.shape, rng_state_v.dtype) == ((2,), torch.int64)


def test_fake_backward_shapes_are_flash_attn_s(flash_attn_compat):
    with FakeTensorMode():
        q, k = torch.empty(2, 100, 8, 64, dtype=torch.float16), torch.empty(2, 300, 2, 64, dtype=torch.float16)
        lse = torch.empty(2, 8, 100)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
        softmax_d = torch.ops.flash_attn._flash_attn_backward(
            q, q, k, k, q, lse, dq, dk, dv, 0.0, 0.125, True, -1, -1, 0.0, None, False
        )
        q_v, k_v = torch.empty(150, 8, 64, dtype=torch.float16), torch.empty(170, 2, 64, dtype=torch.float16)
        cu = torch.empty(4, dtype=torch.int32)
        lse_v = torch.empty(8, 150)
        args_v = (q_v, q_v, k_v, k_v, q_v, lse_v, None, None, None, cu, cu, 70, 130, 0.0, 0.125, True, -1, -1)
        softmax_d_v = torch.ops.flash_attn._flash_attn_varlen_backward(*args_v, 0.0, None, False)
    assert (softmax_d.shape, softmax_d.dtype) == ((2, 8, 128), torch.float32)
    assert (softmax_d_v.shape, softmax_d_v.dtype) == ((8, 150 + 128 * 3), torch.float32)


def _cpu_qkv(varlen=False):
    shape = (10, 2, 8) if varlen else (1, 10, 2, 8)
    return [torch.randn(shape, dtype=torch.float16) for _ in range(3)]


def test_unsupported_features_raise(flash_attn_compat):
    """What cuteflash does not implement raises before anything runs (the functions the ops were made from are
    called directly, on the CPU)."""
    fi = flash_attn_compat.flash_attn_interface
    qv, kv, vv = _cpu_qkv(varlen=True)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for name in ("leftpad_k", "seqused_k"):
        with pytest.raises(NotImplementedError, match=f"dropout_p > 0 with {name} is not implemented"):
            fi._flash_attn_varlen_forward._init_fn(qv, kv, vv, cu, cu, 6, 6, 0.1, 0.3, True, **{name: cu[1:]})
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported"):  # as flash-attn 2.8.4 refuses it
        fi._flash_attn_varlen_forward._init_fn(qv, kv, vv, cu, cu, 6, 6, 0.0, 0.3, True, num_splits=2)


def test_flash_attn_s_own_refusals_raise(flash_attn_compat):
    """Calls flash-attn refuses, or would answer wrongly, raise: the attention matrix without dropout, and a
    backward pass with dropout but no rng_state (flash-attn would draw a new mask)."""
    fi = flash_attn_compat.flash_attn_interface
    q, k, v = _cpu_qkv()
    with pytest.raises(ValueError, match="return_softmax needs dropout_p > 0"):
        fi._flash_attn_forward._init_fn(q, k, v, 0.0, 0.3, False, -1, -1, 0.0, None, True)
    with pytest.raises(ValueError, match="needs the rng_state that the forward call returned"):
        fi._flash_attn_backward._init_fn(
            q, q, k, v, q, None, None, None, None, 0.1, 0.3, False, -1, -1, 0.0, None, False
        )


def test_cuteflash_internals_it_calls():
    """The package wraps these cuteflash internals: a change of their parameters must change it too."""
    expected = {
        _ops.fwd_impl: ["q", "k", "v", "softmax_scale", "causal", "varlen", "options"],
        _ops.bwd_into: "dq dk dv dout q k v out lse softmax_scale causal deterministic varlen options".split(),
        _ops.draw_rng_state: ["device"],
        cuteflash_interface._check_qkv: ["q", "k", "v", "varlen"],
        cuteflash_interface._check_varlen: ["q", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
        cuteflash_interface._check_options: ["q", "batch", "window_size", "softcap", "alibi_slopes"],
        cuteflash_interface._check_dropout: ["dropout_p"],
        cuteflash_interface._check_scale: ["softmax_scale"],
        cuteflash_interface._attn_probs: ["q", "k", "lse", "varlen", "softmax_scale", "causal", "options"],
    }
    for fn, names in expected.items():
        assert list(inspect.signature(fn).parameters)[: len(names)] == names, fn.__name__
    fields = ("window_left", "window_right", "softcap", "alibi_slopes", "dropout_p", "rng_state")
    assert _ops.Options._fields == fields
    assert _ops.Varlen._fields == ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


# ---- On the GPU: the private functions against the references.


def _reference(q, k, v, dout, compute_dtype, **options):
    """out, lse, [dq, dk, dv] of the reference attention computed in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, compute_dtype=compute_dtype, **options)
    out.backward(dout.to(compute_dtype))
    return out, lse, [t.grad for t in leaves]


D_TOLERANCE = dict(rtol=1e-5, atol=1e-4)  # softmax_d sums in fp32


def _rowsum(dout, out) -> torch.Tensor:
    """D = rowsum(dO * O) in float64, (..., nheads)."""
    return (dout.double() * out.double()).sum(-1)


OPTION_CASES = {
    "plain": {},
    "window": dict(window_size=(40, 7)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slopes="alibi"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("seqlens", [(113, 300), (300, 113)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward_and_backward(
    seqlens, case, causal, dtype, flash_attn_compat, make_qkv, assert_close_2x, require_support
):
    """_flash_attn_forward and _flash_attn_backward (GQA, head dim 64) against the references; the gradients go
    into views of larger buffers, as ring-flash-attn passes them, and softmax_d is D = rowsum(dO * O)."""
    require_support(dtype, backward=True)
    fi = flash_attn_compat.flash_attn_interface
    q, k, v = make_qkv(2, *seqlens, 8, 2, 64, dtype)
    options = dict(OPTION_CASES[case])
    if options.get("alibi_slopes") == "alibi":
        options["alibi_slopes"] = torch.rand(8, device="cuda", dtype=torch.float32)
    window = options.get("window_size", (-1, -1))
    scale = 0.11
    out, lse, s_dmask, rng_state = fi._flash_attn_forward(
        q, k, v, 0.0, scale, causal, *window, options.get("softcap", 0.0), options.get("alibi_slopes"), False
    )
    assert s_dmask.shape == (0,) and (rng_state.shape, rng_state.dtype) == ((2,), torch.int64)
    dout = torch.randn_like(q)
    out_ref, lse_ref, grads_ref = _reference(
        q, k, v, dout, torch.float64, softmax_scale=scale, causal=causal, **options
    )
    out_pt, lse_pt, grads_pt = _reference(q, k, v, dout, dtype, softmax_scale=scale, causal=causal, **options)
    assert_close_2x("out", out, out_ref, out_pt)
    assert_close_2x("lse", lse, lse_ref, lse_pt)

    buffers = [
        torch.full((t.shape[0], t.shape[1] + 5, *t.shape[2:]), float("nan"), dtype=dtype, device="cuda")
        for t in (q, k, v)
    ]
    grads = [b[:, : t.shape[1]] for b, t in zip(buffers, (q, k, v))]
    softmax_d = fi._flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *grads,
        0.0,
        scale,
        causal,
        *window,
        options.get("softcap", 0.0),
        options.get("alibi_slopes"),
        False,
        rng_state,
    )
    for name, g, r, p, b in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt, buffers):
        assert_close_2x(name, g, r, p)
        assert b[:, g.shape[1] :].isnan().all(), f"{name}: written past its view"
    batch, seqlen_q, nheads = q.shape[:3]
    assert (softmax_d.shape, softmax_d.dtype) == ((batch, nheads, _round128(seqlen_q)), torch.float32)
    torch.testing.assert_close(softmax_d[:, :, :seqlen_q].double(), _rowsum(dout, out).transpose(1, 2), **D_TOLERANCE)
    assert (softmax_d[:, :, seqlen_q:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_forward_and_backward(dtype, flash_attn_compat, require_support, assert_close_2x):
    """The varlen pair on sequences of 1 to 113 rows (GQA, causal) with 5 rows past the last sequence, which
    zero_tensors zeroes; each sequence against the references, softmax_d in flash-attn's padded layout."""
    require_support(dtype, backward=True)
    fi = flash_attn_compat.flash_attn_interface
    lengths_q, lengths_k = [1, 17, 113, 40], [5, 17, 60, 113]
    cu_q, cu_k = (torch.tensor([0, *ls], device="cuda").cumsum(0).to(torch.int32) for ls in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q) + 5, 8, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lengths_k) + 5, 2, 64, device="cuda", dtype=dtype) for _ in range(2))
    scale = 0.125
    out, lse, _, _ = fi._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.0, scale, True, zero_tensors=True
    )
    dout = torch.randn_like(q)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    softmax_d = fi._flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        *grads,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        0.0,
        scale,
        True,
        -1,
        -1,
        0.0,
        None,
        False,
        None,
        True,
    )
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    assert (out[total_q:] == 0).all() and torch.isneginf(lse[:, total_q:]).all()
    assert (grads[0][total_q:] == 0).all() and (grads[1][total_k:] == 0).all() and (grads[2][total_k:] == 0).all()
    assert softmax_d.shape == (8, q.shape[0] + 128 * len(lengths_q))
    d = _rowsum(dout, out)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        seq = [t[rows].unsqueeze(0) for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        out_ref, lse_ref, grads_ref = _reference(
            *seq, dout[rows_q].unsqueeze(0), torch.float64, softmax_scale=scale, causal=True
        )
        out_pt, lse_pt, grads_pt = _reference(*seq, dout[rows_q].unsqueeze(0), dtype, softmax_scale=scale, causal=True)
        assert_close_2x(f"out {b}", out[rows_q].unsqueeze(0), out_ref, out_pt)
        assert_close_2x(f"lse {b}", lse[:, rows_q].unsqueeze(0), lse_ref, lse_pt)
        for name, g, rows, r, p in zip(("dq", "dk", "dv"), grads, (rows_q, rows_k, rows_k), grads_ref, grads_pt):
            assert_close_2x(f"{name} {b}", g[rows].unsqueeze(0), r, p)
        padded = slice(bq[b] + 128 * b, bq[b + 1] + 128 * b)
        torch.testing.assert_close(softmax_d[:, padded].double(), d[rows_q].t(), **D_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_dropout_rng_state_round_trip(softcap, flash_attn_compat, make_qkv, require_support):
    """With dropout (and softcap), the forward call's rng_state makes the backward call drop what it dropped: the
    results equal cuteflash's own autograd path under the same seed, bit for bit (deterministic backward)."""
    require_support(backward=True)
    fi = flash_attn_compat.flash_attn_interface
    q, k, v = make_qkv(2, 150, 200, 4, 2, 64, torch.float16)
    dout = torch.randn_like(q)
    torch.manual_seed(7)
    out, lse, s_dmask, rng_state = fi._flash_attn_forward(q, k, v, 0.25, 0.125, True, -1, -1, softcap, None, True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    softmax_d = fi._flash_attn_backward(
        dout, q, k, v, out, lse, *grads, 0.25, 0.125, True, -1, -1, softcap, None, True, rng_state
    )
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out_cf, lse_cf, s_dmask_cf = cuteflash.flash_attn_func(
        *leaves, 0.25, 0.125, True, softcap=softcap, deterministic=True, return_attn_probs=True
    )
    out_cf.backward(dout)
    assert (rng_state.shape, rng_state.dtype, rng_state[1].item()) == ((2,), torch.int64, 0)
    assert torch.equal(out, out_cf) and torch.equal(lse, lse_cf) and torch.equal(s_dmask, s_dmask_cf)
    for name, g, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert torch.equal(g, leaf.grad), name
    torch.testing.assert_close(softmax_d[:, :, :150].double(), 0.75 * _rowsum(dout, out).transpose(1, 2), **D_TOLERANCE)


@pytest.mark.gpu
def test_opcheck(flash_attn_compat, make_qkv, require_support):
    """torch.library.opcheck: schemas (what each op writes), fake implementations against the real ones, and
    AOT dispatch, for the four ops."""
    require_support(backward=True)
    q, k, v = make_qkv(2, 70, 90, 4, 2, 64, torch.float16)
    out, lse, _, _ = torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    dout = torch.randn_like(q)
    torch.library.opcheck(
        torch.ops.flash_attn._flash_attn_forward.default, (q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    )
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    args = (dout, q, k, v, out, lse, *grads, 0.0, 0.125, True, -1, -1, 0.0, None, False, None)
    torch.library.opcheck(torch.ops.flash_attn._flash_attn_backward.default, args)
    cu = torch.tensor([0, 70, 140], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.flatten(0, 1) for t in (q, k, v))
    fwd_args = (qv, kv, vv, cu, cu_k, 70, 90, 0.0, 0.125, True)
    torch.library.opcheck(torch.ops.flash_attn._flash_attn_varlen_forward.default, fwd_args)
    out_v, lse_v, _, _ = torch.ops.flash_attn._flash_attn_varlen_forward(*fwd_args)
    grads_v = tuple(torch.empty_like(t) for t in (qv, kv, vv))
    bwd_args = (dout.flatten(0, 1), qv, kv, vv, out_v, lse_v, *grads_v, cu, cu_k, 70, 90, 0.0, 0.125, True, -1, -1)
    torch.library.opcheck(torch.ops.flash_attn._flash_attn_varlen_backward.default, (*bwd_args, 0.0, None, False))


@pytest.mark.gpu
def test_paged_varlen_forward(flash_attn_compat, require_support):
    """block_table: the paged cache as cuteflash.flash_attn_varlen_func reads it."""
    require_support(torch.float16)
    fi = flash_attn_compat.flash_attn_interface
    lengths_q, lengths_k = [3, 20], [40, 77]
    cu_q, cu_k = (torch.tensor([0, *ls], device="cuda").cumsum(0).to(torch.int32) for ls in (lengths_q, lengths_k))
    q = torch.randn(sum(lengths_q), 4, 64, device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(12, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    block_table = torch.randperm(12, device="cuda")[:10].view(2, 5).int()
    args = (q, k_cache, v_cache, cu_q, cu_k, 20, 77, 0.0, 0.125, True)
    out, lse, s_dmask, _ = fi._flash_attn_varlen_forward(*args, block_table=block_table)
    out_cf, lse_cf, _ = cuteflash.flash_attn_varlen_func(*args, return_attn_probs=True, block_table=block_table)
    assert torch.equal(out, out_cf) and torch.equal(lse, lse_cf) and s_dmask.shape == (0,)


@pytest.mark.gpu
def test_head_dim_must_be_a_multiple_of_8(flash_attn_compat, make_qkv):
    q, k, v = make_qkv(1, 16, 16, 2, 2, 36, torch.float16)
    with pytest.raises(ValueError, match="multiples of 8"):
        flash_attn_compat.flash_attn_interface._flash_attn_forward(q, k, v, 0.0, 0.1, False, -1, -1, 0.0, None, False)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_varlen_forward_seqused_and_leftpad(head_dim, paged, flash_attn_compat, require_support, assert_close_2x):
    """seqused_k and leftpad_k of _flash_attn_varlen_forward: sequence b attends to keys [leftpad_k[b],
    seqused_k[b]) of its own (its rows from cu_seqlens_k[b] on, or its pages), causal aligned to the last of them;
    num_splits 0 and 1 give the same bits."""
    require_support(torch.float16)
    fi = flash_attn_compat.flash_attn_interface
    dev = dict(device="cuda", dtype=torch.float16)
    lengths_q, slots_k = [3, 20, 1], [40, 96, 64]
    used, leftpad = [40, 50, 1], [0, 7, 0]
    cu_q, cu_k = (torch.tensor([0, *ls], device="cuda").cumsum(0).to(torch.int32) for ls in (lengths_q, slots_k))
    q = torch.randn(sum(lengths_q), 4, head_dim, **dev)
    k, v = (torch.randn(sum(slots_k), 2, head_dim, **dev) for _ in range(2))
    seqused_k = torch.tensor(used, dtype=torch.int32, device="cuda")
    leftpad_k = torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    keys = []  # each sequence's slots of k and v
    for b in range(3):
        keys.append([t[int(cu_k[b]) : int(cu_k[b + 1])] for t in (k, v)])
    extra = {}
    if paged:  # each sequence's slots on pages of 16 rows of a shuffled pool
        pages = torch.randperm(20, device="cuda")[:18].view(3, 6).int()
        k, v = (torch.randn(20, 16, 2, head_dim, **dev) for _ in range(2))
        for b, (kb, vb) in enumerate(keys):
            for t, src in ((k, kb), (v, vb)):
                t[pages[b].long()] = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, 96 - src.shape[0])).view(6, 16, 2, -1)
        extra["block_table"] = pages
        leftpad_k = None  # flash-attn takes no left padding with a paged cache
        leftpad = [0, 0, 0]
    args = (q, k, v, cu_q, cu_k, 20, 96, 0.0, 0.3, True)
    out, lse, _, _ = fi._flash_attn_varlen_forward(*args, leftpad_k=leftpad_k, seqused_k=seqused_k, **extra)
    for splits in (0, 1):
        again = fi._flash_attn_varlen_forward(
            *args, leftpad_k=leftpad_k, seqused_k=seqused_k, num_splits=splits, **extra
        )[0]
        assert torch.equal(out, again)
    for b, (kb, vb) in enumerate(keys):
        qb = q[int(cu_q[b]) : int(cu_q[b + 1])].unsqueeze(0)
        kb, vb = (t[leftpad[b] : used[b]].unsqueeze(0) for t in (kb, vb))
        ref, lse_ref = attention_ref(qb, kb, vb, 0.3, True, torch.float64)
        pt, _ = attention_ref(qb, kb, vb, 0.3, True, torch.float16)
        assert_close_2x(f"sequence {b}", out[int(cu_q[b]) : int(cu_q[b + 1])].unsqueeze(0), ref, pt)


@pytest.mark.gpu
def test_flash_attn_gpu_entry_points(flash_attn_compat, make_qkv, require_support):
    """flash_attn_2_cuda (flash_attn_interface.flash_attn_gpu): flash-attn 2.8's positional entry points give the
    private functions' results bit for bit, write the given out / dq / dk / dv buffers, and return flash-attn's
    lists."""
    require_support(backward=True)
    import flash_attn_2_cuda as gpu

    fi = flash_attn_compat.flash_attn_interface
    assert fi.flash_attn_gpu is gpu
    q, k, v = make_qkv(2, 70, 90, 4, 2, 64, torch.float16)
    opts = (0.0, 0.125, True, -1, -1, 0.0)
    out_buf = torch.empty_like(q)
    out, lse, s_dmask, rng_state = gpu.fwd(q, k, v, out_buf, None, *opts, False, None)
    want = fi._flash_attn_forward(q, k, v, *opts, None, False)
    assert out is out_buf and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    dout = torch.randn_like(q)
    dq, dk, dv, softmax_d = gpu.bwd(dout, q, k, v, out, lse, None, None, None, None, *opts, False, None, rng_state)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    want_d = fi._flash_attn_backward(dout, q, k, v, out, lse, *grads, *opts, None, False, rng_state)
    for got, ref in zip((dq, dk, dv, softmax_d), (*grads, want_d)):
        assert torch.equal(got, ref)

    cu_q = torch.tensor([0, 70, 140], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.flatten(0, 1) for t in (q, k, v))
    vout, vlse, _, vrng = gpu.varlen_fwd(
        qv, kv, vv, None, cu_q, cu_k, None, None, None, None, 70, 90, *opts[:2], False, *opts[2:], False, None, 0
    )
    assert torch.equal(vout, out.flatten(0, 1))
    vgrads = [torch.empty_like(t) for t in (qv, kv, vv)]
    res = gpu.varlen_bwd(
        dout.flatten(0, 1), qv, kv, vv, vout, vlse, *vgrads, cu_q, cu_k, None, 70, 90, *opts[:2], False, *opts[2:],
        False, None, vrng,
    )  # fmt: skip
    assert all(r is g for r, g in zip(res[:3], vgrads))
    assert torch.equal(res[0], dq.flatten(0, 1)) and torch.equal(res[2], dv.flatten(0, 1))

    k_cache, v_cache = (torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([90, 17], dtype=torch.int32, device="cuda")
    kc_out, kc_lse = gpu.fwd_kvcache(
        q[:, :1], k_cache, v_cache, None, None, seqlens, None, None, None, None, None, None, None, 0.125, True, -1, -1,
        0.0, True, 0,
    )  # fmt: skip
    ref_out, ref_lse = fi.flash_attn_with_kvcache(
        q[:, :1], k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=0.125, causal=True, return_softmax_lse=True
    )
    assert torch.equal(kc_out, ref_out) and torch.equal(kc_lse, ref_lse)


@pytest.mark.gpu
def test_dropout_that_keeps_everything(flash_attn_compat, make_qkv, require_support):
    """diffusers calls _wrapped_flash_attn_forward with dropout_p=1e-30 (to get the log-sum-exp in training): that
    keeps every probability and scales by exactly 1, so the results equal dropout_p=0's bit for bit, without the
    dropout kernels; the backward pass takes the rng_state it returns."""
    require_support(backward=True)
    fi = flash_attn_compat.flash_attn_interface
    q, k, v = make_qkv(1, 100, 100, 2, 2, 64, torch.float16)
    out, lse, _, rng_state = fi._wrapped_flash_attn_forward(q, k, v, 1e-30, 0.125, True, -1, -1, 0.0, None, False)
    out0, lse0, _, _ = fi._wrapped_flash_attn_forward(q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    dout = torch.randn_like(q)
    grads, grads0 = ([torch.empty_like(t) for t in (q, k, v)] for _ in range(2))
    fi._wrapped_flash_attn_backward(
        dout, q, k, v, out, lse, *grads, 1e-30, 0.125, True, -1, -1, 0.0, None, False, rng_state
    )
    fi._wrapped_flash_attn_backward(dout, q, k, v, out, lse, *grads0, 0.0, 0.125, True, -1, -1, 0.0, None, False, None)
    for a, b in zip(grads, grads0):
        assert torch.equal(a, b)

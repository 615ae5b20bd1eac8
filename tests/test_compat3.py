"""FA3's interface (compat3/: the distribution flash_attn_3, modules flash_attn_interface and flash_attn_3): the
signatures FA3 callers use, its wheel, attention_chunk's regrouping (on the CPU, against the chunk mask written
out), flash_attn_combine; on a GPU the functions and ops against cuteflash's and the float64 reference with the 2x
rule, attention_chunk forward and backward, and transformers' flash_attention_3 against sdpa."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import cuteflash
from cuteflash.reference import attention_ref

ROOT = Path(__file__).resolve().parents[1]
COMPAT3 = ROOT / "compat3"

# FA3's parameters, in order (Dao-AILab/flash-attention hopper/flash_attn_interface.py, November 2026).
FA3_SIGNATURES = {
    "flash_attn_func": "q k v softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
    "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k "
    "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk softcap num_splits pack_gqa "
    "deterministic sm_margin return_attn_probs",
    "flash_attn_qkvpacked_func": "qkv softmax_scale causal q_descale k_descale v_descale window_size "
    "attention_chunk softcap deterministic num_heads_q sm_margin return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx "
    "cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens q_descale k_descale "
    "v_descale softmax_scale causal window_size attention_chunk softcap rotary_interleaved scheduler_metadata "
    "num_splits pack_gqa sm_margin return_softmax_lse",
    "flash_attn_combine": "out_partial lse_partial out out_dtype",
    "get_scheduler_metadata": "batch_size max_seqlen_q max_seqlen_k num_heads_q num_heads_kv headdim cache_seqlens "
    "qkv_dtype headdim_v cu_seqlens_q cu_seqlens_k_new cache_leftpad page_size max_seqlen_k_new causal window_size "
    "attention_chunk has_softcap num_splits pack_gqa sm_margin",
}


@pytest.fixture(scope="module")
def fa3():
    """The flash_attn_interface module: the installed one, else the source tree's (compat3/src)."""
    if importlib.util.find_spec("flash_attn_interface") is None:
        sys.path.append(str(COMPAT3 / "src"))
    module = importlib.import_module("flash_attn_interface")
    if not hasattr(module, "_chunk_groups"):
        pytest.skip(f"flash_attn_interface at {module.__file__} is not cuteflash's")
    return module


def test_signatures_are_fa3s(fa3):
    for name, params in FA3_SIGNATURES.items():
        assert list(inspect.signature(getattr(fa3, name)).parameters) == params.split(), name
    package = importlib.import_module("flash_attn_3.flash_attn_interface")
    assert package.flash_attn_func is fa3.flash_attn_func
    assert hasattr(torch.ops.flash_attn_3, "_flash_attn_forward") and hasattr(torch.ops.flash_attn_3, "fwd") is False


def test_unimplemented_arguments_are_named(fa3):
    x = torch.zeros(1, 4, 2, 16)
    for name in ("qv", "q_descale", "k_descale", "v_descale"):
        with pytest.raises(NotImplementedError, match=name):
            fa3.flash_attn_func(x, x, x, **{name: x})
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fa3.flash_attn_varlen_func(x[0], x[0], x[0], None, None, 4, 4, seqused_q=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="cu_seqlens_k_new"):
        fa3.flash_attn_with_kvcache(x, x, x, cu_seqlens_k_new=torch.zeros(2))
    with pytest.raises(ValueError, match="attention_chunk"):
        fa3.flash_attn_func(x, x, x, attention_chunk=-1)


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunk_groups_hold_each_query_with_its_chunk(fa3, chunk):
    """Every query lands in one group whose keys are its chunk's (up to the sequence's end) and in which the
    bottom-right alignment puts it at its own position: the causal mask and windows are unchanged."""
    lengths_q, lengths_k = [5, 0, 17, 9, 1], [5, 3, 20, 6, 12]  # seqlen_q > seqlen_k in the fourth
    cu_q = torch.tensor([0, *lengths_q]).cumsum(0).int()
    cu_k = torch.tensor([0, *lengths_k]).cumsum(0).int()
    gq, gk = fa3._chunk_groups(cu_q, cu_k, max(lengths_k), chunk)
    assert gq[-1] == cu_q[-1] and gk[-1] == cu_k[-1]
    assert bool((gq[1:] >= gq[:-1]).all() and (gk[1:] >= gk[:-1]).all())
    for b, (q_len, k_len) in enumerate(zip(lengths_q, lengths_k)):
        for j in range(q_len):
            row = int(cu_q[b]) + j
            group = int(torch.searchsorted(gq[1:], torch.tensor(row), right=True))
            q0, q1, k0, k1 = int(gq[group]), int(gq[group + 1]), int(gk[group]), int(gk[group + 1])
            position = k_len - q_len + j  # in the sequence's keys
            if position < 0:
                assert k0 == k1, "a query before the first key sees no key"
                continue
            first = position // chunk * chunk
            assert (k0 - int(cu_k[b]), k1 - int(cu_k[b])) == (first, min(first + chunk, k_len))
            assert first + (k1 - k0) - (q1 - q0) + (row - q0) == position


def test_combine_matches_the_merge_written_out(fa3):
    """FA3's layouts (hopper/flash_api.cpp, mha_combine): out_partial (splits, batch, seqlen, nheads, d), lse_partial
    (splits, batch, seqlen, nheads); lse (batch, seqlen, nheads)."""
    torch.manual_seed(0)
    out_partial = torch.randn(3, 2, 5, 4, 8)
    lse_partial = torch.randn(3, 2, 5, 4)
    lse_partial[1, 0, 2] = float("-inf")  # a split of no keys for some rows
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    want_lse = torch.logsumexp(lse_partial.double(), 0)
    weight = torch.exp(lse_partial.double() - want_lse)[..., None]
    want = (weight * out_partial.double()).sum(0)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse)
    torch.testing.assert_close(out.double(), want.half().double(), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="lse_partial"):
        fa3.flash_attn_combine(out_partial, lse_partial.transpose(2, 3))


def test_chunk_leftpad_counts_positions_from_the_left_pad(fa3):
    """A decoding query's first visible row under attention_chunk: the start of its chunk, positions counted from
    cache_leftpad as FA3 counts them (chunk 4, left pad 2, 9 rows before one new key: the query at row 9 is position
    7, in chunk [4, 8) of positions, rows 6 to 9)."""
    q = torch.zeros(2, 1, 1, 8)
    lengths = torch.tensor([9, 3], dtype=torch.int32)
    start = fa3._chunk_leftpad(q, None, torch.zeros(2, 1, 1, 8), lengths, torch.tensor([2, 0]), None, 4)
    assert start.tolist() == [6, 0]
    assert fa3._chunk_leftpad(q, None, None, lengths, None, None, 4).tolist() == [8, 0]


@pytest.fixture(scope="module")
def backend3():
    spec = importlib.util.spec_from_file_location("compat3_build_backend", COMPAT3 / "build_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_and_metadata(backend3, tmp_path, monkeypatch):
    monkeypatch.setattr(backend3._shared, "search_path", lambda: [])
    name = backend3.build_wheel(str(tmp_path))
    version = f"3.0.0+cuteflash{cuteflash.__version__}"
    assert name == f"flash_attn_3-{version}-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / name) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"flash_attn_3-{version}.dist-info/METADATA").decode()
        top_level = wheel.read(f"flash_attn_3-{version}.dist-info/top_level.txt").decode().split()
    assert {"flash_attn_interface.py", "flash_attn_3/__init__.py", "flash_attn_3/flash_attn_interface.py"} <= names
    assert f"Requires-Dist: cuteflash=={cuteflash.__version__.split('+')[0]}" in metadata
    assert top_level == ["flash_attn_3", "flash_attn_interface"]
    official = tmp_path / "site"
    (official / "flash_attn_3-3.0.0.dist-info").mkdir(parents=True)
    (official / "flash_attn_3-3.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn_3\n"
                                                                        "Version: 3.0.0\n")  # fmt: skip
    assert backend3.installed_official([str(official)]) == [("3.0.0", str(official))]
    with pytest.raises(SystemExit, match="official FlashAttention-3"):
        backend3.refuse_to_replace_official([str(official)])


# ---- GPU


def _chunk_reference(q, k, v, causal, window, chunk, compute_dtype):
    """out and lse of attention with the chunk mask on top of causal/window, in compute_dtype."""
    from cuteflash.reference import scores_ref

    scores = scores_ref(q.to(compute_dtype), k.to(compute_dtype), causal=causal, window_size=window,
                        compute_dtype=compute_dtype)  # fmt: skip
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    i = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    scores = scores.masked_fill(torch.div(i, chunk, rounding_mode="floor") != j // chunk, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    group = q.shape[2] // k.shape[2]
    vv = v.to(compute_dtype).repeat_interleave(group, dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv), lse


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 300, 300), (1, 70, 260)], ids=["self", "cross"])
@pytest.mark.parametrize("mask", ["causal", "full", "window"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_attention_chunk_against_the_reference(fa3, dtype, mask, shape, require_support, assert_close_2x):
    require_support(dtype, backward=True)
    batch, seqlen_q, seqlen_k = shape
    causal, window = mask != "full", (40, 0) if mask == "window" else (-1, -1)
    q = torch.randn(batch, seqlen_q, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=64,
                                   return_attn_probs=True)  # fmt: skip
    ref, ref_lse = _chunk_reference(q, k, v, causal, window, 64, torch.float64)
    pt, pt_lse = _chunk_reference(q, k, v, causal, window, 64, dtype)
    assert_close_2x("out", out, ref, pt)
    finite = torch.isfinite(ref_lse)
    assert_close_2x("lse", lse[finite], ref_lse[finite], pt_lse[finite])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert_close_2x(name, g, r, p)


@pytest.mark.gpu
def test_functions_equal_cuteflashs(fa3, require_support, assert_close_2x):
    require_support(torch.float16, backward=True)
    q = torch.randn(2, 128, 8, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 160, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, window_size=(32, 0), softcap=20.0, return_attn_probs=True)
    want, want_lse, _ = cuteflash.flash_attn_func(q, k, v, causal=True, window_size=(32, 0), softcap=20.0,
                                                  return_attn_probs=True)  # fmt: skip
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(fa3.flash_attn_func(q, k, v), cuteflash.flash_attn_func(q, k, v))
    cu_q = torch.tensor([0, 100, 128], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 160], device="cuda", dtype=torch.int32)
    qp, kp, vp = q[0], k[0], v[0]
    got = fa3.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 100, 130, causal=True)
    assert torch.equal(got, cuteflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 100, 130, causal=True))
    used = torch.tensor([90, 20], device="cuda", dtype=torch.int32)  # keys each sequence uses of its slot
    got = fa3.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 100, 130, seqused_k=used, causal=True)
    for a, n, start, keys in ((0, 100, 0, 90), (100, 28, 130, 20)):
        sequence = [t[None, s : s + m] for t, s, m in ((qp, a, n), (kp, start, keys), (vp, start, keys))]
        ref, _ = attention_ref(*sequence, causal=True)
        pt, _ = attention_ref(*sequence, causal=True, compute_dtype=torch.float16)
        assert_close_2x(f"rows {a}:{a + n}", got[None, a : a + n], ref, pt)
    # the ops: forward as the function, backward as cuteflash's (deterministic, so bit for bit)
    out, lse, *accum = torch.ops.flash_attn_3._flash_attn_forward(q, k, v, causal=True)
    assert torch.equal(out, cuteflash.flash_attn_func(q, k, v, causal=True)) and all(a.numel() == 0 for a in accum)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.ops.flash_attn_3._flash_attn_backward(
        dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True, deterministic=True
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(cuteflash.flash_attn_func(*leaves, causal=True, deterministic=True), leaves, dout)
    for g, w in zip((dq, dk, dv), want):
        assert torch.equal(g, w)


@pytest.mark.gpu
def test_kvcache_decoding_with_attention_chunk(fa3, require_support, assert_close_2x):
    require_support(torch.float16)
    batch, rows, chunk = 3, 256, 48
    k_cache, v_cache = (torch.randn(batch, rows, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    q = torch.randn(batch, 1, 8, 64, device="cuda", dtype=torch.float16)
    k_new, v_new = (torch.randn(batch, 1, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([0, 47, 200], device="cuda", dtype=torch.int32)  # the new key at 0, 47 (chunk 0), 200
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                      attention_chunk=chunk)  # fmt: skip
    for b, n in enumerate(lengths.tolist()):
        keys, values = k_cache[b : b + 1, : n + 1], v_cache[b : b + 1, : n + 1]
        ref, _ = _chunk_reference(q[b : b + 1], keys, values, True, (-1, -1), chunk, torch.float64)
        pt, _ = _chunk_reference(q[b : b + 1], keys, values, True, (-1, -1), chunk, torch.float16)
        assert_close_2x(f"out {b}", out[b : b + 1], ref, pt)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_transformers_flash_attention_3(dtype, padded, fa3, tmp_path, require_support):
    """transformers' attn_implementation="flash_attention_3" (flash_attn_interface's functions) on a small random
    Llama against sdpa, logits and three training steps, with test_compat_transformers.py's norm rule."""
    transformers = pytest.importorskip("transformers")
    if not importlib.util.find_spec("flash_attn_3") or "flash_attn_3" not in {
        d.metadata["Name"].replace("-", "_") for d in importlib.metadata.distributions()
    }:
        pytest.skip("transformers needs the flash_attn_3 distribution installed: pip install ./compat3")
    require_support(dtype)
    import test_compat_transformers as common

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**common.CONFIG)).save_pretrained(tmp_path)
    lengths, seqlen = ([48, 31, 9] if padded else [48, 48, 48]), 48
    input_ids = torch.randint(3, common.CONFIG["vocab_size"], (len(lengths), seqlen), device="cuda")
    mask = (torch.arange(seqlen, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]).long()
    inputs = dict(input_ids=input_ids, use_cache=False, **({"attention_mask": mask} if padded else {}))
    common.check_model(tmp_path, dtype, inputs, input_ids.masked_fill(mask == 0, -100), mask.bool(),
                       implementation="flash_attention_3")  # fmt: skip


def test_ops_fake_shapes(fa3):
    """The flash_attn_3 ops' fake implementations (torch.compile traces with them): FA3's output shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 100, 8, 64, dtype=torch.float16), torch.empty(2, 300, 2, 64, dtype=torch.float16)
        out, lse, out_accum, lse_accum = torch.ops.flash_attn_3._flash_attn_forward(q, k, k, causal=True)
        q_v, k_v = torch.empty(150, 8, 64, dtype=torch.bfloat16), torch.empty(170, 2, 64, dtype=torch.bfloat16)
        cu = torch.empty(4, dtype=torch.int32)
        out_v, lse_v, *_ = torch.ops.flash_attn_3._flash_attn_forward(
            q_v, k_v, k_v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70, max_seqlen_k=130
        )
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
        softmax_d = torch.ops.flash_attn_3._flash_attn_backward(q, q, k, k, q, lse, dq=dq, dk=dk, dv=dv)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 8, 100), torch.float32)
    assert out_accum.numel() == lse_accum.numel() == 0
    assert (out_v.shape, lse_v.shape) == (q_v.shape, (8, 150))
    assert (softmax_d.shape, softmax_d.dtype) == ((2, 8, 100), torch.float32)

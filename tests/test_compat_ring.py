"""ring-flash-attn on the flash-attn compatibility package, at world size 1 (one process, one GPU, an NCCL process
group over a FileStore): ring_flash_attn_func and zigzag_ring_flash_attn_func, and the variable-length ring and llama3
functions (axolotl's sequence parallelism), against the float64 reference, forward and backward, with the 2x rule.
They call flash_attn.flash_attn_interface's private functions for the blocks' outputs and log-sum-exps."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import types

import pytest
import torch
import torch.distributed as dist

from cuteflash.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
FUNCTIONS = {
    "ring_flash_attn": ["ring_flash_attn_func"],
    "zigzag_ring_flash_attn": ["zigzag_ring_flash_attn_func"],
    "ring_flash_attn_varlen": ["ring_flash_attn_varlen_func"],
    "llama3_flash_attn_varlen": ["llama3_flash_attn_varlen_func", "llama3_flash_attn_prepare_cu_seqlens"],
}


def _import_ring_flash_attn():
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None:
        pytest.skip("ring-flash-attn is not installed")
    try:
        return importlib.import_module("ring_flash_attn")
    except ImportError:
        # ring-flash-attn 0.1.8's __init__ imports its transformers adapter, which imports a function that
        # transformers 5 removed; the attention functions do not need the adapter, so load their modules alone.
        package = types.ModuleType("ring_flash_attn")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
        for module, names in FUNCTIONS.items():
            loaded = importlib.import_module(f"ring_flash_attn.{module}")
            for name in names:
                setattr(package, name, getattr(loaded, name))
        return package


@pytest.fixture(scope="module")
def ring(flash_attn_compat, tmp_path_factory):
    """ring_flash_attn, with a default NCCL process group of one rank: alone, the ring functions still send their
    dK and dV to themselves, and the llama3 ones gather and reduce-scatter, on the GPU (which gloo does not)."""
    module = _import_ring_flash_attn()
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("ring") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield module
    dist.destroy_process_group()


def _reference(q, k, v, dout, compute_dtype, causal):
    """out, lse and [dq, dk, dv] of the reference attention in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, causal=causal, compute_dtype=compute_dtype)
    out.backward(dout.to(compute_dtype))
    return out, lse, [t.grad for t in leaves]


def _check(fn, q, k, v, causal, assert_close_2x, dq_via_bf16=False, lengths=None):
    """fn(q, k, v) -> (out, lse, None) against the references, forward and backward. dq_via_bf16: fn returns dq
    rounded to bfloat16 (ring-flash-attn's ring_flash_attn_func and its varlen one do), and the peer's dq is rounded
    alike. lengths: q, k, v are (total, nheads, d), these sequences one after another, each checked alone."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fn(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    inputs, results = [q, k, v, dout], [out, lse, *(t.grad for t in leaves)]
    pieces = [(inputs, results)]
    if lengths is not None:  # rows of (total, ...) and columns of the (nheads, total) lse, with a batch dim of 1
        starts = itertools.accumulate([0, *lengths])
        pieces = []
        for rows in (slice(a, a + n) for a, n in zip(starts, lengths)):
            mine = [out[rows], lse[:, rows], *(t.grad[rows] for t in leaves)]
            pieces.append(([t[rows].unsqueeze(0) for t in inputs], [t.unsqueeze(0) for t in mine]))
    for (qs, ks, vs, douts), (out_s, lse_s, *grads) in pieces:
        out_ref, lse_ref, grads_ref = _reference(qs, ks, vs, douts, torch.float64, causal)
        out_pt, lse_pt, grads_pt = _reference(qs, ks, vs, douts, q.dtype, causal)
        if dq_via_bf16:
            grads_pt[0] = grads_pt[0].to(torch.bfloat16).to(q.dtype)
        assert_close_2x("out", out_s, out_ref, out_pt)
        assert_close_2x("lse", lse_s, lse_ref, lse_pt)
        for name, g, r, pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
            assert g.dtype == q.dtype
            assert_close_2x(name, g, r, pt)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_ring_flash_attn_func(dtype, causal, ring, make_qkv, assert_close_2x):
    q, k, v = make_qkv(2, 384, 384, 8, 2, 64, dtype)

    def fn(q, k, v):
        return ring.ring_flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

    _check(fn, q, k, v, causal, assert_close_2x, dq_via_bf16=True)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_zigzag_ring_flash_attn_func(dtype, head_dim, ring, make_qkv, assert_close_2x):
    """Zigzag ring attention is causal only."""
    q, k, v = make_qkv(2, 256, 256, 8, 2, head_dim, dtype)

    def fn(q, k, v):
        return ring.zigzag_ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=True)

    _check(fn, q, k, v, True, assert_close_2x)


def _packed(lengths, dtype, make_qkv):
    """q, k, v (total, nheads, d) of sequences of these lengths, and their offsets."""
    q, k, v = (t[0] for t in make_qkv(1, sum(lengths), sum(lengths), 8, 2, 64, dtype))
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, cu_seqlens


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_ring_flash_attn_varlen_func(dtype, ring, make_qkv, assert_close_2x):
    lengths = [100, 7, 230, 47]  # no sequence of one key: its exact dk is 0, below the rule's 1e-5
    q, k, v, cu_seqlens = _packed(lengths, dtype, make_qkv)

    def fn(q, k, v):
        return ring.ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max(lengths), causal=True, return_attn_probs=True)

    _check(fn, q, k, v, True, assert_close_2x, dq_via_bf16=True, lengths=lengths)


@pytest.mark.parametrize("heads_k_stride", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_llama3_flash_attn_varlen_func(dtype, heads_k_stride, ring, make_qkv, assert_close_2x):
    """The llama3 function computes heads_k_stride key/value heads at a time: with 1, the private functions get
    head slices of q, out and dq (strided views)."""
    lengths = [100, 7, 230, 47]  # no sequence of one key: its exact dk is 0, below the rule's 1e-5
    q, k, v, cu_seqlens = _packed(lengths, dtype, make_qkv)
    cu_q, cu_k, max_q, max_k, local_k_slice = ring.llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, 0, 1)

    def fn(q, k, v):
        return ring.llama3_flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride, local_k_slice, causal=True, return_attn_probs=True
        )

    _check(fn, q, k, v, True, assert_close_2x, lengths=lengths)

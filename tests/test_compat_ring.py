"""ring-flash-attn on the flash-attn compatibility package: ring_flash_attn_func and zigzag_ring_flash_attn_func,
and the variable-length ring, zigzag and llama3 functions (axolotl's sequence parallelism), against the float64
reference, forward and backward, with the 2x rule. They call flash_attn.flash_attn_interface's private functions for
the blocks' outputs and log-sum-exps, and torch.distributed (NCCL) for the rest.

At world size 1 (one process, one GPU, an NCCL group over a FileStore) and, at each world size of 2, 4 and 8 that
the visible GPUs allow, that many processes, one GPU each, each holding its shard of the sequences, checked against
attention on the whole sequences."""

from __future__ import annotations

import datetime
import itertools
import json
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from cuteflash.bench_ring import import_ring_flash_attn, shard_positions, why_not, zigzag_positions
from cuteflash.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = list(DTYPE_NAMES.values())


@pytest.fixture(scope="module")
def ring(flash_attn_compat, tmp_path_factory):
    """ring_flash_attn, with a default NCCL process group of one rank: alone, the ring functions still send their
    dK and dV to themselves, and the llama3 ones gather and reduce-scatter, on the GPU (which gloo does not)."""
    module = import_ring_flash_attn()
    if module is None:
        pytest.skip("ring-flash-attn is not installed")
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
    return q, k, v, _cu_seqlens(lengths)


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


# ---- World sizes 2, 4 and 8: that many processes, one GPU each, over NCCL.

WORLDS = (2, 4, 8)
# Multiples of 2 * 8: the zigzag functions cut each sequence into 2 * world equal chunks, the ring ones into world.
SHARD_LENGTHS = [208, 16, 464, 96]
SHARD_SEQLEN = 1024  # the fixed-length functions: batch 2 of this many tokens


class RingCase(NamedTuple):
    function: str  # ring-flash-attn's
    dtype: str
    causal: bool
    head_dim: int = 64
    heads_k_stride: int = 1  # llama3 only

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        stride = f"-stride{self.heads_k_stride}" if self.function.startswith("llama3") else ""
        return f"{self.function}-{self.dtype}-{mask}-d{self.head_dim}{stride}"


RING_CASES = [
    *(RingCase("ring_flash_attn_func", dt, c) for dt in DTYPE_NAMES for c in (False, True)),
    *(RingCase("zigzag_ring_flash_attn_func", dt, True, d) for dt in DTYPE_NAMES for d in (64, 128)),
    *(RingCase("ring_flash_attn_varlen_func", dt, c) for dt in DTYPE_NAMES for c in (False, True)),
    *(RingCase("zigzag_ring_flash_attn_varlen_func", dt, True) for dt in DTYPE_NAMES),
    *(
        RingCase("llama3_flash_attn_varlen_func", dt, c, 64, s)
        for dt in DTYPE_NAMES
        for c in (False, True)
        for s in (1, 2)
    ),
]
# The functions that return dq rounded to bfloat16 whatever the input dtype (ring-flash-attn's own code).
DQ_VIA_BF16 = {"ring_flash_attn_func", "ring_flash_attn_varlen_func"}


def _cu_seqlens(lengths):
    """int32 offsets of sequences of these lengths, one after another, on the GPU."""
    return torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)


def _shard_call(ring, case: RingCase, rank: int, world: int, lengths):
    """(positions, fn): the token positions rank holds of the whole sequences, and fn(q, k, v) -> (out, lse, None)
    calling the case's function on them."""
    fn = getattr(ring, case.function)
    kwargs = {"causal": case.causal, "return_attn_probs": True}
    if case.function.startswith("llama3"):  # the packed tokens cut into `world` slices, whatever the sequences
        args = ring.llama3_flash_attn_prepare_cu_seqlens(_cu_seqlens(lengths), case.causal, rank, world)
        args = (*args[:4], case.heads_k_stride, args[4])  # cu_q, cu_k, max_q, max_k, heads_k_stride, k_slice
        return shard_positions([sum(lengths)], world, [rank]).cuda(), lambda q, k, v: fn(q, k, v, *args, **kwargs)
    if "zigzag" in case.function:
        positions = zigzag_positions(lengths, rank, world).cuda()
    else:
        positions = shard_positions(lengths, world, [rank]).cuda()
    args = ()
    if "varlen" in case.function:  # the local lengths: each sequence's share of this rank
        local = [n // world for n in lengths]
        args = (_cu_seqlens(local), max(local))
    return positions, lambda q, k, v: fn(q, k, v, *args, **kwargs)


def _whole_reference(q, k, v, dout, lengths, causal, compute_dtype, varlen):
    """out, lse and [dq, dk, dv] of the reference attention on the whole sequences: q, k, v (batch, seqlen, ...), or
    with varlen (total, ...) holding sequences of these lengths (lse then (nheads, total))."""
    if not varlen:
        return _reference(q, k, v, dout, compute_dtype, causal)
    pieces = [
        _reference(*(t[a : a + n].unsqueeze(0) for t in (q, k, v, dout)), compute_dtype, causal)
        for a, n in zip(itertools.accumulate([0, *lengths]), lengths)
    ]
    out = torch.cat([o[0] for o, _, _ in pieces])
    lse = torch.cat([lse[0] for _, lse, _ in pieces], dim=1)
    grads = [torch.cat([g[i][0] for _, _, g in pieces]) for i in range(3)]
    return out, lse, grads


def _check_shard(ring, case: RingCase, rank: int, world: int, assert_close_2x) -> None:
    """The case on this rank's shard, against the reference on the whole sequences (the same on every rank: the
    inputs are drawn from one seed)."""
    dtype = DTYPE_NAMES[case.dtype]
    varlen = "varlen" in case.function
    lengths = SHARD_LENGTHS if varlen else [SHARD_SEQLEN]
    shape = (sum(lengths),) if varlen else (2, SHARD_SEQLEN)
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.id.encode()))
    q, k, v, dout = (
        torch.randn(*shape, heads, case.head_dim, device="cuda", dtype=dtype, generator=g) for heads in (8, 2, 2, 8)
    )
    positions, fn = _shard_call(ring, case, rank, world, lengths)
    seq = 0 if varlen else 1  # the sequence dim of q, k, v; lse's is the last

    def mine(t):
        return t.index_select(seq, positions)

    leaves = [mine(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fn(*leaves)
    out.backward(mine(dout))
    results = [out, lse, *(t.grad for t in leaves)]
    ref = _whole_reference(q, k, v, dout, lengths, case.causal, torch.float64, varlen)
    pt = list(_whole_reference(q, k, v, dout, lengths, case.causal, dtype, varlen))
    if case.function in DQ_VIA_BF16:
        pt[2][0] = pt[2][0].to(torch.bfloat16).to(dtype)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, r, p in zip(names, results, (ref[0], ref[1], *ref[2]), (pt[0], pt[1], *pt[2])):
        pick = (lambda t: t.index_select(-1, positions)) if name == "lse" else mine
        if name != "lse":
            assert got.dtype == dtype, f"{name}: dtype {got.dtype}"
        assert_close_2x(name, got, pick(r), pick(p))


def _ring_worker(rank: int, world: int, store_path: str, results_dir: str) -> None:
    """One rank of `world`: every case of RING_CASES on GPU `rank`, its outcome (None, or the failure) written to
    results_dir/rank<rank>.json. An error outside the checks ends the process, and mp.spawn reports it."""
    from conftest import _assert_close_2x  # this test folder's conftest: the 2x rule

    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=2))
    try:
        ring = import_ring_flash_attn()
        outcomes = {}
        for case in RING_CASES:
            try:
                _check_shard(ring, case, rank, world, _assert_close_2x)
                outcomes[case.id] = None
            except AssertionError as e:
                outcomes[case.id] = f"rank {rank}: {e}"
            dist.barrier()
        (Path(results_dir) / f"rank{rank}.json").write_text(json.dumps(outcomes))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"{world}gpus")
def ring_outcomes(request, flash_attn_compat, tmp_path_factory):
    """{case id: [outcome of each rank]}: the cases run once per world size, by that many processes
    (torch.multiprocessing.spawn), one GPU each."""
    world = request.param
    reason = why_not(world)
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp(f"ring{world}")
    torch.multiprocessing.spawn(_ring_worker, args=(world, str(folder / "store"), str(folder)), nprocs=world)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    return {case.id: [outcomes[case.id] for outcomes in ranks] for case in RING_CASES}


@pytest.mark.parametrize("case", RING_CASES, ids=lambda case: case.id)
def test_ring_over_gpus(case, ring_outcomes):
    """The function over several GPUs, each rank's out, lse, dq, dk and dv against the whole sequences' reference."""
    failures = [f for f in ring_outcomes[case.id] if f is not None]
    assert not failures, "\n".join(failures)

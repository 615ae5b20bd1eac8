"""flash_attn_with_kvcache and paged caches against a float64 reference (2x rule): appending in place, rotary
embeddings, cache_seqlens / cache_batch_idx / cache_leftpad, paged caches, split counts, the options, and both
kernels behind it (the decoding kernel for a few query rows per key-value head, the tiled kernels above)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cuteflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from cuteflash.reference import attention_ref
from cuteflash.rotary import apply_rotary_emb

pytestmark = pytest.mark.gpu


def _paged(k_cache, v_cache, page: int, generator: torch.Generator):
    """The caches (batch, rows, h, d) as pages of `page` rows, in a shuffled pool with spare pages of noise, and
    their block_table (batch, pages per sequence)."""
    batch, rows = k_cache.shape[:2]
    per_seq = -(-rows // page)
    order = torch.randperm(batch * per_seq + 3, generator=generator).to(k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_seq * page - rows))
        pool = torch.randn((batch * per_seq + 3, page, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
        pool[order[: batch * per_seq]] = padded.reshape(batch * per_seq, page, *cache.shape[2:])
        pools.append(pool)
    return *pools, order[: batch * per_seq].view(batch, per_seq).int()


def _unpaged(pool, table, rows):
    return pool[table.long()].flatten(1, 2)[:, :rows]


def _expected_caches(k_cache, v_cache, k, v, cache_seqlens, batch_idx):
    """Each sequence's cache after the append, (batch, rows, h, d)."""
    idx = torch.arange(cache_seqlens.numel(), device=k_cache.device) if batch_idx is None else batch_idx.long()
    kc, vc = k_cache[idx].clone(), v_cache[idx].clone()
    if k is not None:
        for b, s in enumerate(cache_seqlens.tolist()):
            n = min(k.shape[1], kc.shape[1] - s)
            kc[b, s : s + n], vc[b, s : s + n] = k[b, :n], v[b, :n]
    return kc, vc


def _reference(q, kc, vc, used, leftpad, causal, window, softcap, slopes, dtype):
    """attention_ref per sequence over keys [leftpad[b], used[b]) of its cache."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        lo = 0 if leftpad is None else int(leftpad[b])
        hi = int(used[b])
        s = slopes[b : b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        o, lse = attention_ref(
            q[b : b + 1], kc[b : b + 1, lo:hi], vc[b : b + 1, lo:hi], None, causal, dtype, window, softcap, s
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


CASES = [
    # (seqlen_q, nheads, nheads_k, new, paged page size, leftpad, batch_idx, causal)
    (1, 4, 4, 1, None, False, False, False),
    (1, 8, 2, 1, None, False, True, True),
    (3, 4, 2, 3, None, True, False, True),
    (1, 4, 4, 0, 16, False, False, False),
    (2, 8, 2, 2, 48, True, False, True),
    (40, 4, 2, 40, None, True, True, True),  # tiled kernels (seqlen_q x group > 16)
    (40, 4, 4, 40, 32, False, False, True),  # tiled kernels over a paged cache
    (7, 4, 4, 0, None, False, False, False),
]


@pytest.mark.parametrize("head_dim", [59, 64, 111, 128, 256])  # 59 and 111 through padded copies of the caches
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-h{}/{}-new{}-page{}-lp{}-bi{}-c{}".format(*c))
def test_kvcache_matches_reference(case, dtype, head_dim, require_support, require_head_dim, assert_close_2x):
    seqlen_q, nheads, nheads_k, new, page, leftpad, batch_idx, causal = case
    require_support(dtype)
    require_head_dim(head_dim)
    batch, rows, batch_cache = 3, 300, 5
    g = torch.Generator(device="cpu").manual_seed(0)
    dev = dict(device="cuda", dtype=dtype)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, **dev)
    k_cache = torch.randn(batch_cache if batch_idx else batch, rows, nheads_k, head_dim, **dev)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(batch, new, nheads_k, head_dim, **dev) if new else None
    v = torch.randn_like(k) if new else None
    cache_seqlens = torch.tensor([0, 131, rows - new], dtype=torch.int32, device="cuda")
    pad = torch.tensor([0, 57, 100], dtype=torch.int32, device="cuda") if leftpad else None
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda") if batch_idx else None
    kc, vc = _expected_caches(k_cache, v_cache, k, v, cache_seqlens, idx)
    used = cache_seqlens + new
    out_ref, lse_ref = _reference(q, kc, vc, used, pad, causal, (-1, -1), 0.0, None, torch.float64)
    out_pt, _ = _reference(q, kc, vc, used, pad, causal, (-1, -1), 0.0, None, dtype)

    table = None
    if page is not None:
        k_cache, v_cache, table = _paged(k_cache, v_cache, page, g)
    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=idx,
        cache_leftpad=pad,
        block_table=table,
        causal=causal,
        return_softmax_lse=True,
    )
    assert_close_2x("out", out, out_ref, out_pt)
    assert torch.allclose(lse, lse_ref.float(), rtol=1e-3, atol=1e-3)
    # the new keys and values are in the caches
    if page is not None:
        k_now, v_now = _unpaged(k_cache, table, rows), _unpaged(v_cache, table, rows)
    else:
        sel = slice(None) if idx is None else idx.long()
        k_now, v_now = k_cache[sel], v_cache[sel]
    assert torch.equal(k_now, kc) and torch.equal(v_now, vc)


def _decode_inputs(batch=2, rows=1000, seqlen_q=1, nheads=8, nheads_k=8, head_dim=128, dtype=torch.float16):
    dev = dict(device="cuda", dtype=dtype)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, **dev)
    k_cache = torch.randn(batch, rows, nheads_k, head_dim, **dev)
    v_cache = torch.randn_like(k_cache)
    cache_seqlens = torch.tensor([rows, rows * 2 // 3][:batch], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, cache_seqlens


# 4096 keys make chunks enough for 64 to 128 splits: the merge reads their log-sum-exps two to four per lane, their O
# in batches of 16.
@pytest.mark.parametrize("rows", [1000, 4096])
@pytest.mark.parametrize("nheads_k", [8, 2])
def test_every_split_count(nheads_k, rows, require_head_dim, assert_close_2x):
    """Each split count gives the reference within the 2x rule, and the same bits on a second run."""
    require_head_dim(128)
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(rows=rows, nheads_k=nheads_k)
    out_ref, _ = _reference(q, k_cache, v_cache, cache_seqlens, None, False, (-1, -1), 0.0, None, torch.float64)
    out_pt, _ = _reference(q, k_cache, v_cache, cache_seqlens, None, False, (-1, -1), 0.0, None, torch.float16)
    for splits in (0, 1, 2, 3, 7, 16, 128):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=splits)
        assert_close_2x(f"num_splits={splits}", out, out_ref, out_pt)
        again = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=splits)
        assert torch.equal(out, again), f"num_splits={splits}: two runs differ"


def test_split_counters_per_stream(require_head_dim):
    """The decoding kernel's last split merges the splits, counting them in per-stream counters that each call leaves
    zero: calls of several sizes (one needs more counters than the first calls made) and split counts in turn, and
    calls on two streams at once, give the bits of the same calls made one at a time; a call captured in a CUDA
    graph (its splits merged by a kernel of their own) gives the same bits as well."""
    from cuteflash import _ops

    require_head_dim(128)
    _ops._split_counters.clear()
    calls = []
    for batch, nheads_k, rows, splits in ((2, 8, 1000, 0), (2, 16, 700, 7), (2, 520, 64, 2), (1, 2, 4096, 128)):
        q, k_cache, v_cache, seqlens = _decode_inputs(batch=batch, rows=rows, nheads=nheads_k, nheads_k=nheads_k)
        kwargs = dict(cache_seqlens=seqlens, num_splits=splits, return_softmax_lse=True)
        calls.append(partial(flash_attn_with_kvcache, q, k_cache, v_cache, **kwargs))
    expected = [call() for call in calls]
    for _ in range(3):
        for call, (out, lse) in zip(calls, expected):
            got, got_lse = call()
            assert torch.equal(got, out) and torch.equal(got_lse, lse)

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = [[], []]
    for _ in range(4):
        for which, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[which] += [call() for call in calls[which::2]]
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    for which in range(2):
        for (got, got_lse), (out, lse) in zip(results[which], expected[which::2] * 4):
            assert torch.equal(got, out) and torch.equal(got_lse, lse)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls[1]()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], expected[1][0]) and torch.equal(captured[1], expected[1][1])
    assert len(_ops._split_counters) == 3, "one set of counters per stream"
    assert all(not c.any() for c in _ops._split_counters.values()), "counters left nonzero"


def _check_split_counts(q, k_cache, v_cache, cache_seqlens, options, page, counts, assert_close_2x):
    """For each split count in counts: out and lse against the float64 reference (2x rule), the same bits on a second
    run, and with pages of `page` rows (None: none) the same bits as over the contiguous cache. options: causal,
    window, softcap and alibi (ALiBi slopes drawn per head)."""
    causal, window, softcap = options["causal"], options["window"], options["softcap"]
    slopes = torch.rand(q.shape[2], device="cuda") * 0.3 if options["alibi"] else None
    args = (cache_seqlens, None, causal, window, softcap, slopes)
    out_ref, lse_ref = _reference(q, k_cache, v_cache, *args, torch.float64)
    out_pt, _ = _reference(q, k_cache, v_cache, *args, torch.float16)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, return_softmax_lse=True)
    if page is not None:
        pk, pv, table = _paged(k_cache, v_cache, page, torch.Generator().manual_seed(4))
    for splits in counts:
        out, lse = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=splits, **kwargs
        )
        assert_close_2x(f"num_splits={splits}", out, out_ref, out_pt)
        assert torch.allclose(lse, lse_ref.float(), rtol=1e-3, atol=1e-3), f"num_splits={splits}: lse"
        again, _ = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=splits, **kwargs
        )
        assert torch.equal(out, again), f"num_splits={splits}: two runs differ"
        if page is not None:
            got, got_lse = flash_attn_with_kvcache(
                q, pk, pv, cache_seqlens=cache_seqlens, block_table=table, num_splits=splits, **kwargs
            )
            assert torch.equal(got, out) and torch.equal(got_lse, lse), f"num_splits={splits}: paged"


# The tiled kernels (more query rows per key-value head than the decoding kernel takes) split the keys of a KV-cache
# call as well: 200 query rows make two query tiles, the last partial; sequences of 1024, 37 and 0 keys leave some
# splits with no key of some row, or of any; a window leaves whole splits outside some rows' windows.
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize(
    "window,softcap,alibi", [((-1, -1), 0.0, False), ((100, 3), 15.0, True), ((-1, -1), 20.0, False)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_split_counts(causal, window, softcap, alibi, page, head_dim, require_head_dim, assert_close_2x):
    """Each split count of the tiled kernels gives the reference's out and lse (2x rule), the same bits on a second
    run, and over a paged cache the same bits as over the contiguous one."""
    require_head_dim(head_dim)
    batch, rows, seqlen_q, nheads, nheads_k = 3, 1024, 200, 8, 2
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, **dev)
    k_cache, v_cache = (torch.randn(batch, rows, nheads_k, head_dim, **dev) for _ in range(2))
    cache_seqlens = torch.tensor([rows, 37, 0], dtype=torch.int32, device="cuda")
    options = dict(causal=causal, window=window, softcap=softcap, alibi=alibi)
    _check_split_counts(q, k_cache, v_cache, cache_seqlens, options, page, (0, 1, 2, 3, 7, 16, 128), assert_close_2x)


# Up to 16 query rows per key-value head run the decoding kernel at head dims up to 128, the rows as the tensor-core
# products' m (mma.sync in the sm80 family; WMMA in the sm70 family, above 8 rows): 16 queries of one head, 9 x 1,
# 1 query x 16 heads, 3 x 4, 2 x 8 and 5 x 3 per key-value head. A causal mask gives the rows different keys;
# sequences of 1024 and 37 keys leave some splits with none.
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "shape",
    [(16, 4, 4), (9, 2, 2), (1, 16, 1), (3, 8, 2), (2, 16, 2), (5, 6, 2)],
    ids=lambda c: "q{}-h{}/{}".format(*c),
)
@pytest.mark.parametrize("window,softcap,alibi", [((-1, -1), 0.0, False), ((100, 3), 15.0, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_decoding_up_to_16_rows(causal, window, softcap, alibi, shape, head_dim, require_head_dim, assert_close_2x):
    """The decoding kernel computes these calls and gives the reference's out and lse (2x rule) at each split count,
    the same bits on a second run, and over a paged cache the same bits as over the contiguous one."""
    from cuteflash._families import Call
    from cuteflash._lib import call_family, compiled_module, kernel_head_dim

    require_head_dim(head_dim)
    seqlen_q, nheads, nheads_k = shape
    batch, rows = 2, 1024
    # (the family that computes these calls: the registry's rule)
    call = Call(
        "fwd",
        "fp16",
        kernel_head_dim(head_dim),
        window=window != (-1, -1),
        softcap=softcap > 0,
        alibi=alibi,
        cache=True,
    )
    family = call_family(torch.device("cuda"), call)
    plan = compiled_module().fwd_plan
    assert plan(family, batch, nheads, nheads_k, seqlen_q, rows, head_dim, False, False, True, 0)[0], (
        f"{family}: the tiled kernels run"
    )
    # 17 rows run the tiled kernels.
    assert not plan(family, batch, 4, 4, 17, rows, head_dim, False, False, True, 0)[0]
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, **dev)
    k_cache, v_cache = (torch.randn(batch, rows, nheads_k, head_dim, **dev) for _ in range(2))
    cache_seqlens = torch.tensor([rows, 37], dtype=torch.int32, device="cuda")
    options = dict(causal=causal, window=window, softcap=softcap, alibi=alibi)
    _check_split_counts(q, k_cache, v_cache, cache_seqlens, options, 16, (0, 1, 3, 16), assert_close_2x)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3, 24])
def test_rotary(seqlen_q, interleaved, causal, require_head_dim, assert_close_2x):
    """q and the new keys rotated at positions cache_seqlens + i (q: all at cache_seqlens when not causal)."""
    require_head_dim(64)
    batch, rows, nheads, head_dim, rotary_dim = 2, 256, 4, 64, 32
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, **dev)
    k_cache, v_cache = (torch.randn(batch, rows, nheads, head_dim, **dev) for _ in range(2))
    k, v = (torch.randn(batch, seqlen_q, nheads, head_dim, **dev) for _ in range(2))
    angle = torch.rand(rows, rotary_dim // 2, device="cuda") * 6.28
    cos, sin = angle.cos().half(), angle.sin().half()
    cache_seqlens = torch.tensor([5, 200], dtype=torch.int32, device="cuda")
    if causal:
        q_ro = apply_rotary_emb(q, cos, sin, interleaved, seqlen_offsets=cache_seqlens)
    else:
        flat = q.reshape(batch, 1, -1, head_dim)
        q_ro = apply_rotary_emb(flat, cos, sin, interleaved, seqlen_offsets=cache_seqlens).view(q.shape)
    k_ro = apply_rotary_emb(k, cos, sin, interleaved, seqlen_offsets=cache_seqlens)
    kc, vc = _expected_caches(k_cache, v_cache, k_ro, v, cache_seqlens, None)
    used = cache_seqlens + seqlen_q
    out_ref, _ = _reference(q_ro, kc, vc, used, None, causal, (-1, -1), 0.0, None, torch.float64)
    out_pt, _ = _reference(q_ro, kc, vc, used, None, causal, (-1, -1), 0.0, None, torch.float16)
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, causal=causal, rotary_interleaved=interleaved
    )
    assert_close_2x("out", out, out_ref, out_pt)
    assert torch.equal(k_cache, kc)


@pytest.mark.parametrize(
    "window,softcap,alibi",
    [((64, 0), 0.0, False), ((-1, -1), 20.0, False), ((-1, -1), 0.0, True), ((100, 3), 15.0, True)],
)
@pytest.mark.parametrize("seqlen_q", [1, 4, 33])
def test_options(seqlen_q, window, softcap, alibi, require_head_dim, assert_close_2x):
    require_head_dim(128)
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(seqlen_q=seqlen_q, nheads=4, nheads_k=2, rows=400)
    slopes = torch.rand(2, 4, device="cuda") * 0.3 if alibi else None
    args = (cache_seqlens, None, True, window, softcap, slopes)
    out_ref, _ = _reference(q, k_cache, v_cache, *args[:1], None, *args[2:], torch.float64)
    out_pt, _ = _reference(q, k_cache, v_cache, *args[:1], None, *args[2:], torch.float16)
    out = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        causal=True,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
    )
    assert_close_2x("out", out, out_ref, out_pt)


# (seqlen_q, nheads, nheads_k, page size, leftpad): one query row runs the decoding kernel; 40 rows of 4 query heads
# per key-value head, the tiled kernels, whose threads read runs of consecutive rows that leftpad sets across pages.
PAGED_CASES = [
    (1, 8, 8, 16, False),
    (1, 8, 8, 256, False),
    (40, 8, 2, 16, False),
    (40, 8, 2, 48, True),
    (40, 8, 2, 256, True),
    (130, 4, 4, 16, True),
]


# Head dims of both shared-memory row widths of the tiled kernels (64 elements, or 32 at 32, 96, 160 and 224) and of
# each count of rows a thread copies (1 to 8).
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: "q{}-h{}/{}-page{}-lp{}".format(*c))
def test_paged_equals_contiguous(case, causal, head_dim, require_head_dim):
    """A kernel reads a paged cache as it reads the same keys contiguous: the same bits, split or not."""
    seqlen_q, nheads, nheads_k, page, leftpad = case
    require_head_dim(head_dim)
    # rows a multiple of each page size, so that both caches have as many rows (which sets the split count)
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(
        rows=1536, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim
    )
    pad = torch.tensor([5, 203], dtype=torch.int32, device="cuda") if leftpad else None
    pk, pv, table = _paged(k_cache, v_cache, page, torch.Generator().manual_seed(1))
    for splits in (1, 0):
        args = dict(cache_seqlens=cache_seqlens, cache_leftpad=pad, causal=causal, num_splits=splits)
        want = flash_attn_with_kvcache(q, k_cache, v_cache, **args)
        got = flash_attn_with_kvcache(q, pk, pv, block_table=table, **args)
        assert torch.equal(got, want), f"num_splits={splits}"


@pytest.mark.parametrize("seqlen_q", [1, 40])
def test_pages_outside_the_cache_read_as_zeros(seqlen_q, require_head_dim):
    """block_table entries below 0 or past the pages are never read: their rows are keys and values of zeros."""
    require_head_dim(128)
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(rows=1024, seqlen_q=seqlen_q, nheads=8, nheads_k=2)
    page = 16
    pk, pv, table = _paged(k_cache, v_cache, page, torch.Generator().manual_seed(3))
    table[0, 3], table[1, 0], table[1, 40] = -1, pk.shape[0], 2**31 - 1
    for b, index in ((0, 3), (1, 0), (1, 40)):
        k_cache[b, index * page : (index + 1) * page] = 0
        v_cache[b, index * page : (index + 1) * page] = 0
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
    got = flash_attn_with_kvcache(q, pk, pv, cache_seqlens=cache_seqlens, block_table=table)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim", [64, 72, 59])
def test_varlen_with_block_table(head_dim, require_head_dim, assert_close_2x):
    """flash_attn_varlen_func over paged caches: sequence b's keys are the first cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] rows of its pages."""
    require_head_dim(head_dim)
    lens_q, lens_k, rows = [3, 17, 1], [40, 17, 200], 208
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(sum(lens_q), 4, head_dim, **dev)
    k_cache, v_cache = (torch.randn(3, rows, 2, head_dim, **dev) for _ in range(2))
    pk, pv, table = _paged(k_cache, v_cache, 16, torch.Generator().manual_seed(2))
    cu_q = torch.tensor([0, 3, 20, 21], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 40, 57, 257], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, 17, 200, causal=True, block_table=table)
    assert out.shape == q.shape
    for b in range(3):
        qb = q[cu_q[b] : cu_q[b + 1]].unsqueeze(0)
        kb, vb = (t[b : b + 1, : lens_k[b]] for t in (k_cache, v_cache))
        ref, _ = attention_ref(qb, kb, vb, None, True, torch.float64)
        pt, _ = attention_ref(qb, kb, vb, None, True, torch.float16)
        assert_close_2x(f"sequence {b}", out[cu_q[b] : cu_q[b + 1]].unsqueeze(0), ref, pt)


def test_varlen_with_block_table_under_grad(require_head_dim):
    """Inputs that require grad: the forward pass through a paged cache runs as without grad (flash-attn's test
    suites call it so); only a backward pass through it raises, naming block_table."""
    require_head_dim(64)
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(20, 4, 64, **dev)
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, **dev) for _ in range(2))
    pk, pv, table = _paged(k_cache, v_cache, 16, torch.Generator().manual_seed(3))
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 33, 97], dtype=torch.int32, device="cuda")
    args = (cu_q, cu_k, 15, 64)
    with torch.no_grad():
        want = flash_attn_varlen_func(q, pk, pv, *args, causal=True, block_table=table)
    leaves = [t.clone().requires_grad_() for t in (q, pk, pv)]
    out, lse, _ = flash_attn_varlen_func(*leaves, *args, causal=True, block_table=table, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    assert torch.equal(out, want)
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


def _table_bounds_inputs(page=256, pages_per_seq=1):
    """Two sequences whose block_table holds pages_per_seq pages of `page` rows each, in a pool of spare pages."""
    dev = dict(device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(6, page, 2, 64, **dev) for _ in range(2))
    table = torch.tensor([[1, 4, 2][:pages_per_seq], [3, 0, 5][:pages_per_seq]], dtype=torch.int32, device="cuda")
    return torch.randn(2, 1, 4, 64, **dev), k_cache, v_cache, table


@pytest.mark.parametrize("new", [0, 1, 5])
def test_block_table_bounds(new, require_head_dim):
    """cache_seqlens (+ the new keys) past the rows of a sequence's pages raise RuntimeError naming block_table, as
    in flash-attn 2.8.4; exactly at capacity does not."""
    require_head_dim(64)
    q, k_cache, v_cache, table = _table_bounds_inputs(pages_per_seq=2)
    capacity = 2 * 256
    k, v = (torch.randn(2, new, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2)) if new else (None, None)
    at = torch.tensor([capacity - new, 3], dtype=torch.int32, device="cuda")
    for _ in range(2):  # the second call takes the plan the first made, and so do the tensor calls below
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=at, block_table=table)
    assert torch.isfinite(out).all()
    for over in (torch.tensor([10, capacity - new + 1], dtype=torch.int32, device="cuda"), capacity - new + 1):
        with pytest.raises(RuntimeError, match="block_table"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=over, block_table=table)
    # flash_attn_varlen_func's paged keys: more than the pages hold raises too
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 10, 10 + capacity + 1], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(q.flatten(0, 1), k_cache, v_cache, cu_q, cu_k, 1, capacity, block_table=table)


def test_block_table_bounds_under_capture(require_head_dim):
    """While a CUDA graph is captured the lengths are not read on the host: the call does not raise, and the
    kernels read no row past block_table (each sequence's keys are clamped to its pages)."""
    require_head_dim(64)
    q, k_cache, v_cache, table = _table_bounds_inputs(pages_per_seq=1)
    over = torch.tensor([256 + 40, 9], dtype=torch.int32, device="cuda")
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=over.clamp(max=256), block_table=table)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, with lengths in bounds
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=over.clamp(max=256), block_table=table)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=over, block_table=table)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("nheads_k", [8, 1])
def test_flash_attn_func_decoding_shapes_backward(nheads_k, check_grads, require_support):
    """flash_attn_func with a few query rows per key-value head runs the decoding kernel forward; its output and
    log-sum-exp feed the backward pass."""
    require_support(backward=True)
    dev = dict(device="cuda", dtype=torch.float16)
    q = torch.randn(2, 1, 8, 64, **dev)
    k, v = (torch.randn(2, 700, nheads_k, 64, **dev) for _ in range(2))
    check_grads(q, k, v, causal=True)


def test_cuda_graph_and_compile(require_head_dim):
    """A decoding step captured in a CUDA graph replays with new cache lengths; under torch.compile the op is
    traced without graph breaks."""
    require_head_dim(128)
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(rows=512)
    k_new, v_new = (torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([10, 20], dtype=torch.int32, device="cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out_ref = flash_attn_with_kvcache(q, k_ref, v_ref, k_new, v_new, cache_seqlens=seqlens + 5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, cache_seqlens=seqlens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens)
    seqlens += 5
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out_ref)
    assert torch.equal(k_cache[:, 15:16], k_ref[:, 15:16]) and torch.equal(k_cache[1, 25:26], k_new[1])

    compiled = torch.compile(flash_attn_with_kvcache, fullgraph=True)
    k2, v2 = k_cache.clone(), v_cache.clone()
    out_c = compiled(q, k2, v2, k_new, v_new, cache_seqlens=seqlens + 1)
    out_e = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens + 1)
    assert torch.equal(out_c, out_e) and torch.equal(k2, k_cache)


def test_bad_input():
    q, k_cache, v_cache, cache_seqlens = _decode_inputs(rows=64)
    with pytest.raises(ValueError, match="multiple of 16"):
        flash_attn_with_kvcache(
            q,
            k_cache[:, :40].reshape(-1, 20, 8, 128).contiguous(),
            v_cache[:, :40].reshape(-1, 20, 8, 128).contiguous(),
            block_table=torch.zeros(2, 2, dtype=torch.int32, device="cuda"),
        )
    with pytest.raises(TypeError, match="cache_seqlens.*int32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens.long())
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_cache[:, :1], v_cache[:, :1])
    strided = torch.randn(2, 64, 8, 256, device="cuda", dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="k_cache must have a contiguous last dimension"):
        flash_attn_with_kvcache(q, strided, strided)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1])
    # out-of-range lengths, batches and pages are clamped or skipped on the GPU, never read or written outside
    wild = torch.tensor([10**6, -5], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_cache[:, :2],
        v_cache[:, :2],
        cache_seqlens=wild,
        cache_batch_idx=wild,
        cache_leftpad=wild,
    )
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert torch.equal(flash_attn_func(q, k_cache, v_cache), flash_attn_func(q, k_cache, v_cache))

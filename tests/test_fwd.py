"""Forward pass against a float64 reference: error at most 2x PyTorch's own in the input dtype."""

import pytest
import torch

from cuteflash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 40, 59, 64, 72, 96, 128, 160, 192, 224, 256]
SEQLENS = [(1, 1), (17, 17), (113, 203), (203, 113), (1, 1025), (1025, 1), (1000, 1000), (1025, 1025), (4096, 4096)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_forward(seqlen_q, seqlen_k, head_dim, causal, dtype, make_qkv, run_and_check):
    batch, nheads = (1, 2) if seqlen_q * seqlen_k > 2**20 else (2, 3)
    run_and_check(*make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, head_dim, dtype), causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads,nheads_k", [(6, 2), (6, 1), (8, 8)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(128, 128), (77, 300), (300, 77)])
def test_gqa_mqa(seqlen_q, seqlen_k, nheads, nheads_k, causal, dtype, make_qkv, run_and_check):
    run_and_check(*make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 64, dtype), causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_expanded_keys_and_values(causal, make_qkv, run_and_check):
    # k and v expanded over the heads and the batch: strides of 0, read in place (the sm90 family, whose TMA takes no
    # such stride, hands them to the sm80 family).
    q, k, v = make_qkv(2, 200, 300, 8, 1, 64, torch.float16)
    run_and_check(q, k[:1].expand(2, -1, 8, -1), v[:1].expand(2, -1, 8, -1), causal)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_more_tiles_than_multiprocessors(head_dim, make_qkv, run_and_check):
    # 8 query blocks of up to 128 rows per (sequence, head), 384 or more tiles: a persistent kernel's blocks walk
    # several tiles each, of different heads and sequences, the last with a partial query block.
    run_and_check(*make_qkv(3, 1000, 700, 16, 4, head_dim, torch.bfloat16), False)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_large_logits_stay_finite(head_dim, dtype, make_qkv, run_and_check):
    # Scores of magnitude ~100 * sqrt(d): exp() overflows unless the running max is subtracted.
    run_and_check(*make_qkv(2, 513, 517, 4, 4, head_dim, dtype, scale=10.0), causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale(causal, make_qkv, run_and_check):
    run_and_check(*make_qkv(2, 200, 300, 4, 4, 64, torch.float16), causal, softmax_scale=0.05)


@pytest.mark.parametrize("head_dim", [64, 72])
def test_qkvpacked_reads_in_place(head_dim, run_and_check, require_support):
    require_support(torch.float16)
    qkv = torch.randn(2, 333, 3, 4, head_dim, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    run_and_check(q, k, v, True, fn=flash_attn_qkvpacked_func, args=(qkv,))


def test_kvpacked(run_and_check, require_support):
    require_support(torch.bfloat16)
    q = torch.randn(2, 100, 6, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 150, 2, 3, 128, device="cuda", dtype=torch.bfloat16)
    run_and_check(q, kv[:, :, 0], kv[:, :, 1], False, fn=flash_attn_kvpacked_func, args=(q, kv))


def test_strided_inputs(run_and_check):
    # (b, h, s, d) storage viewed as (b, s, h, d): last dim contiguous, other strides permuted.
    q, k, v = (torch.randn(2, 4, 257, 64, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    run_and_check(q, k, v, True)
    # A last dim that is not contiguous is copied first.
    q2 = torch.randn(2, 64, 257, 4, device="cuda", dtype=torch.float16).permute(0, 2, 3, 1)
    run_and_check(q2, k, v, False)


def test_packed_slices_are_not_copied():
    from cuteflash import _ops

    qkv = torch.randn(1, 64, 3, 2, 64, device="cuda", dtype=torch.float16)
    for t in qkv.unbind(2):
        assert _ops._kernel_operand(t) is t


def test_causal_row_without_keys_is_zero(make_qkv):
    q, k, v = make_qkv(1, 40, 8, 2, 2, 64, torch.float16)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :32], torch.zeros_like(out[:, :32]))  # rows 0..31 see no key
    assert torch.isposinf(lse[:, :, :32]).all()
    assert torch.isfinite(out[:, 32:]).all() and out[:, 32:].abs().sum() > 0


def test_runs_on_current_stream(make_qkv):
    q, k, v = make_qkv(2, 1024, 1024, 8, 8, 128, torch.float16)
    expected = flash_attn_func(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_cuda_graph_capture(make_qkv):
    q, k, v = make_qkv(2, 256, 256, 4, 4, 64, torch.float16)
    expected = flash_attn_func(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flash_attn_func(q, k, v, causal=True)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=s):
            out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(out, expected)


def test_torch_compile_fullgraph(make_qkv):
    q, k, v = make_qkv(2, 200, 200, 4, 4, 72, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True) * 2

    torch.testing.assert_close(f(q, k, v), flash_attn_func(q, k, v, causal=True) * 2, rtol=0, atol=0)


def test_deterministic_across_runs(make_qkv):
    q, k, v = make_qkv(2, 777, 777, 4, 4, 128, torch.float16)
    assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q, k, v))


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_sizes(batch, seqlen_q, seqlen_k, make_qkv):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 2, 2, 64, torch.float16)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (batch, 2, seqlen_q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


def test_view_at_an_odd_offset_is_copied_and_correct(make_qkv, run_and_check, require_support):
    require_support(torch.float16)
    flat = torch.randn(2 * 100 * 4 * 64 + 1, device="cuda", dtype=torch.float16)
    q = flat[1:].view(2, 100, 4, 64)  # contiguous, but 2 bytes past an aligned address
    _, k, v = make_qkv(2, 100, 120, 4, 4, 64, torch.float16)
    run_and_check(q, k, v, True)


def test_row_stride_beyond_32_bit_block_offsets_is_copied_and_correct(make_qkv, run_and_check, require_support):
    # The kernels index inside a block of rows with 32-bit offsets; a larger row stride is copied first.
    from cuteflash import _ops

    require_support(torch.float16)
    stride = _ops.MAX_ROW_STRIDE
    flat = torch.randn(2 * stride + 64, device="cuda", dtype=torch.float16)
    q = flat.as_strided((1, 3, 1, 64), (3 * stride, stride, 64, 1))
    assert _ops._kernel_operand(q) is not q
    _, k, v = make_qkv(1, 3, 5, 1, 1, 64, torch.float16)
    run_and_check(q, k, v, False)

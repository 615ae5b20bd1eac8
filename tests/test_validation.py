"""Bad input gets a clear exception naming the argument and the fix, before anything reaches a GPU."""

import pytest
import torch

import cuteflash
from cuteflash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func


def qkv(b=2, sq=16, sk=16, h=4, hk=4, d=64, dtype=torch.float16, device="cpu"):
    return (
        torch.randn(b, sq, h, d, dtype=dtype, device=device),
        torch.randn(b, sk, hk, d, dtype=dtype, device=device),
        torch.randn(b, sk, hk, d, dtype=dtype, device=device),
    )


def test_cpu_tensors_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"q is on cpu.*q\.cuda\(\)"):
        flash_attn_func(*qkv())


def test_meta_tensors_are_refused():
    with pytest.raises(ValueError, match="q is on meta"):
        flash_attn_func(*qkv(device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_wrong_dtype(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q has dtype .*float16.*bfloat16"):
        flash_attn_func(q.to(dtype), k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one dtype"):
        flash_attn_func(q, k.bfloat16(), v)


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(q, k.numpy(), v)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (((2, 16, 4, 64), (2, 16, 4), (2, 16, 4, 64)), "k must have 4 dimensions"),
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 17, 4, 64)), "same shape"),
        (((2, 16, 4, 64), (3, 16, 4, 64), (3, 16, 4, 64)), "batch"),
        (((2, 16, 4, 64), (2, 16, 4, 32), (2, 16, 4, 32)), "head dim 64 but k and v have 32"),
        (((2, 16, 4, 300), (2, 16, 4, 300), (2, 16, 4, 300)), "head dim 300 is not supported"),
        (((2, 16, 6, 64), (2, 16, 4, 64), (2, 16, 4, 64)), "multiple of the number of key/value heads"),
    ],
)
def test_inconsistent_shapes(shapes, message):
    q, k, v = (torch.randn(s, dtype=torch.float16) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, float("nan"), "0.1", None])
def test_bad_dropout_p(dropout_p):
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        flash_attn_func(*qkv(), dropout_p=dropout_p)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(*qkv(), softmax_scale=scale)


def test_packed_shapes():
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3"):
        flash_attn_qkvpacked_func(torch.randn(2, 16, 2, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen_k, 2"):
        flash_attn_kvpacked_func(
            torch.randn(2, 16, 4, 64, dtype=torch.float16), torch.randn(2, 16, 3, 4, 64, dtype=torch.float16)
        )


def test_exports_mirror_flash_attn():
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"):
        assert callable(getattr(cuteflash, name))


def any_family() -> str:
    """A family the build holds: the C++ checks below come before any kernel is looked up."""
    from cuteflash import _lib

    return next(iter(_lib.build_info()["families"]))


# The C++ side re-checks what would otherwise be unsafe, for callers that bypass Python's checks.
def call_c(direction="fwd", **overrides):
    from cuteflash import _lib

    C = _lib.compiled_module()
    args = dict(
        family=any_family(),
        dtype=0,
        q=(256, (64, 64, 64)),
        k=(512, (64, 64, 64)),
        v=(768, (64, 64, 64)),
        out=(1024, (64, 64, 64)),
        lse=2048,
        batch=1,
        nheads=1,
        nheads_k=1,
        seqlen_q=1,
        seqlen_k=1,
        head_dim=64,
        softmax_scale=0.125,
        causal=False,
        fp16_correction=True,
        stream=0,
    )
    args.update(overrides)
    if direction == "bwd":
        for name, ptr in (("dout", 4096), ("dq", 4352), ("dk", 4608), ("dv", 4864)):
            args.setdefault(name, (ptr, (64, 64, 64)))
        args = {"dq_accum": 8192, "dq_accum_floats": 1 << 20, "d_rowsum": 6144, "deterministic": False, **args}
    from cuteflash._ops import FIXED_LENGTH, NO_KERNEL_OPTIONS, Problem

    args = {  # (ptr, strides) as the module's operand tuples
        name: (value[0], *value[1]) if isinstance(value, tuple) else value for name, value in args.items()
    }
    problem = Problem(*(args.pop(field) for field in Problem._fields))
    getattr(C, direction)(problem, FIXED_LENGTH, NO_KERNEL_OPTIONS, **args)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"family": "sm60"}, "no kernel family 'sm60' is compiled into this build"),
        ({"dtype": 7}, "unknown dtype"),
        ({"head_dim": 12}, "multiple of 8"),
        ({"head_dim": 264}, "at most 256"),
        ({"nheads": 6, "nheads_k": 4}, "multiple of nheads_k"),
        ({"q": (0, (64, 64, 64))}, "q is a null pointer"),
        ({"k": (520, (64, 64, 64))}, "k must be 16-byte aligned"),
        ({"v": (768, (64, 60, 64))}, "v strides"),
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"seqlen_k": 2**30}, "below 2\\^30"),
    ],
)
def test_extension_rechecks_raw_arguments(overrides, message):
    pytest.importorskip("cuteflash._C")
    with pytest.raises(ValueError, match=message):
        call_c(**overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dq": (4360, (64, 64, 64))}, "dq must be 16-byte aligned"),
        ({"dq_accum_floats": 100}, "dq_accum holds 100 floats; the pass needs"),
        ({"d_rowsum": 0}, "d_rowsum"),
    ],
)
def test_extension_rechecks_backward_arguments(overrides, message):
    pytest.importorskip("cuteflash._C")
    with pytest.raises(ValueError, match=message):
        call_c("bwd", **overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dtype": 7}, "unknown dtype"),
        ({"head_dim": 12}, "head_dim must be a positive multiple of 8"),
        ({"k_cache": (520, (64, 64, 64))}, "k_cache must be 16-byte aligned"),
        ({"v": (768, (64, 60, 64))}, "v strides must be non-negative multiples of 8"),
    ],
)
def test_extension_rechecks_cache_append_arguments(overrides, message):
    pytest.importorskip("cuteflash._C")
    from cuteflash import _lib

    args = dict(
        family=any_family(),
        dtype=0,
        k=(256, 64, 64, 64),
        v=(512, 64, 64, 64),
        k_cache=(768, 64, 64, 64),
        v_cache=(1024, 64, 64, 64),
        batch=1,
        seqlen_new=1,
        nheads_k=1,
        head_dim=64,
        # (seqused_k, seqlen_new, leftpad_k, kv_batch_idx, kv_batch, kv_rows, block_table, its stride, page_size,
        # num_pages)
        cache=(4096, 1, 0, 0, 1, 16, 0, 0, 0, 0),
        stream=0,
    )
    args.update(
        {name: (value[0], *value[1]) if isinstance(value, tuple) else value for name, value in overrides.items()}
    )
    with pytest.raises(ValueError, match=message):
        _lib.compiled_module().append_kv(**args)


def test_backward_workspace_rule():
    pytest.importorskip("cuteflash._C")
    from cuteflash import _lib

    ws = _lib.compiled_module().bwd_workspace
    # 2 x 3 (batch, head) regions of 256 rows (200 rounded up to 128s) of the 64 kernel (head dim 40), then a count
    # per (batch, head); none for a deterministic pass, whose dQ kernel also needs D in its own buffer. D may live in
    # dq's memory where the family says so (FamilyTraits::kRowsumInDq). (dq_accum_floats, d_rowsum_in_dq)
    rowsum_in_dq = {"sm70": False, "sm75": False, "sm80": True, "sm90": True}
    for family in _lib.build_info()["families"]:  # (the rule of the families this build holds; others raise)
        assert ws(family=family, head_dim=40, batch=2, nheads=3, seqlen_q=200, deterministic=False) == (
            2 * 3 * (256 * 64 + 1),
            rowsum_in_dq[family],
        )
        assert ws(family=family, head_dim=40, batch=2, nheads=3, seqlen_q=200, deterministic=True) == (0, False)
    with pytest.raises(ValueError, match="no kernel family 'sm60'"):
        ws(family="sm60", head_dim=64, batch=1, nheads=1, seqlen_q=1, deterministic=False)


# Which inputs the kernels read in place (no copy) and which are copied first: pure stride/pointer logic.
def test_packed_slices_and_transposed_views_are_read_in_place():
    from cuteflash._ops import _kernel_operand

    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.float16)
    for t in qkv.unbind(2):
        assert _kernel_operand(t) is t
    bhsd = torch.randn(2, 4, 16, 64, dtype=torch.float16).transpose(1, 2)
    assert _kernel_operand(bhsd) is bhsd


def test_unreadable_layouts_are_copied_contiguous():
    from cuteflash._ops import _kernel_operand

    last_dim_strided = torch.randn(2, 64, 16, 4, dtype=torch.float16).permute(0, 2, 3, 1)
    misaligned_rows = torch.randn(2, 16, 4, 72, dtype=torch.float16)[..., :64]  # row stride 72: fine
    odd_offset = torch.randn(2 * 16 * 4 * 64 + 1, dtype=torch.float16)[1:].view(2, 16, 4, 64)  # 2-byte offset
    odd_stride = torch.randn(2, 16, 4, 68, dtype=torch.float16)[..., :64]  # head stride 68: not a multiple of 8
    for t in (last_dim_strided, odd_offset, odd_stride):
        copy = _kernel_operand(t)
        assert copy is not t and copy.is_contiguous() and torch.equal(copy, t)
    assert _kernel_operand(misaligned_rows) is misaligned_rows

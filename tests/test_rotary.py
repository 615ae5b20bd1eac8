"""cuteflash.rotary (apply_rotary_emb, apply_rotary, the in-place qkv/kv functions, RotaryEmbedding) against
rotations written as complex products, on the CPU."""

import pytest
import torch

from cuteflash.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)


def tables(seqlen_rotary, half, base=10000.0):
    """cos and sin of the angles position * base^(-i / half), and the angles (float64)."""
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(seqlen_rotary, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos(), angles.sin(), angles


def rotate_reference(x, angles, interleaved, positions):
    """x (tokens, nheads, headdim) float64, token n at positions[n]; a position past the table: unrotated."""
    half = angles.shape[1]
    out = x.clone()
    for n, pos in enumerate(positions):
        if pos >= angles.shape[0]:
            continue
        a, b = (
            (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
        )
        z = torch.complex(x[n, :, a], x[n, :, b]) * torch.polar(torch.ones(half, dtype=torch.float64), angles[pos])
        out[n, :, a], out[n, :, b] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", [0, 3, "tensor"])
def test_fixed_length_matches_complex_rotation(interleaved, offsets):
    batch, seqlen, nheads, headdim, half = 3, 5, 2, 12, 4  # rotary_dim 8 of 12
    x = torch.randn(batch, seqlen, nheads, headdim, dtype=torch.float64)
    cos, sin, angles = tables(16, half)
    offsets = torch.tensor([0, 7, 2], dtype=torch.int32) if offsets == "tensor" else offsets
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    for b in range(batch):
        shift = int(offsets[b]) if isinstance(offsets, torch.Tensor) else offsets
        expected = rotate_reference(x[b], angles, interleaved, [t + shift for t in range(seqlen)])
        torch.testing.assert_close(out[b], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen_positions_restart_per_sequence(interleaved):
    lengths, nheads, headdim, half = [3, 0, 5], 2, 8, 4
    cu_seqlens = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    x = torch.randn(sum(lengths), nheads, headdim, dtype=torch.float64)
    cos, sin, angles = tables(12, half)
    offsets = torch.tensor([4, 1, 0], dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets, cu_seqlens=cu_seqlens, max_seqlen=5)
    positions = [t + 4 for t in range(3)] + [t for t in range(5)]
    torch.testing.assert_close(out, rotate_reference(x, angles, interleaved, positions), rtol=0, atol=1e-12)


def test_positions_past_the_table_are_not_rotated():
    x = torch.randn(1, 6, 1, 8, dtype=torch.float64)
    cos, sin, angles = tables(4, 4)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
    torch.testing.assert_close(out[0], rotate_reference(x[0], angles, False, range(2, 8)), rtol=0, atol=1e-12)
    assert torch.equal(out[0, 2:], x[0, 2:])


def test_inplace_writes_x_and_returns_it():
    x = torch.randn(2, 4, 3, 16, dtype=torch.float16)
    cos, sin, _ = tables(8, 6)
    expected = apply_rotary_emb(x, cos.half(), sin.half())
    result = apply_rotary_emb(x, cos.half(), sin.half(), inplace=True)
    assert result is x and torch.equal(x, expected)


def test_half_precision_is_the_rotation_rounded_once():
    """fp16 in and out, the products in fp32: within one fp16 ulp of the float64 rotation by the fp16 tables."""
    x = torch.randn(2, 9, 2, 16, dtype=torch.float16)
    cos, sin, _ = tables(9, 8)
    out = apply_rotary_emb(x, cos.half(), sin.half())
    assert out.dtype == torch.float16
    c, s = cos.half().double()[None, :, None], sin.half().double()[None, :, None]
    x1, x2 = x[..., :8].double(), x[..., 8:].double()
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(out.double(), expected.half().double(), rtol=2**-10, atol=2**-24)


def test_gradient():
    x = torch.randn(2, 3, 2, 6, dtype=torch.float64, requires_grad=True)
    cos, sin, _ = tables(5, 2)
    offsets = torch.tensor([1, 0])
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, True, seqlen_offsets=offsets), (x,))


@pytest.mark.parametrize(
    "case, match",
    [
        ("rotary_dim", "exceeds the head dim"),
        ("cos_shape", "cos and sin must both be"),
        ("offsets", "seqlen_offsets must be"),
        ("x_rank", "x must be"),
    ],
)
def test_bad_arguments_name_the_argument(case, match):
    x = torch.randn(2, 3, 2, 8)
    cos, sin, _ = tables(4, 4)
    kwargs = {}
    if case == "rotary_dim":
        cos, sin, _ = tables(4, 5)
    elif case == "cos_shape":
        sin = sin[:, :3]
    elif case == "offsets":
        kwargs["seqlen_offsets"] = torch.zeros(3, dtype=torch.int32)
    else:
        x = x[0]
    with pytest.raises(ValueError, match=match):
        apply_rotary_emb(x, cos, sin, **kwargs)


def test_apply_rotary_conjugate_undoes_the_rotation():
    """flash_attn.ops.triton.rotary's apply_rotary: conjugate=True rotates back (ModernBERT's backward pass), in place
    on a variable-length batch as ModernBERT calls it."""
    x = torch.randn(9, 4, 16, dtype=torch.float64)
    cos, sin, _ = tables(12, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    y = apply_rotary(x.clone(), cos, sin, cu_seqlens=cu, max_seqlen=5, inplace=True)
    assert torch.allclose(y, apply_rotary_emb(x, cos, sin, cu_seqlens=cu))
    assert torch.allclose(apply_rotary(y, cos, sin, cu_seqlens=cu, conjugate=True), x)


@pytest.mark.parametrize("layout", ["packed", "gqa"])
def test_qkv_in_place(layout):
    """q and k of a packed qkv rotate in place (k by cos_k, sin_k where given), v stays; the gradient through the
    in-place writes is the rotation's (checked against the out-of-place function)."""
    batch, seqlen, h, hk, d = 2, 6, 4, 2, 8
    cos, sin, _ = tables(10, 3)
    cos_k, sin_k = cos * 0.5, sin * 0.5
    shape = (batch, seqlen, 3, h, d) if layout == "packed" else (batch, seqlen, h + 2 * hk, d)
    leaf = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    qkv = leaf * 1.0  # a non-leaf, as a projection's output
    num_heads_q = None if layout == "packed" else h
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=2, num_heads_q=num_heads_q)
    assert out is qkv
    if layout == "packed":
        q, k, v = leaf.detach().unbind(2)
        got = out.detach().unbind(2)
    else:
        q, k, v = leaf.detach().split([h, hk, hk], dim=2)
        got = out.detach().split([h, hk, hk], dim=2)
    assert torch.allclose(got[0], apply_rotary_emb(q, cos, sin, seqlen_offsets=2))
    assert torch.allclose(got[1], apply_rotary_emb(k, cos_k, sin_k, seqlen_offsets=2))
    assert torch.equal(got[2], v)
    g = torch.randn_like(out)
    out.backward(g)
    ref_leaf = leaf.detach().clone().requires_grad_()
    parts = ref_leaf.unbind(2) if layout == "packed" else ref_leaf.split([h, hk, hk], dim=2)
    ref = [
        apply_rotary_emb(parts[0], cos, sin, seqlen_offsets=2),
        apply_rotary_emb(parts[1], cos_k, sin_k, seqlen_offsets=2),
        parts[2],
    ]
    ref = torch.stack(ref, dim=2) if layout == "packed" else torch.cat(ref, dim=2)
    ref.backward(g)
    assert torch.allclose(leaf.grad, ref_leaf.grad)


def test_kv_in_place():
    kv = torch.randn(2, 5, 2, 3, 8, dtype=torch.float64)
    k, v = kv.clone().unbind(2)
    cos, sin, _ = tables(8, 4)
    out = apply_rotary_emb_kv_(kv, cos, sin, interleaved=True)
    assert out is kv
    assert torch.allclose(kv[:, :, 0], apply_rotary_emb(k, cos, sin, interleaved=True)) and torch.equal(kv[:, :, 1], v)


def test_rotary_embedding_tables_and_forward():
    """RotaryEmbedding: cos/sin of position * base^(-2i / dim) computed in fp32 and kept in the input's dtype, grown
    as positions grow; forward rotates qkv in place (q and kv apart too)."""
    rotary = RotaryEmbedding(8, base=500.0)
    qkv = torch.randn(2, 5, 3, 2, 12, dtype=torch.float64)
    want_q = apply_rotary_emb(qkv[:, :, 0], *tables(7, 4, base=500.0)[:2], seqlen_offsets=2)
    out = rotary(qkv.clone(), seqlen_offset=2)
    assert rotary._seq_len_cached == 7 and rotary._cos_cached.dtype == torch.float64
    cos, sin, _ = tables(7, 4, base=500.0)
    assert torch.allclose(rotary._cos_cached, cos, atol=1e-6) and torch.allclose(rotary._sin_cached, sin, atol=1e-6)
    assert torch.allclose(out[:, :, 0], want_q, atol=1e-5)
    q, kv = rotary(qkv[:, :, 0].clone(), qkv[:, :, 1:].clone(), seqlen_offset=2)
    assert torch.allclose(q, out[:, :, 0]) and torch.allclose(kv[:, :, 0], out[:, :, 1])
    assert torch.equal(kv[:, :, 1], qkv[:, :, 2])
    rotary(torch.randn(1, 3, 3, 2, 12, dtype=torch.float16), max_seqlen=20)
    assert rotary._seq_len_cached == 20 and rotary._cos_cached.dtype == torch.float16


def test_rotary_embedding_xpos():
    """scale_base (xPos): q's table scaled by s_i^((t - seqlen // 2) / scale_base), k's by its inverse."""
    dim, seqlen, scale_base = 8, 6, 512
    rotary = RotaryEmbedding(dim, scale_base=scale_base)
    rotary._update_cos_sin_cache(seqlen, dtype=torch.float64)
    s = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    scale = s[None, :] ** ((torch.arange(seqlen, dtype=torch.float64)[:, None] - seqlen // 2) / scale_base)
    cos, sin, _ = tables(seqlen, dim // 2)
    assert torch.allclose(rotary._cos_cached, cos * scale, atol=1e-6)
    assert torch.allclose(rotary._sin_k_cached, sin / scale, atol=1e-6)

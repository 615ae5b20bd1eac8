"""cuteflash.rotary.apply_rotary_emb against rotations written as complex products, on the CPU."""

import pytest
import torch

from cuteflash.rotary import apply_rotary_emb


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

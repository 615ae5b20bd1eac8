"""cuteflash.bert_padding: flash-attn's padding helpers, checked against plain indexing on the CPU."""

import pytest
import torch

from cuteflash.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def padded_batch(lengths, seqlen=7, extra=(3, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), seqlen, *extra, generator=g, dtype=torch.float64)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    return x, mask


@pytest.mark.parametrize("lengths", [[7, 3, 0, 1], [1], [0, 0], [5, 7]])
def test_unpad_returns_flash_attn_five_values(lengths):
    x, mask = padded_batch(lengths)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask.to(torch.int64))
    expected = torch.cat([x[b, :n] for b, n in enumerate(lengths)])
    assert torch.equal(packed, expected)
    assert indices.dtype == torch.int64 and torch.equal(x.reshape(-1, 3, 5)[indices], expected)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert max_seqlen == max(lengths) and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths


def test_pad_inverts_unpad_with_zeros_at_the_padding():
    lengths = [4, 0, 7, 2]
    x, mask = padded_batch(lengths)
    packed, indices, *_ = unpad_input(x, mask)
    back = pad_input(packed, indices, len(lengths), x.shape[1])
    assert torch.equal(back, torch.where(mask[:, :, None, None], x, torch.zeros_like(x)))


def test_unused_mask_counts_in_cu_seqlens_not_in_seqused():
    x, mask = padded_batch([3, 5])
    unused = torch.zeros_like(mask)
    unused[0, 3:5] = True  # two more tokens of sequence 0, kept but not attended to
    packed, _, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 5, 10] and max_seqlen == 5 and seqused.tolist() == [3, 5]
    assert torch.equal(packed[:5], x[0, :5])


def test_gradients_flow_through_gather_and_scatter():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 4, 2])  # a repeated row gets both gradients
    torch.autograd.gradcheck(index_first_axis, (x, idx))
    vals = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: index_put_first_axis(v, torch.tensor([5, 1, 2]), 6), (vals,))
    out = index_put_first_axis(vals, torch.tensor([5, 1, 2]), 6)
    assert torch.equal(out[[5, 1, 2]], vals) and torch.count_nonzero(out[[0, 3, 4]]) == 0


def test_a_mask_of_the_wrong_shape_is_refused():
    x, mask = padded_batch([2, 3])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\).*\(2, 7\)"):
        unpad_input(x, mask[:, :6])


def test_unpad_concatenated_sequences():
    """Rows holding several samples one after another: each sample is a sequence of its own."""
    x, _ = padded_batch([7, 7, 7], seqlen=6)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(packed, x.reshape(-1, 3, 5)[indices])


def test_index_first_axis_residual_gradient():
    """Both outputs reach the input: its gradient is the residual's plus the selected rows' (indices repeating)."""
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([4, 1, 4])
    rows, residual = index_first_axis_residual(x, indices)
    assert torch.equal(rows, x[indices]) and torch.equal(residual, x)
    g_rows, g_res = torch.randn(3, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    (rows * g_rows).sum().add((residual * g_res).sum()).backward()
    expected = g_res.clone().index_add_(0, indices, g_rows)
    assert torch.allclose(x.grad, expected)

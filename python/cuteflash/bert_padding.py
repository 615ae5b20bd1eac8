"""Between padded batches (batch, seqlen, ...) and the packed rows (total, ...) that the varlen functions
take, with flash-attn's names, signatures and return values. Pure torch: any device, any dtype, autograd.

    x_packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    ...                                  # varlen attention on x_packed with cu_seqlens, max_seqlen
    y = pad_input(y_packed, indices, batch, seqlen)

`unpad_input` reads the number of rows from the mask, so it synchronises with the GPU once (as flash-attn's
does); `pad_input`, `index_first_axis` and `index_put_first_axis` do not.
"""

from __future__ import annotations

import torch

__all__ = [
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (first axis, everything else), a view where x allows one."""
    return x.reshape(x.shape[0], -1)


class _GatherRows(torch.autograd.Function):
    """output[i] = input[indices[i]]; the gradient scatters back with accumulation (indices may repeat)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis = input.shape[0]
        flat = _rows(input)
        out = torch.gather(flat, 0, indices.view(-1, 1).expand(-1, flat.shape[1]))
        return out.reshape(indices.shape[0], *input.shape[1:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        flat = _rows(grad)
        out = flat.new_zeros(ctx.first_axis, flat.shape[1])
        out.index_add_(0, indices, flat)
        return out.reshape(ctx.first_axis, *grad.shape[1:]), None


class _ScatterRows(torch.autograd.Function):
    """output = zeros(first_axis_dim, ...) with output[indices[i]] = values[i]; indices must not repeat."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        out = values.new_zeros(first_axis_dim, *values.shape[1:])
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad[indices], None, None


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows `indices` (int64, 1-D) of `input` along its first axis: input[indices]."""
    return _GatherRows.apply(input, indices)


class _GatherRowsResidual(torch.autograd.Function):
    """(input[indices], input detached): the second output is a residual path whose gradient flows back to input
    too, with the rows' gradients added to it."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        out = grad_residual.clone()
        out.index_add_(0, indices, grad)
        return out, None


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input[indices], input) where the gradient reaches input through both: flash-attn's helper for a layer
    that keeps the whole input as its residual and computes on the selected rows."""
    return _GatherRowsResidual.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A tensor of `first_axis_dim` rows, zero except row indices[i] = values[i] (indices distinct)."""
    return _ScatterRows.apply(values, indices, first_axis_dim)


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """The rows of a padded batch that the mask keeps, packed.

    hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), nonzero (or True) where a token is
    real; unused_mask: optional, same shape, tokens that are kept in the packed rows but not attended to
    (counted in cu_seqlens, not in seqused).

    Returns (hidden_states_packed (total, ...), indices (total,) int64 into the flattened (batch * seqlen),
    cu_seqlens (batch + 1,) int32, max_seqlen_in_batch (int), seqused (batch,) int32: each sequence's tokens
    that attention_mask keeps).
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected (batch, seqlen) = "
            f"{tuple(hidden_states.shape[:2])}, the first two dims of hidden_states"
        )
    used = attention_mask != 0
    kept = used if unused_mask is None else used | (unused_mask != 0)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    return (*_pack(hidden_states, kept, kept.sum(dim=-1, dtype=torch.int32)), seqused)


def _pack(
    hidden_states: torch.Tensor, kept: torch.Tensor, seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The rows of hidden_states (batch, seqlen, ...) where kept (batch, seqlen) holds, packed, as sequences of
    seqlens (int32) tokens: (packed, indices, cu_seqlens, max_seqlen). Synchronises with the GPU for max_seqlen."""
    indices = torch.nonzero(kept.flatten()).flatten()
    cu_seqlens = torch.zeros(seqlens.shape[0] + 1, dtype=torch.int32, device=seqlens.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    packed = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: packed rows (total, ...) back to (batch, seqlen, ...), zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(
    hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """unpad_input for rows that each hold several samples one after another: attention_mask_in_length (batch,
    seqlen) gives row b's sample lengths in its first entries (zeros after), e.g. [3, 2, 0, 0, 0, 0] for samples of
    3 and 2 tokens at the start of a row of 6. Every sample becomes a sequence of its own.

    Returns (hidden_states_packed (total, ...), indices (total,) int64 into the flattened (batch * seqlen),
    cu_seqlens (samples + 1,) int32, max_seqlen_in_batch (int)). Synchronises with the GPU once, for max_seqlen.
    """
    lengths = attention_mask_in_length
    if lengths.dim() != 2 or tuple(lengths.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask_in_length has shape {tuple(lengths.shape)}; expected (batch, seqlen) = "
            f"{tuple(hidden_states.shape[:2])}, the first two dims of hidden_states"
        )
    kept = torch.arange(lengths.shape[1], device=lengths.device) < lengths.sum(dim=-1, keepdim=True)
    samples = lengths.flatten()
    return _pack(hidden_states, kept, samples[samples != 0].to(torch.int32))

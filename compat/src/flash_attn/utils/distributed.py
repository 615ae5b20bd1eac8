"""flash-attn's flash_attn.utils.distributed: collectives over the first axis of a tensor, with and without
autograd, for sequence and tensor parallelism (OpenRLHF's ring attention imports all_gather). Plain torch.distributed.

- all_gather(x, group): the ranks' x concatenated along the first axis; its gradient is the reduce-scatter.
- reduce_scatter(x, group): the sum over ranks of x, split along the first axis, this rank's part; its gradient
  is the all-gather.
- all_reduce(x, group): the sum over ranks; its gradient passes through unchanged.
The *_raw forms take async_op and return (result, work handle), without autograd.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
    "reduce_scatter",
    "reduce_scatter_raw",
    "sync_shared_params",
]


# Newer torch names the tensor forms *_single (the old names warn there); older torch has only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_raw(input_: Tensor, process_group, async_op: bool = False):
    world = dist.get_world_size(process_group)
    out = input_.new_empty((world * input_.shape[0], *input_.shape[1:]))
    work = _all_gather_tensor(out, input_.contiguous(), group=process_group, async_op=async_op)
    return out, work


def reduce_scatter_raw(input_: Tensor, process_group, async_op: bool = False):
    world = dist.get_world_size(process_group)
    if input_.shape[0] % world:
        raise ValueError(f"reduce_scatter: the first axis ({input_.shape[0]}) must divide among {world} ranks")
    out = input_.new_empty((input_.shape[0] // world, *input_.shape[1:]))
    work = _reduce_scatter_tensor(out, input_.contiguous(), group=process_group, async_op=async_op)
    return out, work


def all_reduce_raw(input_: Tensor, process_group, async_op: bool = False):
    out = input_.contiguous()
    work = dist.all_reduce(out, group=process_group, async_op=async_op)
    return out, work


class _Collective(torch.autograd.Function):
    """forward_raw's result, whose gradient is backward_raw's of the incoming one (an all-gather and a reduce-scatter
    are each other's gradient; an all-reduce's gradient passes through, backward_raw None)."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group, forward_raw, backward_raw) -> Tensor:
        ctx.process_group, ctx.backward_raw = process_group, backward_raw
        return forward_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.backward_raw is not None:
            grad = ctx.backward_raw(grad, ctx.process_group)[0]
        return grad, None, None, None


def all_gather(input_: Tensor, process_group) -> Tensor:
    return _Collective.apply(input_, process_group, all_gather_raw, reduce_scatter_raw)


def reduce_scatter(input_: Tensor, process_group) -> Tensor:
    return _Collective.apply(input_, process_group, reduce_scatter_raw, all_gather_raw)


def all_reduce(input_: Tensor, process_group) -> Tensor:
    return _Collective.apply(input_, process_group, all_reduce_raw, None)


def sync_shared_params(model: torch.nn.Module, process_group) -> None:
    """Broadcasts, from the group's first rank, the parameters marked `_shared_params = True` (flash-attn's
    convention for parameters that every tensor-parallel rank holds whole)."""
    shared = [p for p in model.parameters() if getattr(p, "_shared_params", False)]
    if not shared:
        return
    src = dist.get_global_rank(process_group, 0)
    flat = torch._utils._flatten_dense_tensors(shared)
    dist.broadcast(flat, src=src, group=process_group)
    for p, synced in zip(shared, torch._utils._unflatten_dense_tensors(flat, shared)):
        p.data.copy_(synced)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group) -> None:
    """Sums over the group the gradients of the parameters marked `_sequence_parallel = True` (each rank computed
    its part of them from its part of the sequence)."""
    params = [p for p in model.parameters() if getattr(p, "_sequence_parallel", False) and p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=process_group)
    for g, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(summed)


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """The part of `dim` that rank local_rank holds when it is split into whole multiples of `multiple_of` among
    world_size ranks, the first ranks taking one multiple more where it does not divide evenly."""
    units, extra = divmod(dim // multiple_of, world_size)
    return (units + (1 if local_rank < extra else 0)) * multiple_of

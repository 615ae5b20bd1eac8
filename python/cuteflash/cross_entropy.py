"""Cross-entropy over large vocabularies without an fp32 copy of the logits, with flash-attn's
`cross_entropy_loss` (flash_attn.ops.triton.cross_entropy) and `CrossEntropyLoss` (flash_attn.losses.cross_entropy):
names, signatures and results.

    losses, z_losses = cross_entropy_loss(logits, labels, label_smoothing=0.1, lse_square_scale=1e-4)

Per row of z = logit_scale * logits and its label y: loss = lse(z) - (1 - s) z_y - s mean(z) + c lse(z)^2 with s the
label smoothing and c lse_square_scale (the "z-loss", also returned alone, for logging); 0 where y == ignore_index.
One pass over each row reads the logits once (an online log-sum-exp); the backward pass writes
dloss * logit_scale * (softmax(z) (1 + 2 c lse) - (1 - s) onehot(y) - s / classes), into the logits themselves with
inplace_backward. With process_group, each rank holds a contiguous slice of the vocabulary (rank r the r-th), and
the per-row statistics are combined across the group.

Triton kernels: CUDA tensors (see cuteflash.layer_norm for the GPUs), or the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from .layer_norm import _check_device, _kernels, _on

__all__ = ["CrossEntropyLoss", "cross_entropy_loss"]

_BLOCK = 4096  # vocabulary entries a program reads at a time


class CrossEntropyLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, precomputed_lse=None, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                ignore_index=-100, inplace_backward=False, process_group=None):  # fmt: skip
        kernels = _kernels()
        _check_device(logits)
        if logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError(f"logits must be (batch, vocab_size) with vocab_size >= 1, got {tuple(logits.shape)}")
        if labels.shape != logits.shape[:1] or labels.dtype.is_floating_point:
            raise ValueError(f"labels must be integer ({logits.shape[0]},), got {labels.dtype} {tuple(labels.shape)}")
        if labels.device != logits.device:
            raise ValueError(f"labels are on {labels.device} but logits on {logits.device}")
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {smoothing}")
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()
        rows, n = logits.shape
        world = 1 if process_group is None else torch.distributed.get_world_size(process_group)
        first_class = 0 if process_group is None else torch.distributed.get_rank(process_group) * n
        classes = n * world
        stats = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
        lse, total, picked = stats
        if rows:
            with _on(logits.device):
                kernels.xent_fwd[(rows,)](
                    logits, labels, lse, total, picked, logits.stride(0), n, first_class, float(logit_scale),
                    ignore_index, BLOCK=min(_BLOCK, kernels.triton.next_power_of_2(n)), num_warps=8,
                )  # fmt: skip
        if process_group is not None:
            # every rank's log-sum-exp, combined; the sums and label entries add up across the slices
            dist = torch.distributed
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch's newer name
            gathered = torch.empty(world * rows, dtype=torch.float32, device=logits.device)
            gather(gathered, lse.contiguous(), group=process_group)
            lse = torch.logsumexp(gathered.view(world, rows), dim=0)
            sums = torch.stack((total, picked))
            torch.distributed.all_reduce(sums, group=process_group)
            total, picked = sums
        if precomputed_lse is not None and logit_scale == 1.0 and smoothing == 0.0:  # where flash-attn takes it
            if precomputed_lse.shape != (rows,):
                raise ValueError(f"precomputed_lse must be ({rows},), got {tuple(precomputed_lse.shape)}")
            lse = precomputed_lse.to(torch.float32)
        ignored = labels == ignore_index
        z_losses = (lse_square_scale * lse.square()).masked_fill_(ignored, 0.0)
        losses = lse - (1.0 - smoothing) * picked - (smoothing / classes) * total + z_losses
        losses.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(z_losses)
        ctx.options = (smoothing, float(logit_scale), lse_square_scale, ignore_index, inplace_backward)
        ctx.first_class, ctx.classes = first_class, classes
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        kernels = _kernels()
        logits, labels, lse = ctx.saved_tensors
        smoothing, scale, lse_square_scale, ignore_index, inplace = ctx.options
        dlogits = logits if inplace else torch.empty_like(logits)
        rows, n = logits.shape
        block = min(_BLOCK, kernels.triton.next_power_of_2(n))
        if rows:
            with _on(logits.device):
                kernels.xent_bwd[(rows, -(-n // block))](
                    logits, labels, lse, grad_losses.contiguous(), dlogits, logits.stride(0), dlogits.stride(0), n,
                    ctx.first_class, ctx.classes, scale, smoothing, lse_square_scale, ignore_index, BLOCK=block,
                    num_warps=8,
                )  # fmt: skip
        return dlogits, *(None,) * 8


def cross_entropy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    precomputed_lse: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy, flash-attn's signature.

    Arguments:
        logits: (batch, vocab_size) float16, bfloat16 or float32 (this rank's slice with process_group).
        labels: (batch,) integer class indices into the whole vocabulary.
        precomputed_lse: (batch,) or None: the log-sum-exp of the logits, where the caller has it; used in place
            of the one computed here where logit_scale is 1 and there is no label smoothing (as in flash-attn).
        label_smoothing: s in [0, 1]. logit_scale: multiplies the logits first.
        lse_square_scale: c: adds c * lse^2 to each loss (the z-loss).
        ignore_index: rows with this label get loss 0 and no gradient.
        inplace_backward: the backward pass writes the gradient into logits (saves its memory; logits must not be
            needed afterwards).
        process_group: a torch.distributed group over which the vocabulary is split, in rank order.
    Return:
        losses: (batch,) float32, differentiable in logits; z_losses: (batch,) float32, c * lse^2 (not
        differentiable: for logging).
    """
    return CrossEntropyLossFn.apply(
        logits, labels, precomputed_lse, label_smoothing, logit_scale, lse_square_scale, ignore_index,
        inplace_backward, process_group,
    )  # fmt: skip


class CrossEntropyLoss(torch.nn.Module):
    """flash-attn's CrossEntropyLoss module: cross_entropy_loss's options, reduced by `reduction` ("mean" over the
    rows not ignored, "sum" or "none"); with return_z_loss, forward returns (loss, z_loss) reduced alike."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                 lse_square_scale=0.0, inplace_backward=False, process_group=None, return_z_loss=False):  # fmt: skip
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise NotImplementedError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def forward(self, input, target, precomputed_lse=None):
        loss, z_loss = cross_entropy_loss(
            input, target, precomputed_lse=precomputed_lse, label_smoothing=self.label_smoothing,
            logit_scale=self.logit_scale, lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
            inplace_backward=self.inplace_backward, process_group=self.process_group,
        )  # fmt: skip
        if self.reduction != "none":
            loss, z_loss = loss.sum(), z_loss.sum()
            if self.reduction == "mean":
                counted = (target != self.ignore_index).sum()
                loss, z_loss = loss / counted, z_loss / counted
        return (loss, z_loss) if self.return_z_loss else loss

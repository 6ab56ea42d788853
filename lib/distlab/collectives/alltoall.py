"""``all_to_all_single`` that autograd can see through (forward and backward).

Forward, rank r sends its rows ``input_splits[j]`` to rank j and receives
``output_splits[j]`` rows from rank j; backward, the gradient makes the same trip the
other way (the splits swapped), which is what every dispatch/combine of expert
parallelism and every head/sequence swap of DeepSpeed-Ulysses needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(x: torch.Tensor, input_splits: list[int], output_splits: list[int],
             group=None) -> torch.Tensor:
    """Rows of ``x`` (dim 0) scattered by ``input_splits``, received by ``output_splits``:
    one ``all_to_all_single``, differentiable."""
    return _AllToAll.apply(x, list(input_splits), list(output_splits), group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, input_splits, output_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.group)
        return out, None, None, None

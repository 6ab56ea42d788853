"""Megatron-LM's conjugate operators f and g (Shoeybi et al. 2019, section 3, figure 3),
as autograd functions: f (:func:`copy_to_group`) is the identity forward and an
all-reduce of the gradient backward; g (:func:`reduce_from_group`) is an all-reduce
forward and the identity backward. Lab 06's warm-ups and part of the answers to its
``ColumnParallelLinear`` and ``RowParallelLinear``: this module holds only them, and is
absent from the graded ranks of those exercises (:mod:`distlab.grading.answers`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _CopyToGroup(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand the same gradient tensor to another branch
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's g: forward sums over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None



def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: ``x`` unchanged; its gradient is summed over ``group``."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: the sum of every rank's ``x``; the gradient passes through unchanged."""
    return _ReduceFromGroup.apply(x, group)

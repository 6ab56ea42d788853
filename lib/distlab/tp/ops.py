"""Megatron-LM's communication operators for tensor parallelism (Shoeybi et al. 2019,
section 3, and Korthikanti et al. 2022 for the sequence-parallel pair), as autograd
functions: each is a collective forward and its adjoint backward.

* **f** (:func:`copy_to_group`): identity forward, all-reduce of the gradient backward;
* **g** (:func:`reduce_from_group`): all-reduce forward, identity backward;
* :func:`gather_from_group` (every rank's piece along a dimension, pieces of the given
  sizes; backward keeps this rank's slice) and :func:`all_gather_along` (the same,
  without autograd);
* :func:`split_sequence`, :func:`gather_sequence`, :func:`reduce_scatter_sequence`:
  sequence parallelism's entry and exits, each the adjoint of another;
* :func:`compute_dtype`: a tensor in the autocast dtype when autocast is on.

f and g are lab 06's warm-ups in the notebook and part of the answers to its layers:
they live in :mod:`distlab.tp.fg`, absent while those are graded, and are re-exported
here. The layers of :mod:`distlab.tp.layers` are built on them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab import comm
from distlab.shards import shard_sizes
from distlab.tp.fg import copy_to_group, reduce_from_group

def all_gather_along(x: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank r's piece has ``sizes[r]``
    rows there): one all-gather, pieces padded to the longest."""
    longest = max(sizes)
    front = x.movedim(dim, 0)
    if front.shape[0] < longest:
        front = torch.cat([front, front.new_zeros(longest - front.shape[0], *front.shape[1:])])
    out = front.new_empty(len(sizes) * longest, *front.shape[1:])
    comm.all_gather_into(out, front.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(out.split(longest), sizes)]).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``x`` (even slices)."""
    size = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty(front.shape[0] // size, *front.shape[1:])
    comm.reduce_scatter_into(out, front, group=group)
    return out.movedim(0, dim)


def _my_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    return x.tensor_split(size, dim=dim)[dist.get_rank(group)].contiguous()


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's slice of the gradient (the
    computation after the gather is replicated, so every rank holds the same gradient)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return all_gather_along(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[:dist.get_rank(ctx.group)])
        piece = grad.narrow(ctx.dim, start, ctx.sizes[dist.get_rank(ctx.group)])
        return piece.contiguous(), None, None, None


class _SplitToGroup(torch.autograd.Function):
    """Keep this rank's slice along ``dim``; backward all-gathers the gradient
    (sequence parallelism's entry, after the embedding)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return _my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        sizes = shard_sizes(ctx.length, dist.get_world_size(ctx.group))
        return all_gather_along(grad, ctx.dim, sizes, ctx.group), None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel, before a column-parallel layer: all-gather the sequence
    forward, reduce-scatter the gradient backward (Korthikanti et al., figure 5's g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        return all_gather_along(x, 1, [x.shape[1]] * size, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallel, after a row-parallel layer: reduce-scatter the sequence
    forward, all-gather the gradient backward (figure 5's g-bar)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        return all_gather_along(grad, 1, [grad.shape[1]] * size, ctx.group), None


def gather_from_group(x: torch.Tensor, dim: int, sizes: list[int], group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (``sizes``: each rank's length)."""
    return _GatherFromGroup.apply(x, dim, list(sizes), group)


def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's entry: all-gather the sequence (dim 1) forward,
    reduce-scatter of the gradient backward."""
    return _GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sequence parallelism's exit: reduce-scatter along the sequence forward,
    all-gather of the gradient backward."""
    return _ReduceScatterSequence.apply(x, group)


def split_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the sequence (dim 1) of ``x``; backward all-gathers."""
    _check_sequence(x.shape[1], dist.get_world_size(group))
    return _SplitToGroup.apply(x, 1, group)


def _check_sequence(length: int, size: int) -> None:
    if length % size:
        raise ValueError(f"sequence parallelism splits the sequence over the {size} ranks: "
                         f"{length} tokens do not split evenly; use a sequence length that is a "
                         f"multiple of {size}, or sequence_parallel=False")


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on, so that collectives on it (and
    on its gradient) move 2-byte elements, as the matrix product would use anyway."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


__all__ = ["all_gather_along", "compute_dtype", "copy_to_group", "gather_from_group",
           "gather_sequence", "reduce_from_group", "reduce_scatter_sequence", "split_sequence"]

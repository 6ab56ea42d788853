"""A flat unit's gradients reduced to this rank's shard (:func:`reduce_grads`), the step
the ZeRO-3 wrapper and the sharded optimizer take after backward. Part of lab 05's
answer ``ZeRO3Unit`` (:mod:`distlab.grading.answers`): it is released with lab 05's
answers, so that their ZeRO runs in every later lab.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.zero.collective import Pending
from distlab.zero.flat import FlatParams, reduce_scatter_mean


def reduce_grads(unit: FlatParams, async_op: bool = False) -> Pending:
    """Reduce-scatter (mean) the parameters' gradients of ``unit``; waiting adds this
    rank's shard to the pieces' gradients. A parameter whose ``.grad`` is None on this
    rank (frozen, or unused by the loss) counts as zero, and its piece gets no gradient,
    so the optimizer leaves it alone: every rank must agree on which parameters get a
    gradient, as with DDP's static graphs. A replicated unit is all-reduced (mean)."""
    had = [p.grad is not None for p in unit.params]
    with torch.no_grad():
        flat = torch.cat([p.grad.reshape(-1).to(unit.dtype) if p.grad is not None else
                          p.new_zeros(n, dtype=unit.dtype)
                          for p, n in zip(unit.params, unit.numels)])
        pending = _all_reduce_mean(flat, unit.group, async_op) if unit.replicated else \
            reduce_scatter_mean(flat, unit.layout, unit.group, async_op)
    return Pending(pending.work, lambda: _add_to_pieces(unit, pending.finish(), had))


def _add_to_pieces(unit: FlatParams, shard: torch.Tensor, had: list[bool]) -> None:
    """Add this rank's reduced shard (compute dtype) to the pieces' gradients (master
    dtype): a new gradient is a widened copy, an existing one adds in place."""
    with torch.no_grad():
        for i, (piece, ok) in enumerate(zip(unit.pieces, had)):
            if not ok:
                continue
            lo, hi = unit.ranges[i]
            at = unit.offsets[i] + lo - unit.start
            g = shard[at:at + hi - lo].view(piece.shape)
            if piece.grad is None:
                piece.grad = g.to(unit.master_dtype, copy=True)
            else:
                piece.grad.add_(g)


def _all_reduce_mean(flat: torch.Tensor, group=None, async_op: bool = False) -> Pending:
    """The mean of ``flat`` over the group, in place: one all-reduce (SUM, then the same
    division as :func:`~distlab.zero.flat.reduce_scatter_mean`, so a replicated gradient
    is rounded as a sharded one and as :class:`distlab.dp.DataParallel`'s)."""
    world = dist.get_world_size(group)
    if world == 1:
        return Pending(None, lambda: flat)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(work if async_op else None, lambda: flat.div_(world))

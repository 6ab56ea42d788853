"""What every data-parallel replica agrees on: rank 0's state (:func:`broadcast_state`),
each rank's share of the global mean loss (:func:`shard_loss_weight`), and which
gradients share a bucket (:func:`plan_buckets`, torch DDP's rule); and lab 04's wrapper,
:class:`OneShotDataParallel`, which averages the gradients with the all-reduce it is
given (lab 04's ``allreduce_gradients`` by default, :mod:`distlab.dp.allreduce`). Lab 08's
bucketed wrapper (:mod:`distlab.dp.bucketed`) and lab 09's train step are built on them.
"""
from __future__ import annotations

import contextlib
import numbers

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.backend import check_module_devices
from distlab.comm import in_group
from distlab.dp.allreduce import allreduce_gradients

MB = 1 << 20  # torch's DDP counts bucket_cap_mb in MiB; so do we


def shard_loss_weight(local_count: int, global_count: int, world_size: int) -> float:
    """The factor for a rank's mean loss over its ``local_count`` items so that the mean
    over ranks of the weighted losses is the mean over all ``global_count`` items:
    ``local_count * world_size / global_count`` (1 when the batch splits evenly).
    torch's DDP averages over ranks too, so uneven shards need this weight as well."""
    if global_count < 1:
        raise ValueError(f"global_count must be >= 1, got {global_count}")
    return local_count * world_size / global_count


def plan_buckets(params, bucket_cap_mb: float | None = 25) -> list[list[int]]:
    """Which parameters share a bucket: lists of indices into ``params``, in the order
    the buckets are all-reduced.

    Torch DDP's rule (``compute_bucket_assignment_by_size``): walk the parameters in
    reverse, as backward produces the gradients of the last layers first; keep one open
    bucket per dtype and device; a bucket closes as soon as it holds at least
    ``bucket_cap_mb`` MiB, so a parameter larger than the cap fills a bucket of its own.
    ``None``: one bucket per parameter. Unlike DDP, no 1 MiB first bucket and no
    re-bucketing in the order gradients arrived (see lab 08 for why)."""
    if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(
            bucket_cap_mb, numbers.Real)):
        raise TypeError(f"bucket_cap_mb is a size in MiB (a number) or None, got "
                        f"{type(bucket_cap_mb).__name__}; pass a process group as group=...")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 (MiB), or None for one bucket per "
                         f"parameter; got {bucket_cap_mb}")
    cap = 0 if bucket_cap_mb is None else bucket_cap_mb * MB
    buckets, open_, size = [], {}, {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        size[key] = size.get(key, 0) + p.numel() * p.element_size()
        if size[key] >= cap:
            buckets.append(open_.pop(key))
            size[key] = 0
    return buckets + list(open_.values())


def broadcast_state(module: nn.Module, group=None) -> None:
    """Rank 0 of ``group`` sends its parameters and buffers to every other member."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


class _Replicated(nn.Module):
    """What the data-parallel wrappers share: checks, the broadcast, ``forward``, ``no_sync``."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps an nn.Module, got "
                            f"{type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs a process group: call it inside "
                               f"a function run by distlab.launch.run (or under torchrun)")
        self.module = module
        self.group = group
        self.require_sync = True
        self.member = in_group(group)
        if self.member:
            check_module_devices(module)
            broadcast_state(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient synchronisation inside the block (gradient accumulation): the
        gradients add up locally, and the first synchronised backward after the block
        averages the accumulated sum once."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


class OneShotDataParallel(_Replicated):
    """``OneShotDataParallel(module, group=None, *, allreduce=allreduce_gradients)``, lab
    04's version: after ``loss.backward()``, :meth:`finish_gradient_synchronization`
    averages every gradient with ``allreduce(module, group)``, one blocking call (lab 04's
    exercise; its cells pass the student's own). Nothing overlaps: the link idles during
    backward and the processor during the all-reduce. A rank that is not a member of
    ``group`` does nothing."""

    def __init__(self, module: nn.Module, group=None, *, allreduce=allreduce_gradients):
        super().__init__(module, group)
        self.allreduce = allreduce

    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the group (unless inside :meth:`no_sync`)."""
        if self.require_sync and self.member:
            self.allreduce(self.module, self.group)

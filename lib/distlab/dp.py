"""Data parallelism: every rank holds the whole model, computes gradients on its own
slice of the global batch, and the ranks average their gradients before each step.

:class:`DataParallel` is shaped like ``torch.nn.parallel.DistributedDataParallel`` so
that one can replace the other in a training loop:

    model = DataParallel(GPT(cfg).to(backend.device()))   # rank 0's weights everywhere
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()                # torch's DDP does this in backward
    optimizer.step()

Averaged gradients give the single-process update on the global batch when each rank's
loss is its share of the global mean (see :func:`shard_loss_weight`): the rule every
strategy of this course is tested against.

This is the simple version: after backward, one blocking all-reduce of all gradients
(coalesced in one buffer). Lab 08 adds buckets and overlap with the backward pass (a
subclass overrides :meth:`DataParallel.finish_gradient_synchronization`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


def allreduce_gradients(module: nn.Module, group=None) -> None:
    """Every ``.grad`` of ``module`` becomes its mean over the ranks of ``group``;
    parameters without a gradient (frozen, or unused by the loss) are left alone.
    Tied parameters appear once in ``module.parameters()`` and are reduced once.

    The gradients are copied into one flat buffer per dtype and device and reduced with
    a single all-reduce: small tensors one by one would pay the latency of a collective
    each (PyTorch's DDP groups them in buckets for the same reason). SUM, then divide:
    ``ReduceOp.AVG`` is not offered by every backend and version (older gloo lacks it)."""
    world = dist.get_world_size(group)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None:
            if p.grad.is_sparse:
                raise ValueError("allreduce_gradients handles dense gradients only; build "
                                 "embeddings with sparse=False")
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(world)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def shard_loss_weight(local_count: int, global_count: int, world_size: int) -> float:
    """The factor for a rank's mean loss over its ``local_count`` items so that the mean
    over ranks of the weighted losses is the mean over all ``global_count`` items:
    ``local_count * world_size / global_count`` (1 when the batch splits evenly).
    torch's DDP averages over ranks too, so uneven shards need this weight as well."""
    if global_count < 1:
        raise ValueError(f"global_count must be >= 1, got {global_count}")
    return local_count * world_size / global_count


class DataParallel(nn.Module):
    """``DataParallel(module, group=None)``: replicate ``module`` over the ranks of
    ``group`` (the default group when None).

    At construction, rank 0 of the group broadcasts its parameters and buffers so every
    replica starts equal. After ``loss.backward()`` call
    :meth:`finish_gradient_synchronization`; inside :meth:`no_sync` it does nothing, so
    gradients accumulate locally over micro-batches and the call after the last one
    (outside ``no_sync``) averages the accumulated sum once."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs a process group: call it inside a function "
                               "run by distlab.launch.run (or under torchrun)")
        self.module = module
        self.group = group
        self.require_sync = True
        _check_devices(module)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=src, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient synchronisation inside the block (gradient accumulation)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the group (unless inside :meth:`no_sync`)."""
        if self.require_sync:
            allreduce_gradients(self.module, self.group)


def _check_devices(module: nn.Module) -> None:
    """NCCL moves only CUDA tensors: say so before the first broadcast fails."""
    if dist.get_backend() != "nccl":
        return
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "cuda":
            raise ValueError(
                f"{name} is on {t.device} but the nccl backend needs CUDA tensors: move the "
                f"model with .to(distlab.backend.device()) before wrapping it")

"""A parameter server built from two collectives (lecture 14 of the source).

One step, for W ranks of which one, ``server``, holds the authoritative parameters:

* push: every rank's gradients are summed onto the server (``reduce``);
* update: the server averages them and takes the SGD step, alone;
* pull: the server's parameters go back to every rank (``broadcast``).

The result equals data-parallel SGD with averaged gradients (all-reduce, then the same
step on every rank). The gradients travel as one flat buffer, so a step is two
collectives whatever the number of tensors.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.comm import in_group


@torch.no_grad()
def ps_sgd_step(params, grads, server: int, lr: float, group=None) -> None:
    """In place on every rank of ``group``: ``params -= lr * mean over ranks of grads``,
    computed on rank ``server`` (a global rank) and broadcast from it. ``grads`` are
    left as they were. A rank outside ``group`` returns at once, its tensors untouched."""
    if not in_group(group):
        return
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"{len(params)} parameters but {len(grads)} gradients: pass one "
                         f"gradient per parameter, in the same order")
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.shape != g.shape or p.dtype != g.dtype:
            raise ValueError(f"parameter {i} is {tuple(p.shape)} {p.dtype} but its gradient "
                             f"is {tuple(g.shape)} {g.dtype}; they must match")
    if not params:
        return
    if len({p.dtype for p in params}) > 1:
        raise ValueError("ps_sgd_step sends one flat buffer: give it parameters of one "
                         "dtype (call it once per dtype)")
    world = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])        # a copy: grads stay as they were
    dist.reduce(flat, dst=server, group=group)               # push
    if dist.get_rank() == server:                            # update, on the server only
        flat.div_(world)
        for p, g in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.sub_(g.view_as(p), alpha=lr)
        flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=server, group=group)            # pull
    if dist.get_rank() != server:
        for p, new in zip(params, torch.split(flat, [p.numel() for p in params])):
            p.copy_(new.view_as(p))

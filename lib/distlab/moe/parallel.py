"""Expert parallelism applied to an unmodified MoE model from outside (torchtitan's way).

:func:`expert_parallel` keeps on rank r of ``group`` only its ``E/W`` experts of each
:class:`~distlab.moe.layer.MoE` layer and gives the layer the all-to-all dispatch and
combine (``dispatch``: the library's :func:`~distlab.moe.dispatch.moe_dispatch_combine`,
or lab 10's own answer to it). Every other parameter is replicated: the ranks train as
data-parallel replicas whose experts are shared, and :func:`sync_gradients` averages
what must be averaged.
"""
from __future__ import annotations

import functools

import torch.distributed as dist
import torch.nn as nn

from distlab.moe.dispatch import moe_dispatch_combine
from distlab.moe.layer import moe_layers


def expert_parallel(model: nn.Module, group=None, *,
                    dispatch=moe_dispatch_combine) -> nn.Module:
    """Shard every MoE layer's experts over ``group`` and make ``dispatch`` (with the
    contract of lab 10's ``moe_dispatch_combine``) each layer's dispatch (in place;
    returns ``model``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in moe_layers(model):
        if layer.num_experts % world:
            raise ValueError(f"{layer.num_experts} experts cannot be spread evenly over {world} "
                             f"ranks: choose a number of experts that is a multiple of {world}")
        local = layer.num_experts // world
        layer.experts = nn.ModuleList(list(layer.experts)[rank * local:(rank + 1) * local])
        layer.dispatch = functools.partial(dispatch, group=group)
    return model


def sync_gradients(model: nn.Module, group=None) -> None:
    """After backward of this rank's mean loss: the gradient of the group's mean loss.
    Replicated parameters are all-reduced and averaged; an expert's gradient already
    holds every rank's tokens, and is only divided by the group's size."""
    world = dist.get_world_size(group)
    experts = {id(p) for layer in moe_layers(model) for p in layer.experts.parameters()}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            dist.all_reduce(p.grad, group=group)
        p.grad /= world

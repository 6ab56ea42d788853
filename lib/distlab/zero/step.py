"""Lab 05's answer ``zero2_step`` (one ZeRO-2 step on flat buffers) and the AdamW it runs:
:func:`adamw_` is AdamW (Loshchilov & Hutter 2019, "Decoupled weight decay
regularization") on flat tensors, computed as ``torch.optim.AdamW`` computes it. Used
through :mod:`distlab.zero`."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distlab.comm import in_group
from distlab.zero.flat import Layout, all_gather_shards, reduce_scatter_mean


def adamw_(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float = 1e-3,
           betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: float = 1e-2) -> None:
    """One AdamW step on ``param`` in place; ``state`` holds ``step``, ``exp_avg`` and
    ``exp_avg_sq`` (created at the first step, like ``param``)."""
    beta1, beta2 = betas
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(param),
                     exp_avg_sq=torch.zeros_like(param))
    state["step"] += 1
    t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    param.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))


def zero2_step(flat_params: torch.Tensor, flat_grads: torch.Tensor, state: dict, group=None,
               lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2) -> None:
    """One ZeRO-2 step on flat buffers, in place: ``flat_grads``' mean over the group,
    reduce-scattered, drives AdamW on this rank's shard of ``flat_params``
    (``torch.tensor_split``'s pieces), whose moments ``state`` holds; then every rank's
    ``flat_params`` gets every updated shard (all-gather). A rank that is not a member
    of ``group`` returns at once and touches nothing."""
    if not in_group(group):
        return None
    layout = Layout(flat_params.numel(), dist.get_world_size(group))
    start, end = layout.bounds(dist.get_rank(group))
    grad = reduce_scatter_mean(flat_grads, layout, group).wait()
    shard = flat_params[start:end]
    adamw_(shard, grad, state, lr, betas, eps, weight_decay)
    all_gather_shards(shard.clone(), layout, flat_params, group).wait()
    return None

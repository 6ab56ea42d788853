"""A mixture-of-experts layer, in one process, and a GPT whose MLPs it replaces.

:class:`MoE` routes each token to ``k`` of ``num_experts`` MLPs (:mod:`distlab.moe.router`),
lets each expert take at most its capacity, and sums the chosen experts' outputs
weighted by the router. Which assignments an expert keeps follows GShard (Lepikhin et
al. 2020, section 2.2): every token's first choice before any second choice, then token
order (:func:`~distlab.moe.router.kept`). A dropped assignment adds nothing.

The layer has no parallel code: ``layer.dispatch`` is the function that sends the
tokens to the experts and sums what comes back, :func:`combine_local` in one process;
:func:`distlab.moe.expert_parallel` replaces it (and keeps only a rank's experts) from
outside, as torchtitan does.

:func:`moe_gpt` is the kit's GPT (:mod:`distlab.model`) with every ``every``-th block's
MLP an :class:`MoE`, so it trains on the same synthetic language with a known floor.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distlab.model import GPT, MLP, GPTConfig
from distlab.moe.router import capacity as capacity_of
from distlab.moe.router import balance_bias_step, kept, load_balancing_loss, route


class MoE(nn.Module):
    """``MoE(cfg, num_experts, k=2, capacity_factor=1.25, bias_speed=None)``: (...,
    d_model) → same shape. After each forward, ``aux_loss`` holds the load-balancing loss
    of that batch. With ``bias_speed``, the layer keeps DeepSeek-V3's balance bias
    (the buffer ``balance_bias``, used for the choice of experts only), which
    :meth:`update_bias` moves after each step."""

    def __init__(self, cfg: GPTConfig, num_experts: int, k: int = 2,
                 capacity_factor: float | None = 1.25, bias_speed: float | None = None):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k = {k} experts per token of {num_experts}: choose 1 <= k <= "
                             f"{num_experts}")
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        self.router = nn.Linear(cfg.d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(num_experts))
        self.dispatch = combine_local
        self.aux_loss = None
        self.last_ids = None
        self.bias_speed = bias_speed
        self.register_buffer("balance_bias",
                             None if bias_speed is None else torch.zeros(num_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        r = route(self.router(flat), self.k, self.balance_bias)
        self.aux_loss = load_balancing_loss(r.probs, r.expert_ids)
        self.last_ids = r.expert_ids.detach()
        cap = capacity_of(flat.shape[0], self.num_experts, self.k, self.capacity_factor)
        return self.dispatch(flat, r.expert_ids, r.weights, self.experts, cap).reshape(x.shape)

    def update_bias(self, counts: torch.Tensor | None = None) -> None:
        """After a step: :func:`~distlab.moe.router.balance_bias_step` on ``counts``, the
        assignments per expert of the whole step's batch (default: the last forward's;
        with several data-parallel or expert-parallel ranks, pass their sum)."""
        if self.balance_bias is None:
            raise ValueError("this MoE layer has no balance bias: build it with bias_speed")
        if counts is None:
            counts = torch.bincount(self.last_ids.reshape(-1), minlength=self.num_experts)
        self.balance_bias = balance_bias_step(self.balance_bias, counts, self.bias_speed)


def combine_local(x, expert_ids, weights, experts, capacity=None):
    """Every expert in this process: ``sum_j weights[n, j] · expert_{ids[n, j]}(x[n])``
    over the kept assignments of each token ``n``."""
    keep = kept(expert_ids, len(experts), capacity)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        n, j = ((expert_ids == e) & keep).nonzero(as_tuple=True)
        y = y.index_add(0, n, expert(x[n]) * weights[n, j, None].to(x.dtype))
    return y


def moe_gpt(cfg: GPTConfig, num_experts: int, k: int = 2, every: int = 2,
            capacity_factor: float | None = 1.25, bias_speed: float | None = None) -> GPT:
    """The kit's GPT with the MLP of blocks ``every-1, 2·every-1, ...`` an :class:`MoE`
    (initialised as the GPT initialises its MLPs)."""
    model = GPT(cfg)
    for i, block in enumerate(model.blocks):
        if i % every == every - 1:
            block.mlp = MoE(cfg, num_experts, k, capacity_factor, bias_speed)
            block.mlp.apply(GPT._init)
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The mean load-balancing loss of the model's MoE layers in its last forward."""
    layers = moe_layers(model)
    return sum(m.aux_loss for m in layers) / max(len(layers), 1)

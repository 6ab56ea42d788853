"""Mixture of experts and expert parallelism.

- :mod:`~distlab.moe.router`: top-k routing, capacity and which assignments an expert
  keeps, the load-balancing loss, DeepSeek-V3's auxiliary-loss-free balance bias;
- :mod:`~distlab.moe.layer`: the :class:`MoE` layer in one process (capacity and
  dropping) and :func:`moe_gpt`, the kit's GPT with MoE blocks;
- :mod:`~distlab.moe.dispatch`: the all-to-all dispatch and combine (lab 10's exercise
  ``moe_dispatch_combine``: the module holds only that answer);
- :mod:`~distlab.moe.parallel`: :func:`expert_parallel` (E experts over W ranks, with
  that dispatch or one given) and :func:`sync_gradients`.

The planner (:mod:`distlab.planner`) has no ep dimension yet.
"""
from distlab.moe.layer import MoE, aux_loss, moe_gpt, moe_layers
from distlab.moe.parallel import expert_parallel, sync_gradients
from distlab.moe.router import Routing, balance_bias_step, capacity, load_balancing_loss, route

__all__ = ["MoE", "Routing", "aux_loss", "balance_bias_step", "capacity", "expert_parallel",
           "load_balancing_loss", "moe_gpt", "moe_layers", "route", "sync_gradients"]

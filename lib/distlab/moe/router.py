"""The router of a mixture-of-experts layer: which experts each token goes to, with
which weight, how many an expert may take, and the loss that keeps them balanced.

* :func:`route`: top-k of the softmax over the experts (Shazeer et al. 2017,
  "Outrageously Large Neural Networks"; GShard, Lepikhin et al. 2020, k = 2). The
  weights are the chosen experts' probabilities, not renormalised, so a token whose
  router hesitates puts less into the sum.
* :func:`capacity`: the most assignments one expert takes from a batch of tokens,
  ``ceil(factor · tokens · k / experts)`` (Switch Transformer, Fedus et al. 2021,
  section 2.2); the rest are dropped, and the residual connection carries those tokens.
* :func:`kept`: which assignments an expert takes within its capacity: every token's
  first choice before any second choice, then token order (GShard, section 2.2).
* :func:`load_balancing_loss`: Switch's auxiliary loss ``E · sum_e f_e P_e``, f_e the
  fraction of the assignments that went to expert e and P_e its mean probability; 1 when
  the load is even, E when one expert takes everything.
* the auxiliary-loss-free balance of DeepSeek-V3 (its technical report, section 2.1.2):
  a bias per expert, added to the scores for the top-k choice only (:func:`route`'s
  ``bias``; the weights stay the unbiased probabilities), lowered by ``speed`` after a
  step in which its expert was overloaded and raised by ``speed`` when it was
  underloaded (:func:`balance_bias_step`). No gradient flows through it. DeepSeek-V3
  scores with sigmoid affinities; here the bias shifts the softmax's probabilities.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Routing:
    expert_ids: torch.Tensor   # (N, k) int64, distinct experts per token, best first
    weights: torch.Tensor      # (N, k) the chosen experts' probabilities (differentiable)
    probs: torch.Tensor        # (N, E) the router's softmax


def route(logits: torch.Tensor, k: int, bias: torch.Tensor | None = None) -> Routing:
    """Top-``k`` routing of (N, E) router logits; with ``bias`` (E,), the top k of
    ``probs + bias`` are chosen, weighted by their unbiased probabilities."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k = {k} experts per token, but there are {logits.shape[-1]}: "
                         f"choose 1 <= k <= {logits.shape[-1]}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    if bias is None:
        weights, ids = probs.topk(k, dim=-1)
    else:
        ids = (probs.detach() + bias.to(probs.dtype)).topk(k, dim=-1).indices
        weights = probs.gather(-1, ids)
    return Routing(ids, weights, probs)


def balance_bias_step(bias: torch.Tensor, counts: torch.Tensor, speed: float) -> torch.Tensor:
    """DeepSeek-V3's update after a step (section 2.1.2): ``bias`` lowered by ``speed``
    for each expert whose assignments ``counts`` (E,) exceed the mean, raised by
    ``speed`` for each below it, unchanged at the mean (a new tensor)."""
    counts = counts.to(bias.dtype)
    return bias + speed * torch.sign(counts.mean() - counts)


def capacity(num_tokens: int, num_experts: int, k: int, factor: float | None) -> int | None:
    """Assignments one expert takes from ``num_tokens`` tokens (None: no limit)."""
    if factor is None:
        return None
    if factor <= 0:
        raise ValueError(f"capacity factor must be > 0 (or None for no limit), got {factor}")
    return math.ceil(factor * num_tokens * k / num_experts)


def kept(expert_ids: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(N, k) bool: which assignments their expert takes, at most ``capacity`` each,
    first choices first, then in token order (None: all)."""
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    n, k = expert_ids.shape
    onehot = F.one_hot(expert_ids.t().reshape(-1), num_experts)   # choice-major order
    slot = ((onehot.cumsum(0) - 1) * onehot).sum(1)
    return (slot < capacity).reshape(k, n).t()


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over one batch's routing."""
    num_experts = probs.shape[-1]
    counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts)
    f = counts.to(probs.dtype) / expert_ids.numel()
    return num_experts * (f * probs.mean(0)).sum()

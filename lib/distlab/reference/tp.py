"""Lab 06's answer ``vocab_parallel_cross_entropy``: Megatron-LM's cross-entropy over a
vocabulary split across the tensor-parallel ranks (Shoeybi et al. 2019, section 3).
Not re-exported by :mod:`distlab.tp` (which it imports): import it from here."""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.shards import shard_sizes
from distlab.tp.ops import reduce_from_group


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 group=None) -> torch.Tensor:
    """Mean cross-entropy from this rank's slice of the logits over a vocabulary of
    ``vocab_size`` tokens (the output of a column-parallel head), without gathering them
    (Megatron's algorithm).

    Three all-reduces of one float per token: the largest logit (for a stable
    log-sum-exp), the target's logit (held by one rank, zero on the others) and the sum
    of the exponentials. Gathering the logits would move ``b·s·V`` elements. Backward
    needs no collective: each rank's logits get ``softmax - one_hot`` on its own slice."""
    sizes = shard_sizes(vocab_size, dist.get_world_size(group))
    rank = dist.get_rank(group)
    if logits.shape[-1] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {sizes[rank]} of the {vocab_size} logits, got "
                         f"{logits.shape[-1]}; pass the output of the column-parallel head")
    start = sum(sizes[:rank])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    peak = logits.detach().amax(dim=-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    local = targets - start
    outside = (local < 0) | (local >= sizes[rank])
    picked = shifted.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_group(picked.masked_fill(outside, 0.0), group)
    sum_exp = reduce_from_group(shifted.exp().sum(-1), group)
    return (sum_exp.log() - picked).mean()

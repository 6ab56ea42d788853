"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models").

Each rank holds a contiguous chunk of the sequence for every head. One all-to-all turns
that into every token for H/W of the heads, attention runs on whole sequences locally,
and a second all-to-all turns the output back. Per rank each all-to-all sends (W-1)/W of
a tensor the size of its chunk, four of them (q, k, v and the output): the traffic does
not grow with W, where the ring's (W-1 K/V blocks) does. The limit: the degree W must
divide the heads (with grouped-query attention, the K/V heads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.collectives.alltoall import exchange
from distlab.cp.layout import bounds


def ulysses_attention(q, k, v, group=None, *, causal: bool = False) -> torch.Tensor:
    """Attention over the whole sequence of this rank's contiguous chunk of queries
    (B, H, T_r, D, as :func:`distlab.cp.layout.shard` cuts it), through two
    all-to-alls; differentiable. H must be a multiple of the group's size."""
    world = dist.get_world_size(group)
    if q.shape[1] % world:
        raise ValueError(f"Ulysses needs the heads ({q.shape[1]}) to be a multiple of the "
                         f"context-parallel degree ({world}): use the ring, or a degree that "
                         f"divides the heads")
    sizes = _chunk_sizes(q, group)
    heads = [_to_heads(t, sizes, group) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*heads, is_causal=causal)
    return _to_sequence(out, sizes, group)


def _chunk_sizes(q, group) -> list[int]:
    """Every rank's chunk length, from one all-gather-free rule: the layout's split of
    the whole length, which is the sum of the chunks (exchanged once)."""
    n = torch.tensor([q.shape[2]], device=q.device)
    dist.all_reduce(n, group=group)
    world = dist.get_world_size(group)
    return [b - a for r in range(world) for a, b in bounds(int(n), world, r)]


def _to_heads(x, sizes, group):
    """(B, H, T_r, D) for all heads → (B, H/W, T, D) for this rank's heads."""
    b, h, t, d = x.shape
    w = len(sizes)
    send = x.reshape(b, w, h // w, t, d).transpose(0, 1).reshape(-1)
    got = exchange(send, [b * h // w * t * d] * w, [b * h // w * n * d for n in sizes], group)
    parts = got.split([b * h // w * n * d for n in sizes])
    return torch.cat([p.reshape(b, h // w, n, d) for p, n in zip(parts, sizes)], dim=2)


def _to_sequence(y, sizes, group):
    """(B, H/W, T, D) for this rank's heads → (B, H, T_r, D) for all heads."""
    b, hw, _, d = y.shape
    w, t = len(sizes), sizes[dist.get_rank(group)]
    send = torch.cat([p.reshape(-1) for p in y.split(sizes, dim=2)])
    got = exchange(send, [b * hw * n * d for n in sizes], [b * hw * t * d] * w, group)
    return got.reshape(w, b, hw, t, d).transpose(0, 1).reshape(b, w * hw, t, d)

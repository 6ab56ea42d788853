"""Which tokens of a sequence each rank of a context-parallel group holds.

The sequence of ``seq_len`` tokens is cut the ``torch.tensor_split`` way (the first
``seq_len % n`` pieces one token longer) into

* ``"contiguous"``: W chunks, rank r holding chunk r;
* ``"zigzag"`` (head-tail): 2W chunks, rank r holding chunks r and 2W-1-r, in that
  order (Brandon et al. 2023, "Striped Attention"; the layout of ring-flash-attention
  and of torch's ``context_parallel`` load balancer). Under a causal mask rank r's
  early chunk sees little of the sequence and its late one nearly all of it, so every
  rank does the same work; with contiguous chunks the last rank does about W times the
  first's (:func:`causal_pairs`).

:func:`ring_neighbours` is lab 03's ring: the global ranks this rank receives from and
sends to. Everything else here is plain arithmetic on positions, the same on every rank: the
context-parallel attention of :mod:`distlab.cp` and the notebooks use it to shard a
sequence, put it back together, and tell which query may see which key.
"""
from __future__ import annotations

import torch

from distlab.collectives.ring_layout import neighbours as ring_neighbours  # lab 03's ring

__all__ = ["LAYOUTS", "bounds", "positions", "shard", "unshard", "causal_pairs", "ring_neighbours"]

LAYOUTS = ("contiguous", "zigzag")


def _check(world_size: int, rank: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in range({world_size})")


def bounds(seq_len: int, world_size: int, rank: int, layout: str = "contiguous"
           ) -> list[tuple[int, int]]:
    """The ``[start, stop)`` positions of each chunk rank ``rank`` holds, in the order it
    holds them (one chunk contiguous, two zigzag; a chunk may be empty)."""
    _check(world_size, rank, layout)
    n = world_size if layout == "contiguous" else 2 * world_size
    base, extra = divmod(seq_len, n)
    starts = [i * base + min(i, extra) for i in range(n + 1)]
    mine = (rank,) if layout == "contiguous" else (rank, n - 1 - rank)
    return [(starts[c], starts[c + 1]) for c in mine]


def positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous"
              ) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in its order (int64)."""
    return torch.cat([torch.arange(a, b) for a, b in bounds(seq_len, world_size, rank, layout)])


def shard(x: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous",
          dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s tokens of the whole sequence ``x`` (the sequence along ``dim``)."""
    pos = positions(x.shape[dim], world_size, rank, layout).to(x.device)
    return x.index_select(dim, pos)


def unshard(parts: list[torch.Tensor], layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's ``parts`` (rank order): :func:`shard` undone."""
    world_size, seq_len = len(parts), sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(seq_len, world_size, r, layout) for r in range(world_size)])
    whole = torch.cat(parts, dim)
    return whole.index_select(dim, torch.argsort(order).to(whole.device))


def causal_pairs(seq_len: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """Per rank, the (query, key) pairs a causal mask lets its queries see: the work of
    its attention, whatever the order the keys arrive in (an even split is
    ``seq_len (seq_len + 1) / 2 / world_size`` each)."""
    return [sum((p + 1 for p in positions(seq_len, world_size, r, layout).tolist()), 0)
            for r in range(world_size)]

"""Context parallelism: one sequence split over the ranks of a group.

Attention is the only layer that mixes tokens, so it is the only one that needs the
others' keys and values; everything else runs on the rank's own tokens. Its activation
memory grows with the sequence (the scores are T x T per head, unless a fused kernel
recomputes them; the K/V and the layer's inputs grow as T), which neither TP (it splits
heads and features) nor PP (it splits layers) divides.

- :mod:`~distlab.cp.layout`: which tokens each rank holds (contiguous or zigzag), the
  positions, sharding and unsharding a sequence, the causal work per rank, and lab 03's
  ring neighbours;
- :func:`~distlab.cp.ring.ring_attention`: attention over the whole sequence with K/V
  blocks travelling around the ring, forward and backward (Liu et al. 2023), either
  layout (lab 10's exercise: :mod:`~distlab.cp.ring` holds only that answer);
- :func:`~distlab.cp.ulysses.ulysses_attention`: DeepSpeed-Ulysses' two all-to-alls
  (sequence-sharded to head-sharded and back);
- :func:`~distlab.cp.allgather.allgather_attention`: Llama 3's method, K and V
  all-gathered once per layer (grouped-query attention, document masks).

This is lab 10's counterpart of :mod:`distlab.tp`. The planner (:mod:`distlab.planner`)
prices a cp degree with Llama 3's all-gathers.
"""
from distlab.cp.allgather import allgather_attention
from distlab.cp.layout import LAYOUTS, causal_pairs, positions, ring_neighbours, shard, unshard
from distlab.cp.ring import ring_attention
from distlab.cp.ulysses import ulysses_attention

__all__ = ["LAYOUTS", "allgather_attention", "causal_pairs", "positions", "ring_attention",
           "ring_neighbours", "shard", "ulysses_attention", "unshard"]

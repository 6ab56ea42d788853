"""How ``n`` elements split over ``parts`` ranks, as ``torch.tensor_split`` splits them:
the first ``n % parts`` pieces are one element longer. Rings, ZeRO's shards and tensor
parallelism's rows all follow it, so that a rank's piece never depends on who cut it.

- ``shard_sizes(n, parts)``: the lengths of the ``parts`` pieces;
- ``shard_range(numel, rank, world_size)``: ``(start, end)`` of rank ``rank``'s piece.

Both raise ``ValueError`` on a negative count, fewer than one piece or a rank outside
``[0, world_size)``. Their code is lab 05's exercise ``shard_range``, kept in
:mod:`distlab.reference.shards`."""
from distlab.reference.shards import shard_range, shard_sizes

__all__ = ["shard_range", "shard_sizes"]

"""Lab 05's answer ``shard_range``: how ``n`` elements split over ``parts`` ranks, as
``torch.tensor_split`` splits them (the first ``n % parts`` pieces one element longer).
Rings, ZeRO's shards and tensor parallelism's rows all follow it, so that a rank's piece
never depends on who cut it. Both functions raise ``ValueError`` on a negative count,
fewer than one piece or a rank outside ``[0, world_size)``."""
from __future__ import annotations


def shard_sizes(n: int, parts: int) -> list[int]:
    """Lengths of the ``parts`` pieces of ``n`` elements."""
    if parts < 1:
        raise ValueError(f"the number of pieces must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    return [base + (r < extra) for r in range(parts)]


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of rank ``rank``'s piece of ``numel`` elements over ``world_size``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)

"""How a ring lays out its buffer and its ranks: each rank's neighbours, the K chunks
of a buffer (``torch.tensor_split``'s), and the pieces that the reference ring all-reduce (lab 03's answer,
:mod:`distlab.collectives.ring`) cuts a large chunk into, with the sizes that pay on each
backend. :mod:`distlab.cp.layout` passes blocks around the same ring; the ring's
benchmark (:mod:`distlab.bench.ring`) sets :data:`PIECE_BYTES` to try other pieces.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# (smallest, largest) worthwhile piece of a chunk, per backend: see piece_count.
PIECE_BYTES_BY_BACKEND = {"nccl": (512 << 20, 512 << 20), "gloo": (2 << 20, 4 << 20)}
PIECE_BYTES: int | None = None  # pieces of at most this, whatever the backend (tests, experiments)
LOOKAHEAD = 2                   # exchanges issued before a received piece is added in
# Pieces start a multiple of this many bytes into their chunk. Copy and add kernels (NCCL's
# and torch's) load 16 bytes at a time only from aligned addresses: on two H200s, in two
# runs, every ring whose chunks were cut in thirds (pieces at 4-byte offsets, landing in an
# aligned scratch buffer) ran at half the speed of its neighbours with aligned pieces.
ALIGN_BYTES = 256


def piece_count(chunk_bytes: int, backend: str) -> int:
    """Pieces per chunk of ``chunk_bytes`` on ``backend``: LOOKAHEAD + 1, so that one
    piece is added while the next ones cross, but no fewer than keeps each piece at most
    the largest of :data:`PIECE_BYTES_BY_BACKEND` and no more than keeps each at least
    the smallest (with :data:`PIECE_BYTES` set, simply the fewest of at most that).

    A pipeline can only hide the additions, which read two bytes and write one per
    byte received, while every piece is a message of its own, with a fixed cost and,
    below some size, less bandwidth. Which wins depends on the backend:

    * NCCL over NVLink (two H200s, NCCL 2.28.9; torch's batched send/recv, as
      nccl-tests' sendrecv): 64 MiB cross at 259 GB/s, 128 MiB at 287, 256 MiB at 303,
      512 MiB at 352, 1 GiB at 360. An addition at ~3.5 TB/s of HBM costs 3·352/3500
      = 30 % of a reduce-scatter step's transfer, 13 % of the whole all-reduce, and
      halving a 512 MiB piece loses 14 % on the wire. So a chunk goes whole up to
      512 MiB (to 1 GiB buffers on two GPUs): 2(K-1) transfers and K-1 additions,
      0.80-0.95x of NCCL's all_reduce by this model; beyond, pieces of 512 MiB.
    * gloo (loopback TCP on a CPU): each message costs about a millisecond of Python
      and of gloo's threads; pieces of 2-4 MiB came closest to gloo's all_reduce at
      16-64 MiB on a 2-core machine (lab 03).
    """
    if PIECE_BYTES:
        smallest = largest = PIECE_BYTES
    else:
        smallest, largest = PIECE_BYTES_BY_BACKEND.get(backend, PIECE_BYTES_BY_BACKEND["gloo"])
    return max(1, -(-chunk_bytes // largest), min(LOOKAHEAD + 1, chunk_bytes // smallest))


def chunks(tensor: torch.Tensor, world_size: int) -> tuple[torch.Tensor, ...]:
    """The K chunks of a 1-D buffer, as views (``torch.tensor_split``)."""
    return torch.tensor_split(tensor, world_size)


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """The lengths of the :func:`chunks` of ``numel`` elements (on no memory)."""
    return [c.numel() for c in chunks(torch.empty(numel, device="meta"), world_size)]


def piece_layout(numel: int, world_size: int, element_size: int, backend: str) -> tuple[int, int]:
    """(P, w): each chunk of ``numel`` elements over ``world_size`` ranks is cut into P
    pieces of w elements (its last one shorter, or empty), the same on every rank. P is
    :func:`piece_count` of the largest chunk; w is a multiple of :data:`ALIGN_BYTES` (of
    the piece size instead, if :data:`PIECE_BYTES` is smaller)."""
    biggest = -(-numel // world_size)
    if biggest == 0:
        return 1, 0
    pieces = piece_count(biggest * element_size, backend)
    align = max(1, min(ALIGN_BYTES, PIECE_BYTES or ALIGN_BYTES) // element_size)
    width = -(-biggest // pieces)
    width = -(-width // align) * align
    return -(-biggest // width), width


def neighbours(group=None) -> tuple[int, int]:
    """(previous, next): the global ranks (as send/recv want them) this rank receives
    from and sends to in the ring of ``group``, group rank r-1 and r+1 modulo K."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return ranks[(rank - 1) % size], ranks[(rank + 1) % size]

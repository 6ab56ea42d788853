"""Ring reduce-scatter, all-gather and all-reduce, built from point-to-point send/recv.

The bandwidth-optimal all-reduce of Patarasuk & Yuan (2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"), the one Baidu brought to deep
learning (Gibiansky, 2017) and NCCL runs as its "ring" algorithm. K ranks stand in a
ring; rank r sends only to r+1 and receives only from r-1. The buffer is cut into K
chunks (as ``torch.tensor_split``: the first ``n % K`` are one element longer).

* reduce-scatter, K-1 steps: at step s rank r sends chunk (r-s-1) mod K and receives
  chunk (r-s-2) mod K, adding its own contribution. After the last step it holds chunk
  r summed over all ranks.
* all-gather, K-1 steps: at step t rank r sends chunk (r-t) mod K, the last one it
  completed, and receives chunk (r-t-1) mod K straight into place.

Each rank sends 2(K-1) chunks, 2(K-1)/K of the buffer, whatever K is: the cost is
2(K-1)·α + 2(K-1)/K·N·β (α per message, β per byte). No all-reduce in which ranks
add what they receive can send less (Patarasuk & Yuan); reduction inside the switch
(NVLink SHARP, "NVLS"; InfiniBand SHARP) can, since the switch does the adding.

This reference is written to be fast, not only right: a chunk that is large for the
backend is cut into pieces (:func:`piece_count`) that are pipelined (a piece is added
in :data:`LOOKAHEAD` exchanges after it was received, while the next ones are on the
wire), pieces start on :data:`ALIGN_BYTES` boundaries, receives land straight in their
final place when no addition is needed, the all-reduce works in place, nothing is
copied twice, and every rank issues the same sequence of grouped exchanges, which NCCL
needs (see :class:`_Ring`). ``python -m distlab.bench.ring`` measures it against the
backend's own all-reduce.

:func:`record` runs the ring on K ranks and keeps every step's state, for the stepper
in :mod:`distlab.viz.ring`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import torch
import torch.distributed as dist

from distlab.comm import CommLog, in_group
from distlab.shards import shard_sizes

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


# ------------------------------------------------------------------------ the API


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor | None:
    """This rank's chunk of the element-wise sum of ``tensor`` over the ranks of ``group``.

    Chunk r of the flattened tensor (``torch.tensor_split`` into K pieces), summed
    over ranks, as a new 1-D tensor; ``tensor`` itself is left unchanged. Point to
    point only: K-1 steps, (K-1)/K of the buffer sent by each rank. A rank outside
    ``group`` returns None at once (as torch.distributed's collectives do).
    """
    if not in_group(group):
        return None
    flat = _flat(tensor, "ring_reduce_scatter")
    ring = _Ring(group)
    out = torch.empty(shard_sizes(flat.numel(), ring.size)[ring.rank], dtype=flat.dtype,
                      device=flat.device)
    for _ in ring.reduce_scatter(flat, out=out):
        pass
    return out


def ring_all_gather(chunk: torch.Tensor, numel: int, group=None) -> torch.Tensor | None:
    """The full 1-D buffer of ``numel`` elements whose chunk r came from rank r.

    ``chunk`` is this rank's piece (``torch.tensor_split`` sizes); K-1 steps, (K-1)/K of
    the buffer sent by each rank, every receive straight into its place. A rank outside
    ``group`` returns None at once.
    """
    if not in_group(group):
        return None
    flat = _flat(chunk, "ring_all_gather")
    ring = _Ring(group)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"ring_all_gather: numel must be a non-negative int, got {numel!r}")
    want = shard_sizes(numel, ring.size)[ring.rank]
    if flat.numel() != want:
        raise ValueError(
            f"ring_all_gather: rank {ring.rank} of {ring.size} owns chunk {ring.rank} of "
            f"{numel} elements, which has {want} elements (torch.tensor_split sizes), but "
            f"its chunk has {flat.numel()}; pass the chunk that ring_reduce_scatter returned")
    out = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    chunks(out, ring.size)[ring.rank].copy_(flat)
    for _ in ring.all_gather(out):
        pass
    return out


def ring_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor | None:
    """In place: ``tensor`` becomes the element-wise sum over the ranks of ``group``.

    A ring reduce-scatter then a ring all-gather on the tensor's own memory:
    2(K-1) steps, 2(K-1)/K of the buffer sent by each rank. Returns ``tensor``; a rank
    outside ``group`` returns None at once, its tensor untouched.
    """
    if not in_group(group):
        return None
    flat = _flat(tensor, "ring_allreduce")
    for _ in _Ring(group).allreduce(flat):
        pass
    return tensor


# ------------------------------------------------------------------ the algorithm


def neighbours(group=None) -> tuple[int, int]:
    """(previous, next): the global ranks (as send/recv want them) this rank receives
    from and sends to in the ring of ``group``, group rank r-1 and r+1 modulo K."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return ranks[(rank - 1) % size], ranks[(rank + 1) % size]


def _flat(tensor, who: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{who}: the tensor is not contiguous (a transpose or a strided "
                         f"slice?); pass tensor.contiguous() and copy the result back")
    return tensor.view(-1)


class _Ring:
    """This rank's place in the ring of ``group``, and the two phases as generators
    that yield after each of their K-1 steps (:func:`record` looks at the buffer
    there; the API functions just run them to the end).

    Each phase is a sequence of *exchanges*, the same on every rank: exchange g sends
    piece g to the next rank and receives piece g from the previous one, as one
    ``batch_isend_irecv`` (one NCCL group). So the g-th group a rank issues is matched
    by the g-th group of each neighbour, which NCCL needs (:mod:`distlab.collectives.p2p_check`):
    there a rank's P2P calls run in order on one stream, and a group ends only when all
    of its operations have. What exchange g received is dealt with (waited for, and
    added in) only once exchange g + ``lookahead`` has been issued, so that the link is
    not idle while a piece is added; the piece sent in exchange g + P (P pieces a
    chunk) is the one added after exchange g, hence lookahead < P.

    On NCCL ``wait()`` does not block the host: it makes the compute stream wait for the
    group, and torch makes each new group wait for the compute stream, so the additions
    run on the GPU between transfers, overlapped with those in flight. On gloo
    ``wait()`` blocks the host until the piece has landed, while the transfers already
    issued go on.
    """

    def __init__(self, group=None, lookahead: int | None = None):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.prev, self.next = neighbours(group)
        self.lookahead = LOOKAHEAD if lookahead is None else lookahead
        self.backend = dist.get_backend(group)

    def chunk(self, step: int, offset: int) -> int:
        """Index of the chunk this rank handles at ``step`` with offset ``offset``."""
        return (self.rank - step - offset) % self.size

    def layout(self, flat: torch.Tensor) -> tuple[int, int]:
        """:func:`piece_layout` of ``flat`` on this ring."""
        return piece_layout(flat.numel(), self.size, flat.element_size(), self.backend)

    @staticmethod
    def cut(chunk: torch.Tensor, layout: tuple[int, int]) -> list[torch.Tensor]:
        """The pieces of ``chunk`` (views) under ``layout``."""
        pieces, width = layout
        return [chunk[j * width:(j + 1) * width] for j in range(pieces)]

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor | None = None):
        """Steps of the reduce-scatter of ``flat``. With ``out`` (this rank's chunk of the
        result), ``flat`` is only read and partial sums go to a work buffer; without it
        the partial sums accumulate in ``flat`` itself, whose chunk r ends up summed."""
        if self.size == 1:
            if out is not None:
                out.copy_(flat)
            return
        layout = self.layout(flat)
        yield from self._run(self._reduce_scatter(flat, out, layout), layout[0])

    def all_gather(self, flat: torch.Tensor):
        """Steps of the all-gather, in place: chunk r of ``flat`` is this rank's, the
        others are received straight into their place."""
        if self.size > 1:
            layout = self.layout(flat)
            yield from self._run(self._all_gather(flat, layout), layout[0])

    def allreduce(self, flat: torch.Tensor):
        """Both phases as one stream of exchanges (no pause between them)."""
        if self.size > 1:
            layout = self.layout(flat)
            yield from self._run(self._reduce_scatter(flat, None, layout)
                                 + self._all_gather(flat, layout), layout[0])

    def _reduce_scatter(self, flat, out, layout) -> list:
        """The exchanges of the reduce-scatter: (send, receive into, then, step label)."""
        K, (P, width) = self.size, layout
        mine = chunks(flat, K)
        if out is None:  # in place: receive into scratch slots, add into the buffer
            slots = min(self.lookahead, P - 1) + 1
            scratch = self.cut(torch.empty(slots * width, dtype=flat.dtype, device=flat.device),
                               (slots, width))
        else:            # out of place: receive into a work buffer (or out), add ours to it
            work = chunks(torch.empty_like(flat), K)
        exchanges = []
        for s in range(K - 1):
            c_send, c_recv = self.chunk(s, 1), self.chunk(s, 2)
            own = self.cut(mine[c_recv], layout)
            if out is None:
                sends = self.cut(mine[c_send], layout)
                lands = [scratch[(s * P + j) % slots][: p.numel()] for j, p in enumerate(own)]
                thens = [functools.partial(p.add_, land) for p, land in zip(own, lands)]
            else:
                sends = self.cut(mine[c_send] if s == 0 else work[c_send], layout)
                lands = self.cut(out if s == K - 2 else work[c_recv], layout)
                thens = [functools.partial(land.add_, p) for land, p in zip(lands, own)]
            for j in range(P):
                label = ("reduce-scatter", s + 1) if j == P - 1 else None
                exchanges.append((sends[j], lands[j], thens[j], label))
        return exchanges

    def _all_gather(self, flat, layout) -> list:
        K, P = self.size, layout[0]
        mine = chunks(flat, K)
        exchanges = []
        for t in range(K - 1):
            sends = self.cut(mine[self.chunk(t, 0)], layout)
            lands = self.cut(mine[self.chunk(t, 1)], layout)
            for j in range(P):
                label = ("all-gather", t + 1) if j == P - 1 else None
                exchanges.append((sends[j], lands[j], None, label))
        return exchanges

    def _run(self, exchanges, pieces: int):
        """Issue exchange g, then finish exchange g - lookahead: wait for its works, run
        its ``then`` (the addition). Yields a step's label once its last exchange is
        finished."""
        lookahead = min(self.lookahead, pieces - 1)
        pending = collections.deque()
        for send, land, then, label in exchanges:
            pending.append((self._exchange(send, land), then, label))
            if len(pending) > lookahead:
                yield from _finish(*pending.popleft())
        while pending:
            yield from _finish(*pending.popleft())

    def _exchange(self, send: torch.Tensor, land: torch.Tensor) -> list:
        """Send ``send`` to the next rank and receive ``land`` from the previous one, as
        one group; empty pieces (of short chunks) are sent by neither side."""
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
        if land.numel():
            ops.append(dist.P2POp(dist.irecv, land, self.prev, self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _finish(works, then, label):
    for work in works:  # each once: a second wait() of a gloo P2P work never returns
        work.wait()
    if then is not None:
        then()
    if label is not None:
        yield label


# ------------------------------------------------------- what a ring's traffic is


def bytes_sent(op: str, numel: int, element_size: int, rank: int, world_size: int,
               direction: int = 1) -> int:
    """Bytes ``rank`` sends in one ring ``op`` on ``numel`` elements, sending to
    ``rank + direction``: every chunk but its own in a reduce-scatter, every chunk but
    its successor's in an all-gather, both in an all-reduce; 2(K-1)/K·N in all."""
    sizes = shard_sizes(numel, world_size)
    if world_size == 1:
        return 0
    rs = numel - sizes[rank]
    ag = numel - sizes[(rank + direction) % world_size]
    per_op = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}
    if op not in per_op:
        raise ValueError(f"op must be one of {sorted(per_op)}, got {op!r}")
    return per_op[op] * element_size


def check_traffic(log: CommLog, op: str, numel: int, element_size: int,
                  ranks: list[int] | None = None) -> str | None:
    """The first way the ``log`` of one ring ``op`` made by rank ``log.rank`` differs from
    a ring, in plain words (None when it is one): no collective; sends only to one
    neighbour and receives only from the other; a message per step at least (K-1 steps
    per phase), at most one chunk per message; the bytes of :func:`bytes_sent`.

    ``ranks``: the global ranks of the ring's group, in group order (default: every rank
    of the default group, which needs torch.distributed); pure otherwise, so that it
    can judge a log that came back from a rank."""
    ranks = list(ranks) if ranks is not None else dist.get_process_group_ranks(dist.group.WORLD)
    rank, K = ranks.index(log.rank), len(ranks)
    used = sorted({e.op for e in log.collectives()})
    if used:
        return (f"it called {', '.join(used)} (a collective); a ring uses only point-to-point "
                f"calls (send/recv, isend/irecv, batch_isend_irecv)")
    sends = log.select(("send", "isend"))
    recvs = log.select(("recv", "irecv"))
    if K == 1:
        return None if not log.events else (
            f"with one rank there is nothing to exchange, but rank 0 made {len(log.events)} "
            f"point-to-point calls")
    to = sorted({ranks.index(e.peer) for e in sends if e.peer in ranks})
    frm = sorted({ranks.index(e.peer) for e in recvs if e.peer in ranks})
    nxt, prv = (rank + 1) % K, (rank - 1) % K
    if not ((set(to) <= {nxt} and set(frm) <= {prv}) or (set(to) <= {prv} and set(frm) <= {nxt})):
        return (f"rank {rank} sent to ranks {to} and received from ranks {frm}; in a ring each "
                f"rank sends only to its next neighbour (rank {nxt}) and receives only from "
                f"the previous one (rank {prv})")
    direction = -1 if to == [prv] and prv != nxt else 1
    steps = (K - 1) * (2 if op == "all_reduce" else 1)
    carrying = sum(1 for e in sends if e.nbytes)
    if numel >= K and carrying < steps:
        return (f"rank {rank} sent {carrying} messages; a ring {op.replace('_', '-')} on {K} "
                f"ranks takes {steps} steps, each passing one chunk to the next rank")
    biggest = -(-numel // K) * element_size
    large = [e.nbytes for e in sends if e.nbytes > biggest]
    if large:
        return (f"rank {rank} sent a message of {large[0]} bytes, more than one chunk "
                f"({biggest} bytes at most): each ring step passes one chunk")
    want = bytes_sent(op, numel, element_size, rank, K, direction)
    got = sum(e.nbytes for e in sends)
    if got != want:
        which = {"reduce_scatter": "every chunk but its own",
                 "all_gather": "every chunk but the one its receiver owns",
                 "all_reduce": "every chunk but its own, then every chunk but its receiver's"}[op]
        return (f"rank {rank} sent {got} bytes in all, but in a ring {op.replace('_', '-')} of "
                f"{numel} element{'s' * (numel != 1)} on {K} ranks it sends {want}: {which}, "
                f"once each")
    return None


# -------------------------------------------------------------- recording the steps


@dataclasses.dataclass
class RingRecord:
    """A real run of the ring all-reduce, step by step.

    ``holds[k][r][c]`` is the set of ranks whose contributions chunk c of rank r
    holds after step k (k = 0 is the start); ``calls[k][r]`` the point-to-point calls
    rank r made for step k, as its :class:`~distlab.comm.CommLog` saw them (op, peer,
    bytes), and ``moved[k][r]`` the chunk that rank r received in step k.
    """

    world_size: int
    numel: int
    chunk_sizes: list[int]
    labels: list[str]                        # "start", "reduce-scatter 1/3", ...
    holds: list[list[list[frozenset[int]]]]
    calls: list[list[list[tuple[str, int, int]]]]
    moved: list[list[int | None]]

    @property
    def steps(self) -> int:
        return len(self.labels) - 1


def record(world_size: int = 4, numel: int | None = None, backend: str = "gloo") -> RingRecord:
    """Run :func:`ring_allreduce`'s algorithm on ``world_size`` ranks and record each step.

    Rank r contributes 2**r in every element (int64), so every element's value is the
    set of ranks summed into it, read off its bits; the log of each rank says what it
    sent and received in each step. Receives are not posted ahead, so that the buffer
    seen after a step is exactly that step's result.
    """
    from distlab import launch

    if world_size > 62:
        raise ValueError("record() encodes ranks as bits of an int64: world_size <= 62")
    numel = 2 * world_size if numel is None else numel
    if numel < world_size:
        raise ValueError(f"record() needs at least one element per chunk: numel >= "
                         f"{world_size}, got {numel}")
    runs = launch.run(_record_rank, world_size, numel, backend=backend, timeout=60)
    labels = ["start"] + [f"{phase} {k}/{world_size - 1}" for phase, k in runs[0][0]]
    sizes = shard_sizes(numel, world_size)
    steps = len(labels)
    holds = [[[_ranks_in(runs[r][1][k], c, sizes) for c in range(world_size)]
              for r in range(world_size)] for k in range(steps)]
    calls = [[runs[r][2][k] for r in range(world_size)] for k in range(steps)]
    moved = [[next((c for c in range(world_size) if k and holds[k][r][c] != holds[k - 1][r][c]),
                   None) for r in range(world_size)] for k in range(steps)]
    return RingRecord(world_size, numel, sizes, labels, holds, calls, moved)


def _ranks_in(state: torch.Tensor, c: int, sizes: list[int]) -> frozenset[int]:
    start = sum(sizes[:c])
    if sizes[c] == 0:
        return frozenset()
    bits = int(state[start])
    return frozenset(q for q in range(bits.bit_length()) if bits >> q & 1)


def _record_rank(numel: int):
    rank = dist.get_rank()
    flat = torch.full((numel,), 1 << rank, dtype=torch.int64)
    states, calls, steps = [flat.clone()], [[]], []
    with CommLog() as log:
        seen = 0
        for step in _Ring(lookahead=0).allreduce(flat):
            steps.append(step)
            states.append(flat.clone())
            calls.append([(e.op, e.peer, e.nbytes) for e in log.events[seen:]])
            seen = len(log.events)
    return steps, states, calls

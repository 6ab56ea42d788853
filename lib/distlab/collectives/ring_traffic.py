"""What a ring's traffic is: the bytes each rank of a ring collective sends
(:func:`bytes_sent`), a check that a rank's :class:`~distlab.comm.CommLog` is a ring's
(:func:`check_traffic`, which lab 03's grader applies to the student's ring), and the
ring all-reduce's steps laid out for the stepper of :mod:`distlab.viz.ring`
(:func:`record`). The ring itself, lab 03's answer, is :mod:`distlab.collectives.ring`.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from distlab.collectives.ring_layout import chunk_sizes
from distlab.comm import CommLog


def bytes_sent(op: str, numel: int, element_size: int, rank: int, world_size: int,
               direction: int = 1) -> int:
    """Bytes ``rank`` sends in one ring ``op`` on ``numel`` elements, sending to
    ``rank + direction``: every chunk but its own in a reduce-scatter, every chunk but
    its successor's in an all-gather, both in an all-reduce; 2(K-1)/K·N in all."""
    sizes = chunk_sizes(numel, world_size)
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


@dataclasses.dataclass
class RingRecord:
    """The ring all-reduce, step by step.

    ``holds[k][r][c]`` is the set of ranks whose contributions chunk c of rank r
    holds after step k (k = 0 is the start); ``calls[k][r]`` the point-to-point calls
    rank r makes in step k, as a :class:`~distlab.comm.CommLog` names them (op, peer,
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


def record(world_size: int = 4, numel: int | None = None, element_size: int = 4) -> RingRecord:
    """The ring all-reduce of ``numel`` elements of ``element_size`` bytes on
    ``world_size`` ranks, step by step, as its schedule has it (no rank runs): in step
    s of the reduce-scatter rank r sends chunk (r-s-1) mod K to rank r+1, which adds in
    its own contribution; in step t of the all-gather it sends chunk (r-t) mod K, which
    replaces the receiver's. Each rank calls one isend and one irecv per step."""
    K = world_size
    if K < 1:
        raise ValueError(f"world_size must be >= 1, got {K}")
    numel = 2 * K if numel is None else numel
    if numel < K:
        raise ValueError(f"record() needs at least one element per chunk: numel >= {K}, "
                         f"got {numel}")
    sizes = chunk_sizes(numel, K)
    holds = [[[frozenset({r})] * K for r in range(K)]]
    labels, calls, moved = ["start"], [[[] for _ in range(K)]], [[None] * K]
    for phase, offset, adds in (("reduce-scatter", 1, True), ("all-gather", 0, False)):
        for s in range(K - 1):
            sent = [(r - s - offset) % K for r in range(K)]  # the chunk rank r sends
            got = [sent[(r - 1) % K] for r in range(K)]      # and the one it receives
            after = [row[:] for row in holds[-1]]
            for r in range(K):
                incoming = holds[-1][(r - 1) % K][got[r]]
                after[r][got[r]] = incoming | holds[-1][r][got[r]] if adds else incoming
            holds.append(after)
            labels.append(f"{phase} {s + 1}/{K - 1}")
            calls.append([[("isend", (r + 1) % K, sizes[sent[r]] * element_size),
                           ("irecv", (r - 1) % K, sizes[got[r]] * element_size)]
                          for r in range(K)])
            moved.append(got)
    return RingRecord(K, numel, sizes, labels, holds, calls, moved)

"""Lab 03's answers: ring reduce-scatter, all-gather and all-reduce, built from
point-to-point send/recv.

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
backend is cut into pieces (:mod:`distlab.collectives.ring_layout`) that are pipelined
(a piece is added ``LOOKAHEAD`` exchanges after it was received, while the next ones are
on the wire), pieces start on ``ALIGN_BYTES`` boundaries, receives land straight in their
final place when no addition is needed, the all-reduce works in place, nothing is
copied twice, and every rank issues the same sequence of grouped exchanges, which NCCL
needs (see :class:`_Ring`). ``python -m distlab.bench.ring`` measures it against the
backend's own all-reduce; :mod:`distlab.collectives.ring_traffic` says what a ring's
traffic is. :func:`plain_ring_allreduce` is the ring as one first writes it, the
benchmark's middle contender.
"""
from __future__ import annotations

import collections
import functools

import torch
import torch.distributed as dist

from distlab.collectives import ring_layout
from distlab.collectives.ring_layout import chunk_sizes, chunks, neighbours, piece_layout
from distlab.comm import in_group


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
    out = torch.empty(chunk_sizes(flat.numel(), ring.size)[ring.rank], dtype=flat.dtype,
                      device=flat.device)
    ring.reduce_scatter(flat, out=out)
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
    want = chunk_sizes(numel, ring.size)[ring.rank]
    if flat.numel() != want:
        raise ValueError(
            f"ring_all_gather: rank {ring.rank} of {ring.size} owns chunk {ring.rank} of "
            f"{numel} elements, which has {want} elements (torch.tensor_split sizes), but "
            f"its chunk has {flat.numel()}; pass the chunk that ring_reduce_scatter returned")
    out = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    chunks(out, ring.size)[ring.rank].copy_(flat)
    ring.all_gather(out)
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
    _Ring(group).allreduce(flat)
    return tensor


def _flat(tensor, who: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{who}: the tensor is not contiguous (a transpose or a strided "
                         f"slice?); pass tensor.contiguous() and copy the result back")
    return tensor.view(-1)


class _Ring:
    """This rank's place in the ring of ``group``, and the two phases, each K-1 steps.

    Each phase is a sequence of *exchanges*, the same on every rank: exchange g sends
    piece g to the next rank and receives piece g from the previous one, as one
    ``batch_isend_irecv`` (one NCCL group). So the g-th group a rank issues is matched
    by the g-th group of each neighbour, which NCCL needs (:mod:`distlab.collectives.p2p_check`):
    there a rank's P2P calls run in order on one stream, and a group ends only when all
    of its operations have. What exchange g received is dealt with (waited for, and
    added in) only once exchange g + ``LOOKAHEAD`` has been issued, so that the link is
    not idle while a piece is added; the piece sent in exchange g + P (P pieces a
    chunk) is the one added after exchange g, hence a lookahead below P.

    On NCCL ``wait()`` does not block the host: it makes the compute stream wait for the
    group, and torch makes each new group wait for the compute stream, so the additions
    run on the GPU between transfers, overlapped with those in flight. On gloo
    ``wait()`` blocks the host until the piece has landed, while the transfers already
    issued go on.
    """

    def __init__(self, group=None):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.prev, self.next = neighbours(group)
        self.lookahead = ring_layout.LOOKAHEAD
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
        """The reduce-scatter of ``flat``. With ``out`` (this rank's chunk of the
        result), ``flat`` is only read and partial sums go to a work buffer; without it
        the partial sums accumulate in ``flat`` itself, whose chunk r ends up summed."""
        if self.size == 1:
            if out is not None:
                out.copy_(flat)
            return
        layout = self.layout(flat)
        self._run(self._reduce_scatter(flat, out, layout), layout[0])

    def all_gather(self, flat: torch.Tensor):
        """The all-gather, in place: chunk r of ``flat`` is this rank's, the
        others are received straight into their place."""
        if self.size > 1:
            layout = self.layout(flat)
            self._run(self._all_gather(flat, layout), layout[0])

    def allreduce(self, flat: torch.Tensor):
        """Both phases as one stream of exchanges (no pause between them)."""
        if self.size > 1:
            layout = self.layout(flat)
            self._run(self._reduce_scatter(flat, None, layout)
                      + self._all_gather(flat, layout), layout[0])

    def _reduce_scatter(self, flat, out, layout) -> list:
        """The exchanges of the reduce-scatter: (send, receive into, then)."""
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
            exchanges += zip(sends, lands, thens)
        return exchanges

    def _all_gather(self, flat, layout) -> list:
        K, P = self.size, layout[0]
        mine = chunks(flat, K)
        exchanges = []
        for t in range(K - 1):
            sends = self.cut(mine[self.chunk(t, 0)], layout)
            lands = self.cut(mine[self.chunk(t, 1)], layout)
            exchanges += [(send, land, None) for send, land in zip(sends, lands)]
        return exchanges

    def _run(self, exchanges, pieces: int):
        """Issue exchange g, then finish exchange g - lookahead: wait for its works, run
        its ``then`` (the addition)."""
        lookahead = min(self.lookahead, pieces - 1)
        pending = collections.deque()
        for send, land, then in exchanges:
            pending.append((self._exchange(send, land), then))
            if len(pending) > lookahead:
                _finish(*pending.popleft())
        while pending:
            _finish(*pending.popleft())

    def _exchange(self, send: torch.Tensor, land: torch.Tensor) -> list:
        """Send ``send`` to the next rank and receive ``land`` from the previous one, as
        one group; empty pieces (of short chunks) are sent by neither side."""
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self.next, self.group))
        if land.numel():
            ops.append(dist.P2POp(dist.irecv, land, self.prev, self.group))
        return dist.batch_isend_irecv(ops) if ops else []


def _finish(works, then):
    for work in works:  # each once: a second wait() of a gloo P2P work never returns
        work.wait()
    if then is not None:
        then()


def plain_ring_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The ring as one first writes it: correct, and slow where it need not be.

    Each step allocates a fresh receive buffer, ``+=`` makes the partial sums, the
    chunks are copied out of the tensor at the start and back at the end, and each step
    waits for its whole chunk before reducing (no pipelining)."""
    K, r = dist.get_world_size(group), dist.get_rank(group)
    if K == 1:
        return tensor
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    nxt, prv = ranks[(r + 1) % K], ranks[(r - 1) % K]
    parts = [c.clone() for c in torch.tensor_split(tensor.view(-1), K)]

    def step(send, recv):
        buf = torch.empty_like(parts[recv])
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, parts[send], nxt, group),
                                         dist.P2POp(dist.irecv, buf, prv, group)]):
            w.wait()
        return buf

    for s in range(K - 1):
        parts[(r - s - 2) % K] += step((r - s - 1) % K, (r - s - 2) % K)
    for t in range(K - 1):
        parts[(r - t - 1) % K] = step((r - t) % K, (r - t - 1) % K)
    tensor.view(-1).copy_(torch.cat(parts))
    return tensor

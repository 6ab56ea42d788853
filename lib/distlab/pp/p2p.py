"""Point-to-point transfers between pipeline stages, within NCCL's rules.

Stage s sends activations to stage s+1 and gradients to stage s-1, and receives the
reverse. The shape and dtype of every message follow from what every stage already
knows (the batch's shape, the number of micro-batches, the model's width), so each
receiver allocates its buffer itself: no stage announces a size before it sends, and a
transfer is one message, not a size handshake and then the data.

NCCL runs a send and a receive between the same two ranks on one stream, and a group
(``batch_isend_irecv``) ends only when every operation in it has ended. So the
transfers of one moment go out as **one group**: the runtime puts what a stage sends
after an action together with what it receives for its next action. In 1F1B's steady
state stage s sends an activation up while stage s+1 sends a gradient down; as
separate calls each would sit in its send, waiting for a receive the other has queued
behind its own send. As one group on each side, every send meets a receive its peer
has posted in the same group (``distlab.collectives.p2p_check.nccl_deadlock`` checks this from the
CommLogs in the tests).

NCCL also connects two ranks lazily, in the first group in which they exchange, and
both must then ask for the same connections. Between neighbours the first group usually
opens one direction on both sides (stage s sends an activation, stage s+1 receives it),
but not always: GPipe with one micro-batch has stage 0 send its activation and post the
receive of the gradient in one group while stage 1 only receives, and NCCL fails in its
connection setup ("Message truncated" from its bootstrap). So :meth:`StageLink.connect`
first exchanges one element both ways with each neighbour, the same group on both
sides, which opens both directions of every link (NCCL connects as many channels for a
one-element message as for a large one). Each StageLink does it once per neighbour (a
runner's first step), on every backend: gloo does not need it, but then the CommLogs
show the calls NCCL gets, and ``nccl_deadlock`` checks this rule too.

``grouped=False`` issues each transfer on its own, sends first, and waits for the
sends only at the end of the step: the order that works on gloo (its sends are
asynchronous) and deadlocks under NCCL's rules. It is kept to show what the checker
catches; never use it for real work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class StageLink:
    """This rank's transfers to and from the other stages of its pipeline ``group``
    (the default group when None); peers are stage indices, ranks in ``group``."""

    def __init__(self, group=None, grouped: bool = True):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.index = dist.get_rank(group)
        if self.index < 0:
            raise ValueError("this rank is not a member of the pipeline's group")
        self.grouped = grouped
        self._pending: list = []
        self.connected: set[int] = set()  # peers connected both ways by connect()

    def connect(self, peers, device=None) -> None:
        """Open both directions to each of ``peers`` (stage indices) not yet connected:
        one group [send one element, receive one element] per peer, in increasing stage
        order, so that every pair of ranks meets in the same group whatever else each
        connects (the lower pair first on both sides: no rank waits in a cycle). Call
        it on every rank before any other transfer, each rank naming the peers that
        name it."""
        for peer in sorted(set(peers) - self.connected - {self.index}):
            out = torch.zeros(1, device=device)
            ops = [dist.P2POp(dist.isend, out, self.ranks[peer], self.group),
                   dist.P2POp(dist.irecv, torch.empty_like(out), self.ranks[peer], self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            self.connected.add(peer)

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Send each ``(tensor, stage)`` of ``sends`` and receive into each ``(buffer,
        stage)`` of ``recvs``; returns when the buffers are filled (and, grouped, when
        the sends have left)."""
        if not sends and not recvs:
            return
        if self.grouped:
            ops = [dist.P2POp(dist.isend, t.contiguous(), self.ranks[s], self.group)
                   for t, s in sends]
            ops += [dist.P2POp(dist.irecv, b, self.ranks[s], self.group) for b, s in recvs]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return
        self._pending += [dist.isend(t.contiguous(), self.ranks[s], self.group) for t, s in sends]
        for b, s in recvs:
            dist.irecv(b, self.ranks[s], self.group).wait()

    def finish(self) -> None:
        """Wait for the sends still in flight (only ``grouped=False`` leaves any)."""
        for work in self._pending:
            work.wait()
        self._pending = []

"""distlab.collectives.p2p_check: NCCL's grouping rules, checked from CommLog records on CPU.

Hand-built logs pin the model down (known-good and known-deadlocking patterns); real
gloo runs, recorded with CommLog, show that batch ids travel and that code which runs
on gloo is still judged by NCCL's rules.
"""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import broadcast
from distlab.collectives import ring, ring_layout
from distlab.comm import CommLog
from distlab.collectives.p2p_check import nccl_deadlock


class Log:
    """A rank's records, built by hand: ``send(peer)``, ``recv(peer)``, ``batch(...)``."""

    def __init__(self, rank, world=2, ranks=None):
        self.rank, self.ranks = rank, tuple(ranks or range(world))
        self.records, self._batch = [], 0

    def _event(self, op, peer, nbytes, batch, ranks):
        ranks = tuple(ranks or self.ranks)
        return dict(op=op, nbytes=nbytes, dtype="float32", rank=self.rank, peer=peer,
                    group_size=len(ranks), group_ranks=ranks, async_op=op[0] == "i",
                    start=0.0, end=0.0, batch=batch)

    def call(self, op, peer=None, nbytes=16, ranks=None):
        self.records.append(self._event(op, peer, nbytes, None, ranks))
        return self

    def batch(self, *ops, ranks=None):
        """ops: (op, peer) or (op, peer, nbytes)."""
        self._batch += 1
        for op, peer, *nbytes in ops:
            self.records.append(self._event(op, peer, nbytes[0] if nbytes else 16,
                                            self._batch, ranks))
        return self


def ring_shift_batched(K):
    return [Log(r, K).batch(("isend", (r + 1) % K), ("irecv", (r - 1) % K)).records
            for r in range(K)]


@pytest.mark.parametrize("K", [2, 3, 4])
def test_a_batched_ring_shift_completes(K):
    assert nccl_deadlock(ring_shift_batched(K)) is None


@pytest.mark.parametrize("K", [2, 3, 4])
def test_single_sends_before_receives_hang(K):
    logs = [Log(r, K).call("isend", (r + 1) % K).call("irecv", (r - 1) % K).records
            for r in range(K)]
    found = nccl_deadlock(logs)
    assert found is not None and "would hang" in found
    assert "rank 0 is stuck in its isend of 16 B to rank 1 (call 1)" in found
    assert "posts only later" in found and "irecv of 16 B from rank 0" in found
    assert "gloo does not enforce this" in found


def test_parity_ordered_blocking_calls_complete():
    K = 4
    logs = []
    for r in range(K):
        log = Log(r, K)
        calls = [("send", (r + 1) % K), ("recv", (r - 1) % K)]
        for op, peer in (calls if r % 2 == 0 else calls[::-1]):
            log.call(op, peer)
        logs.append(log.records)
    assert nccl_deadlock(logs) is None


def test_a_batch_whose_receives_come_later_hangs():
    """The old reference ring on NCCL: every send of a chunk in one batch, the peer's
    matching receives in later batches."""
    K = 2
    logs = []
    for r in range(K):
        log = Log(r, K)
        log.batch(("isend", 1 - r), ("isend", 1 - r), ("irecv", 1 - r))
        log.batch(("irecv", 1 - r))
        logs.append(log.records)
    found = nccl_deadlock(logs)
    assert "rank 0 is stuck in its batch_isend_irecv of calls 1-3 (2 x isend of 16 B" in found
    assert "rank 1 posts only later" in found and "calls 4" not in found


def test_same_index_groups_complete_and_pipelined_chain_completes():
    """Group g = (send piece g to the next rank, receive piece g from the previous) on
    every rank; and a chain broadcast that forwards piece c with the receive of c+1."""
    K, G = 3, 5
    ring = [Log(r, K) for r in range(K)]
    for log in ring:
        for _ in range(G):
            log.batch(("isend", (log.rank + 1) % K), ("irecv", (log.rank - 1) % K))
    assert nccl_deadlock([log.records for log in ring]) is None
    chain = [Log(r, 3) for r in range(3)]
    for c in range(G):
        chain[0].call("isend", 1)
        chain[2].call("irecv", 1)
    chain[1].call("irecv", 0)
    for c in range(G - 1):
        chain[1].batch(("isend", 2), ("irecv", 0))
    chain[1].call("isend", 2)
    assert nccl_deadlock([log.records for log in chain]) is None


def test_a_send_nobody_receives():
    logs = [Log(0).call("isend", 1).call("isend", 1).records, Log(1).call("irecv", 0).records]
    found = nccl_deadlock(logs)
    assert "rank 0 is stuck in its isend of 16 B to rank 1 (call 2)" in found
    assert "2nd send to rank 1, but rank 1 never posts a 2nd receive from rank 0" in found


def test_sizes_that_differ_are_named():
    logs = [Log(0).call("send", 1, nbytes=16).records, Log(1).call("recv", 0, nbytes=12).records]
    found = nccl_deadlock(logs)
    assert "rank 0's 1st send to rank 1" in found and "the sizes differ" in found
    assert "would hang" not in found


def test_a_receive_from_any_source_is_named():
    logs = [Log(0).call("send", 1).records, Log(1).call("recv", None).records]
    assert "names no source rank" in nccl_deadlock(logs)


def test_collectives_match_by_count_and_share_the_stream():
    good = [Log(r, 3).call("all_reduce").call("broadcast", 0).records for r in range(3)]
    assert nccl_deadlock(good) is None
    short = [Log(r, 3).call("all_reduce").call("all_reduce").records for r in range(2)]
    short.append(Log(2, 3).call("all_reduce").records)
    assert "not all of them ever do" in nccl_deadlock(short)
    # a send queued before a collective on one stream: the peer is in the collective
    logs = [Log(0).call("isend", 1).call("all_reduce").records,
            Log(1).call("all_reduce").call("irecv", 0).records]
    found = nccl_deadlock(logs)
    assert "rank 0 is stuck in its isend" in found and "all_reduce" in found


def test_process_groups_have_streams_of_their_own():
    """A send on a subgroup is not queued behind the default group's calls."""
    pair = (0, 1)
    logs = [Log(0, 2).call("isend", 1, ranks=pair).call("all_reduce", ranks=(0, 1, 2)).records,
            Log(1, 3).call("all_reduce", ranks=(0, 1, 2)).call("irecv", 0, ranks=pair).records,
            Log(2, 3).call("all_reduce", ranks=(0, 1, 2)).records]
    assert nccl_deadlock(logs) is None


def test_logs_may_be_commlogs_and_absent_ranks_are_none():
    logs = [CommLog.from_records(r, rank) for rank, r in enumerate(ring_shift_batched(3))]
    assert nccl_deadlock(logs) is None
    assert nccl_deadlock([None, None]) is None


# ------------------------------------------------- NCCL's lazy connection of a pair


def old_pipeline_first_step(p):
    """GPipe with one micro-batch over p stages, as the pipeline runtime first issued it:
    stage s's first group with s+1 sends the activation and receives the gradient; s+1's
    first group with s only receives the activation (it failed on two H200s with
    "Message truncated")."""
    logs = [Log(s, p) for s in range(p)]
    for s, log in enumerate(logs):
        if s > 0:
            log.batch(("irecv", s - 1))
        if s < p - 1:
            log.batch(("isend", s + 1), ("irecv", s + 1))
        if s > 0:
            log.batch(("isend", s - 1))
    return logs


def warmed_up(p, logs):
    """The same logs after a warm-up: each stage first exchanges one element both ways
    with each neighbour, lower stages first."""
    out = []
    for s, log in enumerate(logs):
        warm = Log(s, p)
        for peer in (s - 1, s + 1):
            if 0 <= peer < p:
                warm.batch(("isend", peer, 4), ("irecv", peer, 4))
        out.append(warm.records + [dict(r, batch=r["batch"] and r["batch"] + 100)
                                   for r in log.records])
    return out


@pytest.mark.parametrize("p", [2, 3, 4])
def test_first_groups_that_ask_for_different_connections_are_named(p):
    logs = old_pipeline_first_step(p)
    found = nccl_deadlock([log.records for log in logs])
    assert found is not None and "first connection between two ranks would fail" in found
    assert ("rank 0's first exchange with rank 1 is its batch_isend_irecv of calls 1-2 (isend "
            "of 16 B to rank 1, irecv of 16 B from rank 1), which sends to and receives from "
            "rank 1; rank 1's first exchange with rank 0 is its batch_isend_irecv of call 1 "
            "(irecv of 16 B from rank 0), which only receives from rank 0.") in found
    assert "Message truncated" in found and "would hang" not in found
    assert found.count("first exchange with rank") == 2 * min(p - 1, 3)  # every pair
    assert nccl_deadlock(warmed_up(p, logs)) is None


def test_one_way_pairs_and_symmetric_first_groups_connect():
    """A ring shift (each pair exchanges one way), two ranks that both send and receive
    in their first group, and a second direction opened later on both sides."""
    assert nccl_deadlock(ring_shift_batched(3)) is None
    assert nccl_deadlock(ring_shift_batched(2)) is None
    later = [Log(0).batch(("isend", 1)).call("recv", 1).records,
             Log(1).batch(("irecv", 0)).call("send", 0).records]
    assert nccl_deadlock(later) is None
    single = [Log(0).call("isend", 1).call("irecv", 1).records,
              Log(1).batch(("irecv", 0), ("isend", 0)).records]
    found = nccl_deadlock(single)
    assert "rank 0's first exchange with rank 1 is its isend of 16 B to rank 1 (call 1), " \
           "which only sends to rank 1; rank 1's first exchange" in found
    assert "which sends to and receives from rank 0" in found


def test_connections_are_per_process_group():
    """NCCL connects a pair once per communicator: on a subgroup of the same two ranks
    their first groups must agree again."""
    pair = (0, 1)
    logs = [Log(0, 3).batch(("isend", 1), ("irecv", 1))
            .batch(("isend", 1), ("irecv", 1), ranks=pair).records,
            Log(1, 3).batch(("irecv", 0), ("isend", 0))
            .batch(("irecv", 0), ranks=pair).batch(("isend", 0), ranks=pair).records, None]
    found = nccl_deadlock(logs)
    assert found.count("first exchange with rank") == 2 and "would hang" not in found
    assert "rank 0's first exchange with rank 1 is its batch_isend_irecv of calls 3-4" in found
    assert "rank 1's first exchange with rank 0 is its batch_isend_irecv of call 3 " in found


# ------------------------------------------------------------- real gloo runs, recorded


def _shifts():
    """A ring shift two ways; both run on gloo."""
    rank, K = dist.get_rank(), dist.get_world_size()
    out, inc = torch.ones(8), torch.empty(8)
    with CommLog() as batched:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, (rank + 1) % K),
                                         dist.P2POp(dist.irecv, inc, (rank - 1) % K)]):
            w.wait()
    with CommLog() as single:
        works = [dist.isend(out, (rank + 1) % K), dist.irecv(inc, (rank - 1) % K)]
        for w in works:
            w.wait()
    return batched.records(), single.records()


def test_gloo_runs_carry_batch_ids_and_are_judged_by_nccls_rules():
    runs = launch.run(_shifts, 3, backend="gloo", timeout=60)
    batched = [b for b, _ in runs]
    single = [s for _, s in runs]
    for records in batched:
        assert len({r["batch"] for r in records}) == 1 and records[0]["batch"] is not None
    assert all(r["batch"] is None for records in single for r in records)
    assert nccl_deadlock(batched) is None
    assert "would hang" in nccl_deadlock(single)


def _record(fn, *args):
    with CommLog() as log:
        fn(*args)
    return log.records()


def _ring(numel, piece_bytes):
    saved, ring_layout.PIECE_BYTES = ring_layout.PIECE_BYTES, piece_bytes
    try:
        return _record(ring.ring_allreduce, torch.arange(numel, dtype=torch.float32))
    finally:
        ring_layout.PIECE_BYTES = saved


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_reference_ring_obeys_nccls_rules(world_size):
    """It issues the same calls on every backend; with many pieces per chunk, and one."""
    for numel, piece_bytes in ((1000, 64), (1 << 18, None)):
        logs = launch.run(_ring, world_size, numel, piece_bytes, backend="gloo", timeout=60)
        assert nccl_deadlock(logs) is None


def _broadcast(src, chunks):
    t = torch.arange(1001, dtype=torch.float32) * (dist.get_rank() == src)
    return _record(broadcast.pipelined_broadcast, t, src, chunks)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_reference_broadcast_obeys_nccls_rules(world_size):
    for src, chunks in ((0, 1), (world_size - 1, 5)):
        logs = launch.run(_broadcast, world_size, src, chunks, backend="gloo", timeout=60)
        assert nccl_deadlock(logs) is None

"""CommLog: which calls ran, how many bytes, with which peer and group, and when."""
import pickle

import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog, all_gather_into, bus_factor, reduce_scatter_into


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 4, 1.5), ("all_reduce", 1, 0.0), ("all_gather", 4, 0.75),
    ("reduce_scatter_tensor", 8, 0.875), ("broadcast", 4, 1.0), ("reduce", 3, 1.0),
    ("sendrecv", 2, 1.0), ("isend", 2, 1.0)])
def test_bus_factors_are_those_of_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown_ops_and_sizes():
    with pytest.raises(ValueError, match="no bus-bandwidth factor"):
        bus_factor("all_reduce_coalesced", 4)
    with pytest.raises(ValueError, match="world_size"):
        bus_factor("all_reduce", 0)


def _every_kind_of_call():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(10, dtype=torch.float32)
    outside = torch.ones(2)
    dist.all_reduce(outside)  # before the log: not recorded
    with CommLog() as log:
        dist.all_reduce(x)
        dist.broadcast(x, src=1)
        dist.reduce(x, dst=2)
        out = torch.empty(10 * world)
        all_gather_into(out, x)
        rs = torch.empty(3, dtype=torch.float64)
        reduce_scatter_into(rs, torch.ones(3 * world, dtype=torch.float64))
        dist.all_gather([torch.empty(4) for _ in range(world)], torch.ones(4))
        if rank == 0:
            dist.send(torch.ones(5, dtype=torch.int64), dst=1)
        elif rank == 1:
            dist.recv(torch.empty(5, dtype=torch.int64))  # any source
        ops = [dist.P2POp(dist.isend, torch.ones(6), (rank + 1) % world),
               dist.P2POp(dist.irecv, torch.empty(6), (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        with CommLog() as inner:
            dist.barrier()
    return log, inner


def test_the_log_records_op_bytes_peer_group_and_time():
    logs = launch.run(_every_kind_of_call, 3, backend="gloo")
    for rank, (log, inner) in enumerate(logs):
        log = pickle.loads(pickle.dumps(log))  # a log travels
        ops = log.ops()
        p2p = {0: ["send"], 1: ["recv"], 2: []}[rank]
        assert ops == ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_gather", *p2p, "isend", "irecv",
                       "barrier"]
        assert inner.ops() == ["barrier"], "nested logs see the calls made inside them"
        by_op = {e.op: e for e in log.events}
        assert by_op["all_reduce"].nbytes == 40
        assert by_op["broadcast"].peer == 1 and by_op["reduce"].peer == 2
        assert by_op["all_gather_into_tensor"].nbytes == 120, "all-gather counts its output"
        assert by_op["reduce_scatter_tensor"].nbytes == 72, "reduce-scatter counts its input"
        assert by_op["reduce_scatter_tensor"].dtype == "float64"
        assert by_op["all_gather"].nbytes == 48
        assert by_op["isend"].peer == (rank + 1) % 3 and by_op["irecv"].peer == (rank - 1) % 3
        assert by_op["isend"].async_op and not by_op["all_reduce"].async_op
        if rank == 1:
            assert by_op["recv"].peer == 0, "a receive from any source records the sender"
        assert all(e.group_size == 3 and e.group_ranks == (0, 1, 2) for e in log.events)
        assert all(e.end is not None and e.end >= e.start for e in log.events)
        assert log.bytes_sent() == 24 + (40 if rank == 0 else 0)
        assert log.count(("isend", "irecv")) == 2
        assert "all_reduce" in log.summary()


def _subgroup_and_bus_bytes():
    group = dist.new_group([0, 2])
    t = torch.zeros(100)
    with CommLog() as log:
        if dist.get_rank() in (0, 2):
            dist.all_reduce(t, group=group)
            dist.send(t, dst=2 - dist.get_rank(), group=group) if dist.get_rank() == 0 else \
                dist.recv(t, src=0, group=group)
    return log


def test_groups_and_bus_bytes():
    logs = launch.run(_subgroup_and_bus_bytes, 3, backend="gloo")
    assert logs[1].events == []
    for rank in (0, 2):
        e = logs[rank].events[0]
        assert e.group_size == 2 and e.group_ranks == (0, 2)
        assert logs[rank].events[1].peer == 2 - rank
    # all-reduce of 400 B on 2 ranks puts 2(n-1)/n * 400 = 400 B on the wire, plus the send
    assert logs[0].bus_bytes() == pytest.approx(400 + 400)
    assert logs[2].bus_bytes() == pytest.approx(400)


def _status_without_a_log():
    from distlab import comm

    t = torch.ones(4)
    seen = []
    for async_op in (False, True):
        work = dist.all_reduce(t, async_op=async_op)
        seen.append(comm.StatusBoard.read(comm._status.buffer))
        if work is not None:
            work.wait()
    return seen


def test_the_status_board_names_a_collective_without_any_log():
    """With no CommLog active, a collective still says where the rank is (the launcher's
    hang report reads it), through the short path that hooks on the hot path take."""
    for seen in launch.run(_status_without_a_log, 2, backend="gloo"):
        assert seen[0].startswith("after all_reduce(16 B float32) at "), seen
        assert seen[1].startswith("after all_reduce(16 B float32) issued async at "), seen

"""The reference parameter server step: equals single-process SGD on groups of 1 to 4
ranks, by one reduce to the server and one broadcast from it. The sharded server of lab
02's section 4 equals it too, moving only each rank's pieces; stale SGD lags by tau."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import ps, ps_sharded
from distlab.collectives.p2p_check import nccl_deadlock
from distlab.comm import CommLog
from distlab.grading import expect_close

GROUPS = [[2], [0, 3], [1, 2, 3], [0, 1, 2, 3]]
SHAPES = [(4, 3), (3,), (7,)]


def _loss(params, x):
    w, b, v = params
    return torch.tanh(x @ w + b).pow(2).mean() + v.pow(2).sum()


def _step_like_sgd(step, params, reference, shard, x, case) -> CommLog:
    """``step(params, grads)`` on this rank's ``shard`` against SGD on the whole batch ``x``
    (``reference``, stepped here): the same weights, the gradients left as they were. Its
    CommLog."""
    grads = torch.autograd.grad(_loss(params, shard), params)
    before = [gr.clone() for gr in grads]
    with CommLog() as log:
        step(params, grads)
    full = torch.autograd.grad(_loss(reference, x), reference)
    with torch.no_grad():
        for p, gr in zip(reference, full):
            p -= 0.1 * gr
    for p, r in zip(params, reference):
        expect_close(p.detach(), r.detach(), case)
    for gr, b in zip(grads, before):
        expect_close(gr, b, f"{case}: grads left as they were")
    return log


def _against_single_process():
    rank = dist.get_rank()
    groups = [dist.new_group(m) for m in GROUPS]
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for members, group in zip(GROUPS, groups):
        if rank not in members:  # outside: at once, nothing touched, nothing called
            p, gr = torch.ones(3), torch.full((3,), 2.0)
            with CommLog() as log:
                assert ps.ps_sgd_step([p], [gr], members[0], 0.1, group=group) is None
            assert p.tolist() == [1.0] * 3 and gr.tolist() == [2.0] * 3 and not log.events
            continue
        for server in (members[0], members[-1]):
            g = torch.Generator().manual_seed(1)
            params = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
                      for s in SHAPES]
            reference = [p.detach().clone().requires_grad_() for p in params]
            shard = x.chunk(len(members))[members.index(rank)]
            for step in range(3):
                case = f"rank {rank}, group {members}, server {server}, step {step}"
                log = _step_like_sgd(lambda p, g: ps.ps_sgd_step(p, g, server, 0.1, group=group),
                                     params, reference, shard, x, case)
                assert [(e.op, e.peer) for e in log.collectives()] == [
                    ("reduce", server), ("broadcast", server)], case
                nbytes = sum(p.numel() * 8 for p in params)
                assert log.nbytes("reduce") == log.nbytes("broadcast") == nbytes, case


def test_equals_sgd_on_the_whole_batch_on_groups_of_1_to_4_ranks():
    launch.run(_against_single_process, 4, backend="gloo", timeout=60)


def _bad_inputs():
    with pytest.raises(ValueError, match="gradient"):
        ps.ps_sgd_step([torch.zeros(3)], [], 0, 0.1)
    with pytest.raises(ValueError, match="must match"):
        ps.ps_sgd_step([torch.zeros(3)], [torch.zeros(4)], 0, 0.1)
    with pytest.raises(ValueError, match="one dtype"):
        ps.ps_sgd_step([torch.zeros(3), torch.zeros(2, dtype=torch.float64)],
                       [torch.zeros(3), torch.zeros(2, dtype=torch.float64)], 0, 0.1)


def test_bad_inputs_name_the_fix():
    launch.run(_bad_inputs, 4, backend="gloo", timeout=30)


def _sharded_against_single_process():
    """ps_sharded.sharded_sgd_step on groups of 1 to 4 ranks: SGD on the whole batch, grads
    untouched, and per rank exactly its pieces' bytes: 2(W-1)/W of the model when the
    pieces are equal, sent and received, in isends and irecvs only."""
    rank = dist.get_rank()
    groups = [dist.new_group(m) for m in GROUPS]
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    steps = CommLog()          # every group's steps, for NCCL's point-to-point rules
    for members, group in zip(GROUPS, groups):
        if rank not in members:
            p, gr = torch.ones(3), torch.full((3,), 2.0)
            with CommLog() as log:
                assert ps_sharded.sharded_sgd_step([p], [gr], 0.1, group=group) is None
            assert p.tolist() == [1.0] * 3 and gr.tolist() == [2.0] * 3 and not log.events
            continue
        world, me = len(members), members.index(rank)
        g = torch.Generator().manual_seed(1)
        params = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
                  for s in SHAPES]
        reference = [p.detach().clone().requires_grad_() for p in params]
        shard = x.chunk(world)[me]
        for step in range(3):
            case = f"rank {rank}, group {members}, step {step}"
            log = _step_like_sgd(lambda p, g: ps_sharded.sharded_sgd_step(p, g, 0.1, group=group),
                                 params, reference, shard, x, case)
            numel = sum(p.numel() for p in params)
            pieces = [len(c) for c in torch.arange(numel).tensor_split(world)]
            mine, others = pieces[me], numel - pieces[me]
            assert set(log.ops()) <= {"isend", "irecv"}, case
            assert log.bytes_sent() == 8 * (others + (world - 1) * mine), case
            assert log.nbytes("irecv") == 8 * ((world - 1) * mine + others), case
            if numel % world == 0:   # equal pieces: 2(W-1)/W of the model
                assert log.bytes_sent() == 2 * (world - 1) * 8 * numel // world, case
            steps.events += log.events
    return steps.records()


def test_sharded_server_equals_sgd_and_moves_its_pieces_on_groups_of_1_to_4_ranks():
    logs = launch.run(_sharded_against_single_process, 4, backend="gloo", timeout=60)
    assert nccl_deadlock(logs) is None, nccl_deadlock(logs)   # what gloo forgives, NCCL hangs on


def test_stale_sgd_is_synchronous_sgd_at_tau_0_and_lags_by_tau():
    """tau = 0 is plain SGD on the mean of the workers' gradients; with tau = 2 the first
    three steps all take the starting point's gradient, and the fourth step 1's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randn(8, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, generator=g, dtype=torch.float64)
    loss = lambda params, x, y: ((x @ params[0] - y) ** 2).mean()  # noqa: E731
    batches = list(zip(x.chunk(2), y.chunk(2)))

    def grad(w):
        w = w.clone().requires_grad_()
        return torch.autograd.grad(loss([w], x, y), [w])[0]

    plain = [w0]
    for _ in range(5):
        plain.append(plain[-1] - 0.1 * grad(plain[-1]))
    lagged = [w0 - 0.1 * k * grad(w0) for k in range(4)]
    lagged.append(lagged[3] - 0.1 * grad(lagged[1]))
    for tau, ws in ((0, plain), (2, lagged)):
        expected = [loss([w], x, y).item() for w in ws]
        assert ps_sharded.stale_sgd(loss, [w0], batches, 5, 0.1, tau) == pytest.approx(
            expected[:5], rel=1e-12), tau
    with pytest.raises(ValueError, match="tau"):
        ps_sharded.stale_sgd(loss, [w0], batches, 1, 0.1, -1)
    with pytest.raises(ValueError, match="one gradient per parameter"):
        ps_sharded.sharded_sgd_step([w0], [w0[:2]], 0.1)

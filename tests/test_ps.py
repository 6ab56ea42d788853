"""The reference parameter server step: equals single-process SGD on groups of 1 to 4
ranks, by one reduce to the server and one broadcast from it."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import ps
from distlab.comm import CommLog
from distlab.grading import expect_close

GROUPS = [[2], [0, 3], [1, 2, 3], [0, 1, 2, 3]]
SHAPES = [(4, 3), (3,), (7,)]


def _loss(params, x):
    w, b, v = params
    return torch.tanh(x @ w + b).pow(2).mean() + v.pow(2).sum()


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
                grads = torch.autograd.grad(_loss(params, shard), params)
                before = [gr.clone() for gr in grads]
                with CommLog() as log:
                    ps.ps_sgd_step(params, grads, server, 0.1, group=group)
                full = torch.autograd.grad(_loss(reference, x), reference)
                with torch.no_grad():
                    for p, gr in zip(reference, full):
                        p -= 0.1 * gr
                case = f"rank {rank}, group {members}, server {server}, step {step}"
                for p, r in zip(params, reference):
                    expect_close(p.detach(), r.detach(), case)
                for gr, b in zip(grads, before):
                    expect_close(gr, b, f"{case}: grads left as they were")
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

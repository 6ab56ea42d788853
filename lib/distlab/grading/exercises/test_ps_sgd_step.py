"""Lab 02, exercise ps_sgd_step: push (reduce to the server), SGD there, pull (broadcast).

The ranks run the student's steps and return plain data (the parameters after each
step, the CommLog records); the single-process SGD they must equal, and every check,
run here.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "02_parameter_server"
BATCH, STEPS, LR = 12, 3, 0.1          # 12 samples split evenly over 1, 2, 3 or 4 workers
SUBGROUP = (1, 2, 3)                   # of 4 ranks: rank 0 is outside
SUB_SERVER = 2                         # the subgroup's server (its group rank is 1)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get the helpers


def _model(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=g, dtype=dtype),   # weight
            torch.randn(3, generator=g, dtype=dtype),      # bias
            torch.randn(7, generator=g, dtype=dtype)]      # a vector of odd length


def _batch(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 5, generator=g, dtype=dtype), torch.randn(BATCH, 3, generator=g,
                                                                      dtype=dtype)


def _grads(params, x, y):
    """Gradients of the mean loss over the samples (x, y) of a small nonlinear model."""
    params = [p.detach().clone().requires_grad_() for p in params]
    w, b, v = params
    loss = ((torch.tanh(x @ w + b) - y) ** 2).mean() + (v ** 2).sum()
    return [g.detach() for g in torch.autograd.grad(loss, params)]


def _train(ps_sgd_step, servers, members, dtype=torch.float64):
    """In the ranks: for each server, STEPS steps of ps_sgd_step, each rank on its shard
    of the batch. Returns, per server and step, the parameters after it and the log; on
    a subgroup, under "stale", the parameters after one step from copies that differ
    from the first server's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(members)) if len(members) < world else None
    if rank not in members:
        params, grads = _model(dtype), _grads(_model(dtype), *_batch(dtype))
        with CommLog() as log:
            out = ps_sgd_step(params, grads, members[0], LR, group=group)
        return {"outside": (type(out).__name__, params, grads, log.records())}
    x, y = _batch(dtype)
    mine = members.index(rank)
    xs, ys = x.chunk(len(members))[mine], y.chunk(len(members))[mine]
    found = {}
    for server in servers:
        params, steps = _model(dtype), []
        for _ in range(STEPS):
            grads = _grads(params, xs, ys)
            with CommLog() as log:
                ps_sgd_step(params, grads, server, LR, group=group)
            steps.append({"params": [p.clone() for p in params], "log": log.records()})
        found[server] = steps
    if group is not None:  # the workers' copies stale (the server's plus one): pulled over
        params = [p + (rank != servers[0]) for p in _model(dtype)]
        ps_sgd_step(params, _grads(_model(dtype), xs, ys), servers[0], LR, group=group)
        found["stale"] = params
    return found


def _reference(dtype):
    """Single-process SGD on the whole batch: the parameters after each step."""
    params, x_y, after = _model(dtype), _batch(dtype), []
    for _ in range(STEPS):
        params = [p - LR * g for p, g in zip(params, _grads(params, *x_y))]
        after.append(params)
    return after


def _check(results, servers, members, world_size, dtype=torch.float64):
    # The traffic checks are self-reported (CommLog only): the model's 200 bytes a call are
    # far inside the wire's slack, and gloo's all_reduce moves what a reduce and a
    # broadcast move together, so bytes cannot tell (wire.py).
    reference = _reference(dtype)
    param_bytes = sum(p.numel() * p.element_size() for p in _model(dtype))
    where = (f"{len(members)} workers" if len(members) == world_size
             else f"{len(members)} workers (group of global ranks {list(members)})")
    for server in servers:
        for rank in members:
            for step, found in enumerate(results[rank][server]):
                case = f"rank {rank}, server {server}, {where}, step {step + 1}"
                for i, (p, r) in enumerate(zip(found["params"], reference[step])):
                    expect_close(p, r, f"{case}: parameter {i} (shape {tuple(p.shape)}) should "
                                 f"equal SGD on the averaged gradients (did the server divide "
                                 f"the summed gradients by the number of workers, and did "
                                 f"every rank get the new parameters?)")
                calls = [(e.op, e.nbytes, e.peer)
                         for e in CommLog.from_records(found["log"], rank).collectives()]
                ops = [c[0] for c in calls]
                assert set(ops) <= {"reduce", "broadcast"}, (
                    f"{case}: a parameter server pushes with dist.reduce and pulls with "
                    f"dist.broadcast; the log shows {ops}")
                reduced = [c for c in calls if c[0] == "reduce"]
                pulled = [c for c in calls if c[0] == "broadcast"]
                assert reduced and all(c[2] == server for c in reduced), (
                    f"{case}: push the gradients with dist.reduce(..., dst=server), server "
                    f"being a global rank (the log shows reduces to "
                    f"{[c[2] for c in reduced]})")
                assert pulled and all(c[2] == server for c in pulled), (
                    f"{case}: pull the parameters with dist.broadcast(..., src=server), server "
                    f"being a global rank (the log shows broadcasts from "
                    f"{[c[2] for c in pulled]})")
                assert sum(c[1] for c in reduced) == param_bytes, (
                    f"{case}: reduced {sum(c[1] for c in reduced)} bytes; the gradients are "
                    f"{param_bytes} bytes and each should be pushed once")
                assert sum(c[1] for c in pulled) == param_bytes, (
                    f"{case}: broadcast {sum(c[1] for c in pulled)} bytes; the parameters are "
                    f"{param_bytes} bytes and each should be pulled once")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_data_parallel_sgd(student, world_size):
    servers, members = sorted({0, world_size - 1}), tuple(range(world_size))
    results = launch.run(_train, world_size, student.ps_sgd_step, servers, members,
                         backend="gloo", timeout=30)
    _check(results, servers, members, world_size)


def test_float32(student):
    members = (0, 1, 2, 3)
    results = launch.run(_train, 4, student.ps_sgd_step, [1], members, dtype=torch.float32,
                         backend="gloo", timeout=30)
    _check(results, [1], members, 4, torch.float32)


_subgroup_runs = {}


def _on_the_subgroup(student):
    if "runs" not in _subgroup_runs:
        _subgroup_runs["runs"] = launch.run(_train, 4, student.ps_sgd_step, [SUB_SERVER],
                                            SUBGROUP, backend="gloo", timeout=30)
    return _subgroup_runs["runs"]


def test_on_a_subgroup(student):
    """Global ranks 1, 2, 3, the server global rank 2 (its group rank is 1)."""
    _check(_on_the_subgroup(student), [SUB_SERVER], SUBGROUP, 4)


def test_outside_the_group(student):
    kind, params, grads, records = _on_the_subgroup(student)[0]["outside"]
    case = f"rank 0 is not a member of the group {list(SUBGROUP)}"
    calls = [e.op for e in CommLog.from_records(records, 0).events]
    assert not calls, (f"{case}; ps_sgd_step should return at once there, but it called "
                       f"{calls}")
    for i, (p, want) in enumerate(zip(params, _model(torch.float64))):
        expect_close(p, want, f"{case}: its parameter {i} must be left as it was")
    for i, (g, want) in enumerate(zip(grads, _grads(_model(torch.float64),
                                                    *_batch(torch.float64)))):
        expect_close(g, want, f"{case}: its gradient {i} must be left as it was")
    assert kind == "NoneType", f"{case}; ps_sgd_step should return None there, got a {kind}"


def test_every_rank_gets_the_servers_parameters(student):
    """On the subgroup, the server global rank 2: the other members start from stale
    copies (the server's parameters plus one); after the step they hold the server's new
    parameters, as a pull of the parameters (not of the averaged gradient) leaves them."""
    runs = _on_the_subgroup(student)
    want = _reference(torch.float64)[0]
    for rank in SUBGROUP:
        for i, (p, r) in enumerate(zip(runs[rank]["stale"], want)):
            stale = rank != SUB_SERVER and torch.allclose(p, r + 1)
            expect_close(p, r, f"rank {rank}, server {SUB_SERVER}, group of global ranks "
                         f"{list(SUBGROUP)}, its parameters one more than the server's before "
                         f"the step: parameter "
                         f"{i} after it must be the server's new parameter"
                         + (" (it is this rank's own copy stepped: the server takes the step "
                            "and broadcasts the new parameters, not the averaged gradient)"
                            if stale else ""))


def _on_gpu(ps_sgd_step):
    from distlab import backend

    device = backend.device()
    p = [torch.ones(10, device=device)]
    g = [torch.full((10,), float(dist.get_rank() + 1), device=device)]
    ps_sgd_step(p, g, 0, 0.5)
    return p[0].cpu()


def _check_gpu(results):
    world = len(results)
    for rank, p in enumerate(results):
        expect_close(p, torch.full((10,), 1 - 0.5 * (world + 1) / 2),
                     f"rank {rank}: parameters after one step on {world} GPU(s)")


@pytest.mark.gpu
def test_on_gpu(student):
    _check_gpu(launch.run(_on_gpu, 1, student.ps_sgd_step, backend="nccl", timeout=60))


@pytest.mark.multigpu
def test_on_several_gpus(student):
    from distlab import backend

    _check_gpu(launch.run(_on_gpu, backend.gpu_count(), student.ps_sgd_step, backend="nccl",
                          timeout=60))

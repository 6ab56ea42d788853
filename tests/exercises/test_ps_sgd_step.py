"""Lab 02, exercise ps_sgd_step: push (reduce to the server), SGD there, pull (broadcast)."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "02_parameter_server"
BATCH, STEPS, LR = 12, 3, 0.1          # 12 samples split evenly over 1, 2, 3 or 4 workers


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


def _train(ps_sgd_step, servers, members=None, dtype=torch.float64):
    """For each server: STEPS steps of ps_sgd_step, each rank on its shard of the batch,
    compared after each step with single-process SGD on the whole batch. Returns the
    calls each step made, per server."""
    group = dist.new_group(members) if members is not None else None
    members = members if members is not None else list(range(dist.get_world_size()))
    if dist.get_rank() not in members:
        return None
    return {server: _train_one(ps_sgd_step, server, members, group, dtype) for server in servers}


def _train_one(ps_sgd_step, server, members, group, dtype):
    rank = dist.get_rank()
    params = _model(dtype)
    x, y = _batch(dtype)
    mine = members.index(rank)
    xs, ys = x.chunk(len(members))[mine], y.chunk(len(members))[mine]
    reference = _model(dtype)
    where = f"{len(members)} workers{f' (group {members})' if group is not None else ''}"
    logs = []
    for step in range(STEPS):
        grads = _grads(params, xs, ys)
        with CommLog() as log:
            ps_sgd_step(params, grads, server, LR, group=group)
        logs.append([(e.op, e.nbytes, e.peer) for e in log.collectives()])
        for p, g in zip(reference, _grads(reference, x, y)):
            p -= LR * g
        for i, (p, r) in enumerate(zip(params, reference)):
            expect_close(p, r, f"rank {rank}, server {server}, {where}, step {step + 1}: "
                         f"parameter {i} (shape {tuple(p.shape)}) should equal SGD on the "
                         f"averaged gradients (did the server divide the summed gradients by "
                         f"the number of workers, and did every rank get the new parameters?)")
    return logs


def _check_how(results, server, members, dtype=torch.float64):
    param_bytes = sum(p.numel() * p.element_size() for p in _model(dtype))
    for rank in members:
        for step, calls in enumerate(results[rank][server]):
            ops = [c[0] for c in calls]
            case = f"rank {rank}, server {server}, step {step + 1}"
            assert set(ops) <= {"reduce", "broadcast"}, (
                f"{case}: a parameter server pushes with dist.reduce and pulls with "
                f"dist.broadcast; the log shows {ops}")
            reduced = [c for c in calls if c[0] == "reduce"]
            pulled = [c for c in calls if c[0] == "broadcast"]
            assert reduced and all(c[2] == server for c in reduced), (
                f"{case}: push the gradients with dist.reduce(..., dst=server) (the log shows "
                f"reduces to {[c[2] for c in reduced]})")
            assert pulled and all(c[2] == server for c in pulled), (
                f"{case}: pull the parameters with dist.broadcast(..., src=server) (the log "
                f"shows broadcasts from {[c[2] for c in pulled]})")
            assert sum(c[1] for c in reduced) == param_bytes, (
                f"{case}: reduced {sum(c[1] for c in reduced)} bytes; the gradients are "
                f"{param_bytes} bytes and each should be pushed once")
            assert sum(c[1] for c in pulled) == param_bytes, (
                f"{case}: broadcast {sum(c[1] for c in pulled)} bytes; the parameters are "
                f"{param_bytes} bytes and each should be pulled once")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_data_parallel_sgd(student, world_size):
    servers = sorted({0, world_size - 1})
    results = launch.run(_train, world_size, student.ps_sgd_step, servers, backend="gloo",
                         timeout=30)
    for server in servers:
        _check_how(results, server, list(range(world_size)))


def test_float32(student):
    results = launch.run(_train, 4, student.ps_sgd_step, [1], dtype=torch.float32,
                         backend="gloo", timeout=30)
    _check_how(results, 1, [0, 1, 2, 3], torch.float32)


def test_on_a_subgroup(student):
    members = [1, 2, 3]
    results = launch.run(_train, 4, student.ps_sgd_step, [2], members, backend="gloo",
                         timeout=30)
    _check_how(results, 2, members)


def _on_gpu(ps_sgd_step):
    from distlab import backend

    device = backend.device()
    world = dist.get_world_size()
    p = [torch.ones(10, device=device)]
    g = [torch.full((10,), float(dist.get_rank() + 1), device=device)]
    ps_sgd_step(p, g, 0, 0.5)
    expected = torch.full((10,), 1 - 0.5 * (world + 1) / 2)
    expect_close(p[0].cpu(), expected, f"rank {dist.get_rank()}: parameters after one step")


@pytest.mark.gpu
def test_on_gpu(student):
    launch.run(_on_gpu, 1, student.ps_sgd_step, backend="nccl", timeout=60)


@pytest.mark.multigpu
def test_on_several_gpus(student):
    from distlab import backend

    launch.run(_on_gpu, backend.gpu_count(), student.ps_sgd_step, backend="nccl", timeout=60)

"""Lab 00, exercise all_reduce_mean: in place, the element-wise mean over a group."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "00_setup"
SHAPES = [(1,), (7,), (3, 5), (0,)]
DTYPES = [torch.float32, torch.float64]


def _inputs(rank, shape, dtype):
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _mean_on_all_ranks(all_reduce_mean):
    rank, world = dist.get_rank(), dist.get_world_size()
    for shape in SHAPES:
        for dtype in DTYPES:
            t = _inputs(rank, shape, dtype)
            expected = sum(_inputs(r, shape, dtype).double() for r in range(world)) / world
            with CommLog() as log:
                out = all_reduce_mean(t)
            expect_close(t, expected.to(dtype), f"rank {rank}, shape {shape}, {dtype}: tensor "
                         f"after all_reduce_mean (is it the mean over the {world} ranks?)")
            assert out is t, "all_reduce_mean must return the tensor it was given (in place)"
            calls = log.collectives()
            assert len(calls) == 1 and calls[0].op == "all_reduce", (
                f"use exactly one all_reduce; the log shows {[e.op for e in calls]}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mean_over_all_ranks(student, world_size):
    launch.run(_mean_on_all_ranks, world_size, student.all_reduce_mean, backend="gloo",
               timeout=30)


def _mean_on_subgroup(all_reduce_mean):
    rank = dist.get_rank()
    members = [0, 2, 3]
    group = dist.new_group(members)
    t = torch.full((5,), float(rank))
    if rank in members:
        all_reduce_mean(t, group=group)
        expect_close(t, torch.full((5,), sum(members) / len(members)),
                     f"rank {rank}: mean over the group of ranks {members} (divide by the "
                     f"group's size, dist.get_world_size(group), not the world's)")
    else:
        expect_close(t, torch.full((5,), float(rank)), f"rank {rank} is outside the group")


def test_mean_over_a_subgroup(student):
    launch.run(_mean_on_subgroup, 4, student.all_reduce_mean, backend="gloo", timeout=30)


def _mean_on_gpu(all_reduce_mean):
    from distlab import backend

    t = torch.arange(6, dtype=torch.float32, device=backend.device()) + dist.get_rank()
    all_reduce_mean(t)
    world = dist.get_world_size()
    expected = torch.arange(6, dtype=torch.float32) + (world - 1) / 2
    expect_close(t.cpu(), expected, f"rank {dist.get_rank()}: mean on the GPU")


@pytest.mark.gpu
def test_mean_on_gpu(student):
    launch.run(_mean_on_gpu, 1, student.all_reduce_mean, backend="nccl", timeout=60)


@pytest.mark.multigpu
def test_mean_on_several_gpus(student):
    from distlab import backend

    launch.run(_mean_on_gpu, backend.gpu_count(), student.all_reduce_mean, backend="nccl",
               timeout=60)

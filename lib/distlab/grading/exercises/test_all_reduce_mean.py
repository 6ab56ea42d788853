"""Lab 00, exercise all_reduce_mean(tensor, group=None): in place, the element-wise mean
over the ranks of ``group``, returned; a rank outside ``group`` returns None at once and
leaves its tensor untouched.

The ranks run the student's function and return plain data (tensors, what came back,
the CommLog's records); every check is made here, in the test process, against values
computed here. The traffic point rests on the bytes counted on the wire
(:mod:`distlab.grading.wire`): at most one gloo all_reduce of each case, which a hidden
second collective or an all_gather-and-average (K/2 times the bytes) exceeds; the
large case is there so that bytes can tell.
"""
import pytest
import torch
import torch.distributed as dist

from distlab import backend, launch
from distlab.comm import CommLog
from distlab.grading import expect_close, wire

NOTEBOOK = "00_setup"
CASES = [(shape, dtype) for shape in [(1,), (7,), (3, 5), (0,), (1 << 15,)]
         for dtype in (torch.float32, torch.float64)]
MEMBERS = [0, 2, 3]  # the subgroup of 4 ranks; rank 1 is outside it


def _inputs(rank, shape, dtype):
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _returned(value, tensor) -> str:
    return "the tensor" if value is tensor else "None" if value is None else type(value).__name__


def _every_case(all_reduce_mean):
    """Each case on this rank: the tensor after the call, what the call returned, and
    the calls it made."""
    rank, out = dist.get_rank(), []
    for shape, dtype in CASES:
        t = _inputs(rank, shape, dtype)
        with CommLog() as log:
            value = all_reduce_mean(t)
        out.append({"tensor": t, "returned": _returned(value, t), "log": log.records()})
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mean_over_all_ranks(student, world_size):
    with wire.measure(world_size) as reading:
        results = launch.run(_every_case, world_size, student.all_reduce_mean,
                             backend="gloo", timeout=30)
    for (shape, dtype), *cases in zip(CASES, *results):
        mean = sum(_inputs(r, shape, dtype).double() for r in range(world_size)) / world_size
        for rank, case in enumerate(cases):
            expect_close(case["tensor"], mean.to(dtype), f"rank {rank} of {world_size}, shape "
                         f"{shape}, {dtype}: the tensor after all_reduce_mean (is it the mean "
                         f"over the {world_size} ranks?)")
            assert case["returned"] == "the tensor", (
                f"all_reduce_mean returned {case['returned']}: it must return the tensor it "
                f"was given, changed in place")
            ops = [e.op for e in CommLog.from_records(case["log"]).collectives()]
            assert ops == ["all_reduce"], f"use exactly one all_reduce; the log shows {ops}"
    one_each = sum(wire.gloo_bytes("all_reduce", torch.Size(shape).numel() * dtype.itemsize,
                                   world_size, calls=1) for shape, dtype in CASES)
    wire.at_most(reading, one_each, f"all_reduce_mean on {world_size} ranks, every case (one "
                 f"all_reduce of each tensor)")


def _on_a_subgroup(all_reduce_mean):
    """Every rank calls the function with the group MEMBERS, rank 1 included."""
    rank = dist.get_rank()
    group = dist.new_group(MEMBERS)
    t = torch.full((5,), float(rank + 1))
    value = all_reduce_mean(t, group=group)
    return {"tensor": t, "returned": _returned(value, t)}


_subgroup_runs = {}


def _subgroup(student):
    """One launch shared by the two subgroup tests."""
    if "out" not in _subgroup_runs:
        _subgroup_runs["out"] = launch.run(_on_a_subgroup, 4, student.all_reduce_mean,
                                           backend="gloo", timeout=30)
    return _subgroup_runs["out"]


def test_mean_over_a_subgroup(student):
    out = _subgroup(student)
    mean = torch.full((5,), sum(r + 1 for r in MEMBERS) / len(MEMBERS))
    for rank in MEMBERS:
        expect_close(out[rank]["tensor"], mean, f"rank {rank}: the mean over the group of "
                     f"ranks {MEMBERS} (divide by the group's size, "
                     f"dist.get_world_size(group), not the world's)")
        assert out[rank]["returned"] == "the tensor", (
            f"rank {rank}, a member of the group: all_reduce_mean returned "
            f"{out[rank]['returned']}, not the tensor it was given")


def test_a_rank_outside_the_group_is_left_alone(student):
    outside = [r for r in range(4) if r not in MEMBERS]
    for rank, r in ((rank, _subgroup(student)[rank]) for rank in outside):
        before = float(rank + 1)
        after = r["tensor"][0].item()
        assert torch.equal(r["tensor"], torch.full((5,), before)), (
            f"rank {rank} is not a member of the group {MEMBERS}, yet its tensor changed "
            f"({before:g} became {after:g}): a rank outside the group must return at once and "
            f"leave the tensor alone. There dist.get_rank(group) is -1, and so is "
            f"dist.get_world_size(group): dividing by it flips the sign")
        assert r["returned"] == "None", (
            f"rank {rank} is not a member of the group {MEMBERS}: all_reduce_mean must return "
            f"None there (as torch.distributed's collectives do), not {r['returned']}")


def _mean_on_gpu(all_reduce_mean):
    t = torch.arange(6, dtype=torch.float32, device=backend.device()) + dist.get_rank()
    all_reduce_mean(t)
    return t.cpu()


def _check_gpu_means(results):
    world = len(results)
    expected = torch.arange(6, dtype=torch.float32) + (world - 1) / 2
    for rank, t in enumerate(results):
        expect_close(t, expected, f"rank {rank} of {world}: the mean on the GPU")


@pytest.mark.gpu
def test_mean_on_gpu(student):
    _check_gpu_means(launch.run(_mean_on_gpu, 1, student.all_reduce_mean, backend="nccl",
                                timeout=60))


@pytest.mark.multigpu
def test_mean_on_several_gpus(student):
    _check_gpu_means(launch.run(_mean_on_gpu, backend.gpu_count(), student.all_reduce_mean,
                                backend="nccl", timeout=60))

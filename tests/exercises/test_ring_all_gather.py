"""Autograder: ``ring_all_gather(chunk, numel, group=None)`` of lab 03.

One launch per world size runs every case (lengths 0, 1, < K, prime, large; float32,
float16, bfloat16, int64) and keeps, per rank, the first wrong answer and the first
sign that the communication was not a ring (from CommLog); the tests read them.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import backend, launch, ring
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "03_ring_allreduce"
NAME = "ring_all_gather"
TIMEOUT = 30
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers


def cases(world_size):
    """(numel, dtype) pairs: empty, one element, fewer than K, primes, large."""
    lengths = sorted({0, 1, max(world_size - 1, 1), 7, 13, 100_003})
    return [(n, dt) for n in lengths
            for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int64)]


def inputs(numel, dtype, world_size, seed=0):
    """Every rank's input, the same on every rank: integers that every dtype sums
    exactly (large ones for int64, so that a detour through float shows), and normal
    floats for float32."""
    g = torch.Generator().manual_seed(1000 * numel + seed)
    if dtype == torch.int64:
        return [torch.randint(-2**40, 2**40, (numel,), generator=g) for _ in range(world_size)]
    if dtype == torch.float32:
        return [torch.randn(numel, generator=g) for _ in range(world_size)]
    return [torch.randint(-8, 8, (numel,), generator=g).to(dtype) for _ in range(world_size)]


def call(fn, what, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise AssertionError(f"{NAME} raised {type(exc).__name__}: {exc} ({what})") from exc


def run_cases(fn):
    rank, K = dist.get_rank(), dist.get_world_size()
    wrong = comm = None
    for numel, dtype in cases(K):
        what = f"{numel} {str(dtype).removeprefix('torch.')} elements on {K} ranks"
        expected = inputs(numel, dtype, 1)[0]
        mine = torch.tensor_split(expected, K)[rank].clone()
        with CommLog() as log:
            got = call(fn, what, mine, numel)
        if wrong is None:
            try:
                expect_close(got, expected, f"rank {rank}'s gathered buffer of {what} (chunk r "
                                            f"from rank r, 1-D)")
            except AssertionError as exc:
                wrong = str(exc)
        problem = ring.check_traffic(log, "all_gather", numel, mine.element_size())
        if comm is None and problem:
            comm = f"{what}: {problem}"
    return {"wrong": wrong, "comm": comm}


_runs = {}


def outcome(student, world_size):
    """The ranks' findings at ``world_size``, from one launch (errors and deadlocks too)."""
    if world_size not in _runs:
        try:
            _runs[world_size] = launch.run(run_cases, world_size, getattr(student, NAME),
                                           backend="gloo", timeout=TIMEOUT)
        except launch.LaunchError as exc:
            _runs[world_size] = exc
    if isinstance(_runs[world_size], Exception):
        raise _runs[world_size]
    return _runs[world_size]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gathered(student, world_size):
    for found in outcome(student, world_size):
        assert found["wrong"] is None, found["wrong"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_traffic(student, world_size):
    for found in outcome(student, world_size):
        assert found["comm"] is None, found["comm"]


@pytest.mark.multigpu
def test_on_gpus(student):
    def on_gpu(fn):
        rank, K = dist.get_rank(), dist.get_world_size()
        full = inputs(1 << 20, torch.float32, 1)[0].to(backend.device())
        mine = torch.tensor_split(full, K)[rank].clone()
        expect_close(fn(mine, full.numel()), full, f"rank {rank}'s gathered buffer on GPUs")

    launch.run(on_gpu, 2, getattr(student, NAME), backend="nccl", timeout=TIMEOUT)

"""Autograder: ``ring_allreduce(tensor, group=None)`` of lab 03 (in place).

The cases and the one launch per world size are in ring_cases.py.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import backend, launch
from distlab.grading import expect_close
from ring_cases import DTYPES, TIMEOUT, findings, inputs, lengths, make_tests

NOTEBOOK = "03_ring_allreduce"
NAME = "ring_allreduce"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get run_cases


def run_cases(fn):
    rank, K = dist.get_rank(), dist.get_world_size()

    def case(shape, dtype):
        numel = torch.Size(shape).numel()
        what = (f"a tensor of shape {tuple(shape)}, {str(dtype).removeprefix('torch.')}, "
                f"on {K} ranks")
        xs = [x.reshape(shape) for x in inputs(numel, dtype, K)]
        expected = sum(x.double() for x in xs).to(dtype)
        mine = xs[rank].clone()

        def check(_):
            expect_close(mine, expected, f"rank {rank}'s tensor after ring_allreduce of {what} "
                                         f"(the sum must land in the tensor passed in, in place)")
        return what, (mine,), numel, check

    shapes = [((n,), dt) for n in lengths(K) for dt in DTYPES] + [((3, 5), torch.float32)]
    return findings(NAME, fn, "all_reduce", (case(*s) for s in shapes))  # any shape


test_sum, test_ring_traffic = make_tests(NAME, run_cases)


@pytest.mark.multigpu
def test_on_gpus(student):
    def on_gpu(fn):
        rank, K = dist.get_rank(), dist.get_world_size()
        xs = [x.to(backend.device()) for x in inputs(1 << 20, torch.float32, K)]
        mine = xs[rank].clone()
        fn(mine)
        expect_close(mine, sum(xs), f"rank {rank}'s tensor after ring_allreduce on GPUs")

    launch.run(on_gpu, 2, getattr(student, NAME), backend="nccl", timeout=TIMEOUT)

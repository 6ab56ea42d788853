"""Autograder: ``ring_reduce_scatter(tensor, group=None)`` of lab 03.

The cases and the one launch per world size are in ring_cases.py.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import backend, launch
from distlab.grading import expect_close
from ring_cases import DTYPES, TIMEOUT, describe, findings, inputs, lengths, make_tests

NOTEBOOK = "03_ring_allreduce"
NAME = "ring_reduce_scatter"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get run_cases


def run_cases(fn):
    rank, K = dist.get_rank(), dist.get_world_size()

    def case(numel, dtype):
        what = describe(numel, dtype, K)
        xs = inputs(numel, dtype, K)
        expected = torch.tensor_split(sum(x.double() for x in xs).to(dtype), K)[rank]

        def check(got):
            if isinstance(got, torch.Tensor) and got.numel() != expected.numel():
                raise AssertionError(
                    f"rank {rank}'s chunk of {what} has {got.numel()} elements, but should have "
                    f"{expected.numel()}: chunks follow torch.tensor_split (the first n % K "
                    f"chunks are one element longer)")
            expect_close(got, expected, f"rank {rank}'s chunk of the sum of {what}")
        return what, (xs[rank].clone(),), numel, check

    return findings(NAME, fn, "reduce_scatter",
                    (case(n, dt) for n in lengths(K) for dt in DTYPES))


test_sum, test_ring_traffic = make_tests(NAME, run_cases)


@pytest.mark.multigpu
def test_on_gpus(student):
    def on_gpu(fn):
        rank, K = dist.get_rank(), dist.get_world_size()
        xs = [x.to(backend.device()) for x in inputs(1 << 20, torch.float32, K)]
        expected = torch.tensor_split(sum(xs), K)[rank]
        expect_close(fn(xs[rank].clone()), expected, f"rank {rank}'s chunk on GPUs")

    launch.run(on_gpu, 2, getattr(student, NAME), backend="nccl", timeout=TIMEOUT)

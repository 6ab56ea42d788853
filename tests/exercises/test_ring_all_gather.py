"""Autograder: ``ring_all_gather(chunk, numel, group=None)`` of lab 03.

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
NAME = "ring_all_gather"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get run_cases


def run_cases(fn):
    rank, K = dist.get_rank(), dist.get_world_size()

    def case(numel, dtype):
        what = describe(numel, dtype, K)
        expected = inputs(numel, dtype, 1)[0]

        def check(got):
            expect_close(got, expected, f"rank {rank}'s gathered buffer of {what} (chunk r "
                                        f"from rank r, 1-D)")
        return what, (torch.tensor_split(expected, K)[rank].clone(), numel), numel, check

    return findings(NAME, fn, "all_gather", (case(n, dt) for n in lengths(K) for dt in DTYPES))


test_gathered, test_ring_traffic = make_tests(NAME, run_cases)


@pytest.mark.multigpu
def test_on_gpus(student):
    def on_gpu(fn):
        rank, K = dist.get_rank(), dist.get_world_size()
        full = inputs(1 << 20, torch.float32, 1)[0].to(backend.device())
        mine = torch.tensor_split(full, K)[rank].clone()
        expect_close(fn(mine, full.numel()), full, f"rank {rank}'s gathered buffer on GPUs")

    launch.run(on_gpu, 2, getattr(student, NAME), backend="nccl", timeout=TIMEOUT)

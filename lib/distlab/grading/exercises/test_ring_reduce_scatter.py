"""Autograder: ``ring_reduce_scatter(tensor, group=None)`` of lab 03.

The cases, the launches and the checks are in ring_cases.py.
"""
import pytest

from distlab.grading import expect_close
from ring_cases import argument, cases, check_on_gpus, describe, make_tests, outcome

NOTEBOOK = "03_ring_allreduce"
NAME = "ring_reduce_scatter"

(test_sum, test_ring_traffic, test_on_a_subgroup, test_outside_the_group,
 test_would_not_hang_on_nccl) = make_tests(NAME)


def test_keeps_its_input(student):
    members = (0, 1, 2, 3)
    runs = outcome(student, NAME, members, 4)
    for rank in members:
        for (shape, dtype), found in zip(cases(NAME, 4), runs[rank]["cases"]):
            if "input" in found:
                expect_close(found["input"], argument(NAME, shape, dtype, list(members), rank),
                             f"rank {rank}'s tensor after ring_reduce_scatter of "
                             f"{describe(shape, dtype, members, 4)}: do not change `tensor`; "
                             f"work on copies of its chunks")


@pytest.mark.multigpu
def test_on_gpus(student):
    check_on_gpus(student, NAME)

"""Autograder: ``ring_all_gather(chunk, numel, group=None)`` of lab 03.

The cases, the launches and the checks are in ring_cases.py.
"""
import pytest

from ring_cases import check_on_gpus, make_tests

NOTEBOOK = "03_ring_allreduce"
NAME = "ring_all_gather"

(test_gathered, test_ring_traffic, test_on_a_subgroup, test_outside_the_group,
 test_would_not_hang_on_nccl) = make_tests(NAME)


@pytest.mark.multigpu
def test_on_gpus(student):
    check_on_gpus(student, NAME)

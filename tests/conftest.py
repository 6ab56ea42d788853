"""Shared test set-up: tests of the gpu and multigpu tiers are skipped, with a reason
starting with "blocked", where the machine lacks the GPUs (see distlab.grading)."""
import pytest

from distlab.grading import blocked_reason


def pytest_runtest_setup(item):
    reason = blocked_reason(item)
    if reason:
        pytest.skip(reason)

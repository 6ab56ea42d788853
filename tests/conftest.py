"""Shared test set-up: tests of the gpu and multigpu tiers are skipped, with a reason
starting with "blocked", where the machine lacks the GPUs (see distlab.grading.plugin);
the exercises' shared cases (``dp_cases``, ``tp_cases``...) import as the grader's
pytest imports them, from the folder of the exercise tests."""
import sys

import pytest

from distlab.grading.plugin import blocked_reason
from distlab.grading.runner import TESTS

sys.path.insert(0, str(TESTS))


def pytest_runtest_setup(item):
    reason = blocked_reason(item)
    if reason:
        pytest.skip(reason)

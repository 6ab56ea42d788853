"""Shared test set-up.

- Tests of the gpu and multigpu tiers are skipped, with a reason starting with
  "blocked", where the machine lacks the GPUs (see distlab.grading.plugin).
- The exercises' shared cases (``dp_cases``, ``tp_cases``...) import as the grader's
  pytest imports them, from the folder of the exercise tests.
- Every run records how long each unit of work took (``durations.py``).
- How ``make test`` (``--dist loadgroup``) spreads the work over its workers: each file
  is one unit (a module's fixtures are built once, a notebook's cells share a kernel),
  except the files in ``durations.SPLIT``, whose cases are independent runs and go out
  one case a unit; units go out heaviest first (``HEAVY``, then the rest in collection
  order), so that no long unit starts last.
"""
import sys

import pytest

from distlab.grading.plugin import blocked_reason
from distlab.grading.runner import TESTS

sys.path.insert(0, str(TESTS))

from durations import Durations, unit  # noqa: E402  (tests/ is on sys.path)
# Units known to take longest (build/durations.json of a run shows them), first to go.
HEAVY = ["tests/test_grading_solutions.py", "solutions/", "tests/test_mutants_",
         "tests/test_grader_security.py", "tests/test_nbgrader.py", "tests/test_browser.py",
         "tests/test_widgets_static.py", "tests/test_grading.py"]


def pytest_configure(config):
    config.pluginmanager.register(Durations(), "distlab-durations")


def _rank(name: str) -> int:
    return next((i for i, prefix in enumerate(HEAVY) if name.startswith(prefix)), len(HEAVY))


@pytest.hookimpl(tryfirst=True)  # before xdist names the units by their marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item.nodeid)))
    items.sort(key=lambda item: _rank(unit(item.nodeid)))  # stable: a file's order is kept


def pytest_runtest_setup(item):
    reason = blocked_reason(item)
    if reason:
        pytest.skip(reason)

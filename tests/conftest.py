"""Shared test set-up.

- Tests of the gpu and multigpu tiers are skipped, with a reason starting with
  "blocked", where the machine lacks the GPUs (see distlab.grading.plugin).
- The exercises' shared cases (``dp_cases``, ``tp_cases``...) import as the grader's
  pytest imports them, from the folder of the exercise tests.
- Every run records how long each unit of work took (``durations.py``).
- Each solution notebook runs under nbval inside the student edition its students have
  (``editions.py``): lab k with the library of the edition through lab k-1.
- How ``make test`` (``--dist loadfile --no-loadscope-reorder``) spreads the work over
  its workers: in units (``durations.unit``). A unit is a file (a module's fixtures are
  built once, a notebook's cells share a kernel), except in the files of ``SPLIT``, whose
  tests each grade a notebook of their own and share nothing: there every test case is a
  unit. Units go out heaviest first (``HEAVY``, then the rest in collection order), so
  that no long one starts last.
"""
import gc
import sys

import pytest

from distlab.grading.plugin import blocked_reason
from distlab.grading.runner import TESTS

sys.path.insert(0, str(TESTS))

from durations import Durations, unit  # noqa: E402  (tests/ is on sys.path)
from editions import EditionKernels  # noqa: E402
# Units known to take longest (build/durations.json of a run shows them), first to go.
HEAVY = ["tests/test_grading_solutions.py", "solutions/", "tests/test_mutants_",
         "tests/test_grader_security.py", "tests/test_nbgrader.py", "tests/test_browser",
         "tests/test_widgets_static.py", "tests/test_grading.py"]


def pytest_configure(config):
    config.pluginmanager.register(Durations(), "distlab-durations")
    config.pluginmanager.register(EditionKernels(), "distlab-edition-kernels")


def _rank(name: str) -> int:
    return next((i for i, prefix in enumerate(HEAVY) if name.startswith(prefix)), len(HEAVY))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: a file's order is kept
    gc.freeze()  # torch and every test module, imported: no collection walks them again


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``, xdist's scheduling by scope with our units as scopes
    (``durations.unit``: a file, or a case of a split file)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)
    return ByUnit(config, log)


def pytest_runtest_setup(item):
    reason = blocked_reason(item)
    if reason:
        pytest.skip(reason)

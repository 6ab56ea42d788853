"""The suite's own budget: every run writes ``build/durations.json``, the seconds each
unit of work took (its tests' set-up, call and tear-down added, as the worker that ran
it spent them), and ``tests/test_budget.py`` fails on a unit over the budget in the
last run. A unit is what ``make test``'s workers take whole (``conftest.py``): a test
file, a solution notebook, or one case of a file of :data:`SPLIT`.
Registered by ``conftest.py`` as a plugin object, so it sees every report: the
notebooks' nbval cells as well as the tests, on the xdist controller as in one
process."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "build" / "durations.json"
FILE_BUDGET_S = 60.0


# Files whose tests share no fixture beyond a case or a test, split into smaller units:
# "case", one per parameter (the tests of one mutant or one notebook go together), or
# "test", one per test function (or class).
SPLIT = {"tests/test_grading_solutions.py": "case", "tests/test_mutants_": "case",
         "tests/test_grader_security.py": "test", "tests/test_grading.py": "test",
         "tests/test_nbgrader.py": "test", "tests/test_hidden_tests.py": "test",
         "tests/test_edition.py": "case", "tests/test_resilience.py": "test"}


def unit(nodeid: str) -> str:
    """The unit of work that test ``nodeid`` belongs to: its file, or for a file of
    :data:`SPLIT` the file and the case's parameter (``tests/test_mutants_07.py[stack]``)
    or its test function or class (``tests/test_grading.py::TestAHostileNotebook``)."""
    file, _, test = nodeid.partition("::")
    how = next((how for prefix, how in SPLIT.items() if file.startswith(prefix)), None)
    name, bracket, param = test.partition("[")
    if how == "case" and bracket:
        return f"{file}[{param}"
    if how:
        return f"{file}::{name.split('::')[0]}"
    return file


class Durations:
    def __init__(self):
        self.per_test: dict[str, float] = defaultdict(float)
        self.started = time.time()

    def pytest_runtest_logreport(self, report):
        self.per_test[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
            return
        per_unit: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.per_test.items():
            per_unit[unit(nodeid)] += seconds
        RECORD.parent.mkdir(exist_ok=True)
        tmp = RECORD.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": round(time.time() - self.started, 1),
            "complete": session.testscollected > 0 and not session.shouldfail,
            "units": dict(sorted(per_unit.items(), key=lambda kv: -kv[1])),
            "tests": dict(sorted(self.per_test.items(), key=lambda kv: -kv[1])),
        }, indent=1))
        tmp.replace(RECORD)

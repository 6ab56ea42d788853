"""The suite's own budget: every run writes ``build/durations.json``, the seconds each
unit of work took (its tests' set-up, call and tear-down added, as the worker that ran
it spent them), and ``tests/test_budget.py`` fails on a unit over the budget in the
last run. A unit is a test file or a solution notebook: ``make test``'s workers take
whole files (``conftest.py``).
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


def unit(nodeid: str) -> str:
    """The unit of work that test ``nodeid`` belongs to: its file."""
    return nodeid.split("::")[0]


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

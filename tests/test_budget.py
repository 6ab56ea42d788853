"""The suite's budget, read from the last run's record (``build/durations.json``,
written by ``tests/durations.py`` at the end of every run): no unit of work (a test
file, a solution notebook) may take more than a minute, so that
whoever adds a slow test sees it in the next run. A fresh clone
has no record yet; the whole suite's 10 minutes are CI's clock to measure."""
import json

import pytest

from durations import FILE_BUDGET_S, RECORD


def over_budget(record: dict) -> dict:
    """The units of ``record`` that took more than the budget."""
    return {u: s for u, s in record["units"].items() if s > FILE_BUDGET_S}


def test_the_check_finds_a_slow_file():
    record = {"units": {"tests/test_fast.py": 3.0, "tests/test_slow.py": FILE_BUDGET_S + 1}}
    assert over_budget(record) == {"tests/test_slow.py": FILE_BUDGET_S + 1}


def test_no_unit_took_more_than_a_minute_in_the_last_run():
    if not RECORD.exists():
        pytest.skip(f"no {RECORD.name} yet: a run of the suite writes it")
    record = json.loads(RECORD.read_text())
    slow = over_budget(record)
    assert not slow, (
        f"in the run of {record['written']}, these took more than "
        f"{FILE_BUDGET_S:.0f} s: " + ", ".join(f"{f} ({s:.0f} s)" for f, s in slow.items())
        + ". Make their tests cheaper (a smaller world size or tensor that proves the same "
        "thing, one launch shared by several checks), or split a file whose tests share "
        "nothing")

"""The suite's budget, read from the last run's record (``build/durations.json``,
written by ``tests/durations.py`` at the end of every run): no unit of work (a test
file, a solution notebook) may take more than a minute, so that
whoever adds a slow test sees it in the next run. A fresh clone
has no record yet; the whole suite's 10 minutes are CI's clock to measure."""
import json

import pytest

from durations import FILE_BUDGET_S, RECORD, unit


def over_budget(record: dict) -> dict:
    """The units of ``record`` that took more than the budget."""
    return {u: s for u, s in record["units"].items() if s > FILE_BUDGET_S}


def test_the_check_finds_a_slow_file():
    record = {"units": {"tests/test_fast.py": 3.0, "tests/test_slow.py": FILE_BUDGET_S + 1}}
    assert over_budget(record) == {"tests/test_slow.py": FILE_BUDGET_S + 1}


def test_a_unit_is_a_file_or_a_case_of_a_split_file():
    """What a worker takes whole: a notebook's cells and a plain file's tests together; one
    mutant's (or one solution's) tests together; a test function (or class) of a file
    split by test."""
    assert unit("solutions/03_ring_allreduce.ipynb::Cell 4") == "solutions/03_ring_allreduce.ipynb"
    assert unit("tests/test_zero.py::test_stage[3]") == "tests/test_zero.py"
    assert unit("tests/test_mutants_07.py::test_a_mutant_fails[stack]") == \
        unit("tests/test_mutants_07.py::test_the_deadlock[stack]") != \
        unit("tests/test_mutants_07.py::test_a_mutant_fails[untied]")
    assert unit("tests/test_grading.py::TestAHostileNotebook::test_x") == \
        unit("tests/test_grading.py::TestAHostileNotebook::test_y") != \
        unit("tests/test_grading.py::test_z[1]") == unit("tests/test_grading.py::test_z[2]")


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

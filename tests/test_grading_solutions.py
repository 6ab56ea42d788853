"""The autograder on every notebook: the solutions score full marks. (Apart from
tests/test_grading.py so that `make test`'s workers, which take whole files, share the
long runs.)"""
from pathlib import Path

import pytest

from distlab.grading import runner

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solutions_score_full_marks(path):
    results = runner.grade(path)
    assert results, f"{path.name} has no exercises"
    for r in results:
        assert r.verdict == "pass" and r.points == r.max_points > 0, (
            f"{path.name}: {r.exercise} scored {r.points}/{r.max_points} ({r.verdict}): {r.message}")

"""The autograder on every notebook: untouched labs score zero, counted without
running. (Apart from tests/test_grading.py so that `make test`'s workers, which take
whole files, share the long runs.)"""
import time
from pathlib import Path

import pytest

from distlab.grading import runner

ROOT = Path(__file__).resolve().parents[1]
LABS = sorted((ROOT / "labs").glob("*.ipynb"))


@pytest.mark.parametrize("path", LABS, ids=[p.stem for p in LABS])
def test_untouched_labs_score_zero_without_running_them(path):
    start = time.monotonic()
    results = runner.grade(path)
    assert results, f"{path.name} has no exercises"
    for r in results:
        assert (r.points, r.verdict) == (0, "not attempted"), (path.name, r)
        assert r.max_points > 0, f"{path.name}: {r.exercise} has no runnable tests"
    assert time.monotonic() - start < 120, "counting the tests must not hang"

"""The autograder on every notebook: the solutions score full marks, with every
exercise's graded ranks walking their interpreter for the library's answers to it
(:mod:`absence`: a rank that finds one fails the grade). (Apart from
tests/test_grading.py so that `make test`'s workers, which take whole files, share the
long runs.)"""
from pathlib import Path

import nbformat
import pytest
from absence import walk_source

from distlab.grading import notebook, runner

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solutions_score_full_marks(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if notebook.grade_id(c))
    first.source = walk_source(path.stem) + first.source
    walked = tmp_path / path.name
    nbformat.write(nb, walked)
    results = runner.grade(walked)
    assert results, f"{path.name} has no exercises"
    for r in results:
        assert r.verdict == "pass" and r.points == r.max_points > 0, (
            f"{path.name}: {r.exercise} scored {r.points}/{r.max_points} ({r.verdict}): {r.message}")

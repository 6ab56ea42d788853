"""The autograder on every notebook: the solutions score full marks, with every
exercise's graded ranks walking their interpreter for the library's answers to it
(:mod:`absence`: a rank that finds one fails the grade). The labs after the student
editions that ``tests/test_edition.py`` checks (none, 00, 04, 09) are graded inside that
edition, as ``make grade`` grades them there (its tests need no answer of the lab they
grade); the others in the full kit, as an instructor grades. (Apart from
tests/test_grading.py so that `make test`'s workers, which take whole files, share the
long runs.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from absence import walk_source
from editions import THROUGH, edition

from distlab.grading import edition as editions, notebook, runner

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
IN_EDITION = {through + 1 for through in THROUGH}  # lab numbers graded in an edition


def _grade_in_edition(path: Path, through: int, tmp_path: Path) -> list[dict]:
    """``python -m distlab.grading`` inside the edition through lab ``through``."""
    out = edition(through)
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "distlab.grading", str(path), "--json",
                           str(report)], cwd=out, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(out / "lib")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    (graded,) = json.loads(report.read_text()).values()
    return [dict(exercise=name, points=r["points"], max_points=r["max"], verdict=r["verdict"],
                 message=r["message"]) for name, r in graded.items()]


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solutions_score_full_marks(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if notebook.grade_id(c))
    first.source = walk_source(path.stem) + first.source
    walked = tmp_path / path.name
    nbformat.write(nb, walked)
    number = editions.lab_number(path.stem)
    if number in IN_EDITION:
        results = _grade_in_edition(walked, number - 1, tmp_path)
    else:
        results = [vars(r) for r in runner.grade(walked)]
    assert results, f"{path.name} has no exercises"
    for r in results:
        assert r["verdict"] == "pass" and r["points"] == r["max_points"] > 0, (
            f"{path.name}: {r['exercise']} scored {r['points']}/{r['max_points']} "
            f"({r['verdict']}): {r['message']}")
